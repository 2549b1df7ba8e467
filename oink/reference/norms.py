"""RMSNorm and LayerNorm references: fp32 arithmetic, outputs in the input's dtype.

With a residual, the sum ``x + residual`` is rounded to the residual's dtype (that is what is
stored and what the next layer reads) and the norm is taken of that rounded sum, as vLLM's
fused_add_rms_norm does.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def rmsnorm_forward(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                    residual: Tensor | None = None, eps: float = 1e-6, store_rstd: bool = False):
    """-> (y, rstd | None, residual_out | None). rstd is fp32 of shape x.shape[:-1]."""
    residual_out = None
    if residual is not None:
        residual_out = (x.float() + residual.float()).to(residual.dtype)
        h = residual_out.float()
    else:
        h = x.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps)
    y = h * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), (rstd if store_rstd else None), residual_out


def fused_add_rmsnorm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    """vLLM semantics, both in place: residual <- x + residual; x <- rmsnorm(residual) * weight."""
    y, _, residual_out = rmsnorm_forward(x, weight, None, residual, eps)
    residual.copy_(residual_out)
    x.copy_(y)


def rmsnorm_backward(x: Tensor, weight: Tensor | None, dout: Tensor, rstd: Tensor,
                     dresidual_out: Tensor | None = None, has_bias: bool = False,
                     has_residual: bool = False):
    """-> (dx, dw, db, dresidual). ``x`` is the tensor that was normalised (residual_out when
    the forward had a residual). dw, db are summed over rows in fp32 and cast to the weight's
    dtype; dresidual is dx (the gradient flowing into the residual branch)."""
    N = x.shape[-1]
    xf, gf = _rows(x).float(), _rows(dout).float()
    r = rstd.reshape(-1, 1).float()
    xhat = xf * r
    wdy = gf * weight.float() if weight is not None else gf
    c = (xhat * wdy).sum(-1, keepdim=True) / N
    dx = (wdy - xhat * c) * r
    if dresidual_out is not None:
        dx = dx + _rows(dresidual_out).float()
    wdtype = weight.dtype if weight is not None else x.dtype
    dw = (gf * xhat).sum(0).to(wdtype) if weight is not None else None
    db = gf.sum(0).to(wdtype) if has_bias else None
    dx = dx.to(x.dtype).reshape(x.shape)
    dresidual = dx if has_residual else None
    return dx, dw, db, dresidual


def layernorm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-6,
              return_rstd: bool = False, return_mean: bool = False):
    """-> y, or (y, rstd) / (y, mean) / (y, rstd, mean) when asked; rstd and mean fp32 [M]."""
    xf = x.float()
    mean = xf.mean(-1)
    xc = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    y = xc * rstd.unsqueeze(-1) * weight.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    extra = ([rstd] if return_rstd else []) + ([mean] if return_mean else [])
    return (y, *extra) if extra else y


def layernorm_backward(dout: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, mean: Tensor,
                       bias: Tensor | None = None):
    """-> (dx, dw, db); db is None without a bias."""
    N = x.shape[-1]
    xf, gf = _rows(x).float(), _rows(dout).float()
    r = rstd.reshape(-1, 1).float()
    xhat = (xf - mean.reshape(-1, 1).float()) * r
    wdy = gf * weight.float()
    c1 = (xhat * wdy).sum(-1, keepdim=True) / N
    c2 = wdy.sum(-1, keepdim=True) / N
    dx = ((wdy - (xhat * c1 + c2)) * r).to(x.dtype).reshape(x.shape)
    dw = (gf * xhat).sum(0).to(weight.dtype)
    db = gf.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db
