"""Cross-entropy over the last dim of logits [M, V]: fp32 loss and logsumexp.

Rows whose target equals ``ignore_index`` give loss 0 and gradient 0. A class ``weight`` [V]
scales row i's loss and gradient by weight[target_i], and "mean" then divides by the sum of
those weights over rows not ignored (torch.nn.functional.cross_entropy's rule); without one it
divides by the number of rows not ignored ("mean" over nothing is 0, not torch's NaN).

Options (each off by default):
- ``softcap`` c > 0: every logit z becomes c * tanh(z / c) before anything else (Gemma-2), and
  gradients flow through it; lse is then the capped logits' logsumexp.
- ``label_smoothing`` eps in [0, 1): torch's rule, loss = (1 - eps) * w[t] * nll + eps / V *
  sum_j w_j * (-log p_j) (w = 1 without a class weight), 0 on ignored rows.
- ``z_loss`` z >= 0: z * lse^2 added to each row's loss (PaLM's auxiliary loss), scaled by the
  row's weight[target] like the rest of the row; ``return_z_loss`` returns that part too, reduced
  as the loss is (it is included in the loss, and returned for logging: not differentiated).

Vocab-parallel use (tensor parallelism): ``lse_partial`` [M, K] holds each shard's logsumexp (of
the capped logits with ``softcap``) and the row's lse is their logsumexp; ``target_logit`` ([M],
or [M, V] read at the target) supplies the target's logit where the local logits do not hold it.

Logits of +inf give the limit of those logits growing together: with k of a row's logits at +inf,
the softmax is 1/k on each of them and 0 elsewhere, the loss log(k) when the target is one of them
and +inf otherwise, the lse +inf (label smoothing's -log p_j likewise: log k at those, +inf
elsewhere). k is counted in the logits given, so with ``lse_partial`` (the other shards' counts
unknown) such a row's loss stays NaN, and a shard's backward counts its own only. Logits of -inf
(masking) are ordinary: their softmax is 0. With ``softcap`` no logit stays infinite (+-inf caps
to +-c).

The functions compute in fp32, or in fp64 for fp64 logits (so a float64 formula can check them
closely); the public API takes fp32/fp16/bf16 logits."""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import Bench, rand

__all__ = [  # the public ops (oink.reference re-exports them)
    "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd",
]

REDUCTIONS = ("none", "mean", "sum")


def acc(t: Tensor) -> Tensor:
    """The arithmetic's dtype: fp32, fp64 for fp64 inputs."""
    return t if t.dtype == torch.float64 else t.float()


def capped(z: Tensor, softcap: float | None) -> Tensor:
    """softcap * tanh(z / softcap), or z without a softcap."""
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def safe_target(target: Tensor, ignore_index: int):
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros_like(target)).long()


def row_weight(weight: Tensor | None, valid: Tensor, safe: Tensor, dtype=torch.float32) -> Tensor:
    """Per-row factor: weight[target] (1 without a class weight), 0 on ignored rows; [M] of ``dtype``."""
    w = weight.to(dtype)[safe] if weight is not None else torch.ones(safe.shape, device=safe.device, dtype=dtype)
    return w * valid


def per_row(logits: Tensor, target: Tensor, ignore_index: int, weight=None, lse_partial=None,
            target_logit=None, label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None):
    """-> (loss, lse, rw): each row's loss (options and weight applied, the z-loss included, 0 where
    ignored), its lse and ``row_weight``'s factors."""
    valid, safe = safe_target(target, ignore_index)
    z = capped(acc(logits), softcap)
    lse = torch.logsumexp(acc(lse_partial) if lse_partial is not None else z, dim=-1)
    rw = row_weight(weight, valid, safe, lse.dtype)
    posinf = posinf_count(z) if lse_partial is None else None  # the shards' counts are not in their lse
    src = capped(acc(target_logit), softcap) if target_logit is not None else z
    loss = loss_from_lse(lse, src, valid, safe, posinf) * rw
    if label_smoothing:
        smooth = smoothing_rows(z, lse, weight, valid, posinf)
        loss = (1 - label_smoothing) * loss + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss_rows(lse, rw, valid, z_loss)
    return loss, lse, rw


def z_loss_rows(lse: Tensor, rw: Tensor, valid: Tensor, z_loss: float) -> Tensor:
    """Each row's z-loss z * lse^2 * weight[target]; 0 on ignored rows (never 0 * inf)."""
    return torch.where(valid, z_loss * lse.square() * rw, torch.zeros_like(lse))


