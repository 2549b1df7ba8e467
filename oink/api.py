"""The public ``oink.<op>`` functions: thin wrappers over ``torch.ops.oink.*`` that restore the
documented signatures (None for outputs not asked for)."""
from __future__ import annotations

import torch
from torch import Tensor

from . import ops as _ops  # noqa: F401  (registers torch.ops.oink.*)
from . import validate
from .dispatch import explain  # noqa: F401

_oink = torch.ops.oink


def _opt(t: Tensor, wanted: bool):
    return t if wanted else None


def rmsnorm_forward(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
                    residual: Tensor | None = None, eps: float = 1e-6, store_rstd: bool = False, *,
                    out_dtype: torch.dtype | None = None, residual_dtype: torch.dtype | None = None,
                    weight_offset: float = 0.0):
    """RMSNorm: -> (y, rstd | None, residual_out | None); residual_out = x + residual in
    ``residual_dtype`` (default the residual's), and the norm is of that stored sum.
    y = x_hat * (weight + weight_offset) + bias in ``out_dtype`` (default x's); weight and bias
    are [N] or per head [H, D] for x [..., H, D], in any float dtype."""
    validate.rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype, weight_offset)
    y, rstd, res_out = _oink.rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype,
                                             float(weight_offset))
    return y, _opt(rstd, store_rstd), _opt(res_out, residual is not None or residual_dtype is not None)


def fused_add_rmsnorm_(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    """In place, vLLM semantics: residual <- x + residual; x <- rmsnorm(residual) * weight."""
    validate.fused_add_rmsnorm_(x, residual, weight)
    _oink.fused_add_rms_norm(x, residual, weight, eps)


def rmsnorm_backward(x: Tensor, weight: Tensor | None, dout: Tensor, rstd: Tensor,
                     dresidual_out: Tensor | None = None, has_bias: bool = False, has_residual: bool = False, *,
                     weight_offset: float = 0.0):
    """-> (dx, dw | None, db | None, dresidual | None); dresidual is dx itself."""
    validate.rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, has_residual, weight_offset)
    dx, dw, db = _oink.rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, float(weight_offset))
    return dx, _opt(dw, weight is not None), _opt(db, has_bias), _opt(dx, has_residual)


def layernorm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-6,
              return_rstd: bool = False, return_mean: bool = False):
    """-> y, or (y, rstd) / (y, mean) / (y, rstd, mean) when asked."""
    validate.layernorm(x, weight, bias)
    y, rstd, mean = _oink.layernorm(x, weight, bias, eps)
    extra = ([rstd] if return_rstd else []) + ([mean] if return_mean else [])
    return (y, *extra) if extra else y


def layernorm_backward(dout: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, mean: Tensor,
                       bias: Tensor | None = None):
    """-> (dx, dw, db | None)."""
    validate.layernorm_backward(dout, x, weight, rstd, mean, bias)
    dx, dw, db = _oink.layernorm_backward(dout, x, weight, rstd, mean, bias)
    return dx, dw, _opt(db, bias is not None)


def softmax_forward(x: Tensor) -> Tensor:
    validate.softmax_forward(x)
    return _oink.softmax_forward(x)


def softmax_backward(dy: Tensor, y: Tensor) -> Tensor:
    validate.softmax_backward(dy, y)
    return _oink.softmax_backward(dy, y)


def softmax_fwd_bwd(dy: Tensor, x: Tensor) -> Tensor:
    validate.softmax_fwd_bwd(dy, x)
    return _oink.softmax_fwd_bwd(dy, x)


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "none", *,
                          weight: Tensor | None = None, lse_partial: Tensor | None = None,
                          target_logit: Tensor | None = None):
    """-> (loss, lse), fp32. ``weight``: per-class [V]; ``lse_partial`` [M, K]: per-shard logsumexps
    (vocab-parallel), the row's lse is theirs; ``target_logit`` [M] or [M, V]: where to read the
    target's logit instead of ``logits``."""
    validate.cross_entropy_forward(logits, target, ignore_index, reduction, weight, lse_partial, target_logit)
    return tuple(_oink.cross_entropy_forward(logits, target, ignore_index, reduction, weight, lse_partial,
                                             target_logit))


