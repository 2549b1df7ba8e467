"""Hypothesis fuzzing: the public ops (CPU: reference path through dispatch; GPU: kernels) on
random shapes, dtypes and layouts (dense, padded rows, misaligned offset views), on CPU also at
random magnitudes (1e-4 .. 1e4, rows spread apart), and fp16 near its overflow (values up to ~5.9e4, whose
squares and row sums overflow fp16) on CPU and GPU.

Correctness checks compare with an independent float64 computation. The ``*_wiring_cpu`` tests
compare the public op with the reference it runs on CPU: they check arguments, layouts and fakes
reach it intact, not that the answer is right."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import oink
from oink import reference as R
from pytest_oink import strategies as S
from pytest_oink.gate import assert_close
from tests.gpu_helpers import scales_exact


def _dt(name):
    return getattr(torch, name)


def _rms64(x, w, eps=1e-6):
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * w.double()


@given(shape=S.shapes("rmsnorm"), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16),
       mag=S.magnitudes())
def test_rmsnorm_forward_cpu(shape, dtype, layout, seed, mag):
    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, seed=seed, magnitude=mag)
    w = S.make_tensor(1, N, _dt(dtype), "contiguous", seed=seed + 1)[0]
    y = oink.rmsnorm_forward(x, w)[0]
    assert_close(y, _rms64(x, w), family="rmsnorm", dtype=dtype)


@given(shape=S.shapes("softmax"), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16))
def test_softmax_cpu(shape, dtype, layout, seed):
    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, seed=seed)
    assert_close(oink.softmax_forward(x), torch.softmax(x.double(), -1), family="softmax", dtype=dtype)


@given(shape=S.shapes("nvfp4"), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16),
       swizzled=st.booleans())
def test_nvfp4_quantize_layouts_wiring_cpu(shape, dtype, layout, seed, swizzled):
    """Wiring, not correctness: a strided input through the public op gives the reference's answer
    for its contiguous copy (the quantizer's own correctness: tests/test_nvfp4_reference.py)."""
    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, seed=seed)
    gs = torch.tensor([float(seed % 1000 + 1)])
    q, sf = oink.nvfp4_quantize(x, gs, swizzled)
    rq, rsf = R.nvfp4_quantize(x.contiguous(), gs, swizzled)
    assert torch.equal(q, rq) and torch.equal(sf.view(torch.uint8), rsf.view(torch.uint8))


@given(op=st.sampled_from(["rmsnorm_forward", "softmax_forward", "layernorm"]), layout=S.layouts())
def test_dispatch_on_cpu_is_always_the_reference(op, layout):
    x = S.make_tensor(3, 64, torch.float32, layout)
    args = (x, torch.ones(64)) if op != "softmax_forward" else (x,)
    assert oink.explain(op, *args).startswith(f"{op}: reference (cpu tensors")


@pytest.mark.gpu
@pytest.mark.sm(90)
@given(shape=S.shapes("rmsnorm", max_m=5000), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16),
       w_fp32=st.booleans())
def test_rmsnorm_kernels_gpu(shape, dtype, layout, seed, w_fp32):
    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, device="cuda", seed=seed)
    res = S.make_tensor(M, N, _dt(dtype), layout, device="cuda", seed=seed + 1)
    w = S.make_tensor(1, N, torch.float32 if w_fp32 else _dt(dtype), "contiguous", device="cuda", seed=seed + 2)[0]
    y, rstd, r_out = oink.rmsnorm_forward(x, w, residual=res, store_rstd=True)
    ey, erstd, er = R.rmsnorm_forward(x, w, residual=res, store_rstd=True)
    assert torch.equal(r_out, er)
    assert_close(y, ey, family="rmsnorm", dtype=dtype)
    assert_close(rstd, erstd, family="rmsnorm", dtype=torch.float32)
    dx = oink.rmsnorm_backward(r_out, w, y, rstd)[0]
    assert_close(dx, R.rmsnorm_backward(r_out, w, y, rstd)[0], family="norm_backward", dtype=dtype)
    xi, ri = x.clone(), res.clone()
    oink.fused_add_rmsnorm_(x, res, w)  # offset views can't run in place in the kernel: reference
    R.fused_add_rmsnorm_(xi, ri, w)
    assert torch.equal(res, ri)
    assert_close(x, xi, family="rmsnorm", dtype=dtype)


# ---- every public op: the API against an independent float64 computation (CPU), and on the
# GPU the same check through whatever the dispatch picks there (kernel or reference).
def _ln64(x, w, b):
    xd = x.double()
    mu = xd.mean(-1, keepdim=True)
    return (xd - mu) / torch.sqrt(((xd - mu) ** 2).mean(-1, keepdim=True) + 1e-6) * w.double() + b.double()