def smoothing_rows(z: Tensor, lse: Tensor, weight: Tensor | None, valid: Tensor, posinf: Tensor | None) -> Tensor:
    """Each row's sum_j w_j * (-log p_j) / V (label smoothing's term), 0 on ignored rows; where the
    row holds +inf logits, -log p_j is its limit (log k at the k +inf logits, +inf elsewhere)."""
    nlp = lse.unsqueeze(-1) - z
    if posinf is not None:
        at_inf = torch.isposinf(lse).unsqueeze(-1) & torch.isposinf(z)
        nlp = torch.where(at_inf, torch.log(posinf).to(nlp.dtype).unsqueeze(-1), nlp)
    if weight is not None:
        nlp = nlp * weight.to(nlp.dtype)
    return torch.where(valid, nlp.sum(-1) / z.shape[-1], torch.zeros_like(lse))


def posinf_count(logits: Tensor) -> Tensor:
    """How many of each row's logits are +inf: fp32 [M] (no host sync, so CUDA graphs can hold it)."""
    return torch.isposinf(logits).sum(-1, dtype=torch.float32)


def loss_from_lse(lse: Tensor, src: Tensor, valid: Tensor, safe: Tensor, posinf: Tensor | None = None) -> Tensor:
    """lse - the target's logit (read from ``src``: [M] as is, [M, V] at the target); 0 where ignored.
    ``posinf``: each row's count k of +inf logits, where lse and the target's logit are both +inf
    (inf - inf) the loss is the limit log(k) (see the module doc)."""
    picked = src if src.dim() == 1 else src.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    loss = lse - picked.to(lse.dtype)
    if posinf is not None:
        at_inf = torch.isposinf(lse) & torch.isposinf(picked)  # a NaN anywhere makes lse NaN: stays NaN
        loss = torch.where(at_inf, torch.log(posinf).to(loss.dtype), loss)
    return torch.where(valid, loss, torch.zeros_like(lse))


def reduce_loss(loss: Tensor, rw: Tensor, reduction: str) -> Tensor:
    """``rw``: the per-row factors of ``row_weight`` (their sum is "mean"'s divisor)."""
    if reduction == "none":
        return loss
    total = loss.sum()
    if reduction == "sum":
        return total
    return total * mean_factor(rw)


def mean_factor(rw: Tensor) -> Tensor:
    """1 / the sum of the row factors: "mean"'s scale, 0 when no row counts (a device op, no host read)."""
    denom = rw.sum()
    return torch.where(denom > 0, 1 / denom, torch.zeros_like(denom))


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int = -100,
                          reduction: str = "none", weight: Tensor | None = None,
                          lse_partial: Tensor | None = None, target_logit: Tensor | None = None,
                          label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                          return_z_loss: bool = False):
    """-> (loss, lse), or (loss, lse, z-loss) with ``return_z_loss``: loss (and z-loss) fp32 [M]
    ("none") or 0-d; lse fp32 [M]."""
    loss, lse, rw = per_row(logits, target, ignore_index, weight, lse_partial, target_logit, label_smoothing,
                            z_loss, softcap)
    if not return_z_loss:
        return reduce_loss(loss, rw, reduction), lse
    zl = z_loss_rows(lse, rw, target != ignore_index, z_loss)
    return reduce_loss(loss, rw, reduction), lse, reduce_loss(zl, rw, reduction)


def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100, weight: Tensor | None = None, label_smoothing: float = 0.0,
                           z_loss: float = 0.0, softcap: float | None = None) -> Tensor:
    """dlogits of the per-row loss times ``dloss[row]`` (a scalar broadcasts); 0 on ignored rows.
    Plain: (softmax(logits) - onehot(target)) * dloss[row] * weight[target]; with the options the
    derivative of the loss ``cross_entropy_forward`` defines (through the softcap's tanh)."""
    lf = acc(logits)
    z = capped(lf, softcap)
    lse = acc(lse)
    valid, safe = safe_target(target, ignore_index)
    # softmax as torch's own backward forms it, exp(log_softmax), so 16-bit dlogits round as torch's
    # do (exp(x - lse) moves ~1 in 1e4 values to the other neighbour); rescaled where lse is not the
    # logits' own (vocab-parallel: the global lse of a shard)
    own = torch.logsumexp(z, dim=-1)
    p = torch.exp(torch.log_softmax(z, dim=-1)) * torch.exp(own - lse).unsqueeze(-1)
    # rows holding +inf (log_softmax gives NaN there): the limit, 1/k on each of the k +inf logits
    at = torch.isposinf(z)
    limit = (torch.isposinf(own) & torch.isposinf(lse)).unsqueeze(-1)
    p = torch.where(limit, at / at.sum(-1, keepdim=True).clamp_min(1), p)
    up = torch.broadcast_to(acc(dloss), lse.shape) * valid  # the upstream gradient, 0 on ignored rows
    g = up * row_weight(weight, valid, safe, lse.dtype)  # d(loss)/d(nll) without the options
    eps = label_smoothing
    coef = g * (1 - eps)  # of p, from the nll term
    if eps:  # eps / V * sum_j w_j (-log p_j): (W p_k - w_k) eps / V
        V = z.shape[-1]
        W = weight.to(lse.dtype).sum() if weight is not None else V
        coef = coef + up * (eps * W / V)
    if z_loss:  # z * lse^2 * w[t]: 2 z lse w[t] p_k
        coef = coef + 2 * z_loss * lse * g
    d = p * coef.unsqueeze(-1)
    if eps:
        w = weight.to(lse.dtype) if weight is not None else torch.ones((), dtype=lse.dtype, device=lse.device)
        d = d - (up * (eps / z.shape[-1])).unsqueeze(-1) * w
    d.scatter_add_(-1, safe.unsqueeze(-1), -(g * (1 - eps)).unsqueeze(-1))
    if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2
        d = d * (1 - torch.tanh(lf / softcap).square())
    return d.to(logits.dtype)


