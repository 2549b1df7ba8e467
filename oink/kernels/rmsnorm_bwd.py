"""RMSNorm and LayerNorm backward in CuTeDSL: dx per row, dweight/dbias as per-CTA fp32 partials.

A persistent grid walks the row tiles; each thread keeps running sums of dout*xhat (and dout)
for its columns in registers, and writes them once at the end as one row of a partial buffer
(rows ``ldpart`` apart: the host interleaves the dweight and dbias partials, and ``PartialSum``
adds them up in one launch, no host round trip, in the weight's dtype). Wide rows use a cluster
per row tile; successive tiles alternate two reduction slots so a fast CTA never overwrites a
value a peer is still reading.

With xhat = (x - mean) * rstd (mean = 0 for RMSNorm) and wdy = dout * weight:
  RMSNorm:   dx = (wdy - xhat * mean(wdy * xhat)) * rstd
  LayerNorm: dx = (wdy - xhat * mean(wdy * xhat) - mean(wdy)) * rstd   (two reductions, one barrier)
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .reduction import add
from .rmsnorm import RMSNormForward
from .rmsnorm_bwd_rules import (SPLIT_DEPTH, BackwardKey, backward_depth, backward_launch, head_launch,
                                split_launches)
from .row_rules import MAX_N, WARP, RowLaunch


class RMSNormBackward(RMSNormForward):
    """Reuses the forward's tiling and row copies; two reduction slots per reduction for the tile
    loop (slots 0/1: the dot product; LayerNorm adds 2/3: the sum of wdy)."""

    def __init__(self, launch: RowLaunch, x_dtype, w_dtype, dout_dtype, dres_dtype, has_dw: bool, has_db: bool,
                 layernorm: bool = False, depth: int = 1, weight_offset: float = 0.0,
                 heads: int = 1, direct: bool = False):
        RMSNormForward.__init__(self, launch, x_dtype, w_dtype, None, None, x_dtype, None, False, layernorm,
                                weight_offset, heads)
        # per head, a thread's rows must all be of one head (its partial row is that head's)
        assert launch.rows_per_cta % heads == 0, (launch, heads)
        self.num_reductions = 4 if layernorm else 2
        self.dout_dtype, self.dres_dtype = dout_dtype, dres_dtype
        self.has_dw, self.has_db = has_dw, has_db
        self.depth = depth  # self.pdl: from the config (RowKernelBase)
        # one CTA (a cluster) whose first row holds the whole sums: dweight and dbias themselves, stored in
        # the weight's dtype (x's without a weight), with no partials to add up (``direct_sums``)
        self.direct = direct
        self.sums_dtype = (w_dtype or x_dtype) if direct else Float32

    @cute.jit
    def load_tile(self, mX: cute.Tensor, mDout: cute.Tensor, mRstd: cute.Tensor, mMean: Optional[cute.Tensor],
                  tile: Int32, num_tiles: Int32, rX: cute.Tensor, rG: cute.Tensor, rStat: cute.Tensor,
                  slot: cutlass.Constexpr[int], part, ident: cute.Tensor, M: Int32):
        """x, dout, rstd (and mean) of one row tile into registers; rStat[slot, 0] is rstd,
        rStat[slot, 1] the mean. Past the last tile (a prefetch never used) either the last row
        again or zeros; zeros past M."""
        if const_expr(self.launch.rows_per_cta == 1 and self.depth > 1):
            # One row a tile: a tile past the end reloads the last row instead of branching (it is
            # never used). Branch-free loads keep the bf16 -> fp32 conversions at the use, so the
            # compiler does not wait for a prefetch where it is issued.
            last = cutlass.min(tile, num_tiles - 1)
            tXcX = part(ident, last)
            if const_expr(not self.launch.even_n):
                rX.fill(0)
                rG.fill(0)
            self.copy_row(part(mX, last), rX, tXcX, self.x_dtype)
            self.copy_row(part(mDout, last), rG, tXcX, self.dout_dtype)
            rStat[slot, 0] = mRstd[tXcX[0][0]]
            if const_expr(mMean is not None):
                rStat[slot, 1] = mMean[tXcX[0][0]]
        else:
            self.load_tile_guarded(mX, mDout, mRstd, mMean, tile, num_tiles, rX, rG, rStat, slot, part, ident, M)

    @cute.jit
    def load_tile_guarded(self, mX: cute.Tensor, mDout: cute.Tensor, mRstd: cute.Tensor,
                          mMean: Optional[cute.Tensor], tile: Int32, num_tiles: Int32, rX: cute.Tensor,
                          rG: cute.Tensor, rStat: cute.Tensor, slot: cutlass.Constexpr[int], part,
                          ident: cute.Tensor, M: Int32):
        rX.fill(0)
        rG.fill(0)
        rStat[slot, 0] = Float32(0.0)
        rStat[slot, 1] = Float32(0.0)
        if tile < num_tiles:
            tXcX = part(ident, tile)
            row = tXcX[0][0]
            if row < M:
                self.copy_row(part(mX, tile), rX, tXcX, self.x_dtype)
                self.copy_row(part(mDout, tile), rG, tXcX, self.dout_dtype)
                rStat[slot, 0] = mRstd[row]
                if const_expr(mMean is not None):
                    rStat[slot, 1] = mMean[row]

    @cute.jit
    def __call__(self, px: cute.Pointer, pw: Optional[cute.Pointer], pdout: cute.Pointer, prstd: cute.Pointer,
                 pmean: Optional[cute.Pointer], pdres: Optional[cute.Pointer], pdx: cute.Pointer,
                 pdw: Optional[cute.Pointer],
                 pdb: Optional[cute.Pointer], M: Int32, ldx: Int64, lddout: Int64, lddres: Int64, lddx: Int64,
                 ldpart: Int64, num_ctas: Int32, stream: cuda.CUstream):
        L = self.launch
        mX = self.matrix(px, M, ldx)
        mDout = self.matrix(pdout, M, lddout)
        mDx = self.matrix(pdx, M, lddx)
        mDres = self.matrix(pdres, M, lddres) if const_expr(pdres is not None) else None
        mW = self.broadcast_rows(pw) if const_expr(pw is not None) else None
        mRstd = cute.make_tensor(prstd, cute.make_layout((M,)))
        mMean = cute.make_tensor(pmean, cute.make_layout((M,))) if const_expr(pmean is not None) else None
        parts = num_ctas * L.rows_per_cta  # direct: 1, dweight and dbias themselves
        row_major = cute.make_layout((parts, L.N), stride=(cute.assume(ldpart, divby=L.vec), 1))
        mDw = cute.make_tensor(pdw, row_major) if const_expr(pdw is not None) else None
        mDb = cute.make_tensor(pdb, row_major) if const_expr(pdb is not None) else None
        self.launch_rows(self.kernel(mX, mW, mDout, mRstd, mMean, mDres, mDx, mDw, mDb, self.tiled_copy(self.x_dtype)),
                         M, stream, grid=[num_ctas, L.cluster_n, 1])

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mDout: cute.Tensor, mRstd: cute.Tensor,
               mMean: Optional[cute.Tensor], mDres: Optional[cute.Tensor], mDx: cute.Tensor, mDw: Optional[cute.Tensor],
               mDb: Optional[cute.Tensor], tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        gdim, _, _ = cute.arch.grid_dim()

        M = cute.size(mX, mode=[0])
        ident = cute.make_identity_tensor(mX.shape)

        rW = self.load_weight(mW, part, ident)
        proto = part(mX, 0)
        acc_dw, acc_db = self.zero_sums(proto)
        rX = cute.make_rmem_tensor_like(proto)
        rG = cute.make_rmem_tensor_like(proto, self.dout_dtype)
        rDx = cute.make_rmem_tensor_like(proto, self.x_dtype)
        rDres = None
        if const_expr(mDres is not None):
            rDres = cute.make_rmem_tensor_like(proto, self.dres_dtype)
        self.wait_cluster()

        num_tiles = cute.ceil_div(M, L.rows_per_cta)
        it = Int32(0)
        if const_expr(self.depth <= 1):
            # Software pipeline: the next tile's x, dout and row statistics are loaded into a second set of
            # registers before this tile's reduction, so each thread keeps two rows' loads in flight.
            rXn = cute.make_rmem_tensor_like(proto)
            rGn = cute.make_rmem_tensor_like(proto, self.dout_dtype)
            rStat = cute.make_rmem_tensor(cute.make_layout((2, 2), stride=(2, 1)), Float32)
            self.load_tile(mX, mDout, mRstd, mMean, bidx, num_tiles, rX, rG, rStat, 0, part, ident, M)
            for tile in cutlass.range(bidx, num_tiles, gdim, unroll=1):
                self.load_tile(mX, mDout, mRstd, mMean, tile + gdim, num_tiles, rXn, rGn, rStat, 1, part, ident, M)
                self.tile_step(rX, rG, rStat[0, 0], rStat[0, 1], rW, rDres, rDx, acc_dw, acc_db, mDres, mDx, tile,
                               it, buf, mbar, part, ident, M)
                rX.store(rXn.load())
                rG.store(rGn.load())
                rStat[0, 0] = rStat[1, 0]
                rStat[0, 1] = rStat[1, 1]
                it += 1
        else:
            # Software pipeline of depth D: D register sets of x, dout and row statistics, each loaded
            # D - 1 tiles ahead of its use. The loop body is traced D times with the sets' roles fixed
            # (no register moves, which would wait on the loads), so while a tile is reduced the
            # loads of the next D - 1 tiles are in flight.
            D = self.depth
            rXs = [rX] + [cute.make_rmem_tensor_like(proto) for _ in range(D - 1)]
            rGs = [rG] + [cute.make_rmem_tensor_like(proto, self.dout_dtype) for _ in range(D - 1)]
            rStat = cute.make_rmem_tensor(cute.make_layout((D, 2), stride=(2, 1)), Float32)
            for d in cutlass.range_constexpr(D - 1):
                self.load_tile(mX, mDout, mRstd, mMean, bidx + d * gdim, num_tiles, rXs[d], rGs[d], rStat, d,
                               part, ident, M)
            for base in cutlass.range(bidx, num_tiles, D * gdim, unroll=1):
                for s in cutlass.range_constexpr(D):
                    tile = base + s * gdim
                    ahead = (s + D - 1) % D  # the set the previous step used is free
                    self.load_tile(mX, mDout, mRstd, mMean, tile + (D - 1) * gdim, num_tiles, rXs[ahead],
                                   rGs[ahead], rStat, ahead, part, ident, M)
                    if tile < num_tiles:
                        self.tile_step(rXs[s], rGs[s], rStat[s, 0], rStat[s, 1], rW, rDres, rDx, acc_dw, acc_db,
                                       mDres, mDx, tile, it, buf, mbar, part, ident, M)
                        it += 1
        # the partials' sum (launched with PDL) may start launching; it waits for this grid's end
        self.launch_dependents()

        self.store_partials(acc_dw, acc_db, mDw, mDb, part, ident, bidx)

    @cute.jit
    def tile_step(self, rX: cute.Tensor, rG: cute.Tensor, rstd: Float32, mean: Float32, rW, rDres, rDx: cute.Tensor,
                  acc_dw: cute.Tensor, acc_db: cute.Tensor, mDres: Optional[cute.Tensor], mDx: cute.Tensor,
                  tile: Int32, it: Int32, buf, mbar, part, ident: cute.Tensor, M: Int32):
        """dx of one row tile from its registers, and its terms added to the dweight/dbias sums.
        ``it`` (tiles done so far) alternates the reduction slots and their mbarrier phases."""
        xhat, g, wdy = self.row_terms(rX, rG, rW, rstd, mean)
        phase = (it // 2) % 2
        dot = (xhat * wdy).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        total = None
        if const_expr(self.layernorm):
            total = wdy.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
            dot, total = self.row_allreduce_pair(dot, total, add, Float32(0.0), buf, mbar, it % 2, 2 + it % 2,
                                                 phase)
        else:
            dot = self.row_allreduce(dot, add, Float32(0.0), buf, mbar, it % 2, phase)
        self.finish_tile(xhat, g, wdy, dot, total, rstd, rDres, rDx, acc_dw, acc_db, mDres, mDx, tile, part, ident, M)

    @cute.jit
    def zero_sums(self, proto: cute.Tensor):
        """The thread's dweight and dbias sums (fp32 registers shaped like ``proto``), zeroed."""
        acc_dw = cute.make_rmem_tensor_like(proto, Float32)
        acc_dw.fill(0.0)
        acc_db = cute.make_rmem_tensor_like(proto, Float32)
        acc_db.fill(0.0)
        return acc_dw, acc_db

    @cute.jit
    def load_weight(self, mW: Optional[cute.Tensor], part, ident: cute.Tensor):
        """This thread's weight columns (None without a weight). Per head, rows_per_cta is a multiple
        of H, so every row this thread takes has the head of its row in the first tile."""
        rW = None
        if const_expr(mW is not None):
            tXgW = part(self.head_rows(mW, part(ident, 0)[0][0]), 0)
            rW = cute.make_rmem_tensor_like(tXgW)
            rW.fill(0)  # columns past N stay 0: they enter the row's dot product
            self.copy_row(tXgW, rW, part(ident, 0), self.w_dtype)
        return rW

    @cute.jit
    def row_terms(self, rX: cute.Tensor, rG: cute.Tensor, rW, rstd: Float32, mean: Float32):
        """(xhat, dout, wdy) in fp32. Padding columns get xhat = -mean * rstd (LayerNorm) but dout = 0
        (it loads as 0), so wdy = 0 there."""
        if const_expr(self.layernorm):
            xhat = (rX.load().to(Float32) - mean) * rstd
        else:
            xhat = rX.load().to(Float32) * rstd
        g = rG.load().to(Float32)
        wdy = g * self.weight_values(rW) if const_expr(rW is not None) else g
        return xhat, g, wdy

    @cute.jit
    def finish_tile(self, xhat, g, wdy, dot: Float32, total, rstd: Float32, rDres, rDx: cute.Tensor,
                    acc_dw: cute.Tensor, acc_db: cute.Tensor, mDres: Optional[cute.Tensor], mDx: cute.Tensor,
                    tile: Int32, part, ident: cute.Tensor, M: Int32):
        """dx of row tile ``tile`` from its row sums (``total``: LayerNorm's sum of wdy), plus dresidual,
        stored; its terms added to the dweight/dbias sums."""
        L = self.launch
        tXcX = part(ident, tile)
        row = tXcX[0][0]
        if const_expr(self.layernorm):
            dx = (wdy - xhat * (dot / L.N) - total / L.N) * rstd
        else:
            dx = (wdy - xhat * (dot / L.N)) * rstd
        if const_expr(mDres is not None):
            rDres.fill(0)
            if row < M:
                self.copy_row(part(mDres, tile), rDres, tXcX, self.dres_dtype)
            dx = dx + rDres.load().to(Float32)
        rDx.store(dx.to(self.x_dtype))
        if row < M:
            self.copy_row(rDx, part(mDx, tile), tXcX, self.x_dtype)
        if const_expr(self.has_dw):
            acc_dw.store(acc_dw.load() + g * xhat)  # rows past M have g = 0
        if const_expr(self.has_db):
            acc_db.store(acc_db.load() + g)

    @cute.jit
    def store_partials(self, acc_dw: cute.Tensor, acc_db: cute.Tensor, mDw: Optional[cute.Tensor],
                       mDb: Optional[cute.Tensor], part, ident: cute.Tensor, bidx: Int32):
        """This CTA's dweight/dbias sums as its partial rows: row bidx * rows_per_cta + the thread's row
        (``direct``: the one such row is dweight / dbias, stored in their dtype)."""
        pc = part(ident, bidx)  # coordinates with the row tile of this CTA's own partial rows
        for acc, mD, wanted in ((acc_dw, mDw, self.has_dw), (acc_db, mDb, self.has_db)):
            if const_expr(wanted):
                if const_expr(self.direct):
                    out = cute.make_rmem_tensor_like(acc, self.sums_dtype)
                    out.store(acc.load().to(self.sums_dtype))
                    if pc[0][0] == bidx * self.launch.rows_per_cta:  # the CTA's first row: the one row
                        self.copy_row(out, part(mD, bidx), pc, self.sums_dtype)
                else:
                    self.copy_row(acc, part(mD, bidx), pc, Float32)


