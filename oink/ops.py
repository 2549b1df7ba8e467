"""``torch.ops.oink.*``: one custom op per public op, each with a fake (meta) kernel.

The real implementation of every op validates its inputs and goes through
``dispatch.call`` (kernel or reference). Optional outputs that were not asked for come back
as empty tensors (custom ops can't return None); the public API in ``oink.api`` turns them
into None. Importing this module registers the ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import validate
from .dispatch import call
from .reference.nvfp4 import round_up

NS = "oink"


def _empty_like_none(t: Tensor) -> Tensor:
    return t.new_empty(0)


# ---------------------------------------------------------------- RMSNorm (vLLM's two ops)
@torch.library.custom_op(f"{NS}::rmsnorm", mutates_args=())
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    validate.rmsnorm_forward(x, weight, eps=eps)
    return call("rmsnorm_forward", x=x, weight=weight, bias=None, residual=None, eps=eps, store_rstd=False)[0]


@rmsnorm.register_fake
def _(x, weight, eps):
    validate.rmsnorm_forward(x, weight, eps=eps)
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    validate.fused_add_rmsnorm_(x, residual, weight, eps)
    call("fused_add_rmsnorm_", x=x, residual=residual, weight=weight, eps=eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    validate.fused_add_rmsnorm_(x, residual, weight, eps)


# ---------------------------------------------------------------- RMSNorm, general
@torch.library.custom_op(f"{NS}::rmsnorm_forward", mutates_args=())
def rmsnorm_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                    eps: float, store_rstd: bool, out_dtype: Optional[torch.dtype] = None,
                    residual_dtype: Optional[torch.dtype] = None,
                    weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    validate.rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype, weight_offset)
    y, rstd, res_out = call("rmsnorm_forward", x=x, weight=weight, bias=bias, residual=residual, eps=eps,
                            store_rstd=store_rstd, out_dtype=out_dtype, residual_dtype=residual_dtype,
                            weight_offset=weight_offset)
    return y, (rstd if rstd is not None else _empty_like_none(y).float()), (
        res_out if res_out is not None else _empty_like_none(y))


@rmsnorm_forward.register_fake
def _(x, weight, bias, residual, eps, store_rstd, out_dtype=None, residual_dtype=None, weight_offset=0.0):
    validate.rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype, weight_offset)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32) if store_rstd else x.new_empty(0, dtype=torch.float32)
    if residual is not None or residual_dtype is not None:
        res_out = x.new_empty(x.shape, dtype=residual_dtype or residual.dtype)
    else:
        res_out = x.new_empty(0)
    return torch.empty_like(x, dtype=out_dtype or x.dtype), rstd, res_out


@torch.library.custom_op(f"{NS}::rmsnorm_backward", mutates_args=())
def rmsnorm_backward(x: Tensor, weight: Optional[Tensor], dout: Tensor, rstd: Tensor,
                     dresidual_out: Optional[Tensor], has_bias: bool,
                     weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    validate.rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, False, weight_offset)
    dx, dw, db, _ = call("rmsnorm_backward", x=x, weight=weight, dout=dout, rstd=rstd,
                         dresidual_out=dresidual_out, has_bias=has_bias, has_residual=False,
                         weight_offset=weight_offset)
    return dx, (dw if dw is not None else x.new_empty(0)), (db if db is not None else x.new_empty(0))


@rmsnorm_backward.register_fake
def _(x, weight, dout, rstd, dresidual_out, has_bias, weight_offset=0.0):
    validate.rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, False, weight_offset)
    shape, wdt = ((weight.shape, weight.dtype) if weight is not None else ((x.shape[-1],), x.dtype))
    dw = x.new_empty(shape, dtype=wdt) if weight is not None else x.new_empty(0)
    db = x.new_empty(shape, dtype=wdt) if has_bias else x.new_empty(0)
    return torch.empty_like(x), dw, db


# ---------------------------------------------------------------- LayerNorm
@torch.library.custom_op(f"{NS}::layernorm", mutates_args=())
def layernorm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    validate.layernorm(x, weight, bias, eps)
    return call("layernorm", x=x, weight=weight, bias=bias, eps=eps, return_rstd=True, return_mean=True)


@layernorm.register_fake
def _(x, weight, bias, eps):
    validate.layernorm(x, weight, bias, eps)
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op(f"{NS}::layernorm_backward", mutates_args=())
def layernorm_backward(dout: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, mean: Tensor,
                       bias: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    validate.layernorm_backward(dout, x, weight, rstd, mean, bias)
    dx, dw, db = call("layernorm_backward", dout=dout, x=x, weight=weight, rstd=rstd, mean=mean, bias=bias)
    return dx, dw, (db if db is not None else x.new_empty(0))


@layernorm_backward.register_fake
def _(dout, x, weight, rstd, mean, bias):
    validate.layernorm_backward(dout, x, weight, rstd, mean, bias)
    db = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), db


# ---------------------------------------------------------------- Softmax
@torch.library.custom_op(f"{NS}::softmax_forward", mutates_args=())
def softmax_forward(x: Tensor) -> Tensor:
    validate.softmax_forward(x)
    return call("softmax_forward", x=x)


@softmax_forward.register_fake
def _(x):
    validate.softmax_forward(x)
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::softmax_backward", mutates_args=())
def softmax_backward(dy: Tensor, y: Tensor) -> Tensor:
    validate.softmax_backward(dy, y)
    return call("softmax_backward", dy=dy, y=y)


@softmax_backward.register_fake
def _(dy, y):
    validate.softmax_backward(dy, y)
    return torch.empty_like(y)


@torch.library.custom_op(f"{NS}::softmax_fwd_bwd", mutates_args=())
def softmax_fwd_bwd(dy: Tensor, x: Tensor) -> Tensor:
    validate.softmax_fwd_bwd(dy, x)
    return call("softmax_fwd_bwd", dy=dy, x=x)


@softmax_fwd_bwd.register_fake
def _(dy, x):
    validate.softmax_fwd_bwd(dy, x)
    return torch.empty_like(x)


# ---------------------------------------------------------------- CrossEntropy
@torch.library.custom_op(f"{NS}::cross_entropy_forward", mutates_args=())
def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                          weight: Optional[Tensor] = None, lse_partial: Optional[Tensor] = None,
                          target_logit: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    validate.cross_entropy_forward(logits, target, ignore_index, reduction, weight, lse_partial, target_logit)
    indexed = target_logit if target_logit is not None else logits  # what the targets index
    if indexed.dim() == 2:  # a gathered [M] target logit: the vocabulary is another rank's to check
        validate.target_values(indexed, target, ignore_index)
    return call("cross_entropy_forward", logits=logits, target=target, ignore_index=ignore_index,
                reduction=reduction, weight=weight, lse_partial=lse_partial, target_logit=target_logit)


@cross_entropy_forward.register_fake
def _(logits, target, ignore_index, reduction, weight=None, lse_partial=None, target_logit=None):
    validate.cross_entropy_forward(logits, target, ignore_index, reduction, weight, lse_partial, target_logit)
    lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
    loss = torch.empty_like(lse) if reduction == "none" else logits.new_empty((), dtype=torch.float32)
    return loss, lse


@torch.library.custom_op(f"{NS}::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
                           weight: Optional[Tensor] = None) -> Tensor:
    validate.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)
    validate.target_values(logits, target, ignore_index)
    return call("cross_entropy_backward", dloss=dloss, logits=logits, target=target, lse=lse,
                ignore_index=ignore_index, weight=weight)


@cross_entropy_backward.register_fake
def _(dloss, logits, target, lse, ignore_index, weight=None):
    validate.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)
    return torch.empty_like(logits)


@torch.library.custom_op(f"{NS}::cross_entropy_backward_", mutates_args=("logits",))
def cross_entropy_backward_(dloss: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int,
                            weight: Optional[Tensor] = None) -> None:
    """dlogits written over the logits (no second [M, V] buffer)."""
    validate.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)
    validate.target_values(logits, target, ignore_index)
    call("cross_entropy_backward_", dloss=dloss, logits=logits, target=target, lse=lse, ignore_index=ignore_index,
         weight=weight)


@cross_entropy_backward_.register_fake
def _(dloss, logits, target, lse, ignore_index, weight=None):
    validate.cross_entropy_backward(dloss, logits, target, lse, ignore_index, weight)


@torch.library.custom_op(f"{NS}::cross_entropy_fwd_bwd", mutates_args=())
def cross_entropy_fwd_bwd(dloss: Tensor, logits: Tensor, target: Tensor, ignore_index: int,
                          weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (loss, dlogits, lse): the op always returns the lse (the public function drops it unless asked)."""
    validate.cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, weight)
    validate.target_values(logits, target, ignore_index)
    return call("cross_entropy_fwd_bwd", dloss=dloss, logits=logits, target=target, ignore_index=ignore_index,
                weight=weight, return_lse=True)