def reduction_dloss(dloss: Tensor, rw: Tensor, reduction: str) -> Tensor:
    """The per-row upstream gradient of a reduced loss: dloss (a scalar for "mean" and "sum"), "mean"
    divided by the sum of the row factors."""
    return dloss * mean_factor(rw).to(dloss.dtype) if reduction == "mean" else dloss


def cross_entropy_fwd_bwd(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int = -100,
                          weight: Tensor | None = None, return_lse: bool = False, reduction: str = "none",
                          label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                          return_z_loss: bool = False):
    """-> (loss, dlogits), then lse with ``return_lse`` and the z-loss with ``return_z_loss``; loss
    reduced by ``reduction`` and dlogits its gradient times ``dloss``."""
    loss, lse, rw = per_row(logits, target, ignore_index, weight, label_smoothing=label_smoothing, z_loss=z_loss,
                            softcap=softcap)
    dlogits = cross_entropy_backward(reduction_dloss(acc(dloss), rw, reduction), logits, target, lse, ignore_index,
                                     weight, label_smoothing, z_loss, softcap)
    out = (reduce_loss(loss, rw, reduction), dlogits)
    if return_lse:
        out += (lse,)
    if return_z_loss:
        out += (reduce_loss(z_loss_rows(lse, rw, target != ignore_index, z_loss), rw, reduction),)
    return out


def cross_entropy_fwd_bwd_(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int = -100,
                           label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None):
    """In place: logits <- dlogits; -> (loss [M], lse [M]), fp32 (the chunks of ``oink.linear_cross_entropy``)."""
    loss, dlogits, lse = cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, return_lse=True,
                                               label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    logits.copy_(dlogits)
    return loss, lse


def cross_entropy_backward_(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                            ignore_index: int = -100, weight: Tensor | None = None, label_smoothing: float = 0.0,
                            z_loss: float = 0.0, softcap: float | None = None) -> None:
    """In place: logits <- dlogits (the memory-saving backward of ``oink.cross_entropy``)."""
    logits.copy_(cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight, label_smoothing, z_loss,
                                        softcap))


# ---- bench entries (``.bench``: pytest_oink builds each op's benchmark spec from its own) ----
def _forward_inputs(M, N, dtype, device, gen):
    return dict(logits=rand((M, N), dtype, device, gen, 4.0),
                target=torch.randint(0, N, (M,), generator=gen, device=device))


def _backward_inputs(M, N, dtype, device, gen):
    a = _forward_inputs(M, N, dtype, device, gen)
    a["lse"] = cross_entropy_forward(a["logits"], a["target"])[1]
    a["dloss"] = torch.rand(M, generator=gen, device=device)
    return a


def _fwd_bwd_inputs(M, N, dtype, device, gen):
    a = _backward_inputs(M, N, dtype, device, gen)
    del a["lse"]
    return a


BENCH = {
    # read logits and int64 targets; write fp32 loss and lse
    "cross_entropy_forward": Bench("cross_entropy_loss", _forward_inputs, lambda M, N, e: M * N * e + 8 * M + 4 * M,
                                   lambda o, a: (o.cross_entropy_forward(a["logits"], a["target"])[0],)),
    # read logits, targets, lse, dloss; write dlogits
    "cross_entropy_backward": Bench("softmax", _backward_inputs, lambda M, N, e: 2 * M * N * e + 16 * M,
                                    lambda o, a: (o.cross_entropy_backward(a["dloss"], a["logits"], a["target"],
                                                                           a["lse"]),)),
    # read logits, targets, dloss; write loss and dlogits
    "cross_entropy_fwd_bwd": Bench(("cross_entropy_loss", "softmax"), _fwd_bwd_inputs,
                                   lambda M, N, e: 2 * M * N * e + 16 * M,
                                   lambda o, a: o.cross_entropy_fwd_bwd(a["dloss"], a["logits"], a["target"])),
}