def _check_every_op(M, N, dtype, layout, seed, device, mag=None):
    dt = _dt(dtype)
    x = S.make_tensor(M, N, dt, layout, device=device, seed=seed, magnitude=mag)
    dy = S.make_tensor(M, N, dt, layout, device=device, seed=seed + 1)
    w = S.make_tensor(1, N, dt, "contiguous", device=device, seed=seed + 2)[0]
    b = S.make_tensor(1, N, dt, "contiguous", device=device, seed=seed + 3)[0]
    assert_close(oink.layernorm(x, w, b), _ln64(x, w, b), family="layernorm", dtype=dtype)
    y64 = torch.softmax(x.double(), -1)
    g64 = y64 * (dy.double() - (dy.double() * y64).sum(-1, keepdim=True))
    assert_close(oink.softmax_backward(dy, y64.to(dt)), g64, family="norm_backward", dtype=dtype)
    assert_close(oink.softmax_fwd_bwd(dy, x), g64, family="norm_backward", dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    target = torch.randint(0, N, (M,), generator=g, device=device)
    target[::3] = -100
    loss, lse = oink.cross_entropy_forward(x, target)
    expect = torch.nn.functional.cross_entropy(x.double(), target, ignore_index=-100, reduction="none")
    # in units of the row's largest logit (at least 1): the loss is lse - x[target], a difference of two values
    # of the data's size, so its fp32 error is relative to the data, not to the loss
    unit = x.double().abs().amax(-1).clamp_min(1.0)
    assert_close(loss / unit, expect / unit, family="cross_entropy_loss", dtype=torch.float32)
    assert_close(lse / unit, torch.logsumexp(x.double(), -1) / unit, family="cross_entropy_loss",
                 dtype=torch.float32)
    dl = oink.cross_entropy_backward(torch.ones(M, device=device), x, target, lse)
    p = torch.softmax(x.double(), -1)
    onehot = torch.zeros_like(p)
    valid = target != -100
    onehot[valid] = torch.nn.functional.one_hot(target[valid], N).double()
    assert_close(dl, (p - onehot) * valid.unsqueeze(-1), family="norm_backward", dtype=dtype)
    if N % 32 == 0:
        gs = torch.tensor([100.0], device=device)
        res = S.make_tensor(M, N, dt, "contiguous", device=device, seed=seed + 4)
        r_ref = res.clone()
        q, sf = oink.add_rmsnorm_fp4quant(x, res, w, gs)
        rq, rsf = R.add_rmsnorm_fp4quant(x, r_ref, w, gs)
        assert torch.equal(res, r_ref)
        scales_exact(sf, rsf)  # the fused op's documented bound: rare one-step scales (v in another order)
        assert (q == rq).float().mean() >= 0.999 if q.numel() else True
        v = torch.nn.functional.silu(x[:, : N // 2].double()) * x[:, N // 2:].double()
        # NVFP4's global scale from the data (its amax onto E4M3's 448 times E2M1's 6): a fixed one
        # would send small data's block scales to E4M3 zero and large data's to saturation
        amax = float(v.abs().max()) if v.numel() else 1.0
        gs_v = torch.tensor([448 * 6 / max(amax, 1e-30)], device=device)
        q, sf = oink.silu_mul_fp4quant(x, gs_v)
        d = oink.nvfp4_dequantize(q, sf, gs_v)
        blocks = v.reshape(M, N // 32, 16)  # N // 2 values in blocks of 16 (M may be 0)
        # each value within one E2M1 step of its block's scale amax / 6, that scale E4M3-rounded
        # (1/16 relative; where E4M3-subnormal, half its 2^-9 step absolute: 2^-10 / gs in v's units,
        # times the largest code 6)
        bound = blocks.abs().amax(-1, keepdim=True) * (1 / 6 + 1 / 16) + 6 * 2**-10 / gs_v.item()
        assert ((d.double().reshape(M, -1, 16) - blocks).abs() <= bound).all()


@given(shape=S.shapes("cross_entropy", max_m=64), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16),
       mag=S.magnitudes())
def test_every_op_cpu(shape, dtype, layout, seed, mag):
    _check_every_op(*shape, dtype, layout, seed, "cpu", mag)


@pytest.mark.gpu
@given(shape=S.shapes("cross_entropy", max_m=2000), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16))
def test_every_op_gpu(shape, dtype, layout, seed):
    _check_every_op(*shape, dtype, layout, seed, "cuda")


# ---- fp16 near overflow: every op's answer where float64's is finite (the references accumulate in fp32)
def _check_near_fp16_overflow(M, N, layout, seed, device, mag):
    x = S.make_tensor(M, N, torch.float16, layout, device=device, seed=seed, magnitude=mag)
    w = S.make_tensor(1, N, torch.float16, "contiguous", device=device, seed=seed + 1)[0]
    y, rstd, _ = oink.rmsnorm_forward(x, w, store_rstd=True)
    assert_close(y, _rms64(x, w), family="rmsnorm", dtype="float16")
    assert_close(rstd, torch.rsqrt(x.double().square().mean(-1) + 1e-6), family="rmsnorm", dtype=torch.float32)
    # x + residual each at half the peak: the sum stays finite in fp16, its squares do not
    half = S.Magnitude(mag.scale, mag.row_decades, mag.peak / 2)
    h = S.make_tensor(M, N, torch.float16, layout, device=device, seed=seed + 2, magnitude=half)
    res = S.make_tensor(M, N, torch.float16, layout, device=device, seed=seed + 3, magnitude=half)
    h64 = h.double() + res.double()
    oink.fused_add_rmsnorm_(h, res, w)
    assert_close(res, h64, family="rmsnorm", dtype="float16")
    assert_close(h, _rms64(h64, w), family="rmsnorm", dtype="float16")
    _check_every_op(M, N, "float16", layout, seed, device, mag)


@given(shape=S.shapes("softmax", max_m=64), layout=S.layouts(), seed=st.integers(0, 2**16), mag=S.near_overflow())
def test_every_op_near_fp16_overflow_cpu(shape, layout, seed, mag):
    _check_near_fp16_overflow(*shape, layout, seed, "cpu", mag)


@pytest.mark.gpu
@given(shape=S.shapes("cross_entropy", max_m=2000), layout=S.layouts(), seed=st.integers(0, 2**16),
       mag=S.near_overflow())
def test_every_op_near_fp16_overflow_gpu(shape, layout, seed, mag):
    _check_near_fp16_overflow(*shape, layout, seed, "cuda", mag)


@pytest.mark.xfail(strict=True, reason="the norms' references sum a row's squares in fp32: past ~1.8e19 a square "
                                       "overflows, rstd is 0 and y is 0 (bias) where float64's answer is finite")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm"])
def test_norms_past_fp32_squares_cpu(op, dtype):
    """Values of bf16 and fp32 whose squares overflow fp32 (1e20 here; a quarter of the dtype's max is 8.5e37):
    the norms' answers are finite in float64 and should be so here. Strict: a fix turns this into a failure to
    remove the mark."""
    x = S.make_tensor(4, 1000, _dt(dtype), "contiguous", seed=1,
                      magnitude=S.Magnitude(peak=1e20 / torch.finfo(_dt(dtype)).max))
    w = S.make_tensor(1, 1000, _dt(dtype), "contiguous", seed=2)[0]
    if op == "rmsnorm":
        assert_close(oink.rmsnorm_forward(x, w)[0], _rms64(x, w), family="rmsnorm", dtype=dtype)
    else:
        assert_close(oink.layernorm(x, w, w), _ln64(x, w, w), family="layernorm", dtype=dtype)


# ---- FP8: every scale mode; a strided input gives its contiguous copy's answer (wiring), the custom
# op's fake gives the real outputs' shapes and strides (what torch.compile plans memory from), and
# on the GPU the kernel gives the reference's codes and scales
FP8_MODES = st.sampled_from([dict(), dict(scale=0.05), dict(scale_ub=2.0), dict(group_size=64),
                             dict(group_size=128, column_major_scales=True), dict(group_size=128, ue8m0=True)])


def _fp8_args(mode, device):
    return {k: (torch.tensor([v], device=device) if k in ("scale", "scale_ub") else v) for k, v in mode.items()}


@given(shape=S.shapes("fp8"), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16), mode=FP8_MODES)
def test_fp8_quantize_layouts_and_fake_wiring_cpu(shape, dtype, layout, seed, mode):
    """Wiring, not correctness: a strided input gives the reference's answer for its contiguous
    copy, and the fake the real outputs' metadata (the quantizer's own correctness:
    tests/test_fp8_reference.py; the kernel's: test_fp8_quantize_kernel_gpu)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, seed=seed)
    args = _fp8_args(mode, "cpu")
    q, s = oink.fp8_quantize(x, **args)
    rq, rs = R.fp8_quantize(x.contiguous(), **args)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fq, fs = oink.fp8_quantize(torch.empty(M, N, dtype=_dt(dtype)), **args)
    assert (fq.shape, fq.dtype, fs.shape, fs.stride()) == (q.shape, q.dtype, s.shape, s.stride())


@pytest.mark.gpu
@pytest.mark.sm(90)
@given(shape=S.shapes("fp8", max_m=5000), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16),
       mode=FP8_MODES)
def test_fp8_quantize_kernel_gpu(shape, dtype, layout, seed, mode):
    from tests.gpu_helpers import kernel

    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, device="cuda", seed=seed)
    args = _fp8_args(mode, "cuda")
    q, s = kernel("fp8_quantize", x=x, **args)
    rq, rs = R.fp8_quantize(x, **args)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