@cross_entropy_fwd_bwd.register_fake
def _(dloss, logits, target, ignore_index, weight=None):
    validate.cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, weight)
    row = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return row, torch.empty_like(logits), torch.empty_like(row)


# ---------------------------------------------------------------- NVFP4
def _fp4_fake(x, N: int, swizzled: bool, mx: bool = False):
    """Codes [M, N/2] and scales (NVFP4: E4M3 per 16; MXFP4: UE8M0 per 32) of an N-wide quantization."""
    M = x.numel() // x.shape[-1]
    K = N // (32 if mx else 16)
    q = x.new_empty((M, N // 2), dtype=torch.uint8)
    shape = (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu if mx else torch.float8_e4m3fn)


@torch.library.custom_op(f"{NS}::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(x: Tensor, global_scale: Tensor, swizzled: bool) -> tuple[Tensor, Tensor]:
    validate.nvfp4_quantize(x, global_scale, swizzled)
    return call("nvfp4_quantize", x=x, global_scale=global_scale, swizzled=swizzled)


@nvfp4_quantize.register_fake
def _(x, global_scale, swizzled):
    validate.nvfp4_quantize(x, global_scale, swizzled)
    return _fp4_fake(x, x.shape[-1], swizzled)


@torch.library.custom_op(f"{NS}::nvfp4_dequantize", mutates_args=())
def nvfp4_dequantize(q: Tensor, sf: Tensor, global_scale: Tensor, swizzled: bool) -> Tensor:
    validate.nvfp4_dequantize(q, sf, global_scale, swizzled)
    return call("nvfp4_dequantize", q=q, sf=sf, global_scale=global_scale, swizzled=swizzled)


@nvfp4_dequantize.register_fake
def _(q, sf, global_scale, swizzled):
    validate.nvfp4_dequantize(q, sf, global_scale, swizzled)
    return q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::add_rmsnorm_fp4quant", mutates_args=("residual",))
def add_rmsnorm_fp4quant(x: Tensor, residual: Tensor, weight: Tensor, global_scale: Tensor, eps: float,
                         swizzled: bool, return_y: bool) -> tuple[Tensor, Tensor, Tensor]:
    validate.add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps, swizzled, return_y)
    out = call("add_rmsnorm_fp4quant", x=x, residual=residual, weight=weight, global_scale=global_scale,
               eps=eps, swizzled=swizzled, return_y=return_y)
    return (out[0], out[1], out[2] if return_y else x.new_empty(0))


@add_rmsnorm_fp4quant.register_fake
def _(x, residual, weight, global_scale, eps, swizzled, return_y):
    validate.add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps, swizzled, return_y)
    q, sf = _fp4_fake(x, x.shape[-1], swizzled)
    return q, sf, (torch.empty_like(x) if return_y else x.new_empty(0))


@torch.library.custom_op(f"{NS}::silu_mul_fp4quant", mutates_args=())
def silu_mul_fp4quant(x: Tensor, global_scale: Tensor, swizzled: bool) -> tuple[Tensor, Tensor]:
    validate.silu_mul_fp4quant(x, global_scale, swizzled)
    return call("silu_mul_fp4quant", x=x, global_scale=global_scale, swizzled=swizzled)


@silu_mul_fp4quant.register_fake
def _(x, global_scale, swizzled):
    validate.silu_mul_fp4quant(x, global_scale, swizzled)
    return _fp4_fake(x, x.shape[-1] // 2, swizzled)


# ---------------------------------------------------------------- MXFP4
@torch.library.custom_op(f"{NS}::mxfp4_quantize", mutates_args=())
def mxfp4_quantize(x: Tensor, swizzled: bool) -> tuple[Tensor, Tensor]:
    validate.mxfp4_quantize(x, swizzled)
    return call("mxfp4_quantize", x=x, swizzled=swizzled)


@mxfp4_quantize.register_fake
def _(x, swizzled):
    validate.mxfp4_quantize(x, swizzled)
    return _fp4_fake(x, x.shape[-1], swizzled, mx=True)


@torch.library.custom_op(f"{NS}::mxfp4_dequantize", mutates_args=())
def mxfp4_dequantize(q: Tensor, sf: Tensor, swizzled: bool) -> Tensor:
    validate.mxfp4_dequantize(q, sf, swizzled)
    return call("mxfp4_dequantize", q=q, sf=sf, swizzled=swizzled)


@mxfp4_dequantize.register_fake
def _(q, sf, swizzled):
    validate.mxfp4_dequantize(q, sf, swizzled)
    return q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32)


@torch.library.custom_op(f"{NS}::add_rmsnorm_mxfp4quant", mutates_args=("residual",))
def add_rmsnorm_mxfp4quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float, swizzled: bool,
                           return_y: bool) -> tuple[Tensor, Tensor, Tensor]:
    validate.add_rmsnorm_mxfp4quant(x, residual, weight, eps, swizzled, return_y)
    out = call("add_rmsnorm_mxfp4quant", x=x, residual=residual, weight=weight, eps=eps, swizzled=swizzled,
               return_y=return_y)
    return (out[0], out[1], out[2] if return_y else x.new_empty(0))


