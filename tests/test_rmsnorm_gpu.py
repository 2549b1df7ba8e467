"""RMSNorm kernels on the GPU against the fp32 reference (outputs poisoned with NaN first)."""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from tests.gpu_helpers import (DTYPES, MAX_ELEMS, MS, assert_close_poisoned, close_family, cuda_arch, kernel,
                               poison_allocator, random_rows, run_backward_poisoned, shapes_within)

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

NS = (64, 128, 1000, 4096, 6144, 7168, 8192, 16384, 32768, 131072, 262144)


def run_poisoned(x, w, b, res, eps, store_rstd):
    """The forward as the op launches it, its outputs from a poisoned allocator (every element must be
    written)."""
    M, N = x.shape
    poison_allocator(M * N * (x.element_size() + (res.element_size() if res is not None else 0) + 4))
    return kernel("rmsnorm_forward", x=x, weight=w, bias=b, residual=res, eps=eps, store_rstd=store_rstd)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("M,N", shapes_within(MS, NS))
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_forward_with_residual(dtype, w_fp32, N, M, padded, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, res = random_rows(M, N, dtype, padded, g), random_rows(M, N, dtype, padded, g)
    w = torch.randn(N, device="cuda", generator=g).to(torch.float32 if w_fp32 else dtype)
    out, rstd, res_out = run_poisoned(x, w, None, res, 1e-6, True)
    y_ref, rstd_ref, res_ref = R.rmsnorm_forward(x, w, None, res, 1e-6, True)
    assert torch.equal(res_out, res_ref), "residual_out must be exactly round(x + residual)"
    assert_close_poisoned(out, y_ref, dtype, "y")
    assert_close_poisoned(rstd, rstd_ref, torch.float32, "rstd")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w,bias", [("none", False), ("same", False), ("same", True), ("fp32", False),
                                    ("fp32", True)])  # (no bias without a weight: a configuration nobody uses)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("store_rstd", [False, True])
