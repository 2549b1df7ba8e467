"""Cross-entropy over the last dim of logits [M, V]: fp32 loss and logsumexp.

Rows whose target equals ``ignore_index`` give loss 0 and gradient 0; "mean" divides by the
number of rows not ignored (0 when all are ignored, as a sum over nothing)."""
from __future__ import annotations

import torch
from torch import Tensor

REDUCTIONS = ("none", "mean", "sum")


def _per_row(logits: Tensor, target: Tensor, ignore_index: int):
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target)).long()
    picked = lf.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, lse - picked, torch.zeros_like(lse))
    return loss, lse, valid, safe


def reduce_loss(loss: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / valid.sum().clamp_min(1).to(total.dtype)


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int = -100,
                          reduction: str = "none"):
    """-> (loss, lse): loss fp32 [M] ("none") or a 0-d tensor; lse fp32 [M]."""
    loss, lse, valid, _ = _per_row(logits, target, ignore_index)
    return reduce_loss(loss, valid, reduction), lse


def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100) -> Tensor:
    """dlogits = (softmax(logits) - onehot(target)) * dloss[row]; 0 on ignored rows.
    ``dloss`` is the per-row upstream gradient [M] (or a scalar, broadcast)."""
    lf = logits.float()
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target)).long()
    p = torch.exp(lf - lse.float().unsqueeze(-1))
    p.scatter_add_(-1, safe.unsqueeze(-1), -torch.ones_like(p[:, :1]))
    g = torch.broadcast_to(dloss.float(), lse.shape) * valid
    return (p * g.unsqueeze(-1)).to(logits.dtype)


def cross_entropy_fwd_bwd(dloss: Tensor, logits: Tensor, target: Tensor,
                          ignore_index: int = -100):
    """-> (loss fp32 [M], dlogits) in one call, per-row loss (reduction "none")."""
    loss, lse, _, _ = _per_row(logits, target, ignore_index)
    return loss, cross_entropy_backward(dloss, logits, target, lse, ignore_index)


def cross_entropy_backward_(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                            ignore_index: int = -100) -> None:
    """In place: logits <- dlogits (the memory-saving backward of ``oink.cross_entropy``)."""
    logits.copy_(cross_entropy_backward(dloss, logits, target, lse, ignore_index))
