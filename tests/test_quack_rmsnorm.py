"""Port of Quack 0.6.x's tests/test_rmsnorm.py to Oink's API (written here, not copied).

Shapes, dtypes, tolerances and the reference formula (fp32 math, the sum x + residual kept in
fp32) are Quack's. The same tests run on a GPU (all shapes) and on CPU, where Oink runs its
PyTorch reference and only the cheap cases run (see tests/quack_port.py).

Mapping: Quack's ``rmsnorm_fwd`` -> ``oink.rmsnorm_forward`` (returns (y, rstd, residual_out)
instead of Quack's (out, residual_out, rstd); residual_out is None without a residual, where Quack
hands back x); ``rmsnorm_bwd`` -> ``oink.rmsnorm_backward``; ``rmsnorm`` -> ``oink.rmsnorm``.

Left out, and why:
- test_rmsnorm_degenerate_cluster_config_is_clamped, test_rmsnorm_{fwd,bwd}_tuned_config,
  test_rmsnorm_{fwd,bwd}_tuned_dispatch, test_rmsnorm_{fwd,bwd}_tuned_requires_config: they drive
  Quack internals (``rmsnorm_fwd_tuned``/``rmsnorm_bwd_tuned``, ``RmsNormFwdConfig``/
  ``RmsNormBwdConfig``, the autotuner, the cluster-size clamp) that Oink does not have.
- The SM12x (99 KB shared memory) skips: a Quack kernel limit; Oink supports sm_90/sm_100.
- Quack's skip of the fp32 backward for N > 128K ("not enough smem"): a Quack kernel limit, so
  Oink's backward is checked there too. The fp32 N=256K, M=8K out-of-memory skip is kept.
- test_rmsnorm_compile_cache checked ``_compile_rmsnorm_fwd.cache_info()``; here it checks that
  Oink's compile cache (``oink.kernels.compile.CACHE``) does not grow when only M changes (GPU
  only: on CPU no kernel compiles). Quack's exact entry counts for new N / dtypes are not kept,
  as Oink's cache is process-wide and other tests may already have filled those entries.
- test_rmsnorm_input_validation: Oink raises its own errors (ValueError for a wrong weight shape,
  TypeError for float64 x or weight) and CPU tensors are not an error (they run the reference),
  so a CPU call must work instead and a device mix must raise (GPU only).
"""
from __future__ import annotations

import pytest
import torch

import oink
from tests.quack_port import gpu_only_if, maybe_compile, shapes_x_compile, sync, too_big_for_cpu

torch._dynamo.config.cache_size_limit = 1024
torch._dynamo.config.accumulated_cache_size_limit = 1024

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCES = {
    torch.bfloat16: 1e-1,
    torch.float16: 1e-2,
    torch.float32: 1e-4,
}


def ref_rmsnorm(x, w=None, bias=None, residual=None, eps=1e-6, weight_offset=0.0):
    """Quack's reference formula in fp32: y = h / sqrt(mean(h^2) + eps) * (w + offset) + bias with
    h = x (+ residual, summed in fp32). Returns y, or (y, h in residual's dtype) with a residual."""
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    y = h / torch.sqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    if w is not None:
        y = y * (w.float() + weight_offset)
    if bias is not None:
        y = y + bias.float()
    if residual is None:
        return y.to(x.dtype)
    return y.to(x.dtype), h.to(residual.dtype)


def leaf_copy(t):
    return None if t is None else t.detach().clone().requires_grad_()


def weight_grad_atol(weight_dtype, M, ref_grad):
    """dw sums dout * x_hat over M rows in an order of its own: fp32 error grows like sqrt(M); in
    bf16/fp16 the result may land one ulp (of the largest gradient) away."""
    if weight_dtype == torch.float32:
        return 5e-6 * (M**0.5)
    return 2 * torch.finfo(weight_dtype).eps * ref_grad.abs().max()


