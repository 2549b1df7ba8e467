"""Port of Quack 0.6.x's tests/test_cross_entropy.py to Oink's API (written here, not copied).

Shapes, dtypes, tolerances and the reference (torch.nn.functional.cross_entropy in fp32 and its
autograd) are Quack's. The same tests run on a GPU (all shapes) and on CPU, where Oink runs its
PyTorch reference and only the cheap cases run (see tests/quack_port.py).

Mapping: Quack's ``cross_entropy`` -> ``oink.cross_entropy`` (differentiable, same weight=,
lse_partial=, reduction=, ignore_index=); ``cross_entropy_fwd(x, t)`` (loss only) ->
``oink.cross_entropy_forward(x, t)[0]``; ``cross_entropy_fwd(x, t, weight=, return_lse=True,
return_dx=True)`` -> ``oink.cross_entropy_fwd_bwd(ones(M), x, t, weight=, return_lse=True)``;
``cross_entropy_bwd(x, t, dloss, lse)`` -> ``oink.cross_entropy_backward(dloss, x, t, lse)``.

Left out or changed, and why:
- The SM12x (99 KB shared memory) skips: a Quack kernel limit; Oink supports sm_90/sm_100.
- test_cross_entropy_fwd_with_grad's ``inplace_backward=True``: Quack's cross_entropy_fwd can
  write dx over x; ``oink.cross_entropy_fwd_bwd`` has no such option, so that case checks values
  only (on a private copy of x), not that dx is x. It also runs ``oink.cross_entropy(...,
  inplace_backward=True)``, Oink's in-place backward, and checks its gradient's values (under
  torch.compile that backward runs out of place, so identity is not checked there either).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import oink
from tests.quack_port import maybe_compile, shapes_x_compile, sync

torch._dynamo.config.cache_size_limit = 1024
torch._dynamo.config.accumulated_cache_size_limit = 1024

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ce_loss(x, target, ignore_index=-100):
    """Quack's cross_entropy_fwd(x, target, ignore_index=): the per-row fp32 loss."""
    return oink.cross_entropy_forward(x, target, ignore_index)[0]


def ce_fwd_with_grad(x, target, weight=None, ignore_index=-100):
    """Quack's cross_entropy_fwd(..., return_lse=True, return_dx=True) -> (loss, lse, dx), dx for a
    dloss of ones."""
    ones = torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
    loss, dx, lse = oink.cross_entropy_fwd_bwd(ones, x, target, ignore_index, weight=weight, return_lse=True)
    return loss, lse, dx


def fp32_leaf(x):
    return x.detach().clone().float().requires_grad_()


