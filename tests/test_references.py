"""References against float64 computations written independently (autograd in float64 for the
backwards) and against hand-computed small cases."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from oink import reference as R
from tests.helpers import DTYPES, assert_close_to, randn

SHAPES = [(1, 1), (3, 7), (5, 64), (2, 3, 96), (17, 1000)]


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


def rms64(h, w=None, b=None, eps=1e-6):
    y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wdtype", ["same", "fp32", None])
@pytest.mark.parametrize("with_bias,with_res", [(False, False), (True, False), (False, True), (True, True)])
def test_rmsnorm_forward(gen, dtype, shape, wdtype, with_bias, with_res):
    N = shape[-1]
    x = randn(gen, *shape, dtype=dtype)
    wd = dtype if wdtype == "same" else torch.float32
    w = randn(gen, N, dtype=wd) if wdtype else None
    b = randn(gen, N, dtype=wd) if with_bias else None
    res = randn(gen, *shape, dtype=dtype) if with_res else None
    y, rstd, res_out = R.rmsnorm_forward(x, w, b, res, eps=1e-5, store_rstd=True)
    assert y.dtype == dtype and y.shape == x.shape and rstd.dtype == torch.float32 and rstd.shape == shape[:-1]
    h = x.double()
    if with_res:
        assert res_out.dtype == dtype
        assert_close_to(res_out, x.double() + res.double(), "rmsnorm", dtype)
        h = res_out.double()  # the norm is of the stored (rounded) sum
    else:
        assert res_out is None
    expect = rms64(h, None if w is None else w.double(), None if b is None else b.double(), 1e-5)
    assert_close_to(y, expect, "rmsnorm", dtype)
    assert_close_to(rstd, 1 / torch.sqrt((h * h).mean(-1) + 1e-5), "rmsnorm", torch.float32)


def test_rmsnorm_hand_case():
    x = torch.tensor([[3.0, 4.0]])
    y, rstd, _ = R.rmsnorm_forward(x, torch.tensor([1.0, 2.0]), eps=0.0, store_rstd=True)
    rms = math.sqrt(12.5)
    torch.testing.assert_close(y, torch.tensor([[3 / rms, 8 / rms]]))
    torch.testing.assert_close(rstd, torch.tensor([1 / rms]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_in_place(gen, dtype):
    x, res = randn(gen, 9, 128, dtype=dtype), randn(gen, 9, 128, dtype=dtype)
    w = randn(gen, 128, dtype=dtype)
    x0, r0 = x.clone(), res.clone()
    x_ptr, r_ptr = x.data_ptr(), res.data_ptr()
    assert R.fused_add_rmsnorm_(x, res, w, 1e-6) is None
    assert x.data_ptr() == x_ptr and res.data_ptr() == r_ptr
    expect_res = (x0.double() + r0.double()).to(dtype)
    torch.testing.assert_close(res, expect_res, atol=0, rtol=0)
    assert_close_to(x, rms64(res.double(), w.double()), "rmsnorm", dtype)


def _autograd64(fn, inputs, dout):
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t is not None], dout.double())
    it = iter(grads)
    return [next(it) if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 32), (3, 5, 200), (64, 1000)])
@pytest.mark.parametrize("with_w,with_b", [(True, False), (True, True), (False, False)])
def test_rmsnorm_backward(gen, dtype, shape, with_w, with_b):
    N = shape[-1]
    x, dout = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype)
    w = randn(gen, N, dtype=dtype) if with_w else None
    b = randn(gen, N, dtype=dtype) if with_b else None
    dres = randn(gen, *shape, dtype=dtype)
    _, rstd, _ = R.rmsnorm_forward(x, w, b, eps=1e-6, store_rstd=True)
    dx, dw, db, dresidual = R.rmsnorm_backward(x, w, dout, rstd, dres, has_bias=with_b, has_residual=True)
    gx, gw, gb = _autograd64(lambda x_, w_, b_: rms64(x_, w_, b_, 1e-6), [x, w, b], dout)
    assert_close_to(dx, gx + dres.double(), "norm_backward", dtype)
    assert dresidual is dx
    if with_w:
        assert dw.dtype == w.dtype
        assert_close_to(dw, gw, "weight_grad", dtype)
    else:
        assert dw is None
    if with_b:
        assert_close_to(db, gb, "weight_grad", dtype)
    else:
        assert db is None


def ln64(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * w
    return y + b if b is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[1:])
@pytest.mark.parametrize("with_b", [True, False])
def test_layernorm_forward_backward(gen, dtype, shape, with_b):
    N = shape[-1]
    x, dout = randn(gen, *shape, dtype=dtype, scale=2.0) + 0.5, randn(gen, *shape, dtype=dtype)
    w = randn(gen, N, dtype=dtype)
    b = randn(gen, N, dtype=dtype) if with_b else None
    y, rstd, mean = R.layernorm(x, w, b, 1e-6, return_rstd=True, return_mean=True)
    xd = x.double()
    assert_close_to(y, ln64(xd, w.double(), None if b is None else b.double()), "layernorm", dtype)
    assert_close_to(mean, xd.mean(-1), "layernorm", torch.float32)
    assert_close_to(rstd, 1 / torch.sqrt(xd.var(-1, unbiased=False) + 1e-6), "layernorm", torch.float32)
    assert isinstance(R.layernorm(x, w, b), torch.Tensor)
    dx, dw, db = R.layernorm_backward(dout, x, w, rstd, mean, b)
    gx, gw, gb = _autograd64(lambda x_, w_, b_: ln64(x_, w_, b_), [x, w, b], dout)
    assert_close_to(dx, gx, "norm_backward", dtype)
    assert_close_to(dw, gw, "weight_grad", dtype)
    if with_b:
        assert_close_to(db, gb, "weight_grad", dtype)
    else:
        assert db is None


def test_layernorm_hand_case():
    y = R.layernorm(torch.tensor([[1.0, 3.0]]), torch.ones(2), torch.zeros(2), eps=0.0)
    torch.testing.assert_close(y, torch.tensor([[-1.0, 1.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax(gen, dtype, shape):
    x, dy = randn(gen, *shape, dtype=dtype, scale=3.0), randn(gen, *shape, dtype=dtype)
    y = R.softmax_forward(x)
    y64 = torch.softmax(x.double(), -1)
    assert_close_to(y, y64, "softmax", dtype)
    (g64,) = _autograd64(lambda t: torch.softmax(t, -1), [x], dy)
    assert_close_to(R.softmax_backward(dy, y64.to(dtype)), g64, "norm_backward", dtype)
    assert_close_to(R.softmax_fwd_bwd(dy, x), g64, "norm_backward", dtype)


def test_softmax_hand_case():
    y = R.softmax_forward(torch.tensor([[0.0, math.log(3.0)]]))
    torch.testing.assert_close(y, torch.tensor([[0.25, 0.75]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,V", [(1, 2), (7, 64), (33, 1000)])
@pytest.mark.parametrize("tdtype", [torch.int32, torch.int64])
def test_cross_entropy(gen, dtype, M, V, tdtype):
    logits = randn(gen, M, V, dtype=dtype, scale=4.0)
    target = torch.randint(0, V, (M,), generator=gen).to(tdtype)
    ignored = torch.rand(M, generator=gen) < 0.3
    target[ignored] = -100
    loss, lse = R.cross_entropy_forward(logits, target)
    l64 = logits.double()
    expect = F.cross_entropy(l64, target.long(), ignore_index=-100, reduction="none")
    assert loss.dtype == torch.float32 and lse.dtype == torch.float32
    assert_close_to(loss, expect, "cross_entropy_loss", torch.float32)
    assert_close_to(lse, torch.logsumexp(l64, -1), "cross_entropy_loss", torch.float32)
    assert (loss[ignored] == 0).all()
    n_valid = int((~ignored).sum())
    assert_close_to(R.cross_entropy_forward(logits, target, reduction="sum")[0], expect.sum(),
                    "cross_entropy_loss", torch.float32)
    mean = R.cross_entropy_forward(logits, target, reduction="mean")[0]
    assert_close_to(mean, expect.sum() / max(n_valid, 1), "cross_entropy_loss", torch.float32)
    dloss = randn(gen, M)
    (g64,) = _autograd64(lambda t: F.cross_entropy(t, target.long(), ignore_index=-100, reduction="none"),
                         [logits], dloss)
    dlogits = R.cross_entropy_backward(dloss, logits, target, lse)
    assert dlogits.dtype == dtype
    assert_close_to(dlogits, g64, "norm_backward", dtype)
    assert (dlogits[ignored] == 0).all()
    loss2, dlogits2 = R.cross_entropy_fwd_bwd(dloss, logits, target)
    assert_close_to(loss2, expect, "cross_entropy_loss", torch.float32)
    assert_close_to(dlogits2, g64, "norm_backward", dtype)


def test_cross_entropy_hand_case():
    loss, _ = R.cross_entropy_forward(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1]))
    torch.testing.assert_close(loss, torch.tensor([-math.log(0.75)]))


def test_cross_entropy_all_ignored_mean_is_zero():
    loss, _ = R.cross_entropy_forward(torch.randn(3, 5), torch.full((3,), -100), reduction="mean")
    assert loss.item() == 0.0
