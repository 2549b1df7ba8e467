"""RMSNorm and LayerNorm references: fp32 arithmetic, outputs in the input's dtype.

With a residual, the sum ``x + residual`` is rounded to the residual's dtype (that is what is
stored and what the next layer reads) and the norm is taken of that rounded sum, as vLLM's
fused_add_rms_norm does.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = [  # the public ops (oink.reference re-exports them)
    "rmsnorm_forward", "fused_add_rmsnorm_", "rmsnorm_backward", "layernorm", "layernorm_backward",
]


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def rmsnorm_forward(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                    residual: Tensor | None = None, eps: float = 1e-6, store_rstd: bool = False,
                    out_dtype: torch.dtype | None = None, residual_dtype: torch.dtype | None = None,
                    weight_offset: float = 0.0):
    """-> (y, rstd | None, residual_out | None). rstd is fp32 of shape x.shape[:-1].
    y = x_hat * (weight + weight_offset) + bias, in ``out_dtype`` (default x's); weight and bias
    are [N], or [H, D] per head for x [..., H, D]. residual_out = x + residual in
    ``residual_dtype`` (default residual's; without a residual, x itself in that dtype)."""
    residual_out = None
    if residual is not None or residual_dtype is not None:
        total = x.float() + residual.float() if residual is not None else x.float()
        residual_out = total.to(residual_dtype or residual.dtype)
        h = residual_out.float()
    else:
        h = x.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps)
    y = h * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype), (rstd if store_rstd else None), residual_out


def fused_add_rmsnorm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    """vLLM semantics, both in place: residual <- x + residual; x <- rmsnorm(residual) * weight."""
    y, _, residual_out = rmsnorm_forward(x, weight, None, residual, eps)
    residual.copy_(residual_out)
    x.copy_(y)


def rmsnorm_backward(x: Tensor, weight: Tensor | None, dout: Tensor, rstd: Tensor,
                     dresidual_out: Tensor | None = None, has_bias: bool = False,
                     has_residual: bool = False, weight_offset: float = 0.0):
    """-> (dx, dw, db, dresidual). ``x`` is the tensor that was normalised (residual_out when
    the forward had a residual). dw, db are summed over rows in fp32 and cast to the weight's
    dtype, in the weight's shape ([N] or per-head [H, D]); the offset does not change dw.
    dresidual is dx (the gradient flowing into the residual branch)."""
    N = x.shape[-1]
    xf, gf = x.float(), dout.float()
    r = rstd.float().reshape(x.shape[:-1]).unsqueeze(-1)
    xhat = xf * r
    wdy = gf * (weight.float() + weight_offset) if weight is not None else gf
    c = (xhat * wdy).sum(-1, keepdim=True) / N
    dx = (wdy - xhat * c) * r
    if dresidual_out is not None:
        dx = dx + dresidual_out.float()
    wdtype = weight.dtype if weight is not None else x.dtype
    wshape = tuple(weight.shape) if weight is not None else (N,)
    dw = (gf * xhat).reshape(-1, *wshape).sum(0).to(wdtype) if weight is not None else None
    db = gf.reshape(-1, *wshape).sum(0).to(wdtype) if has_bias else None
    dx = dx.to(x.dtype)
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