@memo
def compiled_backward(k: BackwardKey):
    """Compile (or fetch) the RMSNorm (or, with ``layernorm``, LayerNorm) backward for ``k``."""
    x_dtype, N, arch, w_dtype, dout_dtype, dres_dtype = k.x_dtype, k.N, k.arch, k.w_dtype, k.dout_dtype, k.dres_dtype
    has_db, layernorm, weight_offset, heads, few, direct = (k.has_db, k.layernorm, k.weight_offset, k.heads, k.few,
                                                            k.direct)
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the norm kernels handle 1 <= N <= {MAX_N}")
    xd = cute_dtype(x_dtype)
    launch = backward_launch(N, xd.width, arch, layernorm, few, dres=dres_dtype is not None)
    if heads > 1:
        launch = head_launch(launch, heads)
        if launch is None:
            raise ValueError(f"N={N} with {heads} heads: no backward launch has a whole number of heads a CTA")
    depth = backward_depth(launch, layernorm)
    key = ("layernorm_bwd" if layernorm else "rmsnorm_bwd", x_dtype, w_dtype, dout_dtype, dres_dtype, has_db, N,
           arch, launch, depth, float(weight_offset), heads, direct)

    def build():
        wd = None if w_dtype is None else cute_dtype(w_dtype)
        gd = cute_dtype(dout_dtype)
        rd = None if dres_dtype is None else cute_dtype(dres_dtype)
        kernel = RMSNormBackward(launch, xd, wd, gd, rd, w_dtype is not None, has_db, layernorm, depth,
                                 float(weight_offset), heads, direct)
        sums = kernel.sums_dtype
        one = Int64(launch.vec)
        return compile_kernel(
            kernel, gmem_ptr(xd), None if wd is None else gmem_ptr(wd), gmem_ptr(gd), gmem_ptr(Float32, 4),
            gmem_ptr(Float32, 4) if layernorm else None,
            None if rd is None else gmem_ptr(rd), gmem_ptr(xd),
            gmem_ptr(sums) if w_dtype is not None else None, gmem_ptr(sums) if has_db else None,
            Int32(1), one, one, one, one, one, Int32(1), fake_stream(), arch=arch)

    return CACHE.get(key, build)