def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                           ignore_index: int = -100, *, weight: Tensor | None = None) -> Tensor:
    validate.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)
    return _oink.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)


def cross_entropy_fwd_bwd(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int = -100, *,
                          weight: Tensor | None = None, return_lse: bool = False):
    """-> (loss fp32 [M], dlogits), or (loss, dlogits, lse) with ``return_lse``."""
    validate.cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, weight, return_lse)
    loss, dlogits, lse = _oink.cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, weight)
    return (loss, dlogits, lse) if return_lse else (loss, dlogits)


def nvfp4_quantize(x: Tensor, global_scale: Tensor, swizzled: bool = False):
    """-> (q uint8 [M, N/2], sf float8_e4m3fn); see ``oink.reference.nvfp4`` for the semantics."""
    validate.nvfp4_quantize(x, global_scale)
    return tuple(_oink.nvfp4_quantize(x, global_scale, swizzled))


def nvfp4_dequantize(q: Tensor, sf: Tensor, global_scale: Tensor, swizzled: bool = False) -> Tensor:
    validate.nvfp4_dequantize(q, sf, global_scale, swizzled)
    return _oink.nvfp4_dequantize(q, sf, global_scale, swizzled)


def add_rmsnorm_fp4quant(x: Tensor, residual: Tensor, weight: Tensor, global_scale: Tensor,
                         eps: float = 1e-6, swizzled: bool = False, return_y: bool = False):
    """residual <- x + residual (in place); -> (q, sf) of rmsnorm(residual) * weight, or (q, sf, y)."""
    validate.add_rmsnorm_fp4quant(x, residual, weight, global_scale)
    q, sf, y = _oink.add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps, swizzled, return_y)
    return (q, sf, y) if return_y else (q, sf)


def silu_mul_fp4quant(x: Tensor, global_scale: Tensor, swizzled: bool = False):
    """x [..., 2K] -> (q, sf) of silu(x[..., :K]) * x[..., K:]."""
    validate.silu_mul_fp4quant(x, global_scale)
    return tuple(_oink.silu_mul_fp4quant(x, global_scale, swizzled))


def mxfp4_quantize(x: Tensor, swizzled: bool = False):
    """-> (q uint8 [M, N/2], sf float8_e8m0fnu): blocks of 32, power-of-two scales, no global
    scale; see ``oink.reference.nvfp4`` for the exact scale rule."""
    validate.mxfp4_quantize(x, swizzled)
    return tuple(_oink.mxfp4_quantize(x, swizzled))


def mxfp4_dequantize(q: Tensor, sf: Tensor, swizzled: bool = False) -> Tensor:
    validate.mxfp4_dequantize(q, sf, swizzled)
    return _oink.mxfp4_dequantize(q, sf, swizzled)


def add_rmsnorm_mxfp4quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                           swizzled: bool = False, return_y: bool = False):
    """``add_rmsnorm_fp4quant`` quantizing to MXFP4 (blocks of 32, power-of-two scales)."""
    validate.add_rmsnorm_mxfp4quant(x, residual, weight)
    q, sf, y = _oink.add_rmsnorm_mxfp4quant(x, residual, weight, eps, swizzled, return_y)
    return (q, sf, y) if return_y else (q, sf)


def silu_mul_mxfp4quant(x: Tensor, swizzled: bool = False):
    """``silu_mul_fp4quant`` quantizing to MXFP4 (blocks of 32, power-of-two scales)."""
    validate.silu_mul_mxfp4quant(x)
    return tuple(_oink.silu_mul_mxfp4quant(x, swizzled))


PUBLIC_OPS = (
    "rmsnorm_forward", "fused_add_rmsnorm_", "rmsnorm_backward", "layernorm", "layernorm_backward",
    "softmax_forward", "softmax_backward", "softmax_fwd_bwd",
    "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd",
    "nvfp4_quantize", "nvfp4_dequantize", "add_rmsnorm_fp4quant", "silu_mul_fp4quant",
    "mxfp4_quantize", "mxfp4_dequantize", "add_rmsnorm_mxfp4quant", "silu_mul_mxfp4quant",
)
