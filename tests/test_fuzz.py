"""Hypothesis fuzzing: the public ops (CPU: reference path through dispatch; GPU: kernels) on
random shapes, dtypes and layouts (dense, padded rows, misaligned offset views)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import oink
from oink import reference as R
from pytest_oink import strategies as S
from pytest_oink.gate import assert_close


def _dt(name):
    return getattr(torch, name)


def _rms64(x, w, eps=1e-6):
    xd = x.double()
    return xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * w.double()


@given(shape=S.shapes("rmsnorm"), dtype=S.dtypes(), layout=S.layouts(), seed=st.integers(0, 2**16))
def test_rmsnorm_forward_cpu(shape, dtype, layout, seed):
    M, N = shape
    x = S.make_tensor(M, N, _dt(dtype), layout, seed=seed)
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
def test_nvfp4_quantize_layouts_agree_cpu(shape, dtype, layout, seed, swizzled):
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
