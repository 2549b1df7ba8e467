"""The fused per-head QK RMSNorm + rotary embedding (``qk_norm_rope``, vLLM's ``fused_qk_norm_rope``) in CuTeDSL.

One warp a (token, head) of q and k: lane l holds the head's E = D / 32 consecutive values [l E, l E + E) (one
load of 4, 8 or 16 bytes); the sum of squares meets by a butterfly over the warp, the same order for every
token (a row's bits never depend on the batch); n = x * (rstd * w) in fp32; then the rotation by the position's
cos/sin row: GPT-J's pairs lie within a lane, a NeoX value's partner comes from the lane rotary_dim / (2 E) away
(a shuffle); columns past rotary_dim pass. One rounding, at the store (``oink.reference.rope``). A position
outside the cache reads no memory: its rotated values are NaN (never a silent answer; the eager path refuses it
before the launch where values are checked).
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

WARP = 32
WARPS = 4  # heads a CTA: at decode sizes (a token's 40-80 heads) the grid still spans 10-20 SMs


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


def rotary_reason(head_dim: int, rotary_dim: int, neox: bool) -> str | None:
    """Why a rotary width goes to the reference, or None: a NeoX half must be whole lanes (a lane's values all
    rotate with the same partner lane)."""
    E = head_dim // WARP
    if neox and (rotary_dim // 2) % E:
        return f"rotary_dim {rotary_dim}: half of it is not a multiple of head_dim / 32 = {E} (NeoX pairs lanes)"
    return None


class QKNormRope:
    def __init__(self, k: RopeKey):
        self.k = k
        self.dtype, self.w_dtype = cute_dtype(k.dtype), cute_dtype(k.w_dtype)
        self.cache_dtype, self.pos_dtype = cute_dtype(k.cache_dtype), cute_dtype(k.pos_dtype)
        self.D, self.E = k.head_dim, k.head_dim // WARP
        self.half = k.rotary_dim // 2
        self.heads = k.heads_q + k.heads_k
        self.pdl = config.get().pdl
        why = rotary_reason(k.head_dim, k.rotary_dim, k.neox)
        if why:
            raise ValueError(why)

    def heads_view(self, ptr, T, H: int, ld):
        """(T, H, lane, E) view of heads of D values, rows ``ld`` apart."""
        return cute.make_tensor(ptr, cute.make_layout((T, H, WARP, self.E), stride=(ld, self.D, self.E, 1)))

    @cute.jit
    def __call__(self, pqkv: cute.Pointer, pq: Optional[cute.Pointer], pk: Optional[cute.Pointer],
                 pwq: cute.Pointer, pwk: cute.Pointer, pcache: cute.Pointer, ppos: cute.Pointer, T: Int32,
                 ld: Int64, positions: Int32, eps: Float32, stream: cuda.CUstream):
        mQKV = self.heads_view(pqkv, T, self.heads, cute.assume(ld, divby=self.E))
        mQ, mK = None, None
        if const_expr(pq is not None):
            mQ = self.heads_view(pq, T, self.k.heads_q, self.k.heads_q * self.D)
            mK = self.heads_view(pk, T, self.k.heads_k, self.k.heads_k * self.D)
        lanes = cute.make_layout((WARP, self.E), stride=(self.E, 1))
        mWq, mWk = cute.make_tensor(pwq, lanes), cute.make_tensor(pwk, lanes)
        mCache = cute.make_tensor(pcache, cute.make_layout((positions, self.k.rotary_dim),
                                                           stride=(self.k.rotary_dim, 1)))
        mPos = cute.make_tensor(ppos, cute.make_layout((T,)))
        self.kernel(mQKV, mQ, mK, mWq, mWk, mCache, mPos, eps).launch(
            grid=[cute.ceil_div(T * self.heads, WARPS), 1, 1], block=[WARPS * WARP, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mQKV: cute.Tensor, mQ: Optional[cute.Tensor], mK: Optional[cute.Tensor], mWq: cute.Tensor,
               mWk: cute.Tensor, mCache: cute.Tensor, mPos: cute.Tensor, eps: Float32):
        k, E, D, half = self.k, self.E, self.D, self.half
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        head_global = bidx * WARPS + tidx // WARP
        T = cute.size(mQKV, mode=[0])
        t = head_global // self.heads
        h = head_global - t * self.heads
        bits = E * self.dtype.width
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=bits)
        if const_expr(self.pdl):  # launched early (PDL): no read before the kernel ahead has ended
            cute.arch.griddepcontrol_wait()
        if t < T:  # warp-uniform: every lane of a warp has the same head
            gX = mQKV[t, h, lane, None]
            rX = cute.make_rmem_tensor_like(gX)
            cute.copy(atom, gX, rX)
            rW = cute.make_rmem_tensor_like(mWq[lane, None])
            if h < k.heads_q:  # (up to 32 bytes a lane: fp32 weights of 256-wide heads take two loads)
                cute.autovec_copy(mWq[lane, None], rW)
            else:
                cute.autovec_copy(mWk[lane, None], rW)
            x = rX.load().to(Float32)
            ss = (x * x).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
            for i in cutlass.range_constexpr(5):  # offsets 16, 8, 4, 2, 1: the same tree for every head
                ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1 << (4 - i))
            rstd = cute.math.rsqrt(ss / Float32(D) + eps, fastmath=False)
            w = rW.load().to(Float32)
            if const_expr(k.weight_offset != 0.0):
                w = w + Float32(k.weight_offset)
            rN = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
            rN.store(x * (rstd * w))
            p = mPos[t]
            inside = p >= 0 and p < cute.size(mCache, mode=[0])
            row = cutlass.select_(inside, Int32(p), Int32(0))  # no read outside the cache
            nan = Float32(float("nan"))
            rO = cute.make_rmem_tensor(cute.make_layout((E,)), Float32)
            if const_expr(k.neox):
                lanes_half = half // E
                first = lane < lanes_half
                src = cutlass.select_(first, lane + lanes_half, lane - lanes_half)
                rotates = lane < 2 * lanes_half
                for e in cutlass.range_constexpr(E):
                    n = rN[e]
                    partner = cute.arch.shuffle_sync(n, offset=src)
                    j = cutlass.select_(first, lane * E + e, lane * E + e - half)  # the angle's index
                    j = cutlass.select_(rotates, j, Int32(0))
                    c = cutlass.select_(inside, mCache[row, j].to(Float32), nan)
                    s = cutlass.select_(inside, mCache[row, half + j].to(Float32), nan)
                    o = cutlass.select_(first, n * c - partner * s, n * c + partner * s)
                    rO[e] = cutlass.select_(rotates, o, n)
            else:
                for e in cutlass.range_constexpr(0, E, 2):
                    a, b = rN[e], rN[e + 1]
                    col = lane * E + e
                    rotates = col < k.rotary_dim
                    j = cutlass.select_(rotates, col // 2, Int32(0))
                    c = cutlass.select_(inside, mCache[row, j].to(Float32), nan)
                    s = cutlass.select_(inside, mCache[row, half + j].to(Float32), nan)
                    rO[e] = cutlass.select_(rotates, a * c - b * s, a)
                    rO[e + 1] = cutlass.select_(rotates, b * c + a * s, b)
            rY = cute.make_rmem_tensor_like(gX)
            rY.store(rO.load().to(self.dtype))
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
    E = k.head_dim // WARP
    dt, wd = cute_dtype(k.dtype), cute_dtype(k.w_dtype)

    def build():
        out = gmem_ptr(dt, E * dt.width // 8) if k.out_of_place else None
        return compile_kernel(QKNormRope(k), gmem_ptr(dt, E * dt.width // 8), out, out,
                              gmem_ptr(wd, E * wd.width // 8), gmem_ptr(wd, E * wd.width // 8),
                              gmem_ptr(cute_dtype(k.cache_dtype), 4 if k.cache_dtype == "float32" else 2),
                              gmem_ptr(cute_dtype(k.pos_dtype), 4 if k.pos_dtype == "int32" else 8), Int32(1),
                              Int64(E), Int32(1), Float32(1e-6), fake_stream(), arch=k.arch)

    return CACHE.get(("qk_norm_rope", k), build)
