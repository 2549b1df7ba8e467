"""2^z on the FMA and integer pipes (``exp2_fma``, ``exp2_affine_fma``), for kernels bound by the
special-function unit that ``cute.math.exp2`` takes (16 a clock a SM on sm_90): the softcapped
cross-entropy kernels compute part of their exps here."""
from __future__ import annotations

import math
import struct

from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from .reduction import pure_asm

# 2^f on [-1/2, 1/2] by degree, fitted for minimax relative error (fp32 Horner: degree 5 2.4e-7, about the
# special-function unit's ex2.approx; degree 4 2.7e-6); float32 bit patterns, highest degree first
_EXP2_POLY = {
    4: ("0f3C1CCBEB", "0f3D650A20", "0f3E76036D", "0f3F31706E", "0f3F7FFFF4"),
    5: ("0f3AAE062E", "0f3C1E862E", "0f3D635B6E", "0f3E75FC8C", "0f3F317214", "0f3F800001"),
}


@dsl_user_op
def exp2_fma(z: Float32, *, degree: int = 5, clamp: bool = True, loc=None, ip=None) -> Float32:
    """2^z on the FMA and integer pipes, where ``cute.math.exp2`` takes the special-function unit (16 a
    clock a SM on sm_90): a kernel bound by that unit computes part of its exps here. z rounds to an
    integer j (a magic-number add), 2^(z - j) is a polynomial of ``degree`` (4 or 5) and 2^j a float built
    from j's bits that multiplies it, so a NaN stays NaN. With ``clamp``, z below -126.5 (-inf included)
    gives 0; without, z must be at least -126.5 (one instruction fewer, for callers whose z is bounded).
    z must be below 127.5."""
    c = _EXP2_POLY[degree]
    horner = "".join(f"fma.rn.f32 p, p, f, {k}; " for k in c[2:])
    lower = "max.NaN.f32 f, $1, 0fC2FE0000; " if clamp else "mov.f32 f, $1; "  # -127: 2^j's bits then 0
    ptx = ("{ .reg .f32 t, j, f, p; .reg .b32 b; " + lower +
           "add.rn.f32 t, f, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; sub.rn.f32 f, f, j; "  # j, z - j
           f"fma.rn.f32 p, f, {c[0]}, {c[1]}; {horner}"
           "mov.b32 b, t; shl.b32 b, b, 23; add.s32 b, b, 0x3F800000; mov.b32 t, b; "  # 2^j: t's low bits hold j
           "mul.rn.f32 $0, p, t; }")
    return Float32(pure_asm(T.f32(), ptx, "=f,f", [Float32(z).ir_value(loc=loc, ip=ip)], loc, ip))


def _f32_bits(v: float) -> str:
    """v rounded to fp32, as a PTX literal."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


@dsl_user_op
def exp2_affine_fma(u: Float32, scale: float, shift: float, *, degree: int = 4, loc=None, ip=None) -> Float32:
    """2^(u scale - shift) for compile-time ``scale`` and ``shift`` on the FMA and integer pipes, as ``exp2_fma``
    but with the affine argument folded in: u scale rounds to an integer j inside an FMA (the magic number its
    addend), 2^(u scale - j) is the polynomial with 2^(n - shift) (n = ceil(shift)) folded into its coefficients,
    and 2^(j - n) a float built from j's bits that multiplies it (so a NaN stays NaN): 9 instructions where the
    argument's FMA and ``exp2_fma`` take 10. For |u scale| <= 64 and 0 <= shift <= 64 (2^(j - n) stays normal)."""
    if not (0.0 <= shift <= 64.0 and abs(scale) <= 64.0):
        raise ValueError(f"exp2_affine_fma: scale {scale} and shift {shift} must lie in [-64, 64] and [0, 64]")
    n = math.ceil(shift)
    c = [_f32_bits(struct.unpack(">f", bytes.fromhex(k[2:]))[0] * 2.0 ** (n - shift)) for k in _EXP2_POLY[degree]]
    horner = "".join(f"fma.rn.f32 p, p, f, {k}; " for k in c[2:])
    ptx = ("{ .reg .f32 r, nj, f, p; .reg .b32 b; "
           f"fma.rn.f32 r, $1, {_f32_bits(scale)}, 0f4B400000; "  # r's low bits hold j
           "sub.rn.f32 nj, 0f4B400000, r; "  # -j
           f"fma.rn.f32 f, $1, {_f32_bits(scale)}, nj; "  # u scale - j, one rounding
           f"fma.rn.f32 p, f, {c[0]}, {c[1]}; {horner}"
           f"mov.b32 b, r; shl.b32 b, b, 23; add.s32 b, b, {0x3F800000 - (n << 23)}; mov.b32 r, b; "  # 2^(j - n)
           "mul.rn.f32 $0, p, r; }")
    return Float32(pure_asm(T.f32(), ptx, "=f,f", [Float32(u).ir_value(loc=loc, ip=ip)], loc, ip))
