"""The fused per-head QK RMSNorm + rotary embedding (``qk_norm_rope``, vLLM's ``fused_qk_norm_rope``) in CuTeDSL.

A head's D values over ``lanes`` lanes of a warp (``head_lanes``: one 16-byte load a lane, so two 128-wide 16-bit
heads a warp), lane l holding [l E, l E + E), E = D / lanes; the sum of squares meets by a butterfly over those
lanes, the same order for every token (a row's bits never depend on the batch); n = x * (rstd * w) in fp32; then
the rotation by the position's cos/sin row, a lane's angles read as one chunk of each half: GPT-J's pairs lie
within a lane, a NeoX value's partner comes from the lane rotary_dim / (2 E) away (a shuffle); columns past
rotary_dim pass. One rounding, at the store (``oink.reference.rope``). A position outside the cache reads no
memory: its rotated values are NaN (never a silent answer; the eager path refuses it before the launch where
values are checked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .rope_rules import WARP, rotary_reason

WARPS = 4  # warps a CTA


@dataclass(frozen=True, slots=True)
class RopeKey:
    """What the kernel is compiled for (the token count, qkv's row stride, eps and the cache's length are runtime)."""
    dtype: str  # qkv's (float16, bfloat16)
    w_dtype: str  # the weights' (qkv's or float32)
    cache_dtype: str  # cos_sin_cache's (qkv's or float32)
    pos_dtype: str  # position_ids' (int32, int64)
    head_dim: int
    rotary_dim: int
    neox: bool
    heads_q: int
    heads_k: int
    arch: str
    weight_offset: float = 0.0  # y = n * (w + offset): Gemma's 1 + w
    out_of_place: bool = False  # q and k written to their own [T, H, D] tensors (else into qkv)
    lanes: int = WARP  # lanes a head (``head_lanes``)


class QKNormRope:
    def __init__(self, k: RopeKey):
        self.k = k
        self.dtype, self.w_dtype = cute_dtype(k.dtype), cute_dtype(k.w_dtype)
        self.cache_dtype, self.pos_dtype = cute_dtype(k.cache_dtype), cute_dtype(k.pos_dtype)
        self.D, self.lanes = k.head_dim, k.lanes
        self.E = k.head_dim // k.lanes
        self.half = k.rotary_dim // 2
        self.heads = k.heads_q + k.heads_k
        self.per_cta = WARPS * WARP // k.lanes  # heads a CTA
        self.pdl = config.get().pdl
        if WARP % k.lanes or k.head_dim % k.lanes or self.E % 2:
            raise ValueError(f"{k.lanes} lanes a head of {k.head_dim}: lanes must divide a warp, each an even count")
        why = rotary_reason(k.head_dim, k.rotary_dim, k.neox, k.lanes)
        if why:
            raise ValueError(why)

    def heads_view(self, ptr, T, H: int, ld):
        """(T, H, lane, E) view of heads of D values, rows ``ld`` apart."""
        return cute.make_tensor(ptr, cute.make_layout((T, H, self.lanes, self.E), stride=(ld, self.D, self.E, 1)))

    @cute.jit
    def __call__(self, pqkv: cute.Pointer, pq: Optional[cute.Pointer], pk: Optional[cute.Pointer],
                 pwq: cute.Pointer, pwk: cute.Pointer, pcache: cute.Pointer, ppos: cute.Pointer, T: Int32,
                 ld: Int64, positions: Int32, eps: Float32, stream: cuda.CUstream):
        mQKV = self.heads_view(pqkv, T, self.heads, cute.assume(ld, divby=self.E))
        mQ, mK = None, None
        if const_expr(pq is not None):
            mQ = self.heads_view(pq, T, self.k.heads_q, self.k.heads_q * self.D)
            mK = self.heads_view(pk, T, self.k.heads_k, self.k.heads_k * self.D)
        lanes = cute.make_layout((self.lanes, self.E), stride=(self.E, 1))
        mWq, mWk = cute.make_tensor(pwq, lanes), cute.make_tensor(pwk, lanes)
        # a position's row as (cos or sin, chunk, a chunk's values): a lane reads its angles' cos and sin chunks
        per = self.E if const_expr(self.k.neox) else self.E // 2
        rd = self.k.rotary_dim
        mCache = cute.make_tensor(pcache, cute.make_layout((positions, 2, self.half // per, per),
                                                           stride=(rd, self.half, per, 1)))
        mPos = cute.make_tensor(ppos, cute.make_layout((T,)))
        self.kernel(mQKV, mQ, mK, mWq, mWk, mCache, mPos, eps).launch(
            grid=[cute.ceil_div(T * self.heads, self.per_cta), 1, 1], block=[WARPS * WARP, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQKV: cute.Tensor, mQ: Optional[cute.Tensor], mK: Optional[cute.Tensor], mWq: cute.Tensor,
               mWk: cute.Tensor, mCache: cute.Tensor, mPos: cute.Tensor, eps: Float32):
        k, E, D, half, LP = self.k, self.E, self.D, self.half, self.lanes
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % LP  # within the head's lanes
        base = tidx % WARP - lane  # the head's first lane in the warp
        head_global = bidx * self.per_cta + tidx // LP
        T = cute.size(mQKV, mode=[0])
        t_out = head_global // self.heads
        h = head_global - t_out * self.heads
        # heads past the last token (a warp's last group) compute on the last token's values, stored nowhere: every
        # lane takes part in the shuffles
        t = cutlass.min(t_out, T - 1)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=E * self.dtype.width)
        if const_expr(self.pdl):  # launched early (PDL): no read before the kernel ahead has ended
            cute.arch.griddepcontrol_wait()
        gX = mQKV[t, h, lane, None]
        rX = cute.make_rmem_tensor_like(gX)
        cute.copy(atom, gX, rX)
        rW = cute.make_rmem_tensor_like(mWq[lane, None])
        if h < k.heads_q:  # (fp32 weights of a lane's 8 values: two loads)
            cute.autovec_copy(mWq[lane, None], rW)
        else:
            cute.autovec_copy(mWk[lane, None], rW)
        p = mPos[t]
        inside = p >= 0 and p < cute.size(mCache, mode=[0])
        row = cutlass.select_(inside, Int32(p), Int32(0))  # no read outside the cache
        # the lane's angles: NeoX, its chunk of the half (a partner lane hl away); GPT-J, its E / 2 pairs
        hl = half // E if const_expr(k.neox) else 0
        first = lane < hl
        if const_expr(k.neox):
            rotates = lane < 2 * hl
            chunk = cutlass.select_(first, lane, lane - hl)
        else:
            rotates = lane * E < k.rotary_dim
            chunk = lane
        chunk = cutlass.select_(rotates, chunk, Int32(0))
        rC = cute.make_rmem_tensor_like(mCache[row, 0, chunk, None])
        rS = cute.make_rmem_tensor_like(mCache[row, 1, chunk, None])
        cute.autovec_copy(mCache[row, 0, chunk, None], rC)
        cute.autovec_copy(mCache[row, 1, chunk, None], rS)

        x = rX.load().to(Float32)
        ss = (x * x).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        for i in cutlass.range_constexpr(LP.bit_length() - 1):  # offsets LP / 2 .. 1: one tree for every head
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=(LP // 2) >> i)
        rstd = cute.math.rsqrt(ss / Float32(D) + eps, fastmath=False)
        w = rW.load().to(Float32)
        if const_expr(k.weight_offset != 0.0):
            w = w + Float32(k.weight_offset)
        rN = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
        rN.store(x * (rstd * w))
        nan = Float32(float("nan"))
        rO = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
        if const_expr(k.neox):
            src = base + cutlass.select_(first, lane + hl, lane - hl)
            for e in cutlass.range_constexpr(E):
                n = rN[e]
                partner = cute.arch.shuffle_sync(n, offset=src)
                c = cutlass.select_(inside, rC[e].to(Float32), nan)
                s = cutlass.select_(inside, rS[e].to(Float32), nan)
                o = cutlass.select_(first, n * c - partner * s, n * c + partner * s)
                rO[e] = cutlass.select_(rotates, o, n)
        else:
            for e in cutlass.range_constexpr(0, E, 2):
                a, b = rN[e], rN[e + 1]
                c = cutlass.select_(inside, rC[e // 2].to(Float32), nan)
                s = cutlass.select_(inside, rS[e // 2].to(Float32), nan)
                rO[e] = cutlass.select_(rotates, a * c - b * s, a)
                rO[e + 1] = cutlass.select_(rotates, b * c + a * s, b)
        rY = cute.make_rmem_tensor_like(gX)
        rY.store(rO.load().to(self.dtype))
        if t_out < T:
            if const_expr(mQ is None):
                cute.copy(atom, rY, mQKV[t, h, lane, None])
            else:
                if h < k.heads_q:
                    cute.copy(atom, rY, mQ[t, h, lane, None])
                else:
                    cute.copy(atom, rY, mK[t, h - k.heads_q, lane, None])
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()


@memo
def compiled_qk_norm_rope(k: RopeKey):
    """Compile (or fetch) the fused QK norm + rotary embedding for ``k``."""
    E = k.head_dim // k.lanes
    dt, wd, cd = cute_dtype(k.dtype), cute_dtype(k.w_dtype), cute_dtype(k.cache_dtype)
    per = E if k.neox else E // 2  # a lane's cos (and sin) values, one chunk of the cache's row

    def build():
        out = gmem_ptr(dt, E * dt.width // 8) if k.out_of_place else None
        return compile_kernel(QKNormRope(k), gmem_ptr(dt, E * dt.width // 8), out, out,
                              gmem_ptr(wd, min(16, E * wd.width // 8)), gmem_ptr(wd, min(16, E * wd.width // 8)),
                              gmem_ptr(cd, min(16, per * cd.width // 8)),
                              gmem_ptr(cute_dtype(k.pos_dtype), 4 if k.pos_dtype == "int32" else 8), Int32(1),
                              Int64(E), Int32(1), Float32(1e-6), fake_stream(), arch=k.arch)

    return CACHE.get(("qk_norm_rope", k), build)
