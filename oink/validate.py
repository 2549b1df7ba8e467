"""Per-op input validation (metadata only, so it also runs on FakeTensors under torch.compile).

Each function takes the op's arguments by the reference's names and raises a TypeError or
ValueError naming the argument at fault.
"""
from __future__ import annotations

import torch

from . import checks as c
from .reference.cross_entropy import REDUCTIONS
from .reference.nvfp4 import round_up


def rmsnorm_forward(x, weight=None, bias=None, residual=None, eps=1e-6, store_rstd=False, out_dtype=None,
                    residual_dtype=None, weight_offset=0.0):
    c.rows_input("x", x)
    c.norm_param("weight", weight, x)
    c.norm_param("bias", bias, x)
    if bias is not None and bias.dim() == 2 and (weight is None or weight.dim() != 2):
        raise ValueError("bias: a per-head bias [H, D] needs a per-head weight [H, D]")
    c.optional("residual", residual)
    c.same_shape("residual", residual, "x", x)
    c.dtype_arg("out_dtype", out_dtype)
    c.dtype_arg("residual_dtype", residual_dtype)
    c.same_device(x=x, weight=weight, bias=bias, residual=residual)


def fused_add_rmsnorm_(x, residual, weight, eps=1e-6):
    c.rows_input("x", x)
    c.tensor("residual", residual)
    c.same_shape("residual", residual, "x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.same_device(x=x, residual=residual, weight=weight)


def rmsnorm_backward(x, weight, dout, rstd, dresidual_out=None, has_bias=False, has_residual=False,
                     weight_offset=0.0):
    c.rows_input("x", x)
    c.norm_param("weight", weight, x)
    c.tensor("dout", dout)
    c.same_shape("dout", dout, "x", x)
    c.row_stat("rstd", rstd, x.shape[:-1])
    c.optional("dresidual_out", dresidual_out)
    c.same_shape("dresidual_out", dresidual_out, "x", x)
    c.same_device(x=x, weight=weight, dout=dout, rstd=rstd, dresidual_out=dresidual_out)


def layernorm(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
    c.rows_input("x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.vector("bias", bias, x.shape[-1])
    c.same_device(x=x, weight=weight, bias=bias)


def layernorm_backward(dout, x, weight, rstd, mean, bias=None):
    c.rows_input("x", x)
    c.tensor("dout", dout)
    c.same_shape("dout", dout, "x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.vector("bias", bias, x.shape[-1])
    c.row_stat("rstd", rstd, x.shape[:-1])
    c.row_stat("mean", mean, x.shape[:-1])
    c.same_device(dout=dout, x=x, weight=weight, rstd=rstd, mean=mean, bias=bias)


def softmax_forward(x):
    c.rows_input("x", x)


def softmax_backward(dy, y):
    c.rows_input("y", y)
    c.tensor("dy", dy)
    c.same_shape("dy", dy, "y", y)
    c.same_device(dy=dy, y=y)


def softmax_fwd_bwd(dy, x):
    c.rows_input("x", x)
    c.tensor("dy", dy)
    c.same_shape("dy", dy, "x", x)
    c.same_device(dy=dy, x=x)


def _logits_target(logits, target):
    c.rows_input("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2 dims [M, V], got shape {tuple(logits.shape)}")
    c.tensor("target", target, c.INDEX_DTYPES)
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"target: expected shape ({logits.shape[0]},), got {tuple(target.shape)}")


def _class_weight(weight, logits):
    if weight is not None:
        c.vector("weight", weight, logits.shape[-1])
        c.same_device(logits=logits, weight=weight)


def cross_entropy_forward(logits, target, ignore_index=-100, reduction="none", weight=None, lse_partial=None,
                          target_logit=None):
    _logits_target(logits, target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {REDUCTIONS}")
    c.same_device(logits=logits, target=target)
    _class_weight(weight, logits)
    M = logits.shape[0]
    if lse_partial is not None:
        c.tensor("lse_partial", lse_partial, min_dim=2)
        if lse_partial.dim() != 2 or lse_partial.shape[0] != M:
            raise ValueError(f"lse_partial: expected shape ({M}, K), got {tuple(lse_partial.shape)}")
    if target_logit is not None:
        c.tensor("target_logit", target_logit)
        if target_logit.shape[0] != M or target_logit.dim() > 2:
            raise ValueError(f"target_logit: expected shape ({M},) or ({M}, V), got {tuple(target_logit.shape)}")
    c.same_device(logits=logits, lse_partial=lse_partial, target_logit=target_logit)


def _dloss(dloss, M):
    c.tensor("dloss", dloss, min_dim=0)
    if dloss.numel() not in (1, M) or dloss.dim() > 1:
        raise ValueError(f"dloss: expected a scalar or shape ({M},), got {tuple(dloss.shape)}")


def cross_entropy_backward(dloss, logits, target, lse, ignore_index=-100, weight=None):
    _logits_target(logits, target)
    _dloss(dloss, logits.shape[0])
    c.row_stat("lse", lse, logits.shape[:-1])
    c.same_device(dloss=dloss, logits=logits, target=target, lse=lse)
    _class_weight(weight, logits)


def cross_entropy_fwd_bwd(dloss, logits, target, ignore_index=-100, weight=None, return_lse=False):
    _logits_target(logits, target)
    _dloss(dloss, logits.shape[0])
    c.same_device(dloss=dloss, logits=logits, target=target)
    _class_weight(weight, logits)


def target_values(logits, target, ignore_index) -> None:
    """Value check (reads the data, so not for fake tensors): targets in [0, V) or ignored.
    It costs one host sync, which CUDA-graph capture forbids: while the stream is capturing it
    is skipped, and the kernels answer such a row with a NaN loss and NaN dlogits instead."""
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    V = logits.shape[-1]
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"target[{i}] = {int(target[i])} is outside [0, {V}) and is not ignore_index ({ignore_index})")


def nvfp4_quantize(x, global_scale, swizzled=False):
    c.rows_input("x", x)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


def nvfp4_dequantize(q, sf, global_scale, swizzled=False):
    _codes_and_scales(q, sf, swizzled, 16, torch.float8_e4m3fn)
    c.global_scale("global_scale", global_scale, q.device)


def _codes_and_scales(q, sf, swizzled, block, sf_dtype):
    c.tensor("q", q, (torch.uint8,), min_dim=2)
    c.tensor("sf", sf, (sf_dtype,), min_dim=2)
    if q.dim() != 2 or sf.dim() != 2:
        raise ValueError(f"q and sf must be 2-D, got {tuple(q.shape)} and {tuple(sf.shape)}")
    M, K = q.shape[0], q.shape[1] * 2 // block
    if (q.shape[1] * 2) % block:
        raise ValueError(f"q: {q.shape[1]} bytes a row is not a whole number of {block}-element blocks")
    want = (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)
    if tuple(sf.shape) != want:
        raise ValueError(f"sf: expected shape {want} for q of shape {tuple(q.shape)}, got {tuple(sf.shape)}")
    c.same_device(q=q, sf=sf)


def mxfp4_quantize(x, swizzled=False):
    c.rows_input("x", x)
    c.multiple_of_32("x", x.shape[-1])


def mxfp4_dequantize(q, sf, swizzled=False):
    _codes_and_scales(q, sf, swizzled, 32, torch.float8_e8m0fnu)


def add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps=1e-6, swizzled=False, return_y=False):
    fused_add_rmsnorm_(x, residual, weight, eps)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


def silu_mul_fp4quant(x, global_scale, swizzled=False):
    _gate_up("x", x, c.multiple_of_16)
    c.global_scale("global_scale", global_scale, x.device)


def _gate_up(name, x, multiple_of):
    c.rows_input(name, x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim {x.shape[-1]} must be even (gate and up halves)")
    multiple_of(f"{name} (each half)", x.shape[-1] // 2)


def add_rmsnorm_mxfp4quant(x, residual, weight, eps=1e-6, swizzled=False, return_y=False):
    fused_add_rmsnorm_(x, residual, weight, eps)
    c.multiple_of_32("x", x.shape[-1])


def silu_mul_mxfp4quant(x, swizzled=False):
    _gate_up("x", x, c.multiple_of_32)
