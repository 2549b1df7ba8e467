"""vLLM's fused RMSNorm + FP8 ops under vLLM's own names, schemas and out-parameter conventions, so an
engine calls ``torch.ops.oink.<name>`` where it calls ``torch.ops._C.<name>``; declared as ``oink.ops``
declares the others (see ``oink.declare``) and imported by it. Not public ``oink.<name>`` functions.

Every op writes its out-parameters in place and returns nothing. Arithmetic (vLLM's, in its order):
``oink.reference.vllm_fp8``; docs: docs/vllm-ops.md.

Paths: on a GPU, ``per_token_group_fp8_quant`` runs Oink's FP8 group kernel where its arithmetic is vLLM's, and
the four norm ops the fused FP8 norm kernel in vLLM's order (``to_T(to_T(x * rstd) * w)``, where Oink's own FP8
norms round once); the reference serves the rest and CPUs.
"""
from __future__ import annotations

import torch

from . import checks as c
from .declare import declare
from .ops_quant import fp8_kernels

FP8 = (torch.float8_e4m3fn,)
F32 = (torch.float32,)
BLOCK_GROUP_SIZES = (64, 128)  # vLLM's rms_norm_per_block_quant ("Unsupported group size" otherwise)


def _declare(schema: str, kernels=None):
    """``declare(schema, kernels=kernels, fake=<no outputs>, public=False)``; not batch-invariant where the reference
    serves a GPU (torch's reductions there split a row by the batch's size)."""
    return declare(schema, kernels=kernels, fake=lambda *a: None, public=False, batch_invariant=kernels is not None)


# ---------------------------------------------------------------- argument checks (metadata only)
def _contiguous(name: str, t) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (vLLM writes it row-major), got shape {tuple(t.shape)} "
                         f"with strides {tuple(t.stride())}")


def _norm_inputs(result, input, weight, residual=None) -> int:
    """result fp8 and contiguous in input's shape, weight [H] of input's dtype, residual likewise.
    -> the number of tokens (rows)."""
    c.rows_input("input", input)
    H = input.shape[-1]
    c.tensor("result", result, FP8)
    c.same_shape("result", result, "input", input)
    _contiguous("result", result)
    c.tensor("weight", weight)
    c.vector("weight", weight, H)
    if weight.dtype != input.dtype:  # vLLM's TORCH_CHECK: the kernels read weight as input's type
        raise TypeError(f"weight: dtype {weight.dtype} must equal input's {input.dtype}")
    if residual is not None:
        c.tensor("residual", residual)
        c.same_shape("residual", residual, "input", input)
        if residual.dtype != input.dtype:
            raise TypeError(f"residual: dtype {residual.dtype} must equal input's {input.dtype}")
        _contiguous("residual", residual)
    return input.numel() // H


def _one_value(name: str, t) -> None:
    """A 1-element fp32 scale (read on the device, never on the host)."""
    if t is None:
        return
    c.tensor(name, t, F32, min_dim=0)
    if t.numel() != 1:
        raise ValueError(f"{name}: expected a 1-element float32 tensor, got shape {tuple(t.shape)}")


def _group_size(group_size, H: int, allowed=None) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise TypeError(f"group_size: expected a positive int, got {group_size!r}")
    if allowed is not None and group_size not in allowed:
        raise ValueError(f"group_size: {group_size} is not supported (expected one of {allowed})")
    if H % group_size:
        raise ValueError(f"input: last dim {H} is not a multiple of group_size {group_size}")
    return H // group_size


def _scales_2d(name: str, s, T: int, G: int, transposed: bool, hint: str = "") -> None:
    """fp32 (T, G) scales whose strides place (t, g) where vLLM writes it: row-major t * G + g, or
    transposed g * stride(1) + t with stride(1) >= T (TMA-padded when larger; the pad rows stay)."""
    c.tensor(name, s, F32, min_dim=0)
    if s.dim() != 2 or tuple(s.shape) != (T, G):
        raise ValueError(f"{name}: expected a 2-D ({T}, {G}) float32 tensor (tokens x groups), got shape "
                         f"{tuple(s.shape)} ({s.numel()} elements)")
    st0, st1 = s.stride()
    if transposed:
        if (T > 1 and st0 != 1) or (G > 1 and st1 < T):
            raise ValueError(f"{name}: transposed scales need strides (1, >= {T}) for shape ({T}, {G}), got "
                             f"{(st0, st1)}")
    elif (G > 1 and st1 != 1) or (T > 1 and st0 != G):
        raise ValueError(f"{name}: row-major scales need strides ({G}, 1) for shape ({T}, {G}), got "
                         f"{(st0, st1)}{hint}")