FWD_BWD_SHAPES = [(M, N) for M in (1, 199, 8 * 1024)
                  for N in (192, 256, 760, 1024, 1128, 4096, 32768, 131072, 262144)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(FWD_BWD_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("eps", [1e-6])
def test_rmsnorm_forward_backward(M, N, input_dtype, weight_dtype, eps, use_compile):
    if N >= 256 * 1024 and input_dtype == torch.float32 and M >= 8 * 1024:
        pytest.skip("fp32 with M=8K, N=256K: skipped to avoid running out of memory")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    atol = TOLERANCES[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=input_dtype, requires_grad=True)
    weight = (torch.randn(N, device=DEVICE, dtype=weight_dtype, requires_grad=True)
              if weight_dtype is not None else None)
    x_ref, weight_ref = leaf_copy(x), leaf_copy(weight)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    # The eager fp32 reference of the largest shapes would need too much memory: compile it.
    ref = torch.compile(ref_rmsnorm) if (N >= 256 * 1024 and M >= 8 * 1024) else ref_rmsnorm

    # All calls first (forward and backward), then the comparisons.
    out = fn(x, weight, eps=eps)
    out_ref = ref(x_ref, weight_ref, eps=eps)
    grad_out = torch.randn_like(out)
    sync()
    out.backward(grad_out)
    out_ref.backward(grad_out)

    assert out.shape == x.shape
    assert out.dtype == input_dtype
    # Operands of 1 GiB and more are compared in slices: assert_close's fp32 temporaries would
    # otherwise come to several times their size on top of the live tensors.
    pieces = 16 if x.numel() * x.element_size() >= 2**30 else 1

    def compare(actual, expected):
        for a, e in zip(actual.chunk(pieces), expected.chunk(pieces)):
            torch.testing.assert_close(a, e, atol=atol, rtol=1e-3)

    compare(out, out_ref)
    del out, out_ref, grad_out
    compare(x.grad, x_ref.grad)
    x.grad = x_ref.grad = None
    if weight is not None:
        torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=1e-3,
                                   atol=weight_grad_atol(weight_dtype, M, weight_ref.grad))


OFFSET_SHAPES = [(M, N) for M in (1, 199, 8 * 1024) for N in (1024, 4096, 32768)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(OFFSET_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_weight_offset(M, N, input_dtype, weight_dtype, use_compile):
    """Gemma's form y = x_hat * (1 + w), w initialized near zero; forward and backward."""
    atol = TOLERANCES[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=input_dtype, requires_grad=True)
    # Near zero on purpose: a kernel that forgot the offset would give y ~ 0 instead of ~ x_hat.
    weight = (0.1 * torch.randn(N, device=DEVICE, dtype=weight_dtype)).requires_grad_()
    x_ref, weight_ref = leaf_copy(x), leaf_copy(weight)
    fn = maybe_compile(oink.rmsnorm, use_compile)

    out = fn(x, weight, weight_offset=1.0)
    out_ref = ref_rmsnorm(x_ref, weight_ref, weight_offset=1.0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    out_ref.backward(grad_out)

    torch.testing.assert_close(out, out_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-3)
    # dw = sum(dout * x_hat) whatever the offset: same tolerance as test_rmsnorm_forward_backward.
    torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=1e-3,
                               atol=weight_grad_atol(weight_dtype, M, weight_ref.grad))


# 2 x 1024 x 256 elements: above the CPU budget, so GPU only.
@pytest.mark.parametrize("use_compile", [gpu_only_if(too_big_for_cpu(2, 1024, 256), u) for u in (False, True)])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_noncontiguous_grad(input_dtype, use_compile):
    """3D input whose gradient from .sum() reaches the backward non-contiguous (Quack issue #88)."""
    atol = TOLERANCES[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(2, 1024, 256, device=DEVICE, dtype=input_dtype, requires_grad=True)
    w = torch.ones(256, device=DEVICE, dtype=torch.float32)
    x_ref, w_ref = leaf_copy(x), w.detach().clone()
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, w, eps=1e-6)
    out_ref = ref_rmsnorm(x_ref, w_ref, eps=1e-6)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-3)


def test_rmsnorm_compile_2d_then_4d():
    """One torch.compile'd oink.rmsnorm called with 2D x and [N] weight, then (no dynamo reset in
    between) with 4D x, a per-head [H, D] weight and bias, and a residual."""
    torch._dynamo.reset()
    fn = torch.compile(oink.rmsnorm, fullgraph=True)
    atol = TOLERANCES[torch.bfloat16]

    x = torch.randn(32, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device=DEVICE, dtype=torch.float32, requires_grad=True)
    x_ref, w_ref = leaf_copy(x), leaf_copy(w)
    out = fn(x, w, eps=1e-5)
    out_ref = ref_rmsnorm(x_ref, w_ref, eps=1e-5)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-3)

    x4 = torch.randn(2, 16, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.randn(4, 64, device=DEVICE, dtype=torch.float32, requires_grad=True)
    b2 = torch.randn(4, 64, device=DEVICE, dtype=torch.float32, requires_grad=True)
    r4 = torch.randn(2, 16, 4, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    x4_ref, w2_ref, b2_ref, r4_ref = (leaf_copy(t) for t in (x4, w2, b2, r4))
    # prenorm=False: y only. Oink normalizes round_bf16(x + residual), the reference the fp32 sum;
    # the bf16 tolerance covers the difference.
    out2 = fn(x4, w2, bias=b2, residual=r4, eps=1e-6)
    out2_ref, _ = ref_rmsnorm(x4_ref, w2_ref, bias=b2_ref, residual=r4_ref, eps=1e-6)
    out2.sum().backward()
    out2_ref.sum().backward()
    torch.testing.assert_close(out2, out2_ref, atol=atol, rtol=1e-3)
    for got, want in ((x4, x4_ref), (w2, w2_ref), (b2, b2_ref), (r4, r4_ref)):
        torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=1e-3)


QK_SHAPES = [
    (2, 16, 4, 64),  # multi-head q/k norm as in attention
    (1, 1, 32, 128),  # one token, many heads
]


@pytest.mark.parametrize("B,S,H,D,use_compile", shapes_x_compile(QK_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("use_bias,use_residual", [(False, False), (True, True)])
def test_rmsnorm_qk(B, S, H, D, use_compile, input_dtype, use_bias, use_residual):
    """Per-head RMSNorm: x [B, S, H, D] with weight (and bias) [H, D]."""
    eps = 1e-6
    atol = TOLERANCES[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(B, S, H, D, device=DEVICE, dtype=input_dtype, requires_grad=True)
    weight = torch.randn(H, D, device=DEVICE, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(H, D, device=DEVICE, dtype=torch.float32, requires_grad=True) if use_bias else None
    residual = (torch.randn(B, S, H, D, device=DEVICE, dtype=input_dtype, requires_grad=True)
                if use_residual else None)
    x_ref, weight_ref, bias_ref, residual_ref = (leaf_copy(t) for t in (x, weight, bias, residual))

    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, weight, bias=bias, residual=residual, eps=eps)
    out_ref = ref_rmsnorm(x_ref, weight_ref, bias=bias_ref, residual=residual_ref, eps=eps)
    if residual is not None:
        out_ref = out_ref[0]
    grad_out = torch.randn_like(out)
    sync()
    out.backward(grad_out)
    out_ref.backward(grad_out)

    torch.testing.assert_close(out, out_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-3)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=atol, rtol=1e-3)
    if bias is not None:
        torch.testing.assert_close(bias.grad, bias_ref.grad, atol=atol, rtol=1e-3)
    if residual is not None:
        torch.testing.assert_close(residual.grad, residual_ref.grad, atol=atol, rtol=1e-3)


# x is a [8, 4096, 512] view of a [8, 4096, 576] tensor: far above the CPU budget.
@pytest.mark.parametrize("use_compile", [gpu_only_if(too_big_for_cpu(8, 4096, 512), u) for u in (False, True)])
def test_rmsnorm_strided_tensor(use_compile):
    """x with a row stride wider than its last dim: shape (8, 4096, 512), strides (.., 576, 1)."""
    dtype, atol, eps = torch.bfloat16, 1e-1, 1e-5
    wide = torch.randn(8, 4096, 576, device=DEVICE, dtype=dtype)
    x = wide[:, :, :512].detach().requires_grad_()
    weight = torch.randn(512, device=DEVICE, dtype=torch.float32, requires_grad=True)
    x_ref, weight_ref = leaf_copy(x), leaf_copy(weight)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, weight, eps=eps)
    out_ref = ref_rmsnorm(x_ref, weight_ref, eps=eps)
    grad_out = torch.randn_like(out)
    sync()
    out.backward(grad_out)
    out_ref.backward(grad_out)
    assert out.shape == x.shape
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-3)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=atol, rtol=1e-3)


@pytest.mark.gpu  # 32K x 128K..256K bf16: 8-16 GiB per tensor
@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("M", [32 * 1024])
@pytest.mark.parametrize("N", [131072, 262144])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-5])
def test_rmsnorm_large_tensor(M, N, input_dtype, eps, use_compile):
    """Forward on a tensor of 4-8 G elements. x and y live whole; the reference (row-wise, so exact
    by pieces) is computed and compared one slice of rows at a time."""
    pieces = 16
    # x and out in full plus about three slice-sized temporaries; skip when the free memory is short.
    need = 2 * M * N * 2 + 3 * (M // pieces) * N * 2
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if need > 0.9 * free:
        pytest.skip(f"needs ~{need // 2**30} GiB of GPU memory, {free // 2**30} GiB free")
    atol = TOLERANCES[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=input_dtype)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, weight, eps=eps)
    ref = torch.compile(ref_rmsnorm)  # the eager reference's temporaries would not fit
    for x_piece, out_piece in zip(x.chunk(pieces), out.chunk(pieces)):
        assert (out_piece - ref(x_piece, weight, eps=eps)).abs().max() < atol


