"""FP4 quantization kernels in CuTeDSL: ``nvfp4_quantize``, ``silu_mul_fp4quant``, the fused
``add_rmsnorm_fp4quant`` (the RMSNorm forward kernel with this quantizing epilogue), and their
MXFP4 variants ``mxfp4_quantize``, ``silu_mul_mxfp4quant``, ``add_rmsnorm_mxfp4quant`` (blocks
of 32, power-of-two UE8M0 scales, no global scale): the same kernels with ``mx`` set.

Semantics are exactly ``oink.reference.nvfp4`` (bit-exact for the plain quantizers). Tiling: a
thread's unit is one scale block (two to eight 128-bit loads), so a block's amax,
its E4M3 scale and its eight code bytes are all computed in one thread's registers.
- E4M3 scale: the hardware ``cvt.rn.satfinite.e4m3x2.f32`` (SM89+: Hopper and Blackwell);
  satfinite clamps at 448 exactly as the reference's min(., 448); decoded back with
  ``cvt.rn.f16x2.e4m3x2`` (exact).
- E2M1 codes: on SM90 in software, branch-free, ~12 instructions a value: |v| is clamped to
  [0, 6] (NaN -> 0), rounded onto E2M1's grid by one fp32 add of a power of two chosen from
  its exponent (``e2m1_grid``), scaled by 2^-6 so that E2M1's subnormal lines up with E4M3's
  and given v's sign; the exact E4M3 conversion of that (two values a cvt) holds the code in
  bits 2-4 and the sign in bit 7, repacked eight to a word (``e2m1x8``). Checked against the
  reference's threshold count on every fp32 with exponent -10..5 and samples of the rest.
  On SM100 the hardware ``cvt.rn.satfinite.e2m1x2.f32`` gives the magnitudes; NaN lanes are
  then set to magnitude 0 to keep the reference's NaN policy (compile-checked only: no SM100
  GPU has run it).
- MXFP4 scale: the exponent field of the block's fp32 amax, minus 2, clamped to [-127, 127]
  (the reference's rule); v is multiplied by the exact power of two 2^-shared.
Codes are stored as 32-bit words (8 codes each, element 2j in the low nibble of byte j);
scales as one byte a block, row-major or in the 128x4 swizzled layout (``swizzled_offset``).
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32, const_expr
from cutlass.cutlass_dsl import T, dsl_user_op

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .launch_table import pick
from .reduction import RowKernelBase
from .nvfp4_rules import BLOCK, MX_BLOCK, fp4_launch
from .row_rules import MAX_N, RowLaunch
from .reduction import pure_asm as _asm
from .rmsnorm import RMSNormForward

ONE_SIXTH = 0.1666666716337204  # float32(1/6), as the reference uses it
MODES = ("quantize", "silu_mul")


@dsl_user_op
def e4m3_code(x: Float32, *, loc=None, ip=None) -> Int32:
    """float8_e4m3fn bits of x: round to nearest even, saturating at 448."""
    return Int32(_asm(T.i32(), "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.u32.u16 $0, t; }",
                      "=r,f,f", [Float32(x).ir_value(loc=loc, ip=ip), Float32(0.0).ir_value(loc=loc, ip=ip)],
                      loc, ip)) & 0xFF


@dsl_user_op
def e4m3_value(code: Int32, *, loc=None, ip=None) -> Float32:
    """The fp32 value of float8_e4m3fn bits (exact)."""
    return Float32(_asm(
        T.f32(),
        "{ .reg .b16 t, lo, hi; .reg .b32 h2; cvt.u16.u32 t, $1; cvt.rn.f16x2.e4m3x2 h2, t; "
        "mov.b32 {lo, hi}, h2; cvt.f32.f16 $0, lo; }",
        "=f,r", [Int32(code).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Uint32:
    return Uint32(_asm(T.i32(), "mov.b32 $0, $1;", "=r,f", [Float32(x).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def div_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """IEEE round-to-nearest division (the reference's fp32 ``/``), whatever the fast-math flags."""
    return Float32(_asm(T.f32(), "div.rn.f32 $0, $1, $2;", "=f,f,f",
                        [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def f32_from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(_asm(T.f32(), "mov.b32 $0, $1;", "=f,r", [Int32(bits).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def e2m1x2_hw(lo: Float32, hi: Float32, *, loc=None, ip=None) -> Uint32:
    """SM100: two E2M1 codes in one byte (lo in bits 0-3), hardware round-to-nearest-even."""
    return Uint32(_asm(T.i32(), "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $2, $1; cvt.u32.u8 $0, t; }",
                       "=r,f,f", [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                       loc, ip))


@dsl_user_op
def e2m1_grid(y: Float32, *, loc=None, ip=None) -> Float32:
    """y rounded to the E2M1 grid (nearest even, saturating at 6, NaN -> 0) times 2^-6, with y's
    sign: a value E4M3 holds exactly, whose bits are then the E2M1 code (see ``e2m1x8``).
    Rounding: adding m = 2^(22 + max(exponent of |y|, 0)) leaves exactly E2M1's grid step
    (0.5 below 2, 1 below 4, 2 above) as the sum's last bit, so the fp32 add rounds to it,
    ties to even as E2M1 does; subtracting m back is exact."""
    return Float32(_asm(
        T.f32(),
        "{ .reg .f32 a, m; .reg .b32 e, s; "
        "abs.f32 a, $1; max.f32 a, a, 0f00000000; min.f32 a, a, 0f40C00000; "
        "mov.b32 e, a; and.b32 e, e, 0x7F800000; add.s32 e, e, 0x0B000000; max.s32 e, e, 0x4A800000; "
        "mov.b32 m, e; add.rn.f32 a, a, m; sub.rn.f32 a, a, m; mul.rn.f32 a, a, 0f3C800000; "
        "mov.b32 e, $1; and.b32 s, e, 0x80000000; mov.b32 e, a; or.b32 e, e, s; mov.b32 $0, e; }",
        "=f,f", [Float32(y).ir_value(loc=loc, ip=ip)], loc, ip))


@dsl_user_op
def e2m1x8(g: list, *, loc=None, ip=None) -> Uint32:
    """Eight E2M1 codes in one word (element j in bits 4j..4j+3) from eight ``e2m1_grid`` values:
    E4M3 bytes s00ccc00 (exact conversions, two a cvt) become nibbles sccc, paired by a shift
    and gathered by one byte permute."""
    return Uint32(_asm(
        T.i32(),
        "{ .reg .b16 h0, h1, h2, h3; .reg .b32 w0, w1, t; "
        "cvt.rn.satfinite.e4m3x2.f32 h0, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h1, $4, $3; "
        "cvt.rn.satfinite.e4m3x2.f32 h2, $6, $5; cvt.rn.satfinite.e4m3x2.f32 h3, $8, $7; "
        "mov.b32 w0, {h0, h1}; mov.b32 w1, {h2, h3}; "
        "shr.b32 t, w0, 4; and.b32 t, t, 0x08080808; shr.b32 w0, w0, 2; and.b32 w0, w0, 0x07070707; "
        "or.b32 w0, w0, t; shr.b32 t, w0, 4; or.b32 w0, w0, t; "
        "shr.b32 t, w1, 4; and.b32 t, t, 0x08080808; shr.b32 w1, w1, 2; and.b32 w1, w1, 0x07070707; "
        "or.b32 w1, w1, t; shr.b32 t, w1, 4; or.b32 w1, w1, t; "
        "prmt.b32 $0, w0, w1, 0x6420; }",
        "=r,f,f,f,f,f,f,f,f", [Float32(v).ir_value(loc=loc, ip=ip) for v in g], loc, ip))


class Fp4Epilogue:
    """Quantize the fp32 values a thread holds (units of one scale block) and store the codes
    and scales. Mixed into row kernels whose launch has ``vec == block``."""

    arch: str
    swizzled: bool
    mx: bool = False  # MXFP4 (blocks of 32, UE8M0 scales) instead of NVFP4

    @property
    def block(self) -> int:
        return MX_BLOCK if self.mx else BLOCK

    def fp4_tensors(self, pq, psf, M):
        """Codes as uint32 words [M, N/8]; scales as bytes, [M, N/block] or the flat swizzled buffer."""
        N, K = self.launch.N, self.launch.N // self.block
        mQ = cute.make_tensor(pq, cute.make_layout((M, N // 8), stride=(N // 8, 1)))
        if const_expr(self.swizzled):
            mSF = cute.make_tensor(psf, cute.make_layout((cute.round_up(M, 128) * self.padded_cols(),)))
        else:
            mSF = cute.make_tensor(psf, cute.make_layout((M, K), stride=(K, 1)))
        return mQ, mSF

    def padded_cols(self) -> int:
        return -(-self.launch.N // self.block // 4) * 4

    @cute.jit
    def store_scale(self, mSF: cute.Tensor, row: Int32, k: Int32, code: Int32):
        if const_expr(self.swizzled):
            tile = (row // 128) * (self.padded_cols() // 4) + k // 4
            mSF[tile * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + (k % 4)] = Uint8(code)
        else:
            mSF[row, k] = Uint8(code)

    @cute.jit
    def block_scale(self, amax: Float32, gs):
        """-> (scale byte, multiplier s, whether the block's codes are all zero)."""
        if const_expr(self.mx):
            e = Int32((f32_bits(amax) >> 23) & 0xFF) - 127  # floor(log2 amax); 0 and subnormals: -127
            shared = cute.arch.fmin(cute.arch.fmax(Float32(e - 2), Float32(-127.0)), Float32(127.0))
            shared_i = Int32(shared)
            return shared_i + 127, f32_from_bits((127 - shared_i) << 23), amax == 0.0  # 2^-shared, normal
        code = e4m3_code(gs * (amax * ONE_SIXTH))
        sf = e4m3_value(code)
        return code, div_rn(gs, sf), sf == 0.0

    @cute.jit
    def quantize_store(self, rV: cute.Tensor, tXcX: cute.Tensor, row: Int32, M: Int32, gs,
                       mQ: cute.Tensor, mSF: cute.Tensor):
        """rV: this thread's fp32 values, shape (one-block unit, 1, units)."""
        L = self.launch
        B = self.block
        # a block's code words leave in one vector store (64 bits NVFP4, 128 MXFP4), not word by word
        rQ = cute.make_rmem_tensor(cute.make_layout((B // 8,)), Uint32)
        q_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=4 * B)
        for i in cutlass.range_constexpr(cute.size(rV, mode=[2])):
            col0 = tXcX[(0, 0), 0, i][1]
            if row < M and col0 < L.N:
                blk = rV[None, None, i]
                amax = Float32(0.0)
                for j in cutlass.range_constexpr(B):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(blk[j], -blk[j]))  # max.f32 skips NaN
                code, s, zero = self.block_scale(amax, gs)
                for w in cutlass.range_constexpr(B // 8):
                    word = Uint32(0)
                    if not zero:  # a zero scale (NVFP4) or a zero block (MXFP4) gives all-zero codes
                        if const_expr(self.arch.startswith("sm_100")):
                            for j in cutlass.range_constexpr(4):
                                lo, hi = blk[8 * w + 2 * j] * s, blk[8 * w + 2 * j + 1] * s
                                word = word | (self.hw_pair(lo, hi) << (8 * j))
                        else:
                            word = e2m1x8([e2m1_grid(blk[8 * w + j] * s) for j in range(8)])
                    rQ[w] = word
                cute.copy(q_atom, rQ, cute.local_tile(mQ, (1, B // 8), (row, col0 // B))[0, None])
                self.store_scale(mSF, row, col0 // B, code)

    @cute.jit
    def hw_pair(self, lo: Float32, hi: Float32) -> Uint32:
        """SM100 byte of two codes; NaN lanes become magnitude 0 with their sign (reference policy)."""
        byte = e2m1x2_hw(lo, hi)
        if lo != lo:
            byte = (byte & 0xF0) | ((f32_bits(lo) >> 28) & 0x8)
        if hi != hi:
            byte = (byte & 0x0F) | ((f32_bits(hi) >> 24) & 0x80)
        return byte


class Fp4Quantize(Fp4Epilogue, RowKernelBase):
    """nvfp4_quantize (v = x), silu_mul_fp4quant (v = silu(gate) * up, x = [gate | up]) and,
    with ``mx``, mxfp4_quantize and silu_mul_mxfp4quant."""

    def __init__(self, launch: RowLaunch, dtype, mode: str, swizzled: bool, arch: str, mx: bool = False):
        super().__init__(launch, num_reductions=0)
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        self.dtype, self.mode, self.swizzled, self.arch, self.mx = dtype, mode, swizzled, arch, mx

    @cute.jit
    def __call__(self, px: cute.Pointer, pgs: Optional[cute.Pointer], pq: cute.Pointer, psf: cute.Pointer,
                 M: Int32, ldx: Int64, stream: cuda.CUstream):
        mX = self.matrix(px, M, ldx)
        mUp = self.matrix(px + self.launch.N, M, ldx) if const_expr(self.mode == "silu_mul") else None
        mQ, mSF = self.fp4_tensors(pq, psf, M)
        mGS = cute.make_tensor(pgs, cute.make_layout((1,))) if const_expr(pgs is not None) else None
        self.launch_rows(self.kernel(mX, mUp, mGS, mQ, mSF, self.tiled_copy(self.dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mUp: Optional[cute.Tensor], mGS: Optional[cute.Tensor], mQ: cute.Tensor,
               mSF: cute.Tensor, tc: cute.TiledCopy):
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
        row = tXcX[0][0]
        rV, _ = self.load_values(mX, mUp, self.dtype, bidx, part, tXcX, row, M)
        gs = mGS[0] if const_expr(mGS is not None) else None
        self.quantize_store(rV, tXcX, row, M, gs, mQ, mSF)
        self.launch_dependents()


class AddRMSNormFp4(Fp4Epilogue, RMSNormForward):
    """add_rmsnorm_fp4quant: residual <- x + residual (in place), v = rmsnorm(residual) * weight
    in fp32, quantized; optionally y = v in x's dtype. The RMSNorm forward's ``normalize``. With
    ``mx``, add_rmsnorm_mxfp4quant."""

    def __init__(self, launch: RowLaunch, x_dtype, res_dtype, w_dtype, swizzled: bool, arch: str, store_y: bool,
                 mx: bool = False):
        RMSNormForward.__init__(self, launch, x_dtype, w_dtype, None, res_dtype, x_dtype, res_dtype, False)
        self.swizzled, self.arch, self.store_y, self.mx = swizzled, arch, store_y, mx

    @cute.jit
    def __call__(self, px: cute.Pointer, pres: cute.Pointer, pw: cute.Pointer, pgs: Optional[cute.Pointer],
                 py: Optional[cute.Pointer], pq: cute.Pointer, psf: cute.Pointer, M: Int32, ldx: Int64, ldres: Int64,
                 ldy: Int64, eps: Float32, stream: cuda.CUstream):
        mX = self.matrix(px, M, ldx)
        mRes = self.matrix(pres, M, ldres)
        mY = self.matrix(py, M, ldy) if const_expr(py is not None) else None
        mQ, mSF = self.fp4_tensors(pq, psf, M)
        mGS = cute.make_tensor(pgs, cute.make_layout((1,))) if const_expr(pgs is not None) else None
        self.launch_rows(self.kernel(mX, mRes, self.broadcast_rows(pw), mGS, mY, mQ, mSF, eps,
                                     self.tiled_copy(self.x_dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: cute.Tensor, mW: cute.Tensor, mGS: Optional[cute.Tensor],
               mY: Optional[cute.Tensor],
               mQ: cute.Tensor, mSF: cute.Tensor, eps: Float32, tc: cute.TiledCopy):
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
        row = tXcX[0][0]
        # the residual output aliases the residual: each element is read before it is written
        view = lambda m: part(m, bidx)  # noqa: E731  (a closure over this scope)
        v, rX, _, _ = self.normalize(mX, mW, None, mRes, mRes, eps, view, buf, mbar, part, tXcX, row, M, None)
        gs = mGS[0] if const_expr(mGS is not None) else None
        if const_expr(mY is not None):
            rY = cute.make_rmem_tensor_like(rX, self.x_dtype)
            rY.store(v.to(self.x_dtype))
            if row < M:
                self.copy_row(rY, part(mY, bidx), tXcX, self.x_dtype)
        rV = cute.make_rmem_tensor_like(rX, Float32)
        rV.store(v)
        self.quantize_store(rV, tXcX, row, M, gs, mQ, mSF)
        self.launch_dependents()


def _check_width(N: int, mx: bool) -> int:
    block = MX_BLOCK if mx else BLOCK
    if N % block or not block <= N <= MAX_N:
        raise ValueError(f"N={N}: the {'MX' if mx else 'NV'}FP4 kernels take a multiple of {block} up to {MAX_N}")
    return block


@dataclass(frozen=True, slots=True)
class Fp4Key:
    """What an FP4 quantizer is compiled for (M and strides are runtime). Built once where a launch is
    prepared, it is the memoized compile's one argument."""
    mode: str  # "quantize" or "silu_mul"
    dtype: str  # x's torch name
    N: int  # the quantized width (K for silu_mul)
    arch: str
    _: KW_ONLY
    swizzled: bool = False  # the scales in the swizzled (GEMM-ready) layout
    mx: bool = False  # MXFP4 (32-wide blocks, UE8M0 scales), not NVFP4


@dataclass(frozen=True, slots=True)
class AddRMSNormFp4Key:
    """What the fused add + RMSNorm + FP4 kernel is compiled for (M, strides and eps are runtime)."""
    x_dtype: str
    N: int
    arch: str
    _: KW_ONLY
    res_dtype: str
    w_dtype: str
    swizzled: bool = False
    store_y: bool = False  # the normalized rows stored too (in x's dtype)
    mx: bool = False


@memo
def compiled_add_rmsnorm_fp4(k: AddRMSNormFp4Key):
    """Compile (or fetch) the fused add + RMSNorm + FP4 kernel for ``k``."""
    x_dtype, res_dtype, w_dtype, N, arch = k.x_dtype, k.res_dtype, k.w_dtype, k.N, k.arch
    swizzled, store_y, mx = k.swizzled, k.store_y, k.mx
    block = _check_width(N, mx)
    xd, rd, wd = cute_dtype(x_dtype), cute_dtype(res_dtype), cute_dtype(w_dtype)
    launch = pick(f"fp4/add_rmsnorm/{block}", arch, fp4_launch(N, arch, "add_rmsnorm", block), config.get().fp4_upt)

    def build():
        one = Int64(launch.vec)
        return compile_kernel(AddRMSNormFp4(launch, xd, rd, wd, swizzled, arch, store_y, mx), gmem_ptr(xd),
                              gmem_ptr(rd), gmem_ptr(wd), None if mx else gmem_ptr(Float32, 4),
                              gmem_ptr(xd) if store_y else None, gmem_ptr(Uint32, 16), gmem_ptr(Uint8, 1), Int32(1),
                              one, one, one, Float32(1e-6), fake_stream(), arch=arch)

    return CACHE.get(("add_rmsnorm_fp4", mx, x_dtype, res_dtype, w_dtype, swizzled, store_y, N, arch, launch), build)


@memo
def compiled_fp4(k: Fp4Key):
    """Compile (or fetch) the FP4 quantizer for ``k``."""
    mode, dtype, N, arch, swizzled, mx = k.mode, k.dtype, k.N, k.arch, k.swizzled, k.mx
    block = _check_width(N, mx)
    dt = cute_dtype(dtype)
    launch = pick(f"fp4/{mode}/{block}", arch, fp4_launch(N, arch, mode, block), config.get().fp4_upt)

    def build():
        return compile_kernel(Fp4Quantize(launch, dt, mode, swizzled, arch, mx), gmem_ptr(dt),
                              None if mx else gmem_ptr(Float32, 4), gmem_ptr(Uint32, 16), gmem_ptr(Uint8, 1), Int32(1),
                              Int64(launch.vec), fake_stream(), arch=arch)

    return CACHE.get(("mxfp4" if mx else "nvfp4", mode, dtype, swizzled, N, arch, launch), build)

