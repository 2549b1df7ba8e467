"""Port of Quack 0.6.x's tests/test_softmax.py to Oink's API (written here, not copied).

Shapes, dtypes, tolerances and the reference (torch.nn.functional.softmax and its autograd) are
Quack's. The same tests run on a GPU (all shapes) and on CPU, where Oink runs its PyTorch
reference and only the cheap cases run (see tests/quack_port.py).

Mapping: Quack's ``softmax`` -> ``oink.softmax`` (differentiable); ``softmax_fwd`` ->
``oink.softmax_forward``; ``softmax_bwd(dy, y)`` -> ``oink.softmax_backward(dy, y)``.

Left out, and why:
- The SM12x (99 KB shared memory) skips: a Quack kernel limit; Oink supports sm_90/sm_100.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import oink
from tests.quack_port import maybe_compile, shapes_x_compile, sync

torch._dynamo.config.cache_size_limit = 1024
torch._dynamo.config.accumulated_cache_size_limit = 1024

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TOLERANCES = {
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
    torch.float32: (1e-4, 1e-4),
}

SHAPES = [(M, N) for M in (1, 199) for N in (192, 256, 760, 1024, 1128, 4096, 32768, 131072, 262144)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_softmax(M, N, input_dtype, use_compile):
    """Forward and backward against torch's softmax."""
    atol, rtol = TOLERANCES[input_dtype]
    fn = maybe_compile(oink.softmax, use_compile)
    torch.manual_seed(0)
    # Small logits (x 0.1) keep exp well inside range.
    x = (0.1 * torch.randn(M, N, device=DEVICE, dtype=input_dtype)).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()

    # All calls (forward, then the backward through autograd.grad) before any check.
    out = fn(x)
    out_ref = F.softmax(x_ref, dim=-1)
    dy = torch.randn_like(out)
    sync()  # Quack: the backward read stale results without it
    (dx,) = torch.autograd.grad(out, x, grad_outputs=dy)
    (dx_ref,) = torch.autograd.grad(out_ref, x_ref, grad_outputs=dy)

    assert out.shape == x.shape
    assert out.dtype == input_dtype
    assert dx.shape == dy.shape
    assert dx.dtype == input_dtype
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
    row_sums = out.sum(dim=-1)
    torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-4, rtol=1e-4)
    assert (out >= 0).all()
    assert (out <= 1).all()
    torch.testing.assert_close(dx, dx_ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("input_dtype", [torch.float16, torch.float32])
def test_softmax_extreme_values(input_dtype, use_compile):
    """Rows of one constant (+10 or -10) give the uniform 1/N; one +10 among -10s takes ~all."""
    M, N = 16, 1024
    fn = maybe_compile(oink.softmax, use_compile)
    uniform = torch.full((M, N), 1.0 / N, device=DEVICE, dtype=input_dtype)
    for value in (10.0, -10.0):
        out = fn(torch.full((M, N), value, device=DEVICE, dtype=input_dtype))
        torch.testing.assert_close(out, uniform, atol=1e-3, rtol=1e-3)
    x_mixed = torch.full((M, N), -10.0, device=DEVICE, dtype=input_dtype)
    x_mixed[:, 0] = 10.0
    out_mixed = fn(x_mixed)
    assert (out_mixed[:, 0] > 0.99).all()
    assert (out_mixed[:, 1:] < 0.01).all()


@pytest.mark.parametrize("use_compile", [False, True])
def test_softmax_numerical_stability(use_compile):
    """Softmax is shift-invariant: x and x + 100 give the same result."""
    M, N = 8, 512
    fn = maybe_compile(oink.softmax, use_compile)
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.float32)
    torch.testing.assert_close(fn(x), fn(x + 100.0), atol=1e-6, rtol=1e-6)


def test_softmax_fwd_empty():
    """Zero rows: an empty output of x's shape (no launch)."""
    x = torch.empty(0, 4096, device=DEVICE, dtype=torch.bfloat16)
    out = oink.softmax_forward(x)
    assert out.shape == x.shape and out.numel() == 0


def test_softmax_bwd_empty():
    dy = torch.empty(0, 4096, device=DEVICE, dtype=torch.bfloat16)
    y = torch.empty(0, 4096, device=DEVICE, dtype=torch.bfloat16)
    dx = oink.softmax_backward(dy, y)
    assert dx.shape == dy.shape and dx.numel() == 0