def test_rmsnorm_input_validation():
    x_3d = torch.randn(2, 32, 1024, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(1024, device=DEVICE, dtype=torch.float32)
    # Leading dims are flattened: 3D input works and keeps its shape and dtype.
    out = oink.rmsnorm(x_3d, weight)
    assert out.shape == x_3d.shape
    assert out.dtype == x_3d.dtype

    x = torch.randn(32, 1024, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="weight"):
        oink.rmsnorm(x, torch.randn(512, device=DEVICE, dtype=torch.float32))

    # Unlike Quack, CPU tensors are no error: they run the reference.
    x_cpu = torch.randn(32, 1024, dtype=torch.float16)
    w_cpu = torch.randn(1024, dtype=torch.float32)
    out_cpu = oink.rmsnorm(x_cpu, w_cpu)
    assert out_cpu.device.type == "cpu"
    torch.testing.assert_close(out_cpu, ref_rmsnorm(x_cpu, w_cpu), atol=TOLERANCES[torch.float16], rtol=1e-3)

    with pytest.raises(TypeError, match="float64"):
        oink.rmsnorm(torch.randn(32, 1024, device=DEVICE, dtype=torch.float64), weight)
    with pytest.raises(TypeError, match="weight"):
        oink.rmsnorm(x, torch.randn(1024, device=DEVICE, dtype=torch.float64))


@pytest.mark.gpu
def test_rmsnorm_device_mismatch():
    """Quack's CPU-tensor check, Oink's way: x on the GPU with a CPU weight is refused."""
    x = torch.randn(32, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="weight"):
        oink.rmsnorm(x, torch.randn(1024, dtype=torch.float32))


@pytest.mark.gpu  # on CPU no kernel compiles
def test_rmsnorm_compile_cache():
    """Kernels compile per (N, dtypes, flags): a new M must reuse the compiled kernel."""
    from oink.kernels.compile import CACHE

    M, N, eps = 32, 1024, 1e-6

    def lookups(x, w):
        """The cache keys one forward looked up, and the cache size after it."""
        CACHE.clear_used()
        oink.rmsnorm_forward(x, w, eps=eps)
        torch.cuda.synchronize()
        return set(CACHE.used), len(CACHE)

    w1 = torch.randn(N, device="cuda", dtype=torch.float32)
    keys1, size1 = lookups(torch.randn(M, N, device="cuda", dtype=torch.float16), w1)
    assert keys1, "the forward looked up no compiled kernel"
    # The same shape again, then twice the rows: same kernel, no new entry.
    assert lookups(torch.randn(M, N, device="cuda", dtype=torch.float16), w1) == (keys1, size1)
    assert lookups(torch.randn(2 * M, N, device="cuda", dtype=torch.float16), w1) == (keys1, size1)
    # Twice the width, or another dtype, takes another kernel (entries may already exist).
    keys_n, size_n = lookups(torch.randn(M, 2 * N, device="cuda", dtype=torch.float16),
                             torch.randn(2 * N, device="cuda", dtype=torch.float32))
    assert keys_n and keys_n != keys1 and size_n >= size1
    keys_dt, size_dt = lookups(torch.randn(M, N, device="cuda", dtype=torch.float32), w1)
    assert keys_dt and keys_dt not in (keys1, keys_n) and size_dt >= size_n
    # And after all that, a new M still adds nothing.
    assert lookups(torch.randn(3 * M, N, device="cuda", dtype=torch.float16), w1) == (keys1, size_dt)


@pytest.mark.parametrize("use_compile", [False, True])
def test_rmsnorm_with_bias(use_compile):
    M, N, eps = 32, 1024, 1e-6
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.float16, requires_grad=True)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(N, device=DEVICE, dtype=torch.float32, requires_grad=True)
    x_ref, weight_ref, bias_ref = leaf_copy(x), leaf_copy(weight), leaf_copy(bias)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, weight, bias=bias, eps=eps)
    out_ref = ref_rmsnorm(x_ref, weight_ref, bias=bias_ref, eps=eps)
    grad_out = torch.randn_like(out)
    sync()
    out.backward(grad_out)
    out_ref.backward(grad_out)

    assert out.shape == x.shape
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, out_ref, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(bias.grad, bias_ref.grad, atol=1e-4, rtol=1e-3)