# ---------------------------------------------------------------- the ops
@_declare("rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, Tensor scale, "
          "float epsilon) -> ()", kernels=fp8_kernels)
def rms_norm_static_fp8_quant(result, input, weight, scale, epsilon):
    """vLLM's ``rms_norm_static_fp8_quant``: result <- e4m3(sat(to_T(to_T(x * rstd) * w) * (1 / scale))).

    Args:
        result: float8_e4m3fn, input's shape, contiguous; written.
        input: [..., H], fp32, fp16 or bf16; rows may be strided.
        weight: [H], input's dtype.
        scale: 1-element fp32 (the static per-tensor scale).
        epsilon: added to the mean of squares.

    Path: on a GPU, the fused FP8 norm kernel with vLLM's values (``oink.kernels.fp8_ops.CHECKS`` says where not); the
    reference (``oink.reference.vllm_fp8``) otherwise.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names it).
    """
    _norm_inputs(result, input, weight)
    _one_value("scale", scale)
    c.same_device(input=input, result=result, weight=weight, scale=scale)


@_declare("fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor! residual, "
          "Tensor weight, Tensor scale, float epsilon) -> ()", kernels=fp8_kernels)
def fused_add_rms_norm_static_fp8_quant(result, input, residual, weight, scale, epsilon):
    """vLLM's ``fused_add_rms_norm_static_fp8_quant``: z = to_T(input + residual); residual <- z; result as
    ``rms_norm_static_fp8_quant`` of z. ``input`` is not written (unlike ``fused_add_rms_norm``).

    Args:
        result: float8_e4m3fn, input's shape, contiguous; written.
        input: [..., H], fp32, fp16 or bf16; rows may be strided.
        residual: input's shape and dtype, contiguous; overwritten with z.
        weight: [H], input's dtype.
        scale: 1-element fp32.
        epsilon: added to the mean of squares.

    Path: on a GPU, the fused FP8 norm kernel with vLLM's values (``oink.kernels.fp8_ops.CHECKS`` says where not); the
    reference (``oink.reference.vllm_fp8``) otherwise.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names it).
    """
    _norm_inputs(result, input, weight, residual)
    _one_value("scale", scale)
    c.same_device(input=input, result=result, residual=residual, weight=weight, scale=scale)


@_declare("rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, "
          "float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()", kernels=fp8_kernels)
def rms_norm_dynamic_per_token_quant(result, input, weight, scale, epsilon, scale_ub=None, residual=None):
    """vLLM's ``rms_norm_dynamic_per_token_quant``: h = input (+ residual) in fp32, residual <- to_T(h);
    n = to_T(to_T(h * rstd) * w); s = fmax(fmin(amax|n|, scale_ub) / 448, 1 / (448 * 512)) per token;
    result <- e4m3(sat(n / s)), scale <- s.

    Args:
        result: float8_e4m3fn, input's shape, contiguous; written.
        input: [..., H], fp32, fp16 or bf16; rows may be strided.
        weight: [H], input's dtype.
        scale: fp32 with one element per token (vLLM allocates (T, 1)); written.
        epsilon: added to the mean of squares.
        scale_ub: 1-element fp32 upper bound on each token's amax, or None.
        residual: input's shape and dtype, contiguous, or None; overwritten with to_T(input + residual).

    Path: on a GPU, the fused FP8 norm kernel with vLLM's values (``oink.kernels.fp8_ops.CHECKS`` says where not); the
    reference (``oink.reference.vllm_fp8``) otherwise.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names it).
    """
    T = _norm_inputs(result, input, weight, residual)
    c.tensor("scale", scale, F32, min_dim=0)
    if scale.numel() != T:
        raise ValueError(f"scale: expected {T} elements (one fp32 scale per token), got shape {tuple(scale.shape)}")
    _one_value("scale_ub", scale_ub)
    c.same_device(input=input, result=result, weight=weight, scale=scale, scale_ub=scale_ub, residual=residual)


@_declare("rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, "
          "float epsilon, Tensor? scale_ub, Tensor!? residual, int group_size, bool is_scale_transposed, "
          "bool scale_ue8m0=False) -> ()", kernels=fp8_kernels)
