"""Port of Quack 0.6.x's tests/test_layernorm.py to Oink's API (written here, not copied).

Shapes, dtypes, tolerances and the reference formulas (fp32 torch layer_norm, two-pass mean and
variance) are Quack's. The same tests run on a GPU (all shapes) and on CPU, where Oink runs its
PyTorch reference and only the cheap cases run (see tests/quack_port.py).

Mapping: Quack's ``layernorm_fwd(x, weight, eps=, return_rstd=, return_mean=)`` ->
``oink.layernorm`` (same flags); ``layernorm_bwd(x, weight, dout, rstd, mean, has_bias=)`` ->
``oink.layernorm_backward(dout, x, weight, rstd, mean, bias=)``. Quack's backward returns db
without taking a bias; here ``has_bias`` passes a zero fp32 bias (db does not depend on its
values) and db is checked the same way.

Left out, and why:
- The SM12x (99 KB shared memory) skips: a Quack kernel limit; Oink supports sm_90/sm_100.
- Quack's skip of the fp32 backward for N > 128K ("not enough smem"): a Quack kernel limit, so
  Oink's backward is checked there too.
- test_layernorm_forward_masks_oob_variance_lanes checks against float64, not Quack's fp32
  torch layer_norm, which on CPU is itself ~1.3e-4 off on its input (1e-4 allowed); so it runs
  on CPU too.
- test_layernorm_input_validation: Quack refuses 3D input, CPU tensors and fp16 weights with its
  own messages. In Oink 3D input works (leading dims flattened), CPU tensors run the reference,
  a wrong weight shape is a ValueError, float64 x or weight a TypeError, and a device mix a
  ValueError (checked on GPU only).
"""
from __future__ import annotations

import pytest
import torch

import oink
from tests.quack_port import gpu_only_if, too_big_for_cpu

torch._dynamo.config.cache_size_limit = 1024
torch._dynamo.config.accumulated_cache_size_limit = 1024

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (atol, rtol). The backward chains two row reductions (for the mean and variance terms), so its
# budget in the 16-bit dtypes is wider than the forward's.
TOLERANCES_FWD = {
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.float32: (1e-4, 1e-4),
}
TOLERANCES_BWD = {
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
    torch.float32: (1e-4, 1e-4),
}


def ref_layernorm(x, w, eps=1e-6):
    """Quack's reference: torch layer_norm in fp32 (no bias), back in x's dtype."""
    return torch.nn.functional.layer_norm(x.float(), w.shape, w, None, eps).to(x.dtype)


def ref_rstd(x, eps=1e-6):
    """1 / sqrt(var + eps), the variance taken around the mean (two passes), fp32."""
    h = x.float()
    var = (h - h.mean(dim=-1, keepdim=True)).square().mean(dim=-1)
    return 1.0 / torch.sqrt(var + eps)


def ref_mean(x):
    return x.float().mean(dim=-1)


NS = [256, 512, 760, 1024, 1128, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
# M=4096 gives each persistent CTA of the backward several rows (its reduction buffers cycle).
MS = [1, 37, 199, 4096]


@pytest.mark.parametrize("M,N", [gpu_only_if(too_big_for_cpu(M, N), M, N) for M in MS for N in NS])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("eps", [1e-6])  # eps takes no other code path: one value is enough
@pytest.mark.parametrize("has_bias", [True, False])
def test_layernorm_forward_backward(M, N, input_dtype, eps, has_bias):
    """Forward and backward against fp32 autograd through torch's layer_norm. The backward takes
    the rstd and mean the forward stored, as a training step would."""
    fwd_atol, fwd_rtol = TOLERANCES_FWD[input_dtype]
    bwd_atol, bwd_rtol = TOLERANCES_BWD[input_dtype]
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=input_dtype)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32)

    # Ground truth: the same (already rounded) x, all math in fp32.
    x_ref = x.float().requires_grad_()
    w_ref = weight.detach().clone().requires_grad_()
    b_ref = torch.zeros(N, device=DEVICE, dtype=torch.float32, requires_grad=True)
    out_ref = torch.nn.functional.layer_norm(x_ref, (N,), w_ref, b_ref, eps=eps)

    out, rstd, mean = oink.layernorm(x, weight, eps=eps, return_rstd=True, return_mean=True)
    dout = torch.randn_like(x)
    bias = torch.zeros(N, device=DEVICE, dtype=torch.float32) if has_bias else None
    dx, dw, db = oink.layernorm_backward(dout, x, weight, rstd, mean, bias=bias)
    out_ref.backward(dout.float())

    assert out.shape == x.shape
    assert out.dtype == input_dtype
    assert rstd.shape == (M,) and rstd.dtype == torch.float32
    assert mean.shape == (M,) and mean.dtype == torch.float32
    torch.testing.assert_close(out, out_ref.detach().to(input_dtype), atol=fwd_atol, rtol=fwd_rtol)
    torch.testing.assert_close(rstd, ref_rstd(x, eps=eps), atol=6e-4, rtol=6e-4)
    torch.testing.assert_close(mean, ref_mean(x), atol=6e-4, rtol=6e-4)

    assert dx.shape == x.shape and dx.dtype == input_dtype
    assert dw.shape == (N,) and dw.dtype == torch.float32
    torch.testing.assert_close(dx, x_ref.grad.to(input_dtype), atol=bwd_atol, rtol=bwd_rtol)
    # dw and db sum over M rows in fp32, in another order than the reference: error ~ sqrt(M).
    sum_atol = 5e-6 * (M**0.5) if input_dtype == torch.float32 else 1e-3 * (M**0.5)
    torch.testing.assert_close(dw, w_ref.grad, atol=sum_atol, rtol=1e-3)
    if has_bias:
        assert db.shape == (N,) and db.dtype == torch.float32
        torch.testing.assert_close(db, b_ref.grad, atol=sum_atol, rtol=1e-3)
    else:
        assert db is None