def _residual_inputs(M, N):
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.float16, requires_grad=True)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32, requires_grad=True)
    residual = torch.randn(M, N, device=DEVICE, dtype=torch.float16, requires_grad=True)
    return x, weight, residual


@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("backward_type", ["only_output", "both"])
def test_rmsnorm_with_residual(backward_type, use_compile):
    """prenorm=True: (y, residual_out), the gradient coming through y alone or through both.
    Oink normalizes round_fp16(x + residual) where the reference takes the fp32 sum; residual_out
    is that rounded sum in both, and the fp16 tolerance covers y."""
    M, N, eps = 32, 1024, 1e-6
    x, weight, residual = _residual_inputs(M, N)
    x_ref, weight_ref, residual_ref = leaf_copy(x), leaf_copy(weight), leaf_copy(residual)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out, residual_out = fn(x, weight, residual=residual, eps=eps, prenorm=True)
    out_ref, residual_out_ref = ref_rmsnorm(x_ref, weight_ref, residual=residual_ref, eps=eps)
    grad_out = torch.randn_like(out)
    sync()
    if backward_type == "only_output":
        out.backward(grad_out)
        out_ref.backward(grad_out)
    else:
        (out + residual_out).backward(grad_out)
        (out_ref + residual_out_ref).backward(grad_out)

    assert out.shape == x.shape
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, out_ref, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(residual_out, residual_out_ref, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(residual.grad, residual_ref.grad, atol=1e-2, rtol=1e-3)


def rmsnorm_backward64(x, w, dy, rstd):
    """(dx, dw) of y = x * rstd * w in float64, rstd taken as given (as the backward takes it)."""
    x, w, dy = x.double(), w.double(), dy.double()
    r = rstd.double().unsqueeze(-1)
    xhat, wdy = x * r, dy * w
    dx = (wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)) * r
    return dx, (dy * xhat).sum(0)