def rms_norm_per_block_quant(result, input, weight, scale, epsilon, scale_ub=None, residual=None, group_size=128,
                             is_scale_transposed=False, scale_ue8m0=False):
    """vLLM's ``rms_norm_per_block_quant``: ``rms_norm_dynamic_per_token_quant`` with one scale per group of
    ``group_size`` columns of a token (same floor and scale_ub), codes e4m3(sat(n / s_g)).

    Args:
        result: float8_e4m3fn, input's shape, contiguous; written.
        input: [..., H], fp32, fp16 or bf16, H a multiple of group_size; rows may be strided.
        weight: [H], input's dtype.
        scale: fp32 (T, G), G = H / group_size; written. Row-major, or with ``is_scale_transposed``
            strides (1, S), S >= T (S = T plain, round_up(T, 4) TMA-aligned: rows T..S-1 are not written).
        epsilon: added to the mean of squares.
        scale_ub: 1-element fp32 upper bound on each group's amax, or None.
        residual: as ``rms_norm_dynamic_per_token_quant``.
        group_size: 64 or 128.
        is_scale_transposed: the scale layout above.
        scale_ue8m0: scales rounded up to powers of two (vllm-xpu-kernels' flag; upstream vLLM's CUDA op
            has none, so it defaults to False).

    Path: on a GPU, the fused FP8 norm kernel with vLLM's values (``oink.kernels.fp8_ops.CHECKS`` says where not); the
    reference (``oink.reference.vllm_fp8``) otherwise.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names it).
    """
    T = _norm_inputs(result, input, weight, residual)
    G = _group_size(group_size, input.shape[-1], BLOCK_GROUP_SIZES)
    _scales_2d("scale", scale, T, G, is_scale_transposed, " (strided scales need is_scale_transposed=True)")
    _one_value("scale_ub", scale_ub)
    c.same_device(input=input, result=result, weight=weight, scale=scale, scale_ub=scale_ub, residual=residual)


@_declare("per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, int group_size, "
          "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed=False, "
          "bool dummy_is_tma_aligned=False) -> ()", kernels=fp8_kernels)
def per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max, scale_ue8m0,
                              dummy_is_scale_transposed=False, dummy_is_tma_aligned=False):
    """vLLM's ``per_token_group_fp8_quant``: per group of ``group_size`` values of a row, a = fmax(eps,
    amax|x|), s = a / fp8_max (``scale_ue8m0``: 2^ceil(log2(fmax(s, 1e-10)))), output_q <- e4m3(clamp(x / s,
    fp8_min, fp8_max)), output_s <- s.

    Args:
        input: [..., H], fp32, fp16 or bf16, H a multiple of group_size.
        output_q: float8_e4m3fn, input's shape, contiguous; written.
        output_s: fp32 (T, G), G = H / group_size; written. Row-major, or column-major (stride(0) <
            stride(1)): strides (1, S), S >= T (S = round_up(T, 4) TMA-aligned: rows T..S-1 are not written).
        group_size: any positive divisor of H (64 and 128 in practice).
        eps: the amax floor (vLLM passes 1e-10).
        fp8_min, fp8_max: the clamp bounds (-448, 448 for e4m3fn).
        scale_ue8m0: scales rounded up to powers of two (DeepGEMM's UE8M0).
        dummy_is_scale_transposed, dummy_is_tma_aligned: ignored, as vLLM's kernel ignores them (they let
            vLLM's compiler match the op for fusion); the layout comes from output_s's strides.

    Path: on a GPU, Oink's FP8 group kernel (``fp8_quantize``'s, the same arithmetic) for fp8_min, fp8_max and eps
    -448, 448 and 1e-10 without UE8M0 and a group of 64 or 128; the reference otherwise (the ``oink.dispatch``
    logger says why at DEBUG level), and on a CPU.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names it).
    """
    c.rows_input("input", input)
    c.tensor("output_s", output_s, F32, min_dim=0)
    c.tensor("output_q", output_q, FP8)
    c.same_shape("output_q", output_q, "input", input)
    _contiguous("output_q", output_q)
    G = _group_size(group_size, input.shape[-1])
    T = input.numel() // input.shape[-1]
    # vLLM reads the layout off the strides: column-major where stride(0) < stride(1)
    col = output_s.dim() == 2 and output_s.stride(0) < output_s.stride(1)
    _scales_2d("output_s", output_s, T, G, col)
    c.same_device(input=input, output_q=output_q, output_s=output_s)