@add_rmsnorm_mxfp4quant.register_fake
def _(x, residual, weight, eps, swizzled, return_y):
    validate.add_rmsnorm_mxfp4quant(x, residual, weight, eps, swizzled, return_y)
    q, sf = _fp4_fake(x, x.shape[-1], swizzled, mx=True)
    return q, sf, (torch.empty_like(x) if return_y else x.new_empty(0))


@torch.library.custom_op(f"{NS}::silu_mul_mxfp4quant", mutates_args=())
def silu_mul_mxfp4quant(x: Tensor, swizzled: bool) -> tuple[Tensor, Tensor]:
    validate.silu_mul_mxfp4quant(x, swizzled)
    return call("silu_mul_mxfp4quant", x=x, swizzled=swizzled)


@silu_mul_mxfp4quant.register_fake
def _(x, swizzled):
    validate.silu_mul_mxfp4quant(x, swizzled)
    return _fp4_fake(x, x.shape[-1] // 2, swizzled, mx=True)


ALL_OPS = (
    rmsnorm, fused_add_rms_norm, rmsnorm_forward, rmsnorm_backward, layernorm, layernorm_backward,
    softmax_forward, softmax_backward, softmax_fwd_bwd, cross_entropy_forward, cross_entropy_backward,
    cross_entropy_backward_, cross_entropy_fwd_bwd, nvfp4_quantize, nvfp4_dequantize, add_rmsnorm_fp4quant,
    silu_mul_fp4quant, mxfp4_quantize, mxfp4_dequantize, add_rmsnorm_mxfp4quant, silu_mul_mxfp4quant,
)


# ---------------------------------------------------------------- autograd
def _rmsnorm_setup(ctx, inputs, output):
    x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype, weight_offset = inputs
    y, rstd, res_out = output
    if not store_rstd:
        raise RuntimeError("oink::rmsnorm_forward needs store_rstd=True to be differentiated")
    ctx.has_residual, ctx.has_bias = residual is not None, bias is not None
    ctx.normed_res_out = residual is not None or residual_dtype is not None  # the norm was of res_out
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype if residual is not None else None
    ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None
    ctx.weight_offset = weight_offset
    ctx.save_for_backward(res_out if ctx.normed_res_out else x, weight, rstd)


def _rmsnorm_backward(ctx, dy, drstd, dres_out):
    h, weight, rstd = ctx.saved_tensors
    dres = dres_out if ctx.normed_res_out and dres_out is not None and dres_out.numel() else None
    dh, dw, db = torch.ops.oink.rmsnorm_backward(h, weight, dy.contiguous(), rstd, dres, ctx.has_bias,
                                                 ctx.weight_offset)
    dx = dh.to(ctx.x_dtype)
    dresidual = dh.to(ctx.res_dtype) if ctx.has_residual else None
    if ctx.has_bias:  # db comes in the weight's shape and dtype: a [D] bias beside [H, D] weights sums heads
        shape, dtype = ctx.bias_meta
        db = db.reshape(-1, *shape).sum(0).to(dtype)
    else:
        db = None
    return (dx, dw if weight is not None else None, db, dresidual, None, None, None, None, None)


torch.library.register_autograd(f"{NS}::rmsnorm_forward", _rmsnorm_backward, setup_context=_rmsnorm_setup)


def _layernorm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, rstd, mean = output
    ctx.mark_non_differentiable(rstd, mean)  # statistics are outputs for reuse, not differentiated
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, rstd, mean, bias)


