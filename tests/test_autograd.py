"""Differentiable RMSNorm (oink.rmsnorm, oink.RMSNorm) against torch autograd in float64."""
from __future__ import annotations

import pytest
import torch

import oink
from tests.helpers import assert_close_to

EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_grads_match_float64(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 96, generator=g).to(dtype).requires_grad_(True)
    w = torch.randn(96, generator=g).to(dtype).requires_grad_(True)
    dy = torch.randn(6, 96, generator=g).to(dtype)
    y = oink.rmsnorm(x, w, 1e-6)
    gx, gw = torch.autograd.grad(y, [x, w], dy)
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    ex, ew = torch.autograd.grad(y64, [x64, w64], dy.double())
    assert_close_to(y, y64, "rmsnorm", dtype)
    assert_close_to(gx, ex, "norm_backward", dtype)
    assert_close_to(gw, ew, "weight_grad", dtype)


class _Float64ForwardOinkBackward(torch.autograd.Function):
    """y = rmsnorm(x + residual) * w + b evaluated in float64 (finite differences of it are exact to
    ~1e-10), differentiated by oink.rmsnorm's own backward in fp32: gradcheck then judges that
    backward, projection term and residual and bias gradients included, at float64 precision."""

    @staticmethod
    def forward(ctx, x, residual, w, b):
        ctx.save_for_backward(x, residual, w, b)
        h = x + residual
        return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + EPS) * w + b

    @staticmethod
    def backward(ctx, dy):
        leaves = [t.detach().float().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            x, residual, w, b = leaves
            y = oink.rmsnorm(x, w, EPS, bias=b, residual=residual)
            grads = torch.autograd.grad(y, leaves, dy.float())
        return tuple(g.double() for g in grads)


def test_rmsnorm_backward_passes_float64_gradcheck(seed):
    """Every Jacobian entry, full (not fast) mode, gradcheck's default tolerances (atol 1e-5, rtol
    1e-3): fp32 rounding of the backward is ~1e-6 relative, a missing term is O(1/N)."""
    g = torch.Generator().manual_seed(seed)
    args = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)
            for shape in ((3, 8), (3, 8), (8,), (8,))]
    assert torch.autograd.gradcheck(_Float64ForwardOinkBackward.apply, args, eps=1e-6)


def test_residual_path_gradients():
    x = torch.randn(4, 32, requires_grad=True)
    r = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    oink.register(force=True)  # torch.ops.oink.* exist once registered (a run of this test alone)
    y, rstd, res_out = torch.ops.oink.rmsnorm_forward(x, w, None, r, 1e-6, True)
    (y.sum() + (res_out * 2).sum()).backward()
    x2, r2, w2 = [t.detach().clone().requires_grad_(True) for t in (x, r, w)]
    h = x2 + r2
    y2 = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * w2
    (y2.sum() + (h * 2).sum()).backward()
    for a, b in ((x, x2), (r, r2), (w, w2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_module_is_a_drop_in_for_torch_rmsnorm():
    ref = torch.nn.RMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(ref.weight)
    mod = oink.RMSNorm(64, eps=1e-5)
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(mod(x), ref(x), atol=1e-5, rtol=1e-5)
    mod2 = oink.RMSNorm((4, 16), elementwise_affine=False)
    torch.testing.assert_close(mod2(x.view(2, 7, 4, 16)), torch.nn.RMSNorm((4, 16), elementwise_affine=False)(
        x.view(2, 7, 4, 16)), atol=1e-5, rtol=1e-5)


def _float64_copy(t):
    return t.detach().double().requires_grad_(True)


def test_module_compiles_fullgraph():
    """The compiled graph's gradients (through the custom op's backward) against float64 autograd."""
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), oink.RMSNorm(32))
    torch.nn.init.normal_(m[1].weight)  # not all ones: dw and the weight's share of dx show
    f = torch.compile(m, fullgraph=True)
    x = torch.randn(5, 32, requires_grad=True)
    dy = torch.randn(5, 32)
    f(x).backward(dy)
    x64, lw, lb, nw = map(_float64_copy, (x, m[0].weight, m[0].bias, m[1].weight))
    h = torch.nn.functional.linear(x64, lw, lb)
    (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps) * nw).backward(dy.double())
    assert_close_to(x.grad, x64.grad, "norm_backward", torch.float32)
    assert_close_to(m[0].weight.grad, lw.grad, "weight_grad", torch.float32)
    assert_close_to(m[1].weight.grad, nw.grad, "weight_grad", torch.float32)


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_grads_match_float64(bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 96, generator=g) + 0.7).requires_grad_(True)
    w = torch.randn(96, generator=g).requires_grad_(True)
    b = torch.randn(96, generator=g).requires_grad_(True) if bias else None
    dy = torch.randn(6, 96, generator=g)
    y = oink.layernorm(x, w, b)
    leaves = [x, w] + ([b] if bias else [])
    got = torch.autograd.grad(y, leaves, dy)
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    y64 = torch.nn.functional.layer_norm(ref[0], (96,), ref[1], ref[2] if bias else None, 1e-6)
    want = torch.autograd.grad(y64, ref, dy.double())
    assert_close_to(y, y64, "rmsnorm", torch.float32)
    assert_close_to(got[0], want[0], "norm_backward", torch.float32)
    for a, e in zip(got[1:], want[1:]):
        assert_close_to(a, e, "weight_grad", torch.float32)


