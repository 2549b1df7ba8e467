"""RMSNorm and LayerNorm references: fp32 arithmetic, outputs in the input's dtype.

With a residual, the sum ``x + residual`` is rounded to the residual's dtype (that is what is
stored and what the next layer reads) and the norm is taken of that rounded sum, as vLLM's
fused_add_rms_norm does.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import EPS, Bench, rand, x_residual_weight, x_weight

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


# ---- bench entries (``.bench``: pytest_oink builds each op's benchmark spec from its own) ----
def _w32_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen), weight=rand((N,), torch.float32, device, gen))


def _gemma_inputs(M, N, dtype, device, gen):
    # Gemma's zero-initialised weight (plus noise), applied as (1 + w)
    return dict(x=rand((M, N), dtype, device, gen), weight=rand((N,), torch.float32, device, gen, scale=0.1))


def _res32_inputs(M, N, dtype, device, gen):
    # the fp32 residual stream of mixed-precision training: x and y in dtype, the residual in fp32
    return dict(x=rand((M, N), dtype, device, gen), residual=rand((M, N), torch.float32, device, gen),
                weight=rand((N,), torch.float32, device, gen))


def _backward_inputs(M, N, dtype, device, gen):
    x, w = rand((M, N), dtype, device, gen), rand((N,), dtype, device, gen)
    rstd = rmsnorm_forward(x, w, store_rstd=True)[1]
    return dict(x=x, weight=w, dout=rand((M, N), dtype, device, gen), rstd=rstd)


def _ln_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen), weight=rand((N,), dtype, device, gen),
                bias=rand((N,), dtype, device, gen))


def _ln_backward_inputs(M, N, dtype, device, gen):
    a = _ln_inputs(M, N, dtype, device, gen)
    _, rstd, mean = layernorm(a["x"], a["weight"], a["bias"], EPS, return_rstd=True, return_mean=True)
    return dict(dout=rand((M, N), dtype, device, gen), rstd=rstd, mean=mean, **a)


def _y(o, a):
    return (o.rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0],)


def _fused(o, a):
    return (o.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS), a["x"], a["residual"])[1:]


def _torch_ops(o):
    """``torch.ops.oink``, where the vLLM entries call Oink: ``o`` is the ``oink`` package (the entry's Oink call
    gets it), whose declarations, which register torch.ops.oink, load on its first public op looked up."""
    o.rmsnorm_forward  # noqa: B018  (the declarations loaded: no import of oink.ops from the references)
    return torch.ops.oink


BENCH = {
    "rmsnorm_forward": Bench("rmsnorm", x_weight, lambda M, N, e: 2 * M * N * e + N * e, _y),
    # the same op with an fp32 weight (mixed-precision training keeps the weight in fp32)
    "rmsnorm_forward_w32": Bench("rmsnorm", _w32_inputs, lambda M, N, e: 2 * M * N * e + N * 4, _y),
    # Gemma's RMSNorm: y = x_hat * (1 + w), fp32 weight
    "rmsnorm_forward_gemma": Bench("rmsnorm", _gemma_inputs, lambda M, N, e: 2 * M * N * e + N * 4,
                                   lambda o, a: (o.rmsnorm_forward(a["x"], a["weight"], eps=EPS,
                                                                   weight_offset=1.0)[0],)),
    # an fp32 residual stream: y in x's dtype and residual_out = x + residual in fp32
    "rmsnorm_forward_res32": Bench(("rmsnorm", "rmsnorm"), _res32_inputs,
                                   lambda M, N, e: 2 * M * N * e + 8 * M * N + N * 4,
                                   lambda o, a: o.rmsnorm_forward(a["x"], a["weight"], residual=a["residual"],
                                                                  eps=EPS)[::2]),
    "fused_add_rmsnorm_": Bench("rmsnorm", x_residual_weight, lambda M, N, e: 4 * M * N * e + N * e, _fused,
                                mutates=("x", "residual")),
    # dx and dw: every provider must compute both (a compiler would drop an unused dw)
    "rmsnorm_backward": Bench(("norm_backward", "weight_grad"), _backward_inputs,
                              lambda M, N, e: 3 * M * N * e + 2 * N * e + 4 * M,
                              lambda o, a: o.rmsnorm_backward(a["x"], a["weight"], a["dout"], a["rstd"])[:2]),
    "layernorm": Bench("layernorm", _ln_inputs, lambda M, N, e: 2 * M * N * e + 2 * N * e,
                       lambda o, a: (o.layernorm(a["x"], a["weight"], a["bias"], EPS),)),
    # read x, dout, weight, mean, rstd; write dx, dweight, dbias
    "layernorm_backward": Bench(("norm_backward", "weight_grad", "weight_grad"), _ln_backward_inputs,
                                lambda M, N, e: 3 * M * N * e + 8 * M + 3 * N * e,
                                lambda o, a: o.layernorm_backward(a["dout"], a["x"], a["weight"], a["rstd"], a["mean"],
                                                                  a["bias"])),
    # vLLM's two ops as vLLM calls them (torch.ops.oink.*, through the dispatcher): launch cost only
    "vllm_rmsnorm": Bench("rmsnorm", x_weight, lambda M, N, e: 2 * M * N * e + N * e, _y,
                          only_in=("launch", "invariance"),
                          oink=lambda o, a: (_torch_ops(o).rmsnorm(a["x"], a["weight"], EPS),)),
    "vllm_fused_add_rms_norm": Bench("rmsnorm", x_residual_weight, lambda M, N, e: 4 * M * N * e + N * e, _fused,
                                     mutates=("x", "residual"), only_in=("launch", "invariance"),
                                     oink=lambda o, a: (_torch_ops(o).fused_add_rms_norm(a["x"], a["residual"],
                                                                                        a["weight"], EPS),
                                                        a["x"], a["residual"])[1:]),
}
