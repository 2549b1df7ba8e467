"""The FP4 and FP8 quantizing ops, declared as ``oink.ops`` declares the others (see ``oink.declare``):
NVFP4 / MXFP4 codes with their block scales, and FP8 in vLLM's scale modes, alone or fused after an
RMSNorm (with a residual add) or a SiLU-and-multiply. ``oink.ops`` imports this module, so each op is
``oink.<name>`` and ``torch.ops.oink.<op>`` like every other.
"""
from __future__ import annotations

import torch

from . import checks as c
from .declare import absent as _absent
from .declare import declare
from .reference import fp8 as fp8_spec
from .reference.nvfp4 import round_up


def nvfp4_kernels():
    """The FP4 kernels (imported on the first dispatch to a supported GPU: they import cutlass)."""
    from .kernels import nvfp4_ops

    return nvfp4_ops


def fp8_kernels():
    """The FP8 kernels (imported on the first dispatch to a supported GPU: they import cutlass)."""
    from .kernels import fp8_ops

    return fp8_ops


# ---------------------------------------------------------------- NVFP4 / MXFP4
def _fp4_fake(x, N: int, swizzled: bool, mx: bool = False):
    """Codes [M, N/2] and scales (NVFP4: E4M3 per 16; MXFP4: UE8M0 per 32) of an N-wide quantization."""
    M = x.numel() // x.shape[-1]
    K = N // (32 if mx else 16)
    q = x.new_empty((M, N // 2), dtype=torch.uint8)
    shape = (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu if mx else torch.float8_e4m3fn)


def _fake_add_rmsnorm_fp4(x, residual, weight, *rest, mx=False):
    swizzled, return_y = rest[-2:]
    q, sf = _fp4_fake(x, x.shape[-1], swizzled, mx)
    return q, sf, (torch.empty_like(x) if return_y else _absent(x))


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


def _gate_up(name, x, multiple_of):
    c.rows_input(name, x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim {x.shape[-1]} must be even (gate and up halves)")
    multiple_of(f"{name} (each half)", x.shape[-1] // 2)


def _with_y(o, a):
    return tuple(o) if a["return_y"] else tuple(o[:2])


@declare("nvfp4_quantize(Tensor x, Tensor global_scale, bool swizzled) -> (Tensor, Tensor)",
         kernels=nvfp4_kernels, fake=lambda x, g, swizzled: _fp4_fake(x, x.shape[-1], swizzled),
         to_public=lambda o, a: tuple(o))
def nvfp4_quantize(x, global_scale, swizzled=False):
    """NVFP4: E2M1 codes with an E4M3 scale per 16 values (rules: ``oink.reference.nvfp4``).

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 16 (leading dims flattened into M).
        global_scale: 1-element fp32 tensor on x's device (never read on the host).
        swizzled: scales in FlashInfer's 128x4 layout instead of row-major.

    Returns:
        (q, sf): q uint8 [M, N/2], two codes a byte (element 2j in the low nibble); sf
        float8_e4m3fn [M, N/16], or [round_up(M, 128), round_up(N/16, 4)] swizzled.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


@declare("nvfp4_dequantize(Tensor q, Tensor sf, Tensor global_scale, bool swizzled) -> Tensor", kernels=None,
         fake=lambda q, *a: q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32))
def nvfp4_dequantize(q, sf, global_scale, swizzled=False):
    """The values NVFP4 codes stand for: e2m1(code) * sf / global_scale, fp32 [M, N].

    Args:
        q, sf: codes and scales as ``nvfp4_quantize`` returns them.
        global_scale: the 1-element fp32 tensor they were quantized with.
        swizzled: sf is in the 128x4 layout.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _codes_and_scales(q, sf, swizzled, 16, torch.float8_e4m3fn)
    c.global_scale("global_scale", global_scale, q.device)


@declare("add_rmsnorm_fp4quant(Tensor x, Tensor(a!) residual, Tensor weight, Tensor global_scale, float eps, "
         "bool swizzled, bool return_y) -> (Tensor, Tensor, Tensor)",
         kernels=nvfp4_kernels, fake=_fake_add_rmsnorm_fp4, to_public=_with_y)
def add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps=1e-6, swizzled=False, return_y=False):
    """Fused add + RMSNorm + NVFP4: residual <- x + residual, then rmsnorm(residual) * weight quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 16.
        residual: x's shape; overwritten with the sum (in its dtype).
        weight: [N], any float dtype.
        global_scale, swizzled: as ``nvfp4_quantize``.
        eps: added to the mean of squares.
        return_y: also return the normalised values (fp32 arithmetic) in x's dtype.

    Returns:
        (q, sf) as ``nvfp4_quantize``, or (q, sf, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    c.fused_add_inputs(x, residual, weight)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


@declare("silu_mul_fp4quant(Tensor x, Tensor global_scale, bool swizzled) -> (Tensor, Tensor)", kernels=nvfp4_kernels,
         fake=lambda x, g, swizzled: _fp4_fake(x, x.shape[-1] // 2, swizzled), to_public=lambda o, a: tuple(o))
def silu_mul_fp4quant(x, global_scale, swizzled=False):
    """Fused SiLU-and-multiply + NVFP4: silu(x[..., :K]) * x[..., K:] in fp32, quantized.

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up), K a multiple of 16.
        global_scale, swizzled: as ``nvfp4_quantize``.

    Returns:
        (q, sf) of the [M, K] product, as ``nvfp4_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _gate_up("x", x, c.multiple_of_16)
    c.global_scale("global_scale", global_scale, x.device)


@declare("mxfp4_quantize(Tensor x, bool swizzled) -> (Tensor, Tensor)", kernels=nvfp4_kernels,
         fake=lambda x, swizzled: _fp4_fake(x, x.shape[-1], swizzled, mx=True), to_public=lambda o, a: tuple(o))
def mxfp4_quantize(x, swizzled=False):
    """MXFP4 (OCP MX): E2M1 codes, a power-of-two scale per 32 values, no global scale.

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 32.
        swizzled: scales in FlashInfer's 128x4 layout instead of row-major.

    Returns:
        (q, sf): q uint8 [M, N/2]; sf float8_e8m0fnu [M, N/32], or [round_up(M, 128),
        round_up(N/32, 4)] swizzled. The scale rule: ``oink.reference.nvfp4``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.multiple_of_32("x", x.shape[-1])


@declare("mxfp4_dequantize(Tensor q, Tensor sf, bool swizzled) -> Tensor", kernels=None,
         fake=lambda q, *a: q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32))
def mxfp4_dequantize(q, sf, swizzled=False):
    """The values MXFP4 codes stand for: e2m1(code) * 2^(sf - 127), fp32 [M, N].

    Args:
        q, sf: codes and scales as ``mxfp4_quantize`` returns them.
        swizzled: sf is in the 128x4 layout.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _codes_and_scales(q, sf, swizzled, 32, torch.float8_e8m0fnu)


@declare("add_rmsnorm_mxfp4quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool swizzled, "
         "bool return_y) -> (Tensor, Tensor, Tensor)",
         kernels=nvfp4_kernels, fake=lambda *a: _fake_add_rmsnorm_fp4(*a, mx=True), to_public=_with_y)
def add_rmsnorm_mxfp4quant(x, residual, weight, eps=1e-6, swizzled=False, return_y=False):
    """``add_rmsnorm_fp4quant`` quantizing to MXFP4 (``mxfp4_quantize``'s blocks and scales).

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 32.
        residual: x's shape; overwritten with x + residual.
        weight: [N], any float dtype.
        eps, swizzled, return_y: as ``add_rmsnorm_fp4quant``.

    Returns:
        (q, sf) as ``mxfp4_quantize``, or (q, sf, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    c.fused_add_inputs(x, residual, weight)
    c.multiple_of_32("x", x.shape[-1])


@declare("silu_mul_mxfp4quant(Tensor x, bool swizzled) -> (Tensor, Tensor)", kernels=nvfp4_kernels,
         fake=lambda x, swizzled: _fp4_fake(x, x.shape[-1] // 2, swizzled, mx=True), to_public=lambda o, a: tuple(o))
def silu_mul_mxfp4quant(x, swizzled=False):
    """``silu_mul_fp4quant`` quantizing to MXFP4 (``mxfp4_quantize``'s blocks and scales).

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up), K a multiple of 32.
        swizzled: scales in the 128x4 layout.

    Returns:
        (q, sf) of the [M, K] product, as ``mxfp4_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _gate_up("x", x, c.multiple_of_32)


# ---------------------------------------------------------------- FP8 (float8_e4m3fn codes, fp32 scales)
def _fp8_check(name, x, N, scale, group_size, column_major_scales, ue8m0, scale_ub):
    fp8_spec.check_args(N, scale, group_size, column_major_scales, ue8m0, scale_ub, name)
    if scale is not None:
        c.global_scale("scale", scale, x.device)
    if scale_ub is not None:
        c.global_scale("scale_ub", scale_ub, x.device)


def _fp8_fake(x, N, scale, group_size, column_major_scales):
    """Codes [..., N] float8_e4m3fn and the mode's fp32 scales (see ``oink.reference.fp8``)."""
    q = x.new_empty((*x.shape[:-1], N), dtype=torch.float8_e4m3fn)
    return q, fp8_spec.empty_scales(x, x.numel() // x.shape[-1], N, scale, group_size, column_major_scales)


def _fake_fp8_norm(x, *rest):
    scale, group_size, column_major_scales = rest[-6:-3]
    q, s = _fp8_fake(x, x.shape[-1], scale, group_size, column_major_scales)
    return q, s, (torch.empty_like(x) if rest[-1] else _absent(x))


_FP8_ARGS = "Tensor? scale, int group_size, bool column_major_scales, bool ue8m0, Tensor? scale_ub"


@declare(f"fp8_quantize(Tensor x, {_FP8_ARGS}) -> (Tensor, Tensor)", kernels=fp8_kernels,
         fake=lambda x, scale, g, cm, ue, ub: _fp8_fake(x, x.shape[-1], scale, g, cm), to_public=lambda o, a: tuple(o))
def fp8_quantize(x, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False, scale_ub=None):
    """FP8 (float8_e4m3fn) in vLLM's scale modes: static, per token (default) or per group.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        scale: 1-element fp32 tensor: a static scale (q = x * (1 / scale)); None otherwise.
        group_size: 0, or 64 / 128 for a scale per 1 x group_size (N a multiple of it).
        column_major_scales: per-group scales with strides (1, M) (DeepGEMM's layout).
        ue8m0: per-group scales rounded up to powers of two.
        scale_ub: 1-element fp32 bound on each row's amax (per token only), or None.

    Returns:
        (q, scales): q float8_e4m3fn in x's shape; scales fp32 [1] (static), [M, 1] (per token) or
        [M, N / group_size]. Rounding, scale floors and NaN: ``oink.reference.fp8``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"rmsnorm_fp8quant(Tensor x, Tensor weight, float eps, {_FP8_ARGS}, bool return_y) "
         "-> (Tensor, Tensor, Tensor)", kernels=fp8_kernels, fake=_fake_fp8_norm, to_public=_with_y)
def rmsnorm_fp8quant(x, weight, eps=1e-6, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False,
                     scale_ub=None, return_y=False):
    """Fused RMSNorm + FP8: y = rmsnorm(x) * weight, rounded to x's dtype, then quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        weight: [N], any float dtype.
        eps: added to the mean of squares.
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``.
        return_y: also return y.

    Returns:
        (q, scales) as ``fp8_quantize``, or (q, scales, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.same_device(x=x, weight=weight)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"add_rmsnorm_fp8quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, {_FP8_ARGS}, "
         "bool return_y) -> (Tensor, Tensor, Tensor)", kernels=fp8_kernels, fake=_fake_fp8_norm, to_public=_with_y)
def add_rmsnorm_fp8quant(x, residual, weight, eps=1e-6, scale=None, group_size=0, *, column_major_scales=False,
                         ue8m0=False, scale_ub=None, return_y=False):
    """Fused add + RMSNorm + FP8: vLLM's ``fused_add_rms_norm``, then y quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        residual: x's shape; overwritten with x + residual (in its dtype), which is normalised.
        weight: [N], any float dtype.
        eps: added to the mean of squares.
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``.
        return_y: also return y = rmsnorm(residual) * weight in x's dtype.

    Returns:
        (q, scales) as ``fp8_quantize``, or (q, scales, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    c.fused_add_inputs(x, residual, weight)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"silu_mul_fp8quant(Tensor x, {_FP8_ARGS}) -> (Tensor, Tensor)", kernels=fp8_kernels,
         fake=lambda x, scale, g, cm, ue, ub: _fp8_fake(x, x.shape[-1] // 2, scale, g, cm),
         to_public=lambda o, a: tuple(o))
def silu_mul_fp8quant(x, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False, scale_ub=None):
    """Fused SiLU-and-multiply + FP8: silu(x[..., :K]) * x[..., K:] in fp32, quantized.

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up).
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``
            (per group: K a multiple of group_size).

    Returns:
        (q [..., K], scales) as ``fp8_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1]} must be even (gate and up halves)")
    _fp8_check("x (each half)", x, x.shape[-1] // 2, scale, group_size, column_major_scales, ue8m0, scale_ub)