def test_layernorm_module_is_a_drop_in_for_torch_layernorm():
    ref = torch.nn.LayerNorm((4, 16))
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    mod = oink.LayerNorm((4, 16))
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(2, 7, 4, 16, requires_grad=True)
    torch.testing.assert_close(mod(x), ref(x), atol=1e-5, rtol=1e-5)
    mod(x).sum().backward()
    assert mod.weight.grad is not None and mod.bias.grad is not None
    plain, plain_ref = oink.LayerNorm(64, elementwise_affine=False), torch.nn.LayerNorm(64, elementwise_affine=False)
    assert plain.state_dict().keys() == plain_ref.state_dict().keys()
    x = torch.randn(3, 64)
    torch.testing.assert_close(plain(x), plain_ref(x), atol=1e-5, rtol=1e-5)
    assert oink.LayerNorm(64, bias=False).bias is None


def test_softmax_grads_match_float64(seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(5, 77, generator=g) * 3).requires_grad_(True)
    dy = torch.randn(5, 77, generator=g)
    (gx,) = torch.autograd.grad(oink.softmax(x), [x], dy)
    x64 = x.detach().double().requires_grad_(True)
    (ex,) = torch.autograd.grad(torch.softmax(x64, -1), [x64], dy.double())
    assert_close_to(gx, ex, "norm_backward", torch.float32)


def test_layernorm_and_softmax_compile_fullgraph():
    """The compiled graph's gradients (both custom ops' backwards) against float64 autograd."""
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), oink.LayerNorm(32))
    torch.nn.init.normal_(m[1].weight)
    torch.nn.init.normal_(m[1].bias)
    f = torch.compile(lambda t: oink.softmax(m(t)), fullgraph=True)
    x = torch.randn(5, 32, requires_grad=True)
    f(x).square().sum().backward()
    x64, lw, lb, nw, nb = map(_float64_copy, (x, m[0].weight, m[0].bias, m[1].weight, m[1].bias))
    h = torch.nn.functional.layer_norm(torch.nn.functional.linear(x64, lw, lb), (32,), nw, nb, m[1].eps)
    torch.softmax(h, -1).square().sum().backward()
    assert_close_to(x.grad, x64.grad, "norm_backward", torch.float32)
    assert_close_to(m[1].weight.grad, nw.grad, "weight_grad", torch.float32)
    assert_close_to(m[1].bias.grad, nb.grad, "weight_grad", torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_cross_entropy_grads_match_torch(reduction, inplace, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(9, 50, generator=g) * 2
    target = torch.randint(0, 50, (9,), generator=g)
    target[::3] = -100  # about a third of the rows ignored
    x = logits.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(x, target, ignore_index=-100, reduction=reduction)
    upstream = torch.randn(ref.shape, generator=g)
    (want,) = torch.autograd.grad(ref, [x], upstream)
    leaf = logits.clone().requires_grad_(True)
    work = leaf * 1.0  # a non-leaf the in-place backward may overwrite
    loss = oink.cross_entropy(work, target, reduction=reduction, inplace_backward=inplace)
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    (got,) = torch.autograd.grad(loss, [leaf], upstream)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if inplace:  # the logits' storage now holds dlogits
        torch.testing.assert_close(work.detach(), want, atol=1e-5, rtol=1e-5)


def test_cross_entropy_compiles_fullgraph():
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 40)
    target = torch.tensor([1, 5, -100, 39])
    f = torch.compile(lambda t: oink.cross_entropy(lin(t), target), fullgraph=True)
    x = torch.randn(4, 16, requires_grad=True)
    f(x).backward()
    ref = torch.nn.functional.cross_entropy(lin(x.detach()), target)
    torch.testing.assert_close(f(x.detach()), ref, atol=1e-5, rtol=1e-5)
    x64, w64, b64 = map(_float64_copy, (x, lin.weight, lin.bias))
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(x64, w64, b64), target).backward()
    assert_close_to(x.grad, x64.grad, "norm_backward", torch.float32)
