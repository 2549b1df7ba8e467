"""RMSNorm family in CuTeDSL: forward (optional weight, bias, residual, rstd), the fused
add + RMSNorm in place (the forward kernel with its outputs aliased onto x and residual), and
the LayerNorm forward (the same kernel with the row mean subtracted first, and corrected by the
sum of the centred values).

One pass over memory: each thread loads its slice of a row into registers (128-bit accesses),
the row's sum of squares is all-reduced (warp, block, cluster), and the results are stored from
the same registers. In place is safe because every element is read before the reduction's
barrier and written after it, by the same thread.
"""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, replace
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr, memo
from .launch_table import pick, staged
from .reduction import (CLUSTER_ROWS_MIN_N, MAX_CLUSTER, MAX_N, NARROW_SHORT_N, WARP, WIDE_CLUSTER, RowKernelBase,
                        RowLaunch, add, cluster_rows, fewest_warps, narrow_cluster_rows, narrow_rows, pick_row_launch,
                        shifted_window, whole_warp_rows)


# The forward's thread holds its units of x (and residual) live between the reduction and the
# store; 4 units a thread fill the 64 registers a thread of a 1024-thread CTA has, so a wider row
# takes a cluster rather than more units. LayerNorm's centred values need about 1.5x RMSNorm's
# registers, and a weight wider than x doubles the weight's: those CTAs stop at 640 and 512 threads.
FWD_MAX_UNITS = 4
# LayerNorm's one-round moments (``RMSNormForward.pivot_moments``) hold while mean(x - pivot)^2 <= this times the
# variance: the variance then keeps all but ~log2(17) bits of its fp32 sums' precision (16-bit outputs)
PIVOT_LIMIT = 16
LAYERNORM_MAX_THREADS = 640
# LayerNorm's rows of narrower accesses than 16 bytes past this width, a thread holding more than this many values,
# load their parameters late (``late_params``; 12288 columns for the others): in CTAs of 256 threads at 21-48 values
# a thread (5124-12286 columns, 1- to 4-element accesses) late ran 0.54-0.94 of early's time, at 4100 (20) 1.06x
# (H200); narrower rows not measured
LAYERNORM_LATE_NARROW_N = 4096
LAYERNORM_LATE_NARROW_VALUES = 20
# LayerNorm's windows (``forward_window``) up to this width: past it their CTAs of 512-1024 threads spilled
# (180225 and 262137 columns, both archs), and 150001 columns' window ran no faster than the narrow kernel (H200)
LAYERNORM_WINDOW_MAX_N = 131072
# LayerNorm's rows counted in values (``narrow_rows``) keep one CTA of at most this many threads, up to
# LAYERNORM_NARROW_MAX_VALUES a thread (else the CTA of 512): CTAs of 512 held 73-77 registers (one CTA a SM), and
# 256 threads ran 0.55-0.64 of their time at 8196, 8198, 9045 and 13004 columns, 0.93-1.01 at 10244-14330 (H200,
# 256 MB a case; 1- to 4-element accesses); at 64 values a thread (16382, 2-element accesses) 1.13x.
LAYERNORM_NARROW_MAX_THREADS = 256
LAYERNORM_NARROW_MAX_VALUES = 56
WIDE_WEIGHT_MAX_THREADS = 512
WIDE_WEIGHT_NARROW_VALUES = 24  # values of x a thread holds before a narrow row with a wider weight takes a cluster