@pytest.mark.parametrize("M,N", [(128, 1000), (4097, 4096), (3, 131072)])
def test_forward_flags(dtype, w, bias, residual, store_rstd, M, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wd = torch.float32 if w == "fp32" else dtype
    x = random_rows(M, N, dtype, False, g)
    wt = torch.randn(N, device="cuda", generator=g).to(wd) if w != "none" else None
    bt = torch.randn(N, device="cuda", generator=g).to(wd) if bias else None
    rt = random_rows(M, N, dtype, False, g) if residual else None
    out, rstd, res_out = run_poisoned(x, wt, bt, rt, 1e-5, store_rstd)
    y_ref, rstd_ref, res_ref = R.rmsnorm_forward(x, wt, bt, rt, 1e-5, True)
    assert_close_poisoned(out, y_ref, dtype, "y")
    if store_rstd:
        assert_close_poisoned(rstd, rstd_ref, torch.float32, "rstd")
    if residual:
        assert torch.equal(res_out, res_ref)


# rows off 16-byte boundaries: vectors of 1, 2 and 4 elements (odd widths without a residual through windows:
# several rows a CTA, one, a cluster; 5135 takes narrow_rows'; with an fp32 weight, 10378: 11 accesses of 2
# values), rows of one warp's accesses to clusters of CTAs
ODD_NS = (7, 455, 1817, 5135, 10378, 25630, 94557, 94558)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", ODD_NS)
@pytest.mark.parametrize("M", (1, 9, 300))
@pytest.mark.parametrize("flags", ["w", "w_fp32+bias", "residual", "residual+w_fp32+bias"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_forward_rows_off_boundaries(dtype, N, M, flags, padded, seed):
    """Dense rows of odd widths with a weight of x's dtype move through aligned windows, their parameters
    gathered at each window's offset (rows of every shift in one launch); padded rows (another row stride than
    the outputs'), a residual and an fp32 weight take the narrow kernel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    wd = torch.float32 if "w_fp32" in flags else dtype
    x = random_rows(M, N, dtype, padded, g)
    w = torch.randn(N, device="cuda", generator=g).to(wd)
    b = torch.randn(N, device="cuda", generator=g).to(wd) if "bias" in flags else None
    res = random_rows(M, N, dtype, padded, g) if "residual" in flags else None
    out, rstd, res_out = run_poisoned(x, w, b, res, 1e-6, True)
    y_ref, rstd_ref, res_ref = R.rmsnorm_forward(x, w, b, res, 1e-6, True)
    assert_close_poisoned(out, y_ref, dtype, "y")
    assert_close_poisoned(rstd, rstd_ref, torch.float32, "rstd")
    if res is not None:
        assert torch.equal(res_out, res_ref), "residual_out must be exactly round(x + residual)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", ODD_NS)
@pytest.mark.parametrize("M", (1, 9, 300))
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_fused_add_in_place_rows_off_boundaries(dtype, N, M, padded, seed):
    """x and the residual at the same offsets or not (a padded residual), rows off 16-byte boundaries updated
    in place (the narrow kernel: a residual's window measured slower)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, res = random_rows(M, N, dtype, False, g), random_rows(M, N, dtype, padded, g)
    w = torch.randn(N, device="cuda", generator=g).to(dtype)
    xr, rr = x.clone(), res.clone()
    oink.fused_add_rmsnorm_(x, res, w, 1e-6)
    R.fused_add_rmsnorm_(xr, rr, w, 1e-6)
    assert torch.equal(res, rr), "residual must be exactly round(x + residual)"
    assert_close_poisoned(x, xr, dtype, "x")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", shapes_within(MS, NS))
def test_fused_add_in_place(dtype, N, M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, res = random_rows(M, N, dtype, True, g), random_rows(M, N, dtype, True, g)  # padded rows, in place
    w = torch.randn(N, device="cuda", generator=g).to(dtype)
    xr, rr = x.clone(), res.clone()
    assert "kernel" in oink.explain("fused_add_rmsnorm_", x, res, w)
    oink.fused_add_rmsnorm_(x, res, w, 1e-6)
    R.fused_add_rmsnorm_(xr, rr, w, 1e-6)
    assert torch.equal(res, rr), "residual must be exactly round(x + residual)"
    assert_close_poisoned(x, xr, dtype, "x")


def test_public_api_and_custom_op_route_to_kernel(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, 5, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, device="cuda", generator=g).bfloat16()
    assert "kernel" in oink.explain("rmsnorm_forward", x, w)
    oink.register(force=True)  # torch.ops.oink.* exist once registered (a run of this test alone)
    y = torch.ops.oink.rmsnorm(x, w, 1e-6)
    assert_close_poisoned(y, R.rmsnorm_forward(x, w)[0], torch.bfloat16, "torch.ops.oink.rmsnorm")
    y2, rstd, _ = oink.rmsnorm_forward(x[..., ::2].contiguous()[..., :2048], w[:2048], store_rstd=True)
    assert rstd.shape == (2, 5)
    xs = x[..., ::2]  # non-contiguous last dim: copied, never read wrongly
    assert_close_poisoned(oink.rmsnorm_forward(xs, w[:2048])[0], R.rmsnorm_forward(xs, w[:2048])[0], torch.bfloat16,
                          "strided")
    assert oink.rmsnorm_forward(x[:0], w)[0].shape == (0, 5, 4096)
    one = x[0, 0]  # a 1-D input is one row
    y1, rstd1, _ = oink.rmsnorm_forward(one, w, store_rstd=True)
    assert y1.shape == (4096,) and rstd1.shape == ()
    assert_close_poisoned(y1, R.rmsnorm_forward(one, w)[0], torch.bfloat16, "1-D input")
    assert_close_poisoned(oink.rmsnorm_backward(one, w, y1, rstd1)[0], R.rmsnorm_backward(one, w, y1, rstd1)[0],
           torch.bfloat16, "1-D backward")


def test_more_than_2_31_elements(seed):
    M, N = 2**31 // 4096 + 64, 4096
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", generator=g, dtype=torch.bfloat16)
    y = oink.rmsnorm_forward(x, w)[0]
    tail = slice(M - 200, M)
    assert_close_poisoned(y[tail], R.rmsnorm_forward(x[tail], w)[0], torch.bfloat16, "rows past 2^31 elements")


def test_torch_compile_fullgraph_and_cuda_graph(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(512, 7168, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(7168, device="cuda", generator=g, dtype=torch.bfloat16)
    oink.register(force=True)  # torch.ops.oink.* exist once registered (a run of this test alone)
    f = torch.compile(lambda a, b: torch.ops.oink.rmsnorm(a, b, 1e-6) + 1, fullgraph=True)
    assert_close_poisoned(f(x, w), R.rmsnorm_forward(x, w)[0].float() + 1, torch.bfloat16, "compiled")
    res = torch.randn_like(x)
    xg, rg = x.clone(), res.clone()
    oink.fused_add_rmsnorm_(xg, rg, w)  # warm up (compiles) outside capture
    xg.copy_(x), rg.copy_(res)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        oink.fused_add_rmsnorm_(xg, rg, w)
    graph.replay()
    xr, rr = x.clone(), res.clone()
    R.fused_add_rmsnorm_(xr, rr, w)
    assert torch.equal(rg, rr)
    assert_close_poisoned(xg, xr, torch.bfloat16, "graph replay")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w", ["same", "fp32", "none"])
@pytest.mark.parametrize("M,N", shapes_within(MS, NS, MAX_ELEMS // 2))
def test_backward(dtype, w, N, M, seed):
    _check_backward(dtype, w, N, M, seed)


# rows off 16-byte boundaries in the backward: a 16-bit row's budget counted in values (2109: one CTA of 256
# threads; 6571, 11646, 30001: clusters), or in accesses where 700 rows of it would leave SMs short (763)
ODD_BWD_NS = (7, 763, 2109, 2538, 6571, 11646, 30001)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w", ["same", "fp32"])
@pytest.mark.parametrize("N", ODD_BWD_NS)
@pytest.mark.parametrize("M", (3, 700, 6000))
def test_backward_rows_off_boundaries(dtype, w, N, M, seed):
    _check_backward(dtype, w, N, M, seed)


def _check_backward(dtype, w, N, M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, dout, dres = (random_rows(M, N, dtype, True, g) for _ in range(3))
    wt = None if w == "none" else torch.randn(N, device="cuda", generator=g).to(
        torch.float32 if w == "fp32" else dtype)
    has_bias = w == "same"
    _, rstd, _ = R.rmsnorm_forward(x, wt, store_rstd=True)
    dx, dw, db = run_backward_poisoned(x, wt, dout, rstd, dres, has_bias)
    ex, ew, eb, _ = R.rmsnorm_backward(x, wt, dout, rstd, dres, has_bias=has_bias)
    close_family(dx, ex, "norm_backward", dtype, "dx")
    if wt is not None:
        close_family(dw, ew, "weight_grad", wt.dtype, "dw")
    if has_bias:
        close_family(db, eb, "weight_grad", wt.dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", (1, 368, 1001, 2342, 6144, 262144))  # CTAs of 1, 1-2, 4-8, 8 column quads
@pytest.mark.parametrize("kinds", (1, 2))
@pytest.mark.parametrize("P", (1, 45, 133, 2112))
def test_partial_sum_kernel(dtype, N, kinds, P, seed):
    """The dweight/dbias partials' sum: every output element written, padding columns (NaN here)
    never read into an output, the sum in fp32 against a float64 sum."""
    from oink.kernels.rmsnorm_ops import partial_buffers, sum_partials

    g = torch.Generator(device="cuda").manual_seed(seed)
    buf, a, b = partial_buffers(P, N, True, kinds == 2, "cuda", lambda s, **kw: torch.full(s, float("nan"), **kw))
    for part in (a, b):
        if part is not None:
            part.copy_(torch.randn(part.shape, device="cuda", generator=g))
    junk = [torch.full((N,), float("nan"), device="cuda", dtype=dtype) for _ in range(kinds)]
    del junk  # the outputs reuse these blocks: an element the kernel skips stays NaN
    dw, db = sum_partials(cuda_arch(), buf, True, kinds == 2, N, dtype)
    for out, part in ((dw, a), (db, b)):
        if part is not None:
            assert out.dtype == dtype and out.shape == (N,)
            close_family(out, part.double().sum(0).to(dtype), "weight_grad", dtype, "partial sum")
    if kinds == 2:
        assert dw.untyped_storage().data_ptr() != db.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_matches_reference_autograd(dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(300, 7168, device="cuda", generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(7168, device="cuda", generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(300, 7168, device="cuda", generator=g).to(dtype)
    assert "kernel" in oink.explain("rmsnorm_backward", x, w, dy, torch.ones(300, device="cuda"))
    gx, gw = torch.autograd.grad(oink.rmsnorm(x, w), [x, w], dy)
    xr, wr = x.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    yr = xr * torch.rsqrt(xr.square().mean(-1, keepdim=True) + 1e-6) * wr
    ex, ew = torch.autograd.grad(yr, [xr, wr], dy.float())
    close_family(gx, ex, "norm_backward", dtype, "dx")
    close_family(gw, ew, "weight_grad", dtype, "dw")


def test_module_trains_under_compile_and_graph_capture(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), oink.RMSNorm(4096, eps=1e-6)).cuda().bfloat16()
    ref = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.RMSNorm(4096, eps=1e-6)).cuda().bfloat16()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(m, fullgraph=True)
    y = f(x)
    y.float().square().mean().backward()
    yr = ref(x)
    yr.float().square().mean().backward()
    assert_close_poisoned(y, yr, torch.bfloat16, "module output")
    close_family(m[1].weight.grad, ref[1].weight.grad, "weight_grad", torch.bfloat16, "module dw")
    # every op captured in a CUDA graph
    xg = x.clone()
    wv = m[1].weight.detach()
    rstd_holder = {}
    oink.rmsnorm_forward(xg, wv, store_rstd=True)  # compile outside capture
    oink.rmsnorm_backward(xg, wv, xg, torch.ones(64, device="cuda"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, rstd_g, _ = oink.rmsnorm_forward(xg, wv, store_rstd=True)
        rstd_holder["dx"] = oink.rmsnorm_backward(xg, wv, y_g, rstd_g)[0]
    graph.replay()
    y_e, rstd_e, _ = R.rmsnorm_forward(xg, wv, store_rstd=True)
    assert_close_poisoned(y_g, y_e, torch.bfloat16, "graph fwd")
    close_family(rstd_holder["dx"], R.rmsnorm_backward(xg, wv, y_g, rstd_g)[0], "norm_backward", torch.bfloat16,
               "graph bwd")


def test_resident_clusters_is_the_drivers_count():
    """The persistent backward's grid unit: clusters that run at once with one CTA a SM, from the
    driver (at most SMs / cluster size; a GPC holds a cluster's CTAs, so maybe fewer)."""
    from oink.kernels.host import resident_clusters, sm_count

    sms = sm_count(0)
    assert resident_clusters(0, 1) == sms
    found = {c: resident_clusters(0, c) for c in (2, 4, 8, 16)}
    print("resident clusters", torch.cuda.get_device_name(), sms, found)
    for c, n in found.items():
        assert 1 <= n <= sms // c, (c, n)
    assert found[2] >= found[4] >= found[8] >= found[16]