# ---- a very wide row: the row split over CTAs in two kernels -----------------------------------
# A row wider than the registers of the largest cluster hold (x, dout and the dweight sums: past
# 131072 columns over SM90's 16 CTAs, past 65536 over SM100's portable 8) spills in the one-kernel
# backward, at any row count (it then runs far below the copy ceiling). Split
# instead: ``SplitRowDots`` gives each (row, column chunk) CTA its chunk's share
# of the row's sums (dot, and LayerNorm's sum of wdy); ``SplitDx`` then re-reads x and dout (from L2 at
# few rows), adds a row's shares in a fixed order, and writes dx, each CTA keeping its columns' dweight
# sums over its rows as one partial row. Reading the rows twice keeps it well below the copy ceiling.


class _SplitBase(RMSNormBackward):
    """No reduction slots and no hardware cluster: the chunks of a row are independent CTAs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_reductions = 0

    def cluster(self):
        return None

    @cute.jit
    def load_row(self, mX: cute.Tensor, mDout: cute.Tensor, rX: cute.Tensor, rG: cute.Tensor, part,
                 ident: cute.Tensor, row: Int32, M: Int32):
        """This thread's x and dout of ``row``'s chunk (zeros past N or M)."""
        rX.fill(0)
        rG.fill(0)
        if row < M:
            tXcX = part(ident, row)
            self.copy_row(part(mX, row), rX, tXcX, self.x_dtype)
            self.copy_row(part(mDout, row), rG, tXcX, self.dout_dtype)


class SplitRowDots(_SplitBase):
    """Kernel A: shares[row, chunk] = (sum of xhat * wdy, sum of wdy) over the chunk's columns."""

    @cute.jit
    def __call__(self, px: cute.Pointer, pw: Optional[cute.Pointer], pdout: cute.Pointer, prstd: cute.Pointer,
                 pmean: Optional[cute.Pointer], pshares: cute.Pointer, M: Int32, ldx: Int64, lddout: Int64,
                 stream: cuda.CUstream):
        L = self.launch
        mShares = cute.make_tensor(pshares, cute.make_layout((M, L.cluster_n, 2), stride=(L.cluster_n * 2, 2, 1)))
        mW = self.broadcast_rows(pw) if const_expr(pw is not None) else None
        mMean = cute.make_tensor(pmean, cute.make_layout((M,))) if const_expr(pmean is not None) else None
        self.launch_rows(self.kernel(self.matrix(px, M, ldx), mW, self.matrix(pdout, M, lddout),
                                     cute.make_tensor(prstd, cute.make_layout((M,))), mMean, mShares,
                                     self.tiled_copy(self.x_dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mDout: cute.Tensor, mRstd: cute.Tensor,
               mMean: Optional[cute.Tensor], mShares: cute.Tensor, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, _, _, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        ident = cute.make_identity_tensor(mX.shape)
        rW = self.load_weight(mW, part, ident)
        rX = cute.make_rmem_tensor_like(part(mX, 0))
        rG = cute.make_rmem_tensor_like(part(mDout, 0), self.dout_dtype)
        self.load_row(mX, mDout, rX, rG, part, ident, bidx, M)
        mean = mMean[bidx] if const_expr(mMean is not None) else Float32(0.0)
        xhat, g, wdy = self.row_terms(rX, rG, rW, mRstd[bidx], mean)
        dot = (xhat * wdy).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        total = wdy.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        dot = cute.arch.warp_reduction(dot, add)
        total = cute.arch.warp_reduction(total, add)
        warps = const_expr(L.num_threads // WARP)
        smem = cutlass.memory.SmemAllocator()
        sbuf = smem.allocate_tensor(Float32, cute.make_layout((warps, 2), stride=(2, 1)), byte_alignment=16)
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        if lane == 0:
            sbuf[warp, 0] = dot
            sbuf[warp, 1] = total
        cute.arch.barrier()
        if cute.arch.thread_idx()[0] == 0:
            dot, total = sbuf[0, 0], sbuf[0, 1]
            for w in cutlass.range_constexpr(1, warps):  # a fixed order: the same sums every run
                dot = dot + sbuf[w, 0]
                total = total + sbuf[w, 1]
            mShares[bidx, cy, 0] = dot
            mShares[bidx, cy, 1] = total
        self.launch_dependents()


class SplitDx(_SplitBase):
    """Kernel B: dx of its rows' chunk from the rows' shares; CTA (g, chunk) takes the groups of
    ``depth`` rows g, g + G, ... (G CTAs along x), loading a group's rows before it uses them, and
    writes its columns' dweight (and dbias) sums as partial row g."""

    def __init__(self, launch: RowLaunch, chunks_a: int, *args, **kwargs):
        super().__init__(launch, *args, **kwargs)
        self.chunks_a = chunks_a  # the shares' width (kernel A's chunks)

    @cute.jit
    def __call__(self, px: cute.Pointer, pw: Optional[cute.Pointer], pdout: cute.Pointer, prstd: cute.Pointer,
                 pmean: Optional[cute.Pointer], pshares: cute.Pointer, pdres: Optional[cute.Pointer],
                 pdx: cute.Pointer, pdw: Optional[cute.Pointer], pdb: Optional[cute.Pointer], M: Int32, ldx: Int64,
                 lddout: Int64, lddres: Int64, lddx: Int64, ldpart: Int64, groups: Int32, stream: cuda.CUstream):
        L = self.launch
        A = self.chunks_a
        mShares = cute.make_tensor(pshares, cute.make_layout((M, A, 2), stride=(A * 2, 2, 1)))
        mW = self.broadcast_rows(pw) if const_expr(pw is not None) else None
        mMean = cute.make_tensor(pmean, cute.make_layout((M,))) if const_expr(pmean is not None) else None
        mDres = self.matrix(pdres, M, lddres) if const_expr(pdres is not None) else None
        row_major = cute.make_layout((groups, L.N), stride=(cute.assume(ldpart, divby=L.vec), 1))
        mDw = cute.make_tensor(pdw, row_major) if const_expr(pdw is not None) else None
        mDb = cute.make_tensor(pdb, row_major) if const_expr(pdb is not None) else None
        self.launch_rows(self.kernel(self.matrix(px, M, ldx), mW, self.matrix(pdout, M, lddout),
                                     cute.make_tensor(prstd, cute.make_layout((M,))), mMean, mShares, mDres,
                                     self.matrix(pdx, M, lddx), mDw, mDb, self.tiled_copy(self.x_dtype)),
                         M, stream, grid=[groups, L.cluster_n, 1])

    @cute.jit
    def row_sums(self, mShares: cute.Tensor, row: Int32, M: Int32):
        """(dot, total) of ``row``: its chunks' shares added by each warp's lanes, in a fixed order."""
        lane = cute.arch.lane_idx()
        dot, total = Float32(0.0), Float32(0.0)
        if row < M:
            for i in cutlass.range_constexpr(cute.ceil_div(self.chunks_a, WARP)):
                c = lane + i * WARP
                if c < self.chunks_a:
                    dot = dot + mShares[row, c, 0]
                    total = total + mShares[row, c, 1]
        return cute.arch.warp_reduction(dot, add), cute.arch.warp_reduction(total, add)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mDout: cute.Tensor, mRstd: cute.Tensor,
               mMean: Optional[cute.Tensor], mShares: cute.Tensor, mDres: Optional[cute.Tensor], mDx: cute.Tensor,
               mDw: Optional[cute.Tensor], mDb: Optional[cute.Tensor], tc: cute.TiledCopy):
        D = self.depth
        bidx, cy, _, _, part = self.cta_setup(tc)
        groups, _, _ = cute.arch.grid_dim()
        M = cute.size(mX, mode=[0])
        ident = cute.make_identity_tensor(mX.shape)
        rW = self.load_weight(mW, part, ident)
        proto = part(mX, 0)
        acc_dw, acc_db = self.zero_sums(proto)
        rXs = [cute.make_rmem_tensor_like(proto) for _ in range(D)]
        rGs = [cute.make_rmem_tensor_like(proto, self.dout_dtype) for _ in range(D)]
        rDx = cute.make_rmem_tensor_like(proto, self.x_dtype)
        rDres = cute.make_rmem_tensor_like(proto, self.dres_dtype) if const_expr(mDres is not None) else None
        for base in cutlass.range(bidx * D, M, groups * D, unroll=1):
            for d in cutlass.range_constexpr(D):  # the group's loads first, all in flight together
                self.load_row(mX, mDout, rXs[d], rGs[d], part, ident, base + d, M)
            for d in cutlass.range_constexpr(D):
                row = base + d
                rstd, mean = Float32(0.0), Float32(0.0)
                if row < M:
                    rstd = mRstd[row]
                    if const_expr(mMean is not None):
                        mean = mMean[row]
                dot, total = self.row_sums(mShares, row, M)
                xhat, g, wdy = self.row_terms(rXs[d], rGs[d], rW, rstd, mean)
                self.finish_tile(xhat, g, wdy, dot, total, rstd, rDres, rDx, acc_dw, acc_db, mDres, mDx, row, part,
                                 ident, M)  # one row a tile: the tile is the row
        self.launch_dependents()
        self.store_partials(acc_dw, acc_db, mDw, mDb, part, ident, bidx)  # partial row bidx


@memo
def compiled_split_backward(k: BackwardKey):
    """Compile (or fetch) the split backward's two kernels (``split_rows``) for ``k`` (one CTA row at a
    time: its heads, few and direct are not read): -> (A, B, A's chunks)."""
    x_dtype, N, arch, w_dtype, dout_dtype, dres_dtype = k.x_dtype, k.N, k.arch, k.w_dtype, k.dout_dtype, k.dres_dtype
    has_db, layernorm, weight_offset = k.has_db, k.layernorm, k.weight_offset
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the norm kernels handle 1 <= N <= {MAX_N}")
    xd, gd = cute_dtype(x_dtype), cute_dtype(dout_dtype)
    wd = None if w_dtype is None else cute_dtype(w_dtype)
    rd = None if dres_dtype is None else cute_dtype(dres_dtype)
    la, lb = split_launches(N, xd.width)
    common = (xd, wd, gd, rd, w_dtype is not None, has_db, layernorm, SPLIT_DEPTH, float(weight_offset))
    key = ("norm_bwd_split", x_dtype, w_dtype, dout_dtype, dres_dtype, has_db, N, arch, layernorm,
           float(weight_offset), SPLIT_DEPTH)
    one = Int64(la.vec)
    w_ptr = None if wd is None else gmem_ptr(wd)
    mean_ptr = gmem_ptr(Float32, 4) if layernorm else None

    def build_a():
        return compile_kernel(SplitRowDots(la, *common), gmem_ptr(xd), w_ptr, gmem_ptr(gd), gmem_ptr(Float32, 4),
                              mean_ptr, gmem_ptr(Float32, 8), Int32(1), one, one, fake_stream(), arch=arch)

    def build_b():
        return compile_kernel(
            SplitDx(lb, la.cluster_n, *common), gmem_ptr(xd), w_ptr, gmem_ptr(gd), gmem_ptr(Float32, 4), mean_ptr,
            gmem_ptr(Float32, 8), None if rd is None else gmem_ptr(rd), gmem_ptr(xd),
            gmem_ptr(Float32) if w_dtype is not None else None, gmem_ptr(Float32) if has_db else None,
            Int32(1), one, one, one, one, one, Int32(1), fake_stream(), arch=arch)

    return CACHE.get(key + (la,), build_a), CACHE.get(key + (la, lb), build_b), la.cluster_n  # B reads A's chunks
