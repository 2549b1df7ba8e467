"""FP8 (float8_e4m3fn) quantization kernels in CuTeDSL: ``fp8_quantize``, ``silu_mul_fp8quant``
and the RMSNorm forward with this quantizing epilogue (``rmsnorm_fp8quant``,
``add_rmsnorm_fp8quant``). Semantics are exactly ``oink.reference.fp8``.

Tiling: a thread's unit is 16 values (two or four 128-bit loads), whose 16 codes leave in one
128-bit store. A 1 x G group spans G / 16 adjacent lanes (the row tiling puts unit i of col-thread
t at column (i * threads_per_row + t) * 16), so its amax is a butterfly max over those lanes; a
row's amax (per token) is the row all-reduce. Scale arithmetic is IEEE (``div.rn``) like the
reference's fp32 ops; codes come from ``cvt.rn.satfinite.e4m3x2.f32`` (nearest even) after the
spec's clamp, whose min/max send NaN to +448.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .fp8_rules import UNIT, fp8_launch
from .nvfp4 import _asm, div_rn, f32_bits, f32_from_bits
from .reduction import RowKernelBase, add, fmax
from .row_rules import MAX_N, RowLaunch
from .rmsnorm import RMSNormForward

E4M3_MAX = 448.0
MIN_TOKEN_SCALE = 1.0 / (E4M3_MAX * 512.0)
GROUP_EPS = 1e-10
MODES = ("quantize", "silu_mul")


@dsl_user_op
def e4m3x4(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Uint32:
    """Four float8_e4m3fn codes in one word (a in the low byte): round to nearest even."""
    return Uint32(_asm(
        T.i32(),
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f", [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c, d)], loc, ip))


@dsl_user_op
def quotient_sat(v: Float32, y: Float32, s: Float32, bounded: bool = True, *, loc=None, ip=None) -> Float32:
    """sat(v / s) (``Fp8Epilogue.scaled``'s value) from y = div.rn(1, s) and s (0 where s is +inf), without a
    division: q = sat(v * y) (NaN -> +448), then Markstein's correction q + (v - s * q) * y, whose remainder is
    exact (two FMAs), then sat again. The same arithmetic as div.rn's own fast path (which also keeps s's
    reciprocal), with its range check left out: here s is at least 1e-10 / 448 and the quotient is clamped
    first, so the check's cases (denormal v, quotients far past 448, s = inf) give the same e4m3 code (checked
    against the IEEE quotient's code on 4e8 value/scale pairs and the special values; with s = inf, s
    passed as 0, finite v gives +-0 and inf gives NaN -> 448, as v / inf does). The remainder's sign
    is taken so that v = -0 gives -0. ``bounded``: |v| <= the amax s came from (no scale upper bound), so
    v * y stays within a few ulp of +-448: the first clamp (there for quotients past fp32's range: inf - inf) is
    left out, and of the last only min(q, 448) (NaN -> +448) is kept: q >= -448 - 1 ulp, which e4m3's
    round-to-nearest satfinite conversion takes to -448 as the clamp would."""
    clamp = "" if bounded else "min.f32 q, q, 0f43E00000; max.f32 q, q, 0fC3E00000; "
    last = "min.f32 $0, q, 0f43E00000; }" if bounded else "min.f32 q, q, 0f43E00000; max.f32 $0, q, 0fC3E00000; }"
    return Float32(_asm(
        T.f32(),
        "{ .reg .f32 q, r, nv; mul.rn.f32 q, $1, $2; " + clamp +
        "neg.f32 nv, $1; fma.rn.f32 r, $3, q, nv; neg.f32 r, r; fma.rn.f32 q, r, $2, q; " + last,
        "=f,f,f,f", [Float32(x).ir_value(loc=loc, ip=ip) for x in (v, y, s)], loc, ip))


@dsl_user_op
def finite_or_zero(s: Float32, *, loc=None, ip=None) -> Float32:
    """s, or 0 where s is +-inf (``quotient_sat``'s divisor)."""
    return Float32(_asm(T.f32(), "{ .reg .pred p; testp.infinite.f32 p, $1; selp.f32 $0, 0f00000000, $1, p; }",
                        "=f,f", [Float32(s).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def f16_round(a: Float32, *, loc=None, ip=None) -> Float32:
    """a rounded to float16 (nearest even) and back."""
    return Float32(_asm(T.f32(), "{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.f32.f16 $0, h; }", "=f,f",
                        [Float32(a).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def bf16_round2(a: Float32, b: Float32, *, loc=None, ip=None) -> Uint32:
    """a and b rounded to bfloat16 (nearest even) in one cvt: a in the low half, b in the high."""
    return Uint32(_asm(T.i32(), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
                       [Float32(x).ir_value(loc=loc, ip=ip) for x in (a, b)], loc, ip))


class Fp8Epilogue:
    """Quantize the fp32 values a thread holds (units of 16) and store codes and scales. Mixed into
    row kernels whose launch has ``vec == 16``; slot ``amax_slot`` is the per-token reduction's."""

    mode: str  # "static", "token", "group" or "block" (a group scaled by the token's rule: floor and bound)
    group_size: int
    column_major: bool
    ue8m0: bool
    amax_slot: int = 0

    @cute.jit
    def quantize_store(self, rV: cute.Tensor, tXcX: cute.Tensor, row: Int32, M: Int32, cy, mScale, mUb,
                       mQ: cute.Tensor, mS, buf, mbar, row_amax=None):
        """rV: this thread's fp32 values, shape (16, 1, units); mQ: codes as uint32 words [M, N/4];
        mS: the scales out (per token [M], per group [M, N/G] in its layout). ``row_amax``: per token, the
        row's amax where the caller has it (else reduced here from rV)."""
        L = self.launch
        units = cute.size(rV, mode=[2])
        rQ = cute.make_rmem_tensor(cute.make_layout((UNIT // 4,)), Uint32)
        q_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
        inv = Float32(0.0)
        s_row = Float32(0.0)
        y_row = Float32(0.0)
        sp_row = Float32(0.0)
        if const_expr(self.mode == "static"):
            inv = div_rn(Float32(1.0), mScale[0])
        if const_expr(self.mode == "token"):
            amax = row_amax
            if const_expr(row_amax is None):
                amax = Float32(0.0)
                for j in cutlass.range_constexpr(cute.size(rV)):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(rV[j], -rV[j]))  # max.f32 skips NaN
                amax = self.row_allreduce(amax, fmax, Float32(0.0), buf, mbar, self.amax_slot)
            if const_expr(mUb is not None):
                amax = cute.arch.fmin(amax, mUb[0])
            s_row = cute.arch.fmax(div_rn(amax, Float32(E4M3_MAX)), Float32(MIN_TOKEN_SCALE))
            leader = tXcX[0][1] == 0
            if const_expr(L.cluster_n > 1):
                leader = leader and cy == 0
            if leader and row < M:
                mS[row] = s_row
            y_row = div_rn(Float32(1.0), s_row)  # the divisor's reciprocal once a row (``quotient_sat``)
            sp_row = finite_or_zero(s_row)
        for i in cutlass.range_constexpr(units):
            col0 = tXcX[(0, 0), 0, i][1]
            unit = rV[None, None, i]
            s = s_row
            y = y_row
            sp = sp_row
            if const_expr(self.mode in ("group", "block")):
                amax = Float32(0.0)
                for j in cutlass.range_constexpr(UNIT):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(unit[j], -unit[j]))
                # every lane takes part (lanes past M or N hold zeros): the butterfly needs them all
                amax = cute.arch.warp_reduction(amax, fmax, threads_in_group=self.group_size // UNIT)
                if const_expr(self.mode == "group"):
                    s = div_rn(cute.arch.fmax(amax, Float32(GROUP_EPS)), Float32(E4M3_MAX))
                else:
                    if const_expr(mUb is not None):
                        amax = cute.arch.fmin(amax, mUb[0])
                    s = cute.arch.fmax(div_rn(amax, Float32(E4M3_MAX)), Float32(MIN_TOKEN_SCALE))
                if const_expr(self.ue8m0):  # up to a power of two: the exponent, plus one if any mantissa
                    bits = f32_bits(s)
                    up = ((bits & 0x7FFFFF) + 0x7FFFFF) >> 23  # 1 where the mantissa is not zero
                    s = f32_from_bits(Int32((((bits >> 23) & 0xFF) + up) << 23))
                y = div_rn(Float32(1.0), s)
                sp = finite_or_zero(s)
            if row < M and col0 < L.N:
                for w in cutlass.range_constexpr(UNIT // 4):
                    if const_expr(self.mode == "static"):
                        t = [self.scaled(unit[4 * w + j], inv) for j in range(4)]
                    else:
                        t = [quotient_sat(unit[4 * w + j], y, sp, const_expr(mUb is None)) for j in range(4)]
                    rQ[w] = e4m3x4(t[0], t[1], t[2], t[3])
                cute.copy(q_atom, rQ, cute.local_tile(mQ, (1, UNIT // 4), (row, col0 // UNIT))[0, None])
                if const_expr(self.mode in ("group", "block")):
                    lanes = self.group_size // UNIT
                    if (col0 // UNIT) % lanes == 0:
                        g = col0 // self.group_size
                        if const_expr(self.column_major):
                            mS[g * M + row] = s
                        else:
                            mS[row * (L.N // self.group_size) + g] = s

    @cute.jit
    def scaled(self, v: Float32, inv: Float32) -> Float32:
        """v times the static scale's reciprocal, clamped: min/max return the non-NaN operand, so NaN -> +448.
        (The token and group modes divide: ``quotient_sat``.)"""
        return cute.arch.fmax(cute.arch.fmin(v * inv, Float32(E4M3_MAX)), Float32(-E4M3_MAX))


def _scale_tensors(self, pscale, pub, ps, M):
    one = cute.make_layout((1,))
    mScale = cute.make_tensor(pscale, one) if const_expr(pscale is not None) else None
    mUb = cute.make_tensor(pub, one) if const_expr(pub is not None) else None
    mS = None
    if const_expr(ps is not None):
        n = M if const_expr(self.mode == "token") else M * (self.launch.N // self.group_size)
        mS = cute.make_tensor(ps, cute.make_layout((n,)))
    return mScale, mUb, mS


class Fp8Quantize(Fp8Epilogue, RowKernelBase):
    """fp8_quantize (v = x) and silu_mul_fp8quant (v = silu(gate) * up, x = [gate | up])."""

    def __init__(self, launch: RowLaunch, dtype, kind: str, mode: str, group_size: int, column_major: bool,
                 ue8m0: bool):
        if kind not in MODES:
            raise ValueError(f"kind {kind!r}: expected one of {MODES}")
        super().__init__(launch, num_reductions=1 if mode == "token" else 0)
        self.dtype, self.kind, self.mode = dtype, kind, mode
        self.group_size, self.column_major, self.ue8m0 = group_size, column_major, ue8m0

    @cute.jit
    def __call__(self, px: cute.Pointer, pscale: Optional[cute.Pointer], pub: Optional[cute.Pointer],
                 pq: cute.Pointer, ps: Optional[cute.Pointer], M: Int32, ldx: Int64, stream: cuda.CUstream):
        N = self.launch.N
        mX = self.matrix(px, M, ldx)
        mUp = self.matrix(px + N, M, ldx) if const_expr(self.kind == "silu_mul") else None
        mQ = cute.make_tensor(pq, cute.make_layout((M, N // 4), stride=(N // 4, 1)))
        mScale, mUb, mS = _scale_tensors(self, pscale, pub, ps, M)
        self.launch_rows(self.kernel(mX, mUp, mScale, mUb, mQ, mS, self.tiled_copy(self.dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mUp: Optional[cute.Tensor], mScale: Optional[cute.Tensor],
               mUb: Optional[cute.Tensor], mQ: cute.Tensor, mS: Optional[cute.Tensor], tc: cute.TiledCopy):
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
        row = tXcX[0][0]
        rV, _ = self.load_values(mX, mUp, self.dtype, bidx, part, tXcX, row, M)
        self.wait_cluster()  # the per-token amax may cross the CTAs of a cluster
        self.quantize_store(rV, tXcX, row, M, cy, mScale, mUb, mQ, mS, buf, mbar)
        self.launch_dependents()


class RMSNormFp8(Fp8Epilogue, RMSNormForward):
    """rmsnorm_fp8quant, and with a residual add_rmsnorm_fp8quant (residual <- x + residual in
    place): v = x's dtype(rmsnorm(h) * weight), quantized; optionally y = v. The RMSNorm forward's
    ``normalize``; per token ``weighted``, whose amax rides the norm's one round in slot 1.

    ``twice``: vLLM's value instead, v = to_T(to_T(h * rstd) * w) (rounded to x's dtype twice; per token its
    amax in a round of its own); ``raw_sum``: the norm of x + residual in fp32, the residual stored rounded."""

    amax_slot = 1

    def __init__(self, launch: RowLaunch, x_dtype, res_dtype, w_dtype, mode: str, group_size: int,
                 column_major: bool, ue8m0: bool, store_y: bool, twice: bool = False, raw_sum: bool = False):
        RMSNormForward.__init__(self, launch, x_dtype, w_dtype, None, res_dtype, x_dtype, res_dtype, False)
        self.num_reductions = 2
        self.mode, self.group_size, self.column_major, self.ue8m0 = mode, group_size, column_major, ue8m0
        self.store_y, self.twice, self.raw_sum = store_y, twice, raw_sum
        if twice and store_y:
            raise ValueError("twice-rounded values are not stored (vLLM's ops return codes only)")

    @cute.jit
    def __call__(self, px: cute.Pointer, pres: Optional[cute.Pointer], pw: cute.Pointer,
                 pscale: Optional[cute.Pointer], pub: Optional[cute.Pointer], py: Optional[cute.Pointer],
                 pq: cute.Pointer, ps: Optional[cute.Pointer], M: Int32, ldx: Int64, ldres: Int64, ldy: Int64,
                 eps: Float32, stream: cuda.CUstream):
        N = self.launch.N
        mX = self.matrix(px, M, ldx)
        mRes = self.matrix(pres, M, ldres) if const_expr(pres is not None) else None
        mY = self.matrix(py, M, ldy) if const_expr(py is not None) else None
        mQ = cute.make_tensor(pq, cute.make_layout((M, N // 4), stride=(N // 4, 1)))
        mScale, mUb, mS = _scale_tensors(self, pscale, pub, ps, M)
        self.launch_rows(self.kernel(mX, mRes, self.broadcast_rows(pw), mScale, mUb, mY, mQ, mS, eps,
                                     self.tiled_copy(self.x_dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: Optional[cute.Tensor], mW: cute.Tensor, mScale: Optional[cute.Tensor],
               mUb: Optional[cute.Tensor], mY: Optional[cute.Tensor], mQ: cute.Tensor, mS: Optional[cute.Tensor],
               eps: Float32, tc: cute.TiledCopy):
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
        row = tXcX[0][0]
        view = lambda m: part(m, bidx)  # noqa: E731
        if const_expr(self.twice):
            rV = self.twice_rounded(mX, mRes, mW, eps, view, buf, mbar, part, tXcX, row, M)
            amax = None
        else:
            rV, amax = self.once_rounded(mX, mRes, mW, mY, eps, view, buf, mbar, part, tXcX, row, M, bidx)
        self.quantize_store(rV, tXcX, row, M, cy, mScale, mUb, mQ, mS, buf, mbar, amax)
        self.launch_dependents()

    @cute.jit
    def once_rounded(self, mX: cute.Tensor, mRes: Optional[cute.Tensor], mW: cute.Tensor, mY: Optional[cute.Tensor],
                     eps: Float32, view, buf, mbar, part, tXcX: cute.Tensor, row: Int32, M: Int32, bidx):
        """The spec's values, v = to_T(rmsnorm(h) * w) in fp32 registers (T: x's dtype; stored to mY if given), and
        per token the row's amax of them, from the norm's one round (``weighted``); else None."""
        amax = None
        if const_expr(self.mode == "token"):
            v, rX, amax = self.weighted(mX, mRes, mW, eps, view, buf, mbar, part, tXcX, row, M)
        else:
            v, rX, _, _ = self.normalize(mX, mW, None, mRes, mRes, eps, view, buf, mbar, part, tXcX, row, M, None)
        rV = cute.make_rmem_tensor_like(rX, Float32)
        if const_expr(mY is None and self.x_dtype == cutlass.BFloat16):
            # rounded to bf16 two values a cvt (the conversion below takes one cvt a value)
            rV.store(v)
            for j in cutlass.range_constexpr(0, cute.size(rV), 2):
                w = bf16_round2(rV[j], rV[j + 1])
                rV[j] = f32_from_bits(Int32(w << 16))
                rV[j + 1] = f32_from_bits(Int32(w & 0xFFFF0000))
        else:
            rY = cute.make_rmem_tensor_like(rX, self.x_dtype)
            rY.store(v.to(self.x_dtype))  # the spec quantizes the output rounded to x's dtype
            if const_expr(mY is not None):
                if row < M:
                    self.copy_row(rY, part(mY, bidx), tXcX, self.x_dtype)
            rV.store(rY.load().to(Float32))
        if const_expr(amax is not None):
            amax = self.rounded(amax)
        return rV, amax

    @cute.jit
    def weighted(self, mX: cute.Tensor, mRes: Optional[cute.Tensor], mW: cute.Tensor, eps: Float32, view, buf,
                 mbar, part, tXcX: cute.Tensor, row: Int32, M: Int32):
        """The per-token ``normalize``: v = (h * w) * rstd, h * w (exact for 16-bit h and w) taken before the
        reduction round, the weight's registers free across it, and max |h * w| rides the round beside the sum
        of squares. fp32 rounding of p * rstd is monotone in |p|, so that max times rstd is the row's max |v|
        exactly (max.f32 skips NaN, as the amax does; a NaN product, from a NaN rstd or inf * 0, is a row of NaN
        or zero values: 0), and the amax needs no second round. -> (v in fp32, the x registers, that amax)."""
        h, rX, _, _, _, _, rW, _ = self.norm_inputs(mX, mW, None, mRes, mRes, view, part, tXcX, row, M, None)
        ss = (h * h).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        rP = cute.make_rmem_tensor_like(rX, Float32)
        rP.store(h * self.weight_values(rW))
        a = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(rP)):
            a = cute.arch.fmax(a, cute.arch.fmax(rP[j], -rP[j]))
        p = rP.load()
        ss, a = self.row_allreduce_pair(ss, a, add, Float32(0.0), buf, mbar, 0, self.amax_slot, op_b=fmax,
                                        init_b=Float32(0.0))
        rstd = cute.math.rsqrt(ss / self.n + eps, fastmath=False)
        amax = cute.arch.fmax(Float32(0.0), a * rstd)
        return p * rstd, rX, amax

    @cute.jit
    def twice_rounded(self, mX: cute.Tensor, mRes: Optional[cute.Tensor], mW: cute.Tensor, eps: Float32, view, buf,
                      mbar, part, tXcX: cute.Tensor, row: Int32, M: Int32):
        """vLLM's normalized values, v = to_T(to_T(h * rstd) * w) in fp32 registers (T: x's dtype)."""
        h, rX, _, _, _, _, rW, _ = self.norm_inputs(mX, mW, None, mRes, mRes, view, part, tXcX, row, M, None)
        ss = (h * h).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        rstd = cute.math.rsqrt(self.row_allreduce(ss, add, Float32(0.0), buf, mbar, 0) / self.n + eps,
                               fastmath=False)
        rY = cute.make_rmem_tensor_like(rX, self.x_dtype)
        rY.store((h * rstd).to(self.x_dtype))
        rY.store((rY.load().to(Float32) * self.weight_values(rW)).to(self.x_dtype))
        rV = cute.make_rmem_tensor_like(rX, Float32)
        rV.store(rY.load().to(Float32))
        return rV

    @cute.jit
    def rounded(self, a: Float32) -> Float32:
        """a rounded to x's dtype as the values are (nearest even; rounding is monotone, so the row's amax of the
        rounded values is its amax rounded)."""
        if const_expr(self.x_dtype == cutlass.BFloat16):
            return f32_from_bits(Int32(bf16_round2(a, a) & 0xFFFF0000))
        if const_expr(self.x_dtype == cutlass.Float16):
            return f16_round(a)
        return a


def _check_width(N: int, group_size: int) -> None:
    if N % UNIT or not UNIT <= N <= MAX_N or (group_size and N % group_size):
        raise ValueError(f"N={N}: the FP8 kernels take a multiple of {UNIT} (and of the group) up to {MAX_N}")


def _scale_ptrs(mode: str, ub: bool):
    """Fake pointers: the static scale, the per-token upper bound, the scales out."""
    return (gmem_ptr(Float32, 4) if mode == "static" else None, gmem_ptr(Float32, 4) if ub else None,
            None if mode == "static" else gmem_ptr(Float32, 4))


@dataclass(frozen=True, slots=True)
class Fp8Key:
    """What an FP8 quantizer is compiled for (M and strides are runtime). Built once where a launch is
    prepared, it is the memoized compile's one argument."""
    kind: str  # "quantize" or "silu_mul"
    dtype: str  # x's torch name
    N: int  # the quantized width (K for silu_mul)
    arch: str
    _: KW_ONLY
    mode: str  # "token", "group" or "static" (``mode_of``)
    group_size: int = 0  # a group's width ("group" mode)
    column_major: bool = False  # the group scales stored column-major
    ue8m0: bool = False  # scales rounded up to powers of two
    ub: bool = False  # a per-token scale upper bound read


@dataclass(frozen=True, slots=True)
class RMSNormFp8Key:
    """What the fused (add +) RMSNorm + FP8 kernel is compiled for (M, strides and eps are runtime)."""
    x_dtype: str
    N: int
    arch: str
    _: KW_ONLY
    w_dtype: str
    res_dtype: str | None = None  # the residual read and updated in place, if any
    mode: str  # as Fp8Key's
    group_size: int = 0
    column_major: bool = False
    ue8m0: bool = False
    ub: bool = False
    store_y: bool = False  # the normalized rows stored too (in x's dtype)
    twice: bool = False  # vLLM's values: to_T(to_T(h * rstd) * w) (``RMSNormFp8``)
    raw_sum: bool = False  # the norm of x + residual in fp32, the residual stored rounded


@memo
def compiled_fp8(k: Fp8Key):
    """Compile (or fetch) the FP8 quantizer for ``k``."""
    kind, dtype, N, arch, mode, group_size = k.kind, k.dtype, k.N, k.arch, k.mode, k.group_size
    column_major, ue8m0, ub = k.column_major, k.ue8m0, k.ub
    _check_width(N, group_size)
    dt = cute_dtype(dtype)
    launch = fp8_launch(N, arch, kind, group_size)

    def build():
        pscale, pub, ps = _scale_ptrs(mode, ub)
        return compile_kernel(Fp8Quantize(launch, dt, kind, mode, group_size, column_major, ue8m0), gmem_ptr(dt),
                              pscale, pub, gmem_ptr(Uint32, 16), ps, Int32(1), Int64(launch.vec), fake_stream(),
                              arch=arch)

    return CACHE.get(("fp8", kind, dtype, N, arch, mode, group_size, column_major, ue8m0, ub, launch), build)


@memo
def compiled_rmsnorm_fp8(k: RMSNormFp8Key):
    """Compile (or fetch) the fused RMSNorm + FP8 kernel for ``k`` (with a residual when ``k.res_dtype``)."""
    x_dtype, res_dtype, w_dtype, N, arch, mode = k.x_dtype, k.res_dtype, k.w_dtype, k.N, k.arch, k.mode
    group_size, column_major, ue8m0, ub, store_y = k.group_size, k.column_major, k.ue8m0, k.ub, k.store_y
    twice, raw_sum = k.twice, k.raw_sum
    _check_width(N, group_size)
    xd, wd = cute_dtype(x_dtype), cute_dtype(w_dtype)
    rd = cute_dtype(res_dtype) if res_dtype else None
    launch = fp8_launch(N, arch, "add_rmsnorm", group_size, "add_rmsnorm" if rd else "rmsnorm")

    def build():
        one = Int64(launch.vec)
        pscale, pub, ps = _scale_ptrs(mode, ub)
        return compile_kernel(RMSNormFp8(launch, xd, rd, wd, mode, group_size, column_major, ue8m0, store_y, twice,
                                         raw_sum),
                              gmem_ptr(xd), gmem_ptr(rd) if rd else None, gmem_ptr(wd), pscale, pub,
                              gmem_ptr(xd) if store_y else None, gmem_ptr(Uint32, 16), ps, Int32(1), one, one, one,
                              Float32(1e-6), fake_stream(), arch=arch)

    flags = (store_y, launch) if not (twice or raw_sum) else (store_y, twice, raw_sum, launch)  # old keys kept
    return CACHE.get(("rmsnorm_fp8", x_dtype, res_dtype, w_dtype, N, arch, mode, group_size, column_major, ue8m0, ub,
                      *flags), build)
