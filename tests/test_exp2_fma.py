"""``fma_exp2.exp2_fma`` and ``exp2_affine_fma``, the exp2s the softcapped cross-entropy kernels take on the FMA
pipe for part of their logits: each polynomial degree, with and without the clamp below, compiled for both archs on
CPU, and on a GPU against float64 over its whole input range (-inf, NaN, the integers, where 2^j's bits are built,
and the underflow edge included; without the clamp, the range its callers promise: z >= -126.5); the affine form
over the softcap's u in [-1, 1] at the scale and shift of softcaps 30 and 40 (the largest the kernels take)."""
from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32

from oink.kernels.compile import compile_kernel, fake_stream, gmem_ptr
from oink.kernels.fma_exp2 import exp2_affine_fma, exp2_fma
from oink.kernels.reduction import LOG2E

THREADS = 128


# the largest relative error a degree may have (fp32 Horner; the special-function unit's ex2.approx: ~2.4e-7)
MAX_REL = {5: 3e-7, 4: 3e-6}
FORMS = [(5, True), (5, False), (4, True), (4, False)]


class _Exp2Fma:
    """y[i] = exp2_fma(x[i]) over n fp32 values; with ``affine`` (scale, shift), exp2_affine_fma(x[i], scale,
    shift)."""

    def __init__(self, degree: int, clamp: bool, affine: tuple[float, float] | None = None):
        self.degree, self.clamp, self.affine = degree, clamp, affine

    @cute.jit
    def __call__(self, px: cute.Pointer, py: cute.Pointer, n: Int32, stream: cuda.CUstream):
        mX = cute.make_tensor(px, cute.make_layout((n,)))
        mY = cute.make_tensor(py, cute.make_layout((n,)))
        self.kernel(mX, mY).launch(grid=[cute.ceil_div(n, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        i = bidx * THREADS + tidx
        if i < cute.size(mX):
            if cutlass.const_expr(self.affine is None):
                mY[i] = exp2_fma(mX[i], degree=self.degree, clamp=self.clamp)
            else:
                mY[i] = exp2_affine_fma(mX[i], *self.affine, degree=self.degree)


def _compiled(arch: str, degree: int, clamp: bool, affine: tuple[float, float] | None = None):
    f32 = gmem_ptr(Float32, 4)
    return compile_kernel(_Exp2Fma(degree, clamp, affine), f32, f32, Int32(1), fake_stream(), arch=arch)


# (scale, shift) of the softcap forward's exp(t - c) = 2^(u c log2(e) - c log2(e)), softcaps 30 and 40
AFFINE = [(c * LOG2E, c * LOG2E) for c in (30.0, 40.0)]


@pytest.mark.parametrize("degree,clamp", FORMS)
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_exp2_fma_compiles(arch, degree, clamp):
    assert _compiled(arch, degree, clamp) is not None


@pytest.mark.gpu
@pytest.mark.sm(90)
@pytest.mark.parametrize("degree,clamp", FORMS)
def test_exp2_fma_matches_float64(degree, clamp, seed):
    from oink.dispatch import device_arch
    from oink.kernels.compile import current_stream

    g = torch.Generator(device="cuda").manual_seed(seed)
    z = torch.cat([
        torch.linspace(-130.0, 127.0, 1 << 20, device="cuda"),
        torch.rand(1 << 20, device="cuda", generator=g) * -120.0,  # the softcapped kernels' range
        torch.arange(-127.0, 128.0, device="cuda"),
        torch.arange(-127.0, 127.0, device="cuda") + 0.5,  # rounding ties (127.5 is past the domain: j = 128)
        torch.tensor([-math.inf, math.nan, -126.51, -126.49, -127.0, -200.0, 0.0, -0.0], device="cuda"),
    ])
    if not clamp:  # without the clamp, only the domain its callers promise (NaN included)
        z = z[z.isnan() | (z >= -126.5)]
    y = torch.full_like(z, 12345.0)  # poison: every value must be written
    fn = _compiled(device_arch(z.device.index)[0], degree, clamp)
    fn(z.data_ptr(), y.data_ptr(), z.numel(), current_stream(z.device))
    torch.cuda.synchronize()
    want = torch.exp2(z.double())
    nan = z.isnan()
    assert y[nan].isnan().all(), "a NaN must stay NaN"
    normal = ~nan & (want >= 2.0 ** -125)
    rel = ((y[normal].double() - want[normal]) / want[normal]).abs().max().item()
    assert rel <= MAX_REL[degree], f"relative error {rel:.3g}"
    tiny = ~nan & ~normal  # below 2^-125: 0 or the value, never more than 2^-125 away
    assert ((y[tiny].double() - want[tiny]).abs() <= 2.0 ** -125).all()
    if clamp:
        assert y[z == -math.inf].eq(0).all() and y[z < -127].eq(0).all()


@pytest.mark.parametrize("degree", (4, 5))
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_exp2_affine_fma_compiles(arch, degree):
    assert _compiled(arch, degree, False, AFFINE[0]) is not None


@pytest.mark.parametrize("scale,shift", [(100.0, 10.0), (10.0, 100.0), (10.0, -1.0)])
def test_exp2_affine_fma_refuses_what_leaves_its_range(scale, shift):
    """2^(j - n) must stay a normal fp32: a scale or shift past 64 (or a negative shift) is refused at trace."""
    with pytest.raises(ValueError, match="exp2_affine_fma"):
        exp2_affine_fma(Float32(0.5), scale, shift)


@pytest.mark.gpu
@pytest.mark.sm(90)
@pytest.mark.parametrize("affine", AFFINE, ids=("softcap30", "softcap40"))
@pytest.mark.parametrize("degree", (4, 5))
def test_exp2_affine_fma_matches_float64(degree, affine, seed):
    from oink.dispatch import device_arch
    from oink.kernels.compile import current_stream

    scale, shift = affine
    g = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.cat([
        torch.linspace(-1.0, 1.0, 1 << 20, device="cuda"),
        torch.rand(1 << 20, device="cuda", generator=g) * 2 - 1,
        torch.arange(-57.0, 58.0, device="cuda") / scale,  # u scale near the integers, where j's bits are built
        torch.tensor([math.nan, -1.0, 1.0, 0.0, -0.0], device="cuda"),
    ])
    y = torch.full_like(u, 12345.0)  # poison: every value must be written
    fn = _compiled(device_arch(u.device.index)[0], degree, False, affine)
    fn(u.data_ptr(), y.data_ptr(), u.numel(), current_stream(u.device))
    torch.cuda.synchronize()
    scale32 = torch.tensor(scale, dtype=torch.float32).double()  # the kernel's scale, an fp32 literal
    want = torch.exp2(u.double() * scale32 - shift)
    nan = u.isnan()
    assert y[nan].isnan().all(), "a NaN must stay NaN"
    rel = ((y[~nan].double() - want[~nan]) / want[~nan]).abs().max().item()
    assert rel <= MAX_REL[degree], f"relative error {rel:.3g}"