# N: unaligned small (192, 668), aligned small (1024), unaligned medium (1128), multi-stage (4096,
# 32768), and the vocabulary sizes at the shared-memory edge (128256 = Llama 3, 262144).
CE_SHAPES = [(M, N) for M in (1, 289) for N in (192, 668, 1024, 1128, 4096, 32768, 128256, 262144)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(CE_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("has_weight", [False, True])
def test_cross_entropy(M, N, input_dtype, has_weight, use_compile):
    """Forward and backward (reduction="none") against torch, once with every target valid and
    once with ~30% of them set to ignore_index=-100."""
    atol, rtol = 5e-5, 1e-5
    torch.manual_seed(0)
    x = (0.1 * torch.randn(M, N, device=DEVICE, dtype=input_dtype)).requires_grad_()
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    weight = (torch.rand(N, device=DEVICE, dtype=torch.float32) + 0.1) if has_weight else None
    x_ref = fp32_leaf(x)
    fn = maybe_compile(oink.cross_entropy, use_compile)

    # All calls first, then the checks.
    loss = fn(x, target, weight=weight, reduction="none")
    loss_ref = F.cross_entropy(x_ref, target, weight=weight, reduction="none")
    dloss = torch.randn_like(loss)
    sync()
    (dx,) = torch.autograd.grad(loss, x, grad_outputs=dloss)
    (dx_ref,) = torch.autograd.grad(loss_ref, x_ref, grad_outputs=dloss)

    ignore_index = -100  # targets are drawn from [0, N): only the masked rows carry it
    ignore_mask = torch.rand(M, device=DEVICE) < 0.3
    target_ig = target.clone()
    target_ig[ignore_mask] = ignore_index
    x_ig = x.detach().clone().requires_grad_()
    x_ref_ig = fp32_leaf(x)
    loss_ig = fn(x_ig, target_ig, weight=weight, reduction="none", ignore_index=ignore_index)
    loss_ref_ig = F.cross_entropy(x_ref_ig, target_ig, weight=weight, reduction="none", ignore_index=ignore_index)
    dloss_ig = torch.randn_like(loss_ig)
    sync()
    (dx_ig,) = torch.autograd.grad(loss_ig, x_ig, grad_outputs=dloss_ig)
    (dx_ref_ig,) = torch.autograd.grad(loss_ref_ig, x_ref_ig, grad_outputs=dloss_ig)

    assert loss.shape == (M,)
    assert loss.dtype == torch.float32
    assert dx.shape == x.shape
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=rtol)
    assert (loss >= 0).all()
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(dx, dx_ref.to(input_dtype), atol=atol, rtol=rtol)

    assert dx_ig.shape == x.shape
    assert (loss_ig[ignore_mask] == 0).all(), "ignored rows must have a zero loss"
    if (~ignore_mask).any():
        torch.testing.assert_close(loss_ig[~ignore_mask], loss_ref_ig[~ignore_mask], atol=atol, rtol=rtol)
    torch.testing.assert_close(dx_ig, dx_ref_ig.to(input_dtype), atol=atol, rtol=rtol)


@pytest.mark.gpu  # 4096 x 128256: far above the CPU budget
@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("M", [4096])
@pytest.mark.parametrize("N", [128256])
@pytest.mark.parametrize("input_dtype", [torch.bfloat16])
def test_cross_entropy_lse_partial(M, N, input_dtype, use_compile):
    """The lse comes from per-shard logsumexps (blocks of 128 columns): the loss and the gradient
    must match torch's on the whole row."""
    assert N % 128 == 0
    atol, rtol = 5e-5, 1e-5
    torch.manual_seed(0)
    x = (0.1 * torch.randn(M, N, device=DEVICE, dtype=input_dtype)).requires_grad_()
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    with torch.no_grad():
        lse_partial = x.view(M, N // 128, 128).float().logsumexp(dim=-1)
    x_ref = x.detach().clone().requires_grad_()  # kept in x's dtype: its grad comes back in it
    fn = maybe_compile(oink.cross_entropy, use_compile)
    loss = fn(x, target, lse_partial=lse_partial, reduction="none")
    loss_ref = F.cross_entropy(x_ref.float(), target, reduction="none")
    dloss = torch.randn_like(loss)
    sync()
    (dx,) = torch.autograd.grad(loss, x, grad_outputs=dloss)
    (dx_ref,) = torch.autograd.grad(loss_ref, x_ref, grad_outputs=dloss)

    assert loss.shape == (M,)
    assert loss.dtype == torch.float32
    assert dx.shape == x.shape
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=rtol)
    assert (loss >= 0).all()
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(dx, dx_ref.to(input_dtype), atol=atol, rtol=rtol)


@pytest.mark.parametrize("use_compile", [False, True])
@pytest.mark.parametrize("input_dtype", [torch.float16, torch.float32])
def test_cross_entropy_extreme_values(input_dtype, use_compile):
    """Equal logits (all +10 or all -10) give log(N); a +10 target among -10s gives ~0."""
    M, N = 16, 1024
    fn = maybe_compile(ce_loss, use_compile)
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    log_n = torch.full((M,), math.log(N), device=DEVICE, dtype=torch.float32)
    for value in (10.0, -10.0):
        loss = fn(torch.full((M, N), value, device=DEVICE, dtype=input_dtype), target)
        torch.testing.assert_close(loss, log_n, atol=1e-2, rtol=1e-2)
    x_peaked = torch.full((M, N), -10.0, device=DEVICE, dtype=input_dtype)
    x_peaked[torch.arange(M, device=DEVICE), target] = 10.0
    assert (fn(x_peaked, target) < 1.0).all()


@pytest.mark.parametrize("use_compile", [False, True])
def test_cross_entropy_numerical_stability(use_compile):
    """Cross-entropy is shift-invariant in the logits: x and x + 100 give the same loss."""
    M, N = 8, 512
    fn = maybe_compile(ce_loss, use_compile)
    torch.manual_seed(0)
    x = torch.randn(M, N, device=DEVICE, dtype=torch.float32)
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    torch.testing.assert_close(fn(x, target), fn(x + 100.0, target), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_compile", [False, True])
def test_cross_entropy_edge_targets(use_compile):
    """Targets at the first (0) and the last (N - 1) class."""
    M, N = 16, 1024
    fn = maybe_compile(ce_loss, use_compile)
    x = 0.1 * torch.randn(M, N, device=DEVICE, dtype=torch.float32)
    for cls in (0, N - 1):
        target = torch.full((M,), cls, device=DEVICE, dtype=torch.int64)
        torch.testing.assert_close(fn(x, target), F.cross_entropy(x, target, reduction="none"), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_compile", [False, True])
def test_cross_entropy_ignore_index_edge_cases(use_compile):
    """Every target ignored; none ignored (ignore_index=-1 never occurs); the default -100 on
    one row."""
    M, N = 16, 1024
    fn = maybe_compile(ce_loss, use_compile)
    x = 0.1 * torch.randn(M, N, device=DEVICE, dtype=torch.float32)

    all_zero = torch.zeros(M, device=DEVICE, dtype=torch.int64)
    assert (fn(x, all_zero, ignore_index=0) == 0).all(), "every row is ignored: every loss must be 0"

    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    torch.testing.assert_close(fn(x, target, ignore_index=-1), F.cross_entropy(x, target, reduction="none"),
                               atol=1e-4, rtol=1e-4)

    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    target[0] = -100  # the default ignore_index: row 0 is ignored, by Oink and by torch
    torch.testing.assert_close(fn(x, target), F.cross_entropy(x, target, reduction="none"), atol=1e-4, rtol=1e-4)


FWD_GRAD_SHAPES = [(M, N) for M in (1, 77, 289) for N in (192, 1024, 32768, 128256)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(FWD_GRAD_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("has_weight", [False, True])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cross_entropy_fwd_with_grad(M, N, input_dtype, has_weight, inplace_backward, use_compile):
    """Loss, lse and dx (for dloss = 1) from the fused forward-backward, without and with ignored
    rows. inplace_backward=True: values only (see the module docstring)."""
    atol, rtol = 1e-4, 1e-4
    torch.manual_seed(0)
    x = (0.1 * torch.randn(M, N, device=DEVICE, dtype=input_dtype)).requires_grad_()
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    weight = (torch.rand(N, device=DEVICE, dtype=torch.float32) + 0.1) if has_weight else None
    x_ref = fp32_leaf(x)
    target_ref = target.clone()
    fn = maybe_compile(ce_fwd_with_grad, use_compile)

    # Quack hands its in-place variant a copy of x to overwrite; Oink's never writes x.
    loss, lse, dx = fn(x.detach().clone() if inplace_backward else x, target, weight)

    ignore_index = -100  # targets are drawn from [0, N): only the masked rows carry it
    ignore_mask = torch.rand(M, device=DEVICE) < 0.3
    target[ignore_mask] = ignore_index
    loss_ig, lse_ig, dx_ig = fn(x.detach().clone() if inplace_backward else x, target, weight, ignore_index)

    loss_ref = F.cross_entropy(x_ref, target_ref, weight=weight, reduction="none")
    lse_ref = torch.logsumexp(x_ref, dim=-1)
    dloss = torch.ones_like(loss_ref)
    (dx_ref,) = torch.autograd.grad(loss_ref, x_ref, grad_outputs=dloss)
    x_ref_ig = fp32_leaf(x)
    loss_ref_ig = F.cross_entropy(x_ref_ig, target, weight=weight, reduction="none", ignore_index=ignore_index)
    (dx_ref_ig,) = torch.autograd.grad(loss_ref_ig, x_ref_ig, grad_outputs=dloss)

    if not inplace_backward:
        assert dx is not x and dx_ig is not x, "dx must be a new tensor"
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse, lse_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(dx, dx_ref.to(input_dtype), atol=atol, rtol=rtol)
    assert (loss_ig[ignore_mask] == 0).all(), "ignored rows must have a zero loss"
    if (~ignore_mask).any():
        torch.testing.assert_close(loss_ig[~ignore_mask], loss_ref_ig[~ignore_mask], atol=atol, rtol=rtol)
    torch.testing.assert_close(dx_ig, dx_ref_ig.to(input_dtype), atol=atol, rtol=rtol)

    if inplace_backward:
        # Oink's in-place backward: oink.cross_entropy(inplace_backward=True) writes dlogits over
        # the logits. Under torch.compile it falls back to out of place, so values only.
        x_ip = x.detach().clone().requires_grad_()
        loss_ip = maybe_compile(oink.cross_entropy, use_compile)(
            x_ip, target_ref, weight=weight, reduction="none", inplace_backward=True)
        (dx_ip,) = torch.autograd.grad(loss_ip, x_ip, grad_outputs=torch.ones_like(loss_ip))
        torch.testing.assert_close(loss_ip, loss_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(dx_ip, dx_ref.to(input_dtype), atol=atol, rtol=rtol)


def test_cross_entropy_fwd_empty():
    """Zero rows: empty loss and lse (no launch)."""
    x = torch.empty(0, 4096, device=DEVICE, dtype=torch.bfloat16)
    target = torch.empty(0, device=DEVICE, dtype=torch.int64)
    loss, lse = oink.cross_entropy_forward(x, target)
    assert loss.shape == (0,) and lse.shape == (0,)


def test_cross_entropy_bwd_empty():
    x = torch.empty(0, 4096, device=DEVICE, dtype=torch.bfloat16)
    target = torch.empty(0, device=DEVICE, dtype=torch.int64)
    dloss = torch.empty(0, device=DEVICE, dtype=torch.float32)
    lse = torch.empty(0, device=DEVICE, dtype=torch.float32)
    dx = oink.cross_entropy_backward(dloss, x, target, lse)
    assert dx.shape == x.shape and dx.numel() == 0


REDUCTION_SHAPES = [(M, N) for M in (77, 289) for N in (1024, 32768, 128256)]


@pytest.mark.parametrize("M,N,use_compile", shapes_x_compile(REDUCTION_SHAPES))
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_weight_reduction(M, N, input_dtype, reduction, use_compile):
    """Class weights with each reduction; "mean" divides by the sum of the rows' weights."""
    atol, rtol = 1e-4, 1e-4
    torch.manual_seed(0)
    x = (0.1 * torch.randn(M, N, device=DEVICE, dtype=input_dtype)).requires_grad_()
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    weight = torch.rand(N, device=DEVICE, dtype=torch.float32) + 0.1
    x_ref = fp32_leaf(x)
    fn = maybe_compile(oink.cross_entropy, use_compile)
    loss = fn(x, target, weight=weight, reduction=reduction)
    loss_ref = F.cross_entropy(x_ref, target, weight=weight, reduction=reduction)
    if reduction != "none":
        loss.backward()
        loss_ref.backward()

    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=rtol)
    if reduction != "none":
        torch.testing.assert_close(x.grad, x_ref.grad.to(input_dtype), atol=atol, rtol=rtol)


def test_cross_entropy_bwd_stride0_dloss():
    """A dloss broadcast from a scalar (stride 0) must be read correctly by the backward."""
    M, N = 77, 1024
    torch.manual_seed(0)
    x = 0.1 * torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, N, (M,), device=DEVICE, dtype=torch.int64)
    lse = torch.logsumexp(x.float(), dim=-1)
    dloss = torch.ones((), device=DEVICE, dtype=torch.float32).expand(M)
    assert dloss.stride() == (0,)
    dx = oink.cross_entropy_backward(dloss, x, target, lse)
    # dloss = 1: dx = softmax(x) - one_hot(target)
    x_ref = x.float().requires_grad_()
    loss_ref = F.cross_entropy(x_ref, target, reduction="none")
    (dx_ref,) = torch.autograd.grad(loss_ref, x_ref, grad_outputs=torch.ones_like(loss_ref))
    torch.testing.assert_close(dx, dx_ref.to(torch.bfloat16), atol=1e-4, rtol=1e-4)
