"""The norm backward's second launch: dweight and/or dbias from its per-CTA fp32 partial rows.

The backward's persistent grid writes P partial rows ([P, kinds, Np], Np = N rounded up to 4); this
kernel adds them up, in fp32 and in a fixed order (deterministic), into the weight's dtype.
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .reduction import add
from .row_rules import WARP

THREADS = 256
# CTAs the grid should reach: about one for every SM of a current GPU (a column's partials are read by one CTA)
MIN_CTAS = 128
# partial rows a thread reads, at most, where a CTA of fewer columns allows it: the loop's unroll, one batch
LOADS = 8


def quads_per_cta(cols: int, parts: int = 0) -> int:
    """float4 columns a CTA of ``THREADS`` owns: 8 where that leaves ``MIN_CTAS`` CTAs and a thread at most
    ``LOADS`` of the ``parts`` partial rows, fewer (down to 1) for narrow rows or many partial rows, so that
    the grid spans the GPU and each thread's loads go out in one batch. With 8 a CTA, narrow rows left most SMs
    idle and a thread dozens of loads, and the sum took as long as the backward itself (docs/tuning.md,
    "The norm backward's grid")."""
    q = 8
    while q > 1 and (-(-cols // q) < MIN_CTAS or -(-parts // (THREADS // q)) > LOADS):
        q //= 2
    return q


class PartialSum:
    """out_k[n] = the sum over p of part[p, k, n]. A CTA owns ``per_cta`` float4 columns (16 contiguous
    bytes each of a partial row; ``quads_per_cta``) and THREADS / per_cta streams of threads split the
    partial rows, so a thread has few, independent loads in flight; the streams' sums meet by warp
    shuffles, then across the CTA's warps in shared memory, always in one order. With ``pdl`` it is
    launched as a programmatic dependent of the backward: its launch overlaps the backward's tail and
    ``griddepcontrol.wait`` holds the loads until the backward's writes are visible."""

    def __init__(self, N: int, kinds: int, out_dtype, pdl: bool = False, per_cta: int = 8):
        self.N, self.kinds, self.out_dtype, self.pdl = N, kinds, out_dtype, pdl
        self.quads = -(-N // 4)  # float4 columns a kind
        self.cols = kinds * self.quads
        self.per_cta = per_cta
        self.streams = THREADS // self.per_cta

    @cute.jit
    def __call__(self, ppart: cute.Pointer, pout0: cute.Pointer, pout1: Optional[cute.Pointer], P: Int32,
                 stream: cuda.CUstream):
        mPart = cute.make_tensor(ppart, cute.make_layout((P, self.cols, 4), stride=(self.cols * 4, 4, 1)))
        mOut0 = cute.make_tensor(pout0, cute.make_layout((self.N,)))
        mOut1 = cute.make_tensor(pout1, cute.make_layout((self.N,))) if const_expr(pout1 is not None) else None
        self.kernel(mPart, mOut0, mOut1).launch(grid=[cute.ceil_div(self.cols, self.per_cta), 1, 1],
                                                block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mPart: cute.Tensor, mOut0: cute.Tensor, mOut1: Optional[cute.Tensor]):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        Q, S = self.per_cta, self.streams
        q, stream = tidx % Q, tidx // Q
        c = bidx * Q + q
        P = cute.size(mPart, mode=[0])
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        acc = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        acc.fill(0.0)
        frag = cute.make_rmem_tensor(cute.make_layout((4,)), Float32)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        if c < self.cols:
            for p in cutlass.range(stream, P, S, unroll=8):
                cute.copy(atom, mPart[p, c, None], frag)
                acc.store(acc.load() + frag.load())
        # lanes Q apart hold the same column quad: a butterfly over them leaves each lane the warp's sum
        for j in cutlass.range_constexpr(4):
            for i in cutlass.range_constexpr(5):
                if const_expr((1 << i) >= Q):
                    acc[j] = add(acc[j], cute.arch.shuffle_sync_bfly(acc[j], offset=1 << i, mask=-1,
                                                                      mask_and_clamp=31))
        warps = THREADS // WARP
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(Float32, cute.make_layout((warps, Q, 4), stride=(Q * 4, 4, 1)),
                                    byte_alignment=16)
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        if lane < Q:
            for j in cutlass.range_constexpr(4):
                sbuf[warp, lane, j] = acc[j]
        cute.arch.barrier()
        if tidx < Q * 4:
            qq, j = tidx // 4, tidx % 4
            total = sbuf[0, qq, j]
            for w in cutlass.range_constexpr(1, warps):
                total = total + sbuf[w, qq, j]
            cq = bidx * Q + qq
            col = (cq % self.quads) * 4 + j
            if cq < self.cols and col < self.N:
                if cq < self.quads:
                    mOut0[col] = total.to(self.out_dtype)
                else:
                    if const_expr(mOut1 is not None):
                        mOut1[col] = total.to(self.out_dtype)


@memo
def compiled_partial_sum(N: int, kinds: int, out_dtype: str, arch: str, parts: int = 0):
    """Compile (or fetch) the partials' sum for (N, kinds, dtype, arch) and up to ``parts`` partial rows (the
    CTA's width, ``quads_per_cta``: the most a call's grid writes, not its M's); the row count is runtime."""
    od = cute_dtype(out_dtype)
    per_cta = quads_per_cta(kinds * -(-N // 4), parts)

    def build():
        return compile_kernel(PartialSum(N, kinds, od, config.get().pdl, per_cta), gmem_ptr(Float32),
                              gmem_ptr(od, 2), gmem_ptr(od, 2) if kinds == 2 else None, Int32(1), fake_stream(),
                              arch=arch)

    # the cache keys on the PDL setting
    return CACHE.get(("partial_sum", N, kinds, out_dtype, arch, per_cta), build)