@memo
def forward_launch(N: int, x_bits: int, arch: str, w_bits: int = 0, layernorm: bool = False,
                   residual: bool = False) -> RowLaunch:
    """Launch heuristic for the forward (the one place it is chosen, but for the keys ``staged_rows`` takes, which
    ``forward_launch_of`` asks first: they hold more than a width). Measured on SM90 only;
    SM100 takes the same shapes until a Blackwell card can tune them. Rows wider than
    ``CLUSTER_ROWS_MIN_N`` take the wide-row rule (``reduction.cluster_rows``; 16-bit rows of 2-element
    accesses ``reduction.narrow_cluster_rows``), 16-bit rows whose width is not a multiple of 8 (but a
    weight wider than x) ``reduction.narrow_rows``, those of 2-element accesses at any width and of 4 up to
    1024 columns too (``NARROW_SHORT_N``). A ``residual`` (the fused add: twice the loads, more registers)
    keeps the access count for rows of 2- and 4-element accesses outside 4097-16384: counted in values, rows
    of 2 ran 0.91-1.16x the time (H200, random seeds 7373-9595).
    A unit is one 128-bit access of x, 4 a thread; a weight or residual wider than x (fp32 with bf16 x:
    ``w_bits``, the widest) costs two accesses a unit, so rows then take 2 units a thread where that still
    covers the row exactly in one CTA (faster there, as at N = 4096; where the tile would not be exact, as at
    6144 and 7168, 4 units a thread stay faster); such rows whose width is not a multiple of x's vector
    hold as many values a thread, in narrower accesses, and up to ``WIDE_WEIGHT_NARROW_VALUES`` in one CTA
    (counted in accesses, 3151 and 6571 columns took clusters of 512-thread CTAs and ran 2.1-2.4x slower;
    10378 and 11130 at 22 values a thread ran in 0.68 of a cluster of 2's time, 15001 at 30 in 1.11x; H200).
    LayerNorm's rows counted in values keep CTAs of 256 threads (``LAYERNORM_NARROW_MAX_THREADS``); its other
    rows take whole warps where that tiles them exactly (7168 bf16: 224 threads): its
    padded tail costs registers (mask, corrected mean: 105 instead of 80 at 256 threads).
    The ``fwd_upt`` development setting (units a thread, oink.config) overrides, for sweeps."""
    if config.get().fwd_upt:
        return pick_row_launch(N, x_bits, units_per_thread=config.get().fwd_upt)
    if N > CLUSTER_ROWS_MIN_N:
        counted = w_bits <= x_bits and not residual  # a row's values counted, not its accesses
        spread = narrow_cluster_rows(N, x_bits, WIDE_CLUSTER.get(arch, MAX_CLUSTER)) if counted else None
        # LayerNorm's clusters of 16 CTAs of 512 threads: 1.3-1.4x a cluster of 8 of 1024 (163844, 180226, H200)
        if spread is not None and not (layernorm and spread.cluster_n > MAX_CLUSTER and spread.num_threads > 256):
            return spread
        # LayerNorm's two reduction rounds: a cluster of 16 cost more than 8
        widest = MAX_CLUSTER if layernorm else WIDE_CLUSTER.get(arch, MAX_CLUSTER)
        return cluster_rows(N, math.gcd(N, 128 // x_bits), widest)
    short = None if residual else NARROW_SHORT_N
    narrow = None if w_bits > x_bits else narrow_rows(N, x_bits, FWD_MAX_UNITS, short)
    if narrow is not None and layernorm and narrow.num_threads > LAYERNORM_NARROW_MAX_THREADS:
        most = LAYERNORM_NARROW_MAX_THREADS
        fewer = replace(narrow, threads_per_row=most, num_threads=most)
        if fewer.iters * fewer.vec <= LAYERNORM_NARROW_MAX_VALUES:
            return fewer
    if narrow is not None:
        return narrow
    if layernorm:
        launch = whole_warp_rows(pick_row_launch(N, x_bits, max_units_per_thread=FWD_MAX_UNITS,
                                                 max_threads=LAYERNORM_MAX_THREADS), 4, LAYERNORM_MAX_THREADS)
        return launch if launch.even_n else fewest_warps(launch, FWD_MAX_UNITS, LAYERNORM_MAX_THREADS)
    if w_bits > x_bits:
        vec = math.gcd(N, 128 // x_bits)
        if vec < 128 // x_bits:  # narrower accesses: an aligned thread's values (2 units), up to 24 before a cluster
            return pick_row_launch(N, x_bits, units_per_thread=2 * (128 // x_bits) // vec,
                                   max_units_per_thread=WIDE_WEIGHT_NARROW_VALUES // vec,
                                   max_threads=WIDE_WEIGHT_MAX_THREADS)
        narrow = pick_row_launch(N, x_bits, units_per_thread=2)
        if narrow.even_n and narrow.cluster_n == 1 and narrow.iters <= 2:
            return narrow
        return pick_row_launch(N, x_bits, max_units_per_thread=FWD_MAX_UNITS, max_threads=WIDE_WEIGHT_MAX_THREADS)
    return pick_row_launch(N, x_bits, max_units_per_thread=FWD_MAX_UNITS)


def late_params(launch: RowLaunch, layernorm: bool, wide: bool, narrow: bool = False) -> bool:
    """Whether the forward loads weight and bias after the reduction (``RMSNormForward.late_params``):
    it frees their registers (and x's fp32 copy) across the reduction's barriers, so more CTAs fit a SM,
    but exposes the parameters' load latency. Timed both ways over the sweep suite, it pays where
    registers limit the CTAs a SM holds: the LayerNorm forward from 12288 columns (from
    ``LAYERNORM_LATE_NARROW_N`` where its accesses are ``narrow``, under 16 bytes, and a thread holds more than
    ``LAYERNORM_LATE_NARROW_VALUES`` values), and a weight or residual wider than x (``wide``) in CTAs of 1024
    threads. Never chosen by the row count: the two forms are two compiled kernels, whose arithmetic ptxas may
    contract differently, so a row's bits would depend on the batch (batch invariance)."""
    if layernorm:
        held = launch.iters * launch.vec  # values a thread
        return launch.N >= 12288 or (narrow and launch.N > LAYERNORM_LATE_NARROW_N
                                     and held > LAYERNORM_LATE_NARROW_VALUES)
    return wide and launch.num_threads == 1024


# The most bytes of a row tile (x and residual) the forward stages in shared memory: a SM has 227 KB, so
# such a tile (1024 threads x 4 units of 128 bits, x and a residual) still leaves one CTA a SM room for
# the reduction buffers; fp32 x and residual over 1024 threads x 8 units (256 KB) are never staged.
STAGE_MAX_BYTES = 128 * 1024

# 16-bit RMSNorm rows of 4-element accesses (N % 8 == 4) wider than CLUSTER_ROWS_MIN_N (``staged_rows``): staged
# in shared memory, the weight loaded after the reduction, over CTAs of 256 threads in a cluster of up to 8, up to
# this many accesses a thread (the staged tile is no register's), then CTAs of 512 (1024: slower at 171988), then
# on sm_90a a cluster of 16 CTAs of 256 (512 x 8 at 16 accesses ran 1.2-1.3x its time at 250004-262140). Held in
# registers, such a thread stopped at 5-6 accesses and the row took 16 CTAs. H200 (bench/RESULTS.md).
STAGED_MAX_ITERS = 12
# Rows of 2-element accesses (N % 4 == 2) keep ``narrow_cluster_rows``' CTAs of 256 threads past its 17 accesses,
# up to this many (on sm_90a every width: 16 CTAs), where it takes CTAs of 512: at 150002-262142, 19-32 accesses
# over 16 CTAs of 256 ran 0.75-0.93 of 10-16 over 16 CTAs of 512, both staged (H200).
STAGED_NARROW_MAX_ITERS = 32
# CTAs of 256 threads a SM the staged kernel keeps room for (``RMSNormForward.min_ctas``), by the row's elements an
# access and up to how many accesses a thread: ptxas left to itself holds a staged row's values in 66-94 registers
# (2-3 CTAs a SM), while the loads in flight that hide HBM's latency come from more CTAs. Capped, rows of
# 2-element accesses ran 0.84-0.99 of the uncapped staged kernel's time, those of 4 (at up to 13 accesses)
# 0.77-1.00 (H200). Each cap is the most CTAs that compile without a spill on sm_90a and sm_100a (test_spills):
# 4 CTAs leave 64 registers, and a thread of 16 4-element or 22 2-element accesses spilled there; past 24
# 2-element accesses 3 CTAs spilled on sm_100a, and on sm_90a ran as fast as 2 (ptxas' own choice there).
STAGED_CTAS = {2: ((17, 4), (24, 3)), 4: ((13, 4),)}


def stage_rows(launch: RowLaunch, x_bits: int, res_bits: int, tuned: bool) -> bool:
    """Whether the forward stages x (and the residual) in shared memory (``RMSNormForward.stage``):
    the ``fwd_stage`` setting where set, else the launch table's choice (``tuned``; without an entry, not: it
    pays only with a launch searched for it, and was slower with the heuristic's launch);
    never for too big a tile (a padded tile's vectors past N are not copied), nor with a residual: staged with
    its fp32 residual, a launch-table entry's rows (tuned for an fp32 weight, whose key the residual's shares) came
    out with other bits at identical calls, where unstaged they did not (bench/RESULTS.md, "Batch invariance").
    The staged rule (``staged_rows``) never takes a residual."""
    tile_bytes = launch.rows_per_cta * launch.cols_per_cta * (x_bits + res_bits) // 8
    if tile_bytes > STAGE_MAX_BYTES or res_bits:
        return False
    forced = config.get().fwd_stage
    return tuned if forced is None else forced


FORWARD_KINDS = ("rmsnorm_fwd", "layernorm_fwd")  # the first item of a forward's compile-cache key


def ran_staged(keys) -> bool:
    """Whether any of the compile-cache keys (``CACHE.used``: (key, launch flags...)) is a staged
    forward's (its key ends with the stage flag)."""
    return any(isinstance(k, tuple) and isinstance(k[0], tuple) and k[0][0] in FORWARD_KINDS and k[0][-1] is True
               for k in keys)


class RMSNormForward(RowKernelBase):
    """RMSNorm forward; with ``layernorm`` it subtracts the row mean first (LayerNorm), in two
    reduction rounds: the mean, then the sum of the centred values (a correction to the mean) with
    the sum of their squares."""

    def __init__(self, launch: RowLaunch, x_dtype, w_dtype, b_dtype, res_dtype, out_dtype, res_out_dtype,
                 store_rstd: bool, layernorm: bool = False, weight_offset: float = 0.0, heads: int = 1,
                 late_params: bool = False, stage: bool = False, n: int | None = None):
        """``n``: the row's width where ``launch.N`` is its window's (RMSNorm rows off 16-byte boundaries, every
        row tensor's rows at x's offsets, read and written through aligned windows: ``RowKernelBase.window``;
        the parameters gathered a value at a time, ``load_shifted``; which calls take them: ``forward_window``)."""
        super().__init__(launch, num_reductions=4 if layernorm else 1, n=n)
        self.x_dtype, self.w_dtype, self.b_dtype = x_dtype, w_dtype, b_dtype
        self.res_dtype, self.out_dtype, self.res_out_dtype = res_dtype, out_dtype, res_out_dtype
        self.store_rstd = store_rstd
        self.layernorm = layernorm
        self.weight_offset = weight_offset  # y = x_hat * (w + offset): Gemma's (1 + w) is 1.0
        self.heads = heads  # per-head weight/bias [H, D]: row r (of [..., H, D] rows) takes head r % H
        # weight and bias loaded after the reduction, and x converted to fp32 again where it is used,
        # so that neither is held in registers across the reduction's barriers
        self.late_params = late_params
        # x (and the residual) copied into shared memory (cp.async) and read from there again after the
        # reduction, so that no register holds them across its barriers (``stage_rows``)
        self.stage = stage
        # the norm of the residual sum in fp32 rather than of the sum stored (vLLM's dynamic FP8 norms); never
        # with ``late_params`` or ``stage``, which read the stored sum again
        self.raw_sum = False
        self.pivot_setting = config.get().ln_pivot  # (the compile cache keys on it: ``compiled_forward``)
        if self.shifted and (heads > 1 or stage):
            raise ValueError(f"shifted rows: one head, unstaged; got {launch}")

    @cute.jit
    def weight_values(self, rW: cute.Tensor):
        """The weight registers in fp32, offset added (a compile-time constant, added only if nonzero)."""
        w = rW.load().to(Float32)
        if const_expr(self.weight_offset != 0.0):
            w = w + Float32(self.weight_offset)
        return w

    def broadcast_rows(self, ptr):
        """A per-column vector seen as a (rows_per_cta, N) matrix with row stride 0; per head, H such
        matrices (H, rows_per_cta, N) that ``head_rows`` picks from."""
        L = self.launch
        if const_expr(self.heads > 1):
            return cute.make_tensor(ptr, cute.make_layout((self.heads, L.rows_per_cta, L.N), stride=(L.N, 0, 1)))
        return cute.make_tensor(ptr, cute.make_layout((L.rows_per_cta, L.N), stride=(0, 1)))

    def head_rows(self, mP: cute.Tensor, row):
        """The (rows_per_cta, N) broadcast view of a per-column parameter for ``row``'s head."""
        if const_expr(self.heads > 1):
            return mP[row % self.heads, None, None]
        return mP

    @cute.jit
    def __call__(self, px: cute.Pointer, pw: Optional[cute.Pointer], pb: Optional[cute.Pointer],
                 pres: Optional[cute.Pointer], pout: cute.Pointer, pres_out: Optional[cute.Pointer],
                 prstd: Optional[cute.Pointer], pmean: Optional[cute.Pointer], M: Int32, ldx: Int64,
                 ldres: Int64, ldout: Int64, ldres_out: Int64, eps: Float32, stream: cuda.CUstream):
        matrix = self.shifted_matrix if const_expr(self.shifted) else self.matrix  # (windows: rows start anywhere)
        mX = matrix(px, M, ldx)
        mO = matrix(pout, M, ldout)
        mRes = matrix(pres, M, ldres) if const_expr(pres is not None) else None
        mResO = matrix(pres_out, M, ldres_out) if const_expr(pres_out is not None) else None
        mW = self.broadcast_rows(pw) if const_expr(pw is not None) else None
        mB = self.broadcast_rows(pb) if const_expr(pb is not None) else None
        mRstd = cute.make_tensor(prstd, cute.make_layout((M,))) if const_expr(prstd is not None) else None
        mMean = cute.make_tensor(pmean, cute.make_layout((M,))) if const_expr(pmean is not None) else None
        self.launch_rows(self.kernel(mX, mW, mB, mRes, mO, mResO, mRstd, mMean, eps, self.tiled_copy(self.x_dtype)),
                         M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
               mRes: Optional[cute.Tensor], mO: cute.Tensor, mResO: Optional[cute.Tensor],
               mRstd: Optional[cute.Tensor], mMean: Optional[cute.Tensor], eps: Float32, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        shift = None
        if const_expr(self.shifted):  # each thread's row through its window
            row = bidx * L.rows_per_cta + cute.arch.thread_idx()[0] // L.threads_per_row
            tXcX, _, shift = self.row_window(mX, row, M, part)
            view = lambda m: self.row_window(m, row, M, part)[1]  # noqa: E731
        else:
            tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
            row = tXcX[0][0]
            view = lambda m: part(m, bidx)  # noqa: E731
        y, rX, rstd, mean = self.normalize(mX, mW, mB, mRes, mResO, eps, view, buf, mbar, part, tXcX, row, M, shift)
        rO = cute.make_rmem_tensor_like(rX, self.out_dtype)
        rO.store(y.to(self.out_dtype))
        if row < M:
            self.store_slice(rO, view(mO), tXcX, self.out_dtype, shift)
        if const_expr(mRstd is not None or mMean is not None):
            # one thread per row (column 0, first CTA of the cluster) writes the row statistics
            leader = tXcX[0][1] == 0
            if const_expr(L.cluster_n > 1):
                leader = leader and cy == 0
            if leader and row < M:
                if const_expr(mRstd is not None):
                    mRstd[row] = rstd
                if const_expr(mMean is not None):
                    mMean[row] = mean
        self.launch_dependents()

    @cute.jit
    def normalize(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
                  mRes: Optional[cute.Tensor], mResO: Optional[cute.Tensor], eps: Float32, view, buf, mbar,
                  part, tXcX: cute.Tensor, row: Int32, M: Int32, shift):
        """Load this thread's slice of its row (and residual, weight, bias), store the residual
        sum, reduce, and return (y in fp32, the x registers, rstd, mean); traced into the kernel.
        ``view(m)``: this thread's slice of a row tensor; ``shift``: a shifted row's first column in its
        window (None for aligned rows)."""
        h, rX, rRes, rResO, smem_rows, src, rW, rB = self.norm_inputs(mX, mW, mB, mRes, mResO, view, part, tXcX,
                                                                        row, M, shift)
        mean = Float32(0.0)
        if const_expr(self.layernorm):
            again = lambda: self.reload(src, rX, rRes, rResO, smem_rows, tXcX)  # noqa: E731
            inside = lambda v: self.row_columns(v, rX, tXcX, shift)  # noqa: E731
            if const_expr(self.pivoted):
                h, mean, var = self.pivot_moments(h, again, inside, self.pivot(mX, row, M), buf, mbar)
            else:
                h, mean, var = self.centred_moments(h, again, inside, buf, mbar)
        else:
            ss = (h * h).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
            var = self.row_allreduce(ss, add, Float32(0.0), buf, mbar, 0) / self.n
        rstd = cute.math.rsqrt(var + eps, fastmath=False)

        if const_expr(self.late_params):
            rW, rB = self.load_params(mW, mB, part, tXcX, row, shift)
        if const_expr((self.late_params or self.stage) and not self.layernorm):
            h = self.reload(src, rX, rRes, rResO, smem_rows, tXcX)
        y = h * rstd
        if const_expr(mW is not None):
            y = y * self.weight_values(rW)
        if const_expr(mB is not None):
            y = y + rB.load().to(Float32)
        return y, rX, rstd, mean

    @cute.jit
    def norm_inputs(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
                    mRes: Optional[cute.Tensor], mResO: Optional[cute.Tensor], view, part, tXcX: cute.Tensor,
                    row: Int32, M: Int32, shift):
        """``normalize``'s loads, up to its reduction: this thread's slice of its row (and residual) in fp32 h, the
        residual sum stored, the weight and bias (None where loaded late), the cluster waited for. -> (h, the x
        registers, the residual's and its sum's, the staged rows, what ``reload`` converts again, rW, rB)."""
        tXgX = view(mX)

        # Loads: rows past M load nothing (their values stay 0, or staged, undefined; never stored).
        rX = cute.make_rmem_tensor_like(tXgX)
        rRes, tXgRes = None, None
        if const_expr(mRes is not None):
            tXgRes = view(mRes)
            rRes = cute.make_rmem_tensor_like(tXgRes)
        smem_rows = None
        if const_expr(self.stage):
            smem_rows = self.stage_loads(tXgX, tXgRes, part, tXcX, row, M)
        else:
            rX.fill(0)
            if const_expr(mRes is not None):
                rRes.fill(0)
            if const_expr(self.unbranched):
                self.load_inputs(tXgX, rX, tXgRes, rRes, tXcX, shift)
            elif row < M:
                self.load_inputs(tXgX, rX, tXgRes, rRes, tXcX, shift)
        rW, rB = None, None
        if const_expr(not self.late_params):
            rW, rB = self.load_params(mW, mB, part, tXcX, row, shift)

        rResO = None
        if const_expr(mRes is not None):
            rResO = cute.make_rmem_tensor_like(rRes, self.res_out_dtype)
        h = self.row_values(rX, rRes, rResO, smem_rows, tXcX)
        if const_expr(mResO is not None):
            tXgResO = view(mResO)
            if row < M:
                self.store_slice(rResO, tXgResO, tXcX, self.res_out_dtype, shift)
        # what the values are computed from again after a reduction round (``reload``)
        src = rX if const_expr(mRes is None) else rResO
        if const_expr(self.stage):
            src = None

        self.wait_cluster()
        return h, rX, rRes, rResO, smem_rows, src, rW, rB

    @property
    def pivoted(self) -> bool:
        """Whether LayerNorm's moments take one reduction round about a pivot (``pivot_moments``), not two
        (``centred_moments``): 16-bit x, and a launch whose threads of one barrier or shuffle all take the
        fallback round or none: one row a CTA (a cluster's CTAs share their row), or rows inside warps (a
        warp vote). Several rows over several warps a CTA (a CTA-wide vote: a barrier more) keep two rounds;
        so does fp32 x (its 1e-5 bound leaves no room for the pivot's cancellation), and so do rows of
        narrower accesses than 16 bytes whose values are read again after the round (late parameters, staged):
        there ptxas gave the one round 17-28 registers more a thread, a CTA a SM fewer, and 22094, 45058 and
        71300 columns ran 1.06-1.34x the two rounds' time (H200)."""
        L = self.launch
        uniform = L.rows_per_cta == 1 or L.threads_per_row <= WARP
        if self.pivot_setting is not None:  # the ``ln_pivot`` development setting
            return self.layernorm and uniform and self.pivot_setting
        again = (self.late_params or self.stage) and L.vec * self.x_dtype.width < 128
        return self.layernorm and self.x_dtype.width == 16 and not again and uniform

    @cute.jit
    def pivot(self, mX: cute.Tensor, row, M):
        """The row's first value in fp32; 0 past M, or where it is not finite (a pivot of +inf would make the
        mean of a row holding +inf NaN, the reference's +inf)."""
        p = Float32(0.0)
        if row < M:
            v = mX[row, 0].to(Float32)
            if v - v == Float32(0.0):
                p = v
        return p

    @cute.jit
    def row_columns(self, vals, like: cute.Tensor, tXcX: cute.Tensor, shift):
        """``vals`` with the register columns outside the row (padding, a window's other rows) set to 0."""
        if const_expr(self.shifted):
            return cute.where(self.window_columns(like, tXcX, shift), vals, cute.full_like(vals, 0.0))
        if const_expr(not self.launch.even_n):
            return self.zero_padding(vals, like, tXcX)
        return vals

    def row_sums(self, c, buf, mbar, slot_a, slot_b):
        """(the sum of c, the sum of c^2) over the row, in one reduction round (slots ``slot_a``, ``slot_b``); c zero
        outside the row."""
        s1 = c.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        s2 = (c * c).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        return self.row_allreduce_pair(s1, s2, add, Float32(0.0), buf, mbar, slot_a, slot_b)

    @cute.jit
    def centred_moments(self, h, again, inside, buf, mbar):
        """(the centred values, mean, variance) in two reduction rounds: the mean, then the sums of the
        centred values and of their squares. ``again()``: the values once more (late parameters, staged rows);
        ``inside(v)``: v zero outside the row."""
        mean = self.row_allreduce(h.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0),
                                  add, Float32(0.0), buf, mbar, 0) / self.n
        if const_expr(self.late_params or self.stage):
            h = again()  # rather than held in fp32 across the round
        # columns outside the row hold 0 - mean after centring: zeroed before the squares (subtracting
        # pad * mean^2 afterwards cancels catastrophically when |mean| >> the row's spread)
        h = inside(h - mean)
        # The fp32 row sum leaves the mean a few ulps of |mean| off, which the spread then divides:
        # the sum of the centred values (nearly exact) corrects it, in the squares' barrier round.
        dsum, ss = self.row_sums(h, buf, mbar, 1, 2)
        corr = dsum / self.n
        mean = mean + corr
        if const_expr(self.late_params or self.stage):
            h = again() - mean  # columns outside the row are not stored
        else:
            h = h - corr
        # the clamp keeps a NaN (a row holding NaN or +-inf has no variance)
        return h, mean, cute.arch.fmax(ss / self.n - corr * corr, Float32(0.0), nan=True)

    @cute.jit
    def pivot_moments(self, h, again, inside, p, buf, mbar):
        """``centred_moments`` in one round where the pivot ``p`` (the row's first value) lies near the mean:
        the sums of d = x - p and of d^2; mean = p + mean(d), variance = mean(d^2) - mean(d)^2. That difference
        loses the variance's low bits as mean(d)^2 / variance grows: past ``PIVOT_LIMIT`` (a pivot more than 4
        standard deviations out, an outlier) the row takes a second round, ``centred_moments``' about that mean
        (the pivot's rounding, ~an ulp of |p|, then corrected)."""
        L = self.launch
        s1, s2 = self.row_sums(inside(h - p), buf, mbar, 0, 1)
        dbar = s1 / self.n
        var = s2 / self.n - dbar * dbar
        mean = p + dbar
        far = dbar * dbar > var * Float32(PIVOT_LIMIT)
        if const_expr(L.rows_per_cta > 1):  # rows inside warps: the warp's rows take the second round or none
            far = cute.arch.vote_any_sync(far)
        if far:
            c = inside((again() if const_expr(self.late_params or self.stage) else h) - mean)
            dsum, ss = self.row_sums(c, buf, mbar, 2, 3)
            corr = dsum / self.n
            mean = mean + corr
            var = ss / self.n - corr * corr
        if const_expr(self.late_params or self.stage):
            h = again()  # columns outside the row are not stored
        return h - mean, mean, cute.arch.fmax(var, Float32(0.0), nan=True)

    @cute.jit
    def stage_loads(self, tXgX: cute.Tensor, tXgRes, part, tXcX: cute.Tensor, row: Int32, M: Int32):
        """Copy this thread's slice of x (and the residual) into shared memory (cp.async, waited for:
        each thread reads back only what it copied; vectors past N are not copied, and ``row_values``
        reads them as 0). -> (x's, residual's or None) slices there."""
        L = self.launch
        smem = cutlass.memory.SmemAllocator()
        tile = cute.make_ordered_layout((L.rows_per_cta, L.cols_per_cta), order=(1, 0))
        tXsX = part(smem.allocate_tensor(self.x_dtype, tile, byte_alignment=16), None)
        tXsRes = None
        if const_expr(tXgRes is not None):
            tXsRes = part(smem.allocate_tensor(self.res_dtype, tile, byte_alignment=16), None)
        if row < M:
            self.copy_row(tXgX, tXsX, tXcX, self.x_dtype, cute.nvgpu.cpasync.CopyG2SOp())
            if const_expr(tXgRes is not None):
                self.copy_row(tXgRes, tXsRes, tXcX, self.res_dtype, cute.nvgpu.cpasync.CopyG2SOp())
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        return tXsX, tXsRes

    @cute.jit
    def row_values(self, rX: cute.Tensor, rRes, rResO, smem_rows, tXcX: cute.Tensor):
        """This thread's row values in fp32: x, or x + residual rounded to the residual output's dtype
        (the stored sum, kept in ``rResO``; the norm is of that rounded value, or with ``raw_sum`` of the fp32 sum);
        read from ``smem_rows`` (``stage_loads``) where staged, the vectors past N (never copied there) as 0."""
        if const_expr(smem_rows is not None):
            cute.autovec_copy(smem_rows[0], rX)
            if const_expr(rRes is not None):
                cute.autovec_copy(smem_rows[1], rRes)
        h = rX.load().to(Float32)
        if const_expr(rRes is not None):
            total = h + rRes.load().to(Float32)
            rResO.store(total.to(self.res_out_dtype))
            h = total if const_expr(self.raw_sum) else rResO.load().to(Float32)
        if const_expr(smem_rows is not None and not self.launch.even_n):
            h = self.zero_padding(h, rX, tXcX)
        return h

    @cute.jit
    def reload(self, src, rX: cute.Tensor, rRes, rResO, smem_rows, tXcX: cute.Tensor):
        """The row values in fp32 again after a reduction round: converted again from the registers
        they were computed from (``src``), or read again from shared memory (``smem_rows``)."""
        if const_expr(smem_rows is not None):
            return self.row_values(rX, rRes, rResO, smem_rows, tXcX)
        return src.load().to(Float32)

    @cute.jit
    def load_params(self, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor], part, tXcX: cute.Tensor, row,
                    shift=None):
        """This thread's slice of the weight and bias (row's head) in registers (None where absent); for a
        shifted row (``shift``: its first column in its window) at its window's columns (``load_shifted``)."""
        return (self.load_param(mW, part, tXcX, row, shift, self.w_dtype),
                self.load_param(mB, part, tXcX, row, shift, self.b_dtype))

    @cute.jit
    def load_param(self, mP: Optional[cute.Tensor], part, tXcX: cute.Tensor, row, shift, dtype: cutlass.Constexpr):
        """``load_params`` of one parameter."""
        if const_expr(mP is None):
            return None
        if const_expr(self.shifted):
            return self.load_shifted(mP, part, tXcX, shift, dtype)
        tXgP = part(self.head_rows(mP, row), 0)
        rP = cute.make_rmem_tensor_like(tXgP)
        if const_expr(not self.clamped):
            self.copy_row(tXgP, rP, tXcX, dtype)
        else:  # the values past N multiply x's zeros, their outputs never stored
            self.load_clamped(tXgP, rP, tXcX, dtype)
        return rP

    @cute.jit
    def load_shifted(self, mP: cute.Tensor, part, tXcX: cute.Tensor, shift, dtype: cutlass.Constexpr):
        """A per-column parameter at a shifted row's window columns: column j of the window is the
        parameter's j - shift, gathered a value at a time (the parameter is read by every row: from cache);
        0 outside the row."""
        L = self.launch
        base = cute.make_ptr(dtype, (mP.iterator - shift).toint(), cute.AddressSpace.gmem,
                             assumed_align=dtype.width // 8)
        tXgP = part(cute.make_tensor(base, cute.make_layout((L.rows_per_cta, L.N), stride=(0, 1))), 0)
        rP = cute.make_rmem_tensor_like(tXgP)
        rP.fill(0)
        for i in cutlass.range_constexpr(cute.size(rP)):
            if tXcX[i][1] >= shift and tXcX[i][1] < shift + self.n:
                rP[i] = tXgP[i]
        return rP

    @property
    def unbranched(self) -> bool:
        """x's loads unbranched (``rows_in_grid``) where a thread holds 16-bit values of one row, no residual
        and no wider parameter: with fp32 rows, a residual or an fp32 weight ptxas then spilled a few bytes."""
        return self.rows_in_grid and self.x_dtype.width == 16 and self.res_dtype is None and all(
            d is None or d.width <= 16 for d in (self.w_dtype, self.b_dtype))

    @cute.jit
    def load_inputs(self, tXgX: cute.Tensor, rX: cute.Tensor, tXgRes: Optional[cute.Tensor],
                    rRes: Optional[cute.Tensor], tXcX: cute.Tensor, shift):
        """Load this thread's slices of its row of x (and of the residual)."""
        self.load_slice(tXgX, rX, tXcX, self.x_dtype, shift)
        if const_expr(rRes is not None):
            self.load_slice(tXgRes, rRes, tXcX, self.res_dtype, shift)

    @cute.jit
    def load_slice(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr, shift):
        """Load this thread's slice of a row: ``copy_row``, or a shifted row's through its window (columns
        outside the row 0)."""
        if const_expr(self.shifted):
            self.load_window(src, dst, tXcX, shift, 0.0, dtype)
        elif const_expr(not self.clamped):
            self.copy_row(src, dst, tXcX, dtype)
        else:
            self.load_clamped(src, dst, tXcX, dtype)
            dst.store(cute.where(self.inside_vectors(dst, tXcX), dst.load(), cute.full_like(dst.load(), 0.0)))

    @property
    def clamped(self) -> bool:
        """Whether an uneven row (``launch.even_n`` false) of 16-byte accesses loads ``load_clamped``'s way; rows of
        narrower accesses keep the predicated loads (clamped, LayerNorm's 4750-column rows spilled on sm_100a)."""
        return not self.launch.even_n and self.launch.vec * self.x_dtype.width == 128

    @cute.jit
    def load_clamped(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr):
        """This thread's slice of an uneven row (``launch.even_n`` false), a vector past N read from the row's last
        vector instead (in bounds): the loads go out unpredicated, all at once. Predicated, ptxas unpacked each
        vector's values under its load's predicate, ran out of predicates past 6 vectors a thread (x and the
        weight), and waited for a load's data before the next vectors' loads (a round trip)."""
        L = self.launch
        atom = self.atom(dtype)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            s_i = src[None, None, i]
            back = cutlass.min(Int32(L.N - L.vec) - tXcX[(0, 0), 0, i][1], Int32(0))
            at = cute.make_ptr(dtype, (s_i.iterator + back).toint(), cute.AddressSpace.gmem, assumed_align=16)
            cute.copy(atom, cute.make_tensor(at, s_i.layout), dst[None, None, i])

    @cute.jit
    def store_slice(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr, shift):
        """Store this thread's slice of a row: ``copy_row``, or a shifted row's through its window."""
        if const_expr(self.shifted):
            self.store_window(src, dst, tXcX, shift, dtype)
        else:
            self.copy_row(src, dst, tXcX, dtype)


def _cute(name):
    return None if name is None else cute_dtype(name)


@dataclass(frozen=True, slots=True)
class ForwardKey:
    """What a norm forward is compiled for: dtypes (torch names; None for an absent tensor), N, flags
    and arch; M, strides and eps are runtime. Built once where a launch is prepared, it is the memoized
    compile's one argument."""
    x_dtype: str
    N: int
    arch: str
    _: KW_ONLY
    w_dtype: str | None = None
    b_dtype: str | None = None
    res_dtype: str | None = None  # the residual read
    res_out_dtype: str | None = None  # the sum stored (x + residual)
    store_rstd: bool = False
    layernorm: bool = False  # the row mean subtracted first (LayerNorm)
    store_mean: bool = False
    out_dtype: str | None = None  # default x's
    weight_offset: float = 0.0  # compiled in: y = x_hat * (w + offset)
    heads: int = 1  # per-head parameters [H, D]
    few: bool = False  # for calls of ``launch_table.few_rows`` rows (their own launch where the table has one)
    # RMSNorm rows off 16-byte boundaries (N not a multiple of the 128-bit vector), one head, x, residual and
    # outputs at the same offsets: read and written through aligned windows (``RowKernelBase.window``) of
    # 16-byte accesses, launched as an aligned row of the window's width
    window: bool = False


def widest_bits(*dtypes) -> int:
    """The widest of the dtypes (torch names; None for an absent tensor), in bits; 0 if none."""
    return max([cute_dtype(d).width for d in dtypes if d is not None], default=0)


def forward_window(k: ForwardKey) -> int | None:
    """The width of the aligned windows the forward for ``k`` reads its rows through, or None (aligned rows,
    or no window asked): RMSNorm or LayerNorm of one head, without a residual, its parameters of x's width, on
    rows of an odd width outside ``narrow_rows``' (whose launch stays), the window no wider than ``MAX_N``
    (LayerNorm's: ``LAYERNORM_WINDOW_MAX_N``). Measured on an H200 against the narrow kernel: rows of odd widths
    ran 0.35-0.9 of its time at most shapes (LayerNorm 0.41-0.75 at 423-33333 columns, 1.03x at 94557); rows
    whose accesses already held 4 or 8 bytes ran 1.0-1.3x (the weight gathered a value at a time costs more than
    the wider accesses save), and so did rows with a residual (its window held 60% more registers a thread) or an
    fp32 weight."""
    bits = cute_dtype(k.x_dtype).width
    if (not k.window or k.heads != 1 or k.res_dtype or widest_bits(k.w_dtype, k.b_dtype) > bits
            or k.N % 2 == 0):
        return None
    width = shifted_window(k.N, bits)
    # a window wider than MAX_N (262143 columns' is 262152) takes an access a thread more: on sm_100a's cluster of
    # 8 CTAs of 1024 threads, 5 where 4 fill the 64 registers such a thread has (200 bytes spilled)
    widest = LAYERNORM_WINDOW_MAX_N if k.layernorm else MAX_N
    return width if narrow_rows(k.N, bits) is None and width <= widest else None


def staged_rows(k: ForwardKey) -> RowLaunch | None:
    """The staged rule's launch for ``k`` (rows staged in shared memory, the weight loaded late), or None where it
    does not apply: RMSNorm of one head without a residual, 16-bit x, parameters and output, rows of 4-element
    accesses (``STAGED_MAX_ITERS``) or 2-element ones (``narrow_cluster_rows``' CTAs of 256 threads up to
    ``STAGED_NARROW_MAX_ITERS`` accesses) wider than ``CLUSTER_ROWS_MIN_N``, no ``fwd_upt`` setting; at any row count
    (its launch may split a row otherwise than the forward's rule: batch invariance)."""
    bits = cute_dtype(k.x_dtype).width
    vec = math.gcd(k.N, 8)
    if (k.layernorm or k.heads != 1 or k.res_dtype or bits != 16 or config.get().fwd_upt
            or widest_bits(k.w_dtype, k.b_dtype, k.out_dtype) > bits or k.N <= CLUSTER_ROWS_MIN_N
            or vec not in (2, 4)):
        return None
    if vec == 2:
        launch = narrow_cluster_rows(k.N, bits, WIDE_CLUSTER.get(k.arch, MAX_CLUSTER))
        held = cluster_rows(k.N, 2, launch.cluster_n, 256, STAGED_NARROW_MAX_ITERS, max_threads=256)
        if launch.num_threads > 256 and held.iters <= STAGED_NARROW_MAX_ITERS:
            return held
        return launch if launch.num_threads <= 512 else None  # (1024 threads staged: not measured)
    launch = cluster_rows(k.N, 4, MAX_CLUSTER, 256, STAGED_MAX_ITERS, max_threads=512)
    if launch.iters > STAGED_MAX_ITERS and k.arch in WIDE_CLUSTER:  # past 196608 columns: 16 CTAs of 256 threads
        launch = cluster_rows(k.N, 4, WIDE_CLUSTER[k.arch], 256, 2 * STAGED_MAX_ITERS, max_threads=256)
    return launch


def staged_min_ctas(launch: RowLaunch) -> int:
    """CTAs a SM the staged rule's kernel on ``launch`` keeps room for (``STAGED_CTAS``), 0 for none."""
    if launch.num_threads != 256:
        return 0
    return next((ctas for most, ctas in STAGED_CTAS.get(launch.vec, ()) if launch.iters <= most), 0)


@memo
def forward_launch_of(k: ForwardKey) -> tuple[str, RowLaunch]:
    """(the launch table's key, the launch) of the forward for ``k``: a table entry's, or the rule's
    (``staged_rows``, else ``forward_launch``) for its rows or their windows (``forward_window``)."""
    xd = cute_dtype(k.x_dtype)
    wide = widest_bits(k.w_dtype, k.res_dtype, k.res_out_dtype)
    width = forward_window(k)
    table_key = f"{'layernorm' if k.layernorm else 'rmsnorm'}_fwd{'_window' if width else ''}/x{xd.width}w{wide}"
    default = staged_rows(k) or forward_launch(width or k.N, xd.width, k.arch, wide, k.layernorm,
                                               k.res_dtype is not None)
    return table_key, pick(table_key, k.arch, default, config.get().fwd_upt, k.few)


@memo
def compiled_forward(k: ForwardKey):
    """Compile (or fetch) the forward for ``k``."""
    x_dtype, N, arch, w_dtype, b_dtype = k.x_dtype, k.N, k.arch, k.w_dtype, k.b_dtype
    res_dtype, res_out_dtype, store_rstd, layernorm = k.res_dtype, k.res_out_dtype, k.store_rstd, k.layernorm
    store_mean, out_dtype, weight_offset, heads, few = k.store_mean, k.out_dtype, k.weight_offset, k.heads, k.few
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the RMSNorm kernel handles 1 <= N <= {MAX_N}")
    xd = cute_dtype(x_dtype)
    out_dtype = out_dtype or x_dtype
    wide = widest_bits(w_dtype, res_dtype, res_out_dtype)
    table_key, launch = forward_launch_of(k)
    # None, or where a staged launch loads its parameters: a trial's or a table entry's staging, else the staged rule's
    ruled = launch == staged_rows(k)
    tuned = staged(table_key, arch, launch.N, config.get().fwd_upt, few, "late" if ruled else None)
    stage = stage_rows(launch, xd.width, cute_dtype(res_dtype).width if res_dtype else 0,
                       tuned is not None) and launch.N == N  # (never through windows)
    late = config.get().fwd_late
    if late is None:
        late = tuned == "late" if stage and tuned else late_params(launch, layernorm, wide > xd.width,
                                                                  launch.vec * xd.width < 128)
    # a register cap: a sweep's setting, else the staged rule's where its kernel runs as the rule has it
    ctas = config.get().fwd_ctas or (staged_min_ctas(launch) if ruled and stage and late else 0)
    pivot = config.get().ln_pivot if layernorm else None
    key = (FORWARD_KINDS[layernorm], x_dtype, w_dtype, b_dtype, res_dtype, res_out_dtype,
           out_dtype, store_rstd, store_mean, float(weight_offset), heads, N, arch, launch,
           *((("ctas", ctas),) if ctas else ()), *((("pivot", pivot),) if pivot is not None else ()),
           late, stage)  # the stage flag last (``ran_staged``)

    def build():
        dts = [_cute(d) for d in (w_dtype, b_dtype, res_dtype, res_out_dtype, out_dtype)]
        kernel = RMSNormForward(launch, xd, *dts[:3], dts[4], dts[3], store_rstd, layernorm, float(weight_offset),
                                heads, late, stage, n=N)
        kernel.min_ctas = ctas
        ptr = lambda dt: None if dt is None else gmem_ptr(dt)  # noqa: E731
        one = Int64(launch.vec)
        return compile_kernel(
            kernel, gmem_ptr(xd), ptr(dts[0]), ptr(dts[1]), ptr(dts[2]), gmem_ptr(dts[4]), ptr(dts[3]),
            gmem_ptr(Float32, 4) if store_rstd else None, gmem_ptr(Float32, 4) if store_mean else None,
            Int32(1), one, one, one, one, Float32(1e-6),
            fake_stream(), arch=arch)

    return CACHE.get(key, build)
