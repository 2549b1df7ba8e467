"""LayerNorm kernels on the GPU against the fp32 reference (outputs poisoned with NaN first)."""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from tests.gpu_helpers import (DTYPES, MAX_ELEMS, MS, assert_close_poisoned, close_family, kernel,
                               poison_allocator, random_rows,
                               run_backward_poisoned)

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

LN_NS = (64, 1000, 4096, 6144, 8192, 16384, 131072, 262144)
# widths no whole-warp tiling covers (the forward's fewest_warps: 2120, 4240) and rows off 16-byte boundaries
# (the backward's budget in values, or in accesses at 700 rows of 965; the forward's parameters loaded late past
# 4096 columns: 5124, 6571, 11646)
LN_ODD_NS = (965, 2109, 2120, 4240, 5124, 6571, 11646)
LN_CASES = [(N, M) for N in LN_NS for M in MS] + [(N, M) for N in LN_ODD_NS for M in (3, 700, 6000)]
LN_CASES = [(N, M) for N, M in LN_CASES if M * N <= MAX_ELEMS // 2]  # one case (and its backward) within a few GB


def check_forward(x, w, b):
    """The kernel's y, rstd and mean (outputs poisoned first) against the fp32 reference's."""
    M, N = x.shape
    poison_allocator(M * N * x.element_size() + 8 * M)
    out, rstd, mean = kernel("layernorm", x=x, weight=w, bias=b, eps=1e-6, return_rstd=True, return_mean=True)
    y_ref, rstd_ref, mean_ref = R.layernorm(x, w, b, 1e-6, return_rstd=True, return_mean=True)
    assert_close_poisoned(out, y_ref, x.dtype, "y")
    assert_close_poisoned(rstd, rstd_ref, torch.float32, "rstd")
    assert_close_poisoned(mean, mean_ref, torch.float32, "mean")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N,M", LN_CASES)
def test_layernorm_forward(dtype, w_fp32, bias, N, M, seed):
    """LayerNorm forward kernel (the RMSNorm kernel with the mean subtracted), outputs poisoned."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (random_rows(M, N, torch.float32, True, g) * 2 + 0.5).to(dtype)  # offset mean: centring matters
    wd = torch.float32 if w_fp32 else dtype
    w = torch.randn(N, device="cuda", generator=g).to(wd)
    b = torch.randn(N, device="cuda", generator=g).to(wd) if bias else None
    check_forward(x, w, b)


# rows off 16-byte boundaries, dense: odd widths through aligned windows (several rows a CTA, one, a cluster; 5135
# takes narrow_rows'), a window's columns of the rows beside its row never in its mean or variance
LN_WINDOW_NS = (7, 423, 2147, 3001, 5135, 17001, 94557)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", LN_WINDOW_NS)
@pytest.mark.parametrize("M", (1, 9, 300, 2000))
@pytest.mark.parametrize("params", ["w", "w+bias", "w_fp32+bias"])
def test_layernorm_forward_rows_off_boundaries(dtype, N, M, params, seed):
    """Dense rows of odd widths (windows; an fp32 weight takes the narrow kernel), each row's mean far from 0
    and unlike its neighbours' (a neighbour's column let into a row's sums would move its mean and spread).
    fp32 rows' means stay within 4: the fp32 reference's own mean is ~1e-6 of |mean| off, the bound's size."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    reach = 4 if dtype == torch.float32 else 40
    offsets = torch.randint(-reach, reach, (M, 1), device="cuda", generator=g).float()
    x = (random_rows(M, N, torch.float32, False, g) + offsets).to(dtype)
    wd = torch.float32 if "w_fp32" in params else dtype
    w = torch.randn(N, device="cuda", generator=g).to(wd)
    b = torch.randn(N, device="cuda", generator=g).to(wd) if "bias" in params else None
    check_forward(x, w, b)


def test_layernorm_public_api_routes_to_kernel(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, 7, 6144, device="cuda", generator=g).bfloat16()
    w, b = torch.randn(6144, device="cuda", generator=g).bfloat16(), torch.randn(6144, device="cuda").bfloat16()
    assert "kernel" in oink.explain("layernorm", x, w, b)
    y, rstd, mean = oink.layernorm(x, w, b, return_rstd=True, return_mean=True)
    ey, erstd, emean = R.layernorm(x, w, b, return_rstd=True, return_mean=True)
    assert_close_poisoned(y, ey, torch.bfloat16, "y")
    assert rstd.shape == mean.shape == (3, 7)
    assert_close_poisoned(oink.layernorm(x, w), R.layernorm(x, w), torch.bfloat16, "y without bias or stats")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("N,M", LN_CASES)
def test_layernorm_backward(dtype, w_fp32, bias, N, M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (random_rows(M, N, torch.float32, True, g) * 2 + 0.5).to(dtype)
    dout = random_rows(M, N, dtype, True, g)
    wd = torch.float32 if w_fp32 else dtype
    w = torch.randn(N, device="cuda", generator=g).to(wd)
    b = torch.randn(N, device="cuda", generator=g).to(wd) if bias else None
    _, rstd, mean = R.layernorm(x, w, b, return_rstd=True, return_mean=True)
    dx, dw, db = run_backward_poisoned(x, w, dout, rstd, None, bias, mean)
    ex, ew, eb = R.layernorm_backward(dout, x, w, rstd, mean, b)
    close_family(dx, ex, "norm_backward", dtype, "dx")
    close_family(dw, ew, "weight_grad", wd, "dw")
    if bias:
        close_family(db, eb, "weight_grad", wd, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_autograd_and_module(dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ref = torch.nn.LayerNorm(7168, device="cuda", dtype=dtype)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    mod = oink.LayerNorm(7168, device="cuda", dtype=dtype)
    mod.load_state_dict(ref.state_dict())
    x = (torch.randn(300, 7168, device="cuda", generator=g) + 1).to(dtype).requires_grad_(True)
    dy = torch.randn(300, 7168, device="cuda", generator=g).to(dtype)
    assert "kernel" in oink.explain("layernorm_backward", dy, x, mod.weight, torch.ones(300, device="cuda"),
                                    torch.ones(300, device="cuda"))
    y = mod(x)
    gx, gw, gb = torch.autograd.grad(y, [x, mod.weight, mod.bias], dy)
    x32 = x.detach().float().requires_grad_(True)
    w32, b32 = (p.detach().float().requires_grad_(True) for p in (ref.weight, ref.bias))
    y32 = torch.nn.functional.layer_norm(x32, (7168,), w32, b32, 1e-5)
    ex, ew, eb = torch.autograd.grad(y32, [x32, w32, b32], dy.float())
    assert_close_poisoned(y, y32, dtype, "y")
    close_family(gx, ex, "norm_backward", dtype, "dx")
    close_family(gw, ew, "weight_grad", dtype, "dw")
    close_family(gb, eb, "weight_grad", dtype, "db")


def test_layernorm_under_compile_and_graph_capture(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), oink.LayerNorm(4096)).cuda().bfloat16()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(m, fullgraph=True)
    f(x).float().square().mean().backward()
    assert torch.isfinite(m[1].weight.grad).all()
    w, b = m[1].weight.detach(), m[1].bias.detach()
    oink.layernorm_backward(x, x, w, torch.ones(64, device="cuda"), torch.zeros(64, device="cuda"), b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, rstd, mean = oink.layernorm(x, w, b, return_rstd=True, return_mean=True)
        dx = oink.layernorm_backward(y, x, w, rstd, mean, b)[0]
    graph.replay()
    assert_close_poisoned(y, R.layernorm(x, w, b), torch.bfloat16, "graph fwd")
    close_family(dx, R.layernorm_backward(y, x, w, rstd, mean, b)[0], "norm_backward", torch.bfloat16, "graph bwd")