def test_layernorm_fwd_return_arity():
    """Each (return_rstd, return_mean) pair gives its own tuple (the numbers are checked above)."""
    M, N = 37, 1024
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(N, device=DEVICE, dtype=torch.float32)

    out_r, rstd = oink.layernorm(x, weight, return_rstd=True, return_mean=False)
    assert out_r.shape == x.shape and rstd.shape == (M,) and rstd.dtype == torch.float32
    out_m, mean = oink.layernorm(x, weight, return_rstd=False, return_mean=True)
    assert out_m.shape == x.shape and mean.shape == (M,) and mean.dtype == torch.float32
    out = oink.layernorm(x, weight, return_rstd=False, return_mean=False)
    assert isinstance(out, torch.Tensor) and out.shape == x.shape


def test_layernorm_forward_masks_oob_variance_lanes():
    """A ragged N (769: the last tile is partly out of bounds) with a large mean: lanes past N
    must not enter the variance (a kernel's tiling; on CPU the reference's two-pass variance,
    which a one-pass E[x^2] - mean^2 in fp32 gets wrong here). Against float64, not Quack's fp32
    torch layer_norm, which on CPU is itself ~1.3e-4 off."""
    M, N, eps = 3, 769, 1e-5
    cols = torch.arange(N, device=DEVICE, dtype=torch.float32)
    rows = torch.arange(M, device=DEVICE, dtype=torch.float32).unsqueeze(1)
    x = 1000.0 + rows * 100.0 + ((cols % 17) - 8.0) / 8.0
    weight = torch.ones(N, device=DEVICE, dtype=torch.float32)

    out, rstd, mean = oink.layernorm(x, weight, eps=eps, return_rstd=True, return_mean=True)
    x64 = x.double()
    mean64 = x64.mean(-1)
    rstd64 = torch.rsqrt((x64 - mean64.unsqueeze(-1)).square().mean(-1) + eps)
    out64 = (x64 - mean64.unsqueeze(-1)) * rstd64.unsqueeze(-1)
    # The means (1000..1200) are fp32 sums of 769 values: allowed two ulps there (2^-13 each; the
    # CPU reference is 0.4 ulp off). y inherits the mean's error times rstd (1.63). x - mean is
    # exact (Sterbenz), so the variance and rstd barely feel the mean's error. Lanes past N in the
    # variance move rstd by orders of magnitude; a one-pass variance here by 0.2%.
    ulp = 2.0**-13
    torch.testing.assert_close(mean.double(), mean64, atol=2 * ulp, rtol=0)
    torch.testing.assert_close(rstd.double(), rstd64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), out64, atol=4 * ulp, rtol=0)


def test_layernorm_input_validation():
    weight = torch.randn(1024, device=DEVICE, dtype=torch.float32)
    # Quack refuses 3D input; Oink flattens the leading dims.
    x_3d = torch.randn(2, 32, 1024, device=DEVICE, dtype=torch.float16)
    out = oink.layernorm(x_3d, weight)
    assert out.shape == x_3d.shape and out.dtype == x_3d.dtype
    torch.testing.assert_close(out, ref_layernorm(x_3d, weight), atol=TOLERANCES_FWD[torch.float16][0],
                               rtol=TOLERANCES_FWD[torch.float16][1])

    x = torch.randn(32, 1024, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="weight"):
        oink.layernorm(x, torch.randn(512, device=DEVICE, dtype=torch.float32))

    # CPU tensors are no error: they run the reference.
    x_cpu = torch.randn(32, 1024, dtype=torch.float16)
    w_cpu = torch.randn(1024, dtype=torch.float32)
    out_cpu = oink.layernorm(x_cpu, w_cpu)
    assert out_cpu.device.type == "cpu"
    torch.testing.assert_close(out_cpu, ref_layernorm(x_cpu, w_cpu), atol=TOLERANCES_FWD[torch.float16][0],
                               rtol=TOLERANCES_FWD[torch.float16][1])

    with pytest.raises(TypeError, match="float64"):
        oink.layernorm(torch.randn(32, 1024, device=DEVICE, dtype=torch.float64), weight)
    with pytest.raises(TypeError, match="weight"):
        oink.layernorm(x, torch.randn(1024, device=DEVICE, dtype=torch.float64))


@pytest.mark.gpu
def test_layernorm_device_mismatch():
    """Quack's CPU-tensor check, Oink's way: x on the GPU with a CPU weight is refused."""
    x = torch.randn(32, 1024, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="weight"):
        oink.layernorm(x, torch.randn(1024, dtype=torch.float32))