@pytest.mark.gpu  # 32K x 1K: above the CPU budget
def test_amp_bf16_training():
    """The backward takes a bf16 dout with fp32 x and weight (what AMP hands it); dx and dw
    against float64 (Quack only checked that they exist). rstd is the forward's, not Quack's
    random one: what a training step passes."""
    M, N = 32768, 1024
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.float32)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    dx, dw, _, _ = oink.rmsnorm_backward(x, weight, dy, rstd)
    dx64, dw64 = rmsnorm_backward64(x, weight, dy, rstd)
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    # fp32 math on exact inputs: dx within the norm backward's fp32 bound; dw sums M rows in fp32
    # in another order, an error ~ sqrt(M) ulps of its O(1) terms
    torch.testing.assert_close(dx.double(), dx64, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw.double(), dw64, atol=5e-6 * M**0.5, rtol=1e-4)


@pytest.mark.parametrize("use_compile", [False, True])
def test_rmsnorm_prenorm_false(use_compile):
    """A residual in, prenorm=False: a single tensor out (no residual_out)."""
    M, N, eps = 32, 1024, 1e-6
    x, weight, residual = _residual_inputs(M, N)
    x_ref, weight_ref, residual_ref = leaf_copy(x), leaf_copy(weight), leaf_copy(residual)
    fn = maybe_compile(oink.rmsnorm, use_compile)
    out = fn(x, weight, residual=residual, eps=eps, prenorm=False)
    assert isinstance(out, torch.Tensor)
    assert out.shape == x.shape
    assert out.dtype == torch.float16

    out_ref, _ = ref_rmsnorm(x_ref, weight_ref, residual=residual_ref, eps=eps)
    grad_out = torch.randn_like(out)
    sync()
    out.backward(grad_out)
    out_ref.backward(grad_out)
    torch.testing.assert_close(out, out_ref, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(weight.grad, weight_ref.grad, atol=1e-2, rtol=1e-3)
    torch.testing.assert_close(residual.grad, residual_ref.grad, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("use_compile", [False, True])
def test_rmsnorm_residual_dtype_override(use_compile):
    """residual_dtype=float32 with a bf16 residual: residual_out is fp32 and holds x + residual
    exactly (the sum of two bf16 values is exact in fp32); y stays bf16."""
    M, N, eps = 32, 1024, 1e-6
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32)
    residual = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    exact_sum = x.float() + residual.float()

    out, _, residual_out = oink.rmsnorm_forward(x, weight, residual=residual, residual_dtype=torch.float32, eps=eps)
    assert residual_out.dtype == torch.float32, f"residual_out is {residual_out.dtype}, asked for float32"
    torch.testing.assert_close(residual_out, exact_sum, atol=0.0, rtol=0.0)
    assert out.dtype == torch.bfloat16

    fn = maybe_compile(oink.rmsnorm, use_compile)
    _, residual_out2 = fn(x, weight, residual=residual, residual_dtype=torch.float32, eps=eps, prenorm=True)
    assert residual_out2.dtype == torch.float32
    torch.testing.assert_close(residual_out2, exact_sum, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("store_rstd", [False, True])
def test_rmsnorm_fwd_empty(store_rstd):
    """Zero rows (an uneven FSDP shard, say): empty outputs of the right shapes, no launch."""
    N = 4096
    x = torch.empty(0, N, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(N, device=DEVICE, dtype=torch.bfloat16)
    out, rstd, residual_out = oink.rmsnorm_forward(x, weight, store_rstd=store_rstd)
    assert out.shape == x.shape and out.numel() == 0
    assert residual_out is None  # Oink: None without a residual (Quack returns x itself)
    if store_rstd:
        assert rstd.shape == x.shape[:-1] and rstd.numel() == 0
    else:
        assert rstd is None


@pytest.mark.parametrize("has_bias", [False, True])
def test_rmsnorm_bwd_empty(has_bias):
    """Zero rows: dx empty, dw (and db) the gradient of an empty batch, i.e. zeros."""
    N = 4096
    x = torch.empty(0, N, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(N, device=DEVICE, dtype=torch.bfloat16)
    dout = torch.empty(0, N, device=DEVICE, dtype=torch.bfloat16)
    rstd = torch.empty(0, device=DEVICE, dtype=torch.float32)
    dx, dw, db, dresidual = oink.rmsnorm_backward(x, weight, dout, rstd, has_bias=has_bias)
    assert dx.shape == x.shape and dx.numel() == 0
    assert dw is not None and dw.shape == weight.shape
    assert torch.all(dw == 0)
    if has_bias:
        assert db is not None and db.shape == weight.shape
        assert torch.all(db == 0)
    else:
        assert db is None
    assert dresidual is None
