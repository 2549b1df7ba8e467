"""Cross-entropy over the last dim of logits [M, V]: fp32 loss and logsumexp.

Rows whose target equals ``ignore_index`` give loss 0 and gradient 0. A class ``weight`` [V]
scales row i's loss and gradient by weight[target_i], and "mean" then divides by the sum of
those weights over rows not ignored (torch.nn.functional.cross_entropy's rule); without one it
divides by the number of rows not ignored ("mean" over nothing is 0, not torch's NaN).

Vocab-parallel use (tensor parallelism): ``lse_partial`` [M, K] holds each shard's logsumexp
and the row's lse is their logsumexp; ``target_logit`` ([M], or [M, V] read at the target)
supplies the target's logit where the local logits do not hold it.

Logits of +inf give the limit of those logits growing together: with k of a row's logits at +inf,
the softmax is 1/k on each of them and 0 elsewhere, the loss log(k) when the target is one of them
and +inf otherwise, the lse +inf. k is counted in the logits given, so with ``lse_partial`` (the
other shards' counts unknown) such a row's loss stays NaN, and a shard's backward counts its own
only. Logits of -inf (masking) are ordinary: their softmax is 0."""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [  # the public ops (oink.reference re-exports them)
    "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd",
]

REDUCTIONS = ("none", "mean", "sum")


def safe_target(target: Tensor, ignore_index: int):
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros_like(target)).long()


def row_weight(weight: Tensor | None, valid: Tensor, safe: Tensor) -> Tensor:
    """Per-row factor: weight[target] (1 without a class weight), 0 on ignored rows; fp32 [M]."""
    w = weight.float()[safe] if weight is not None else torch.ones(safe.shape, device=safe.device)
    return w * valid


def per_row(logits: Tensor, target: Tensor, ignore_index: int, weight=None, lse_partial=None,
             target_logit=None):
    valid, safe = safe_target(target, ignore_index)
    lse = torch.logsumexp((lse_partial if lse_partial is not None else logits).float(), dim=-1)
    rw = row_weight(weight, valid, safe)
    posinf = posinf_count(logits) if lse_partial is None else None  # the shards' counts are not in their lse
    src = target_logit if target_logit is not None else logits
    return loss_from_lse(lse, src, valid, safe, posinf) * rw, lse, rw


def posinf_count(logits: Tensor) -> Tensor:
    """How many of each row's logits are +inf: fp32 [M] (no host sync, so CUDA graphs can hold it)."""
    return torch.isposinf(logits).sum(-1, dtype=torch.float32)


def loss_from_lse(lse: Tensor, src: Tensor, valid: Tensor, safe: Tensor, posinf: Tensor | None = None) -> Tensor:
    """lse - the target's logit (read from ``src``: [M] as is, [M, V] at the target); 0 where ignored.
    ``posinf``: each row's count k of +inf logits, where lse and the target's logit are both +inf
    (inf - inf) the loss is the limit log(k) (see the module doc)."""
    picked = src.float() if src.dim() == 1 else src.gather(-1, safe.unsqueeze(-1)).squeeze(-1).float()
    loss = lse - picked
    if posinf is not None:
        at_inf = torch.isposinf(lse) & torch.isposinf(picked)  # a NaN anywhere makes lse NaN: stays NaN
        loss = torch.where(at_inf, torch.log(posinf), loss)
    return torch.where(valid, loss, torch.zeros_like(lse))


def reduce_loss(loss: Tensor, rw: Tensor, reduction: str) -> Tensor:
    """``rw``: the per-row factors of ``row_weight`` (their sum is "mean"'s divisor)."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    denom = rw.sum().to(total.dtype)
    return torch.where(denom > 0, total / denom, torch.zeros_like(total))  # nothing counted: 0


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int = -100,
                          reduction: str = "none", weight: Tensor | None = None,
                          lse_partial: Tensor | None = None, target_logit: Tensor | None = None):
    """-> (loss, lse): loss fp32 [M] ("none") or a 0-d tensor; lse fp32 [M]."""
    loss, lse, rw = per_row(logits, target, ignore_index, weight, lse_partial, target_logit)
    return reduce_loss(loss, rw, reduction), lse


def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100, weight: Tensor | None = None) -> Tensor:
    """dlogits = (softmax(logits) - onehot(target)) * dloss[row] * weight[target]; 0 on ignored
    rows. ``dloss`` is the per-row upstream gradient [M] (or a scalar, broadcast)."""
    lf = logits.float()
    valid, safe = safe_target(target, ignore_index)
    # softmax as torch's own backward forms it, exp(log_softmax), so 16-bit dlogits round as torch's
    # do (exp(x - lse) moves ~1 in 1e4 values to the other neighbour); rescaled where lse is not the
    # logits' own (vocab-parallel: the global lse of a shard)
    own = torch.logsumexp(lf, dim=-1)
    p = torch.exp(torch.log_softmax(lf, dim=-1)) * torch.exp(own - lse.float()).unsqueeze(-1)
    # rows holding +inf (log_softmax gives NaN there): the limit, 1/k on each of the k +inf logits
    at = torch.isposinf(lf)
    limit = (torch.isposinf(own) & torch.isposinf(lse.float())).unsqueeze(-1)
    p = torch.where(limit, at / at.sum(-1, keepdim=True).clamp_min(1), p)
    g = torch.broadcast_to(dloss.float(), lse.shape) * row_weight(weight, valid, safe)
    d = p * g.unsqueeze(-1)
    d.scatter_add_(-1, safe.unsqueeze(-1), -g.unsqueeze(-1))
    return d.to(logits.dtype)


def cross_entropy_fwd_bwd(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int = -100,
                          weight: Tensor | None = None, return_lse: bool = False):
    """-> (loss fp32 [M], dlogits), or (loss, dlogits, lse) with ``return_lse``; per-row loss."""
    loss, lse, _ = per_row(logits, target, ignore_index, weight)
    dlogits = cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)
    return (loss, dlogits, lse) if return_lse else (loss, dlogits)


def cross_entropy_backward_(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                            ignore_index: int = -100, weight: Tensor | None = None) -> None:
    """In place: logits <- dlogits (the memory-saving backward of ``oink.cross_entropy``)."""
    logits.copy_(cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight))