def _layernorm_backward(ctx, dy, _drstd, _dmean):
    x, weight, rstd, mean, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.oink.layernorm_backward(dy.contiguous(), x, weight, rstd, mean, bias)
    return dx, dw, (db if ctx.has_bias else None), None


torch.library.register_autograd(f"{NS}::layernorm", _layernorm_backward, setup_context=_layernorm_setup)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.oink.softmax_backward(dy.contiguous(), y)


torch.library.register_autograd(f"{NS}::softmax_forward", _softmax_backward, setup_context=_softmax_setup)


# Ops whose outputs are gradients, statistics or quantized codes: not differentiable. Their
# outputs are marked so; without this a call on inputs that require grad (e.g. Quack's
# cross_entropy_fwd under torch.compile) fails to compile, as AOTAutograd finds no formula.
def _mark_not_differentiable(ctx, inputs, output):
    outs = output if isinstance(output, (tuple, list)) else (output,)
    ctx.mark_non_differentiable(*outs)


def _not_differentiable(ctx, *grads):
    raise RuntimeError("this oink op is not differentiable (its outputs were marked so)")


for _op in (rmsnorm_backward, layernorm_backward, softmax_backward, softmax_fwd_bwd, cross_entropy_forward,
            cross_entropy_backward, cross_entropy_fwd_bwd, nvfp4_quantize, nvfp4_dequantize, silu_mul_fp4quant,
            mxfp4_quantize, mxfp4_dequantize, silu_mul_mxfp4quant):
    torch.library.register_autograd(_op, _not_differentiable, setup_context=_mark_not_differentiable)
