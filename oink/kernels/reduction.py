"""Row-reduction base shared by every row-wise kernel family (norms, softmax, cross-entropy).

A CTA owns ``rows_per_cta`` rows; each row is spread over ``threads_per_row`` threads that
move ``vec`` elements per 128-bit access, and for wide rows over ``cluster_n`` CTAs of a
thread-block cluster that combine their partial results through distributed shared memory.
Values stay in registers between the load and the store, so a kernel reads and writes each
element of memory once.
"""
from __future__ import annotations

import math
import operator

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from .. import config
from .row_rules import WARP, RowLaunch

LOG2E = math.log2(math.e)


class RowKernelBase:
    """Shared pieces of row kernels: tiling, predicates, and the thread/warp/block/cluster
    all-reduce. Subclasses define ``__call__`` (host side) and ``kernel``."""

    arch: str | None = None  # the arch the kernel is traced for (``compile_kernel`` sets it)

    def __init__(self, launch: RowLaunch, num_reductions: int = 1, n: int | None = None):
        """``n``: the row's width where ``launch.N`` is its aligned window's (rows off 16-byte boundaries, read
        and written through ``window``: ``shifted``), at least n plus a vector less one."""
        self.launch = launch
        self.n = launch.N if n is None else n
        self.shifted = self.n != launch.N
        if self.shifted and launch.N < self.n + launch.vec - 1:
            raise ValueError(f"shifted rows of {self.n} columns: a window of >= n + vec - 1; got {launch}")
        self.num_reductions = num_reductions  # independent reduction slots (e.g. mean, var)
        self.pdl = config.get().pdl  # programmatic dependent launch (the compile cache keys on it)
        self.min_ctas = 0  # > 1: CTAs a SM ptxas keeps room for (``launch_rows``), a cap on registers a thread

    # ---- host-side helpers -------------------------------------------------------------
    def tiler(self):
        return (self.launch.rows_per_cta, self.launch.cols_per_cta)

    def atom(self, dtype, op=None):
        # a vector wider than 128 bits (the FP4 kernels' one-block units) is several 128-bit copies;
        # ``op``: the copy's operation (default a plain load/store; cp.async for shared memory)
        bits = min(128, self.launch.vec * dtype.width)
        return cute.make_copy_atom(op or cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)

    def tiled_copy(self, dtype):
        L = self.launch
        atom = self.atom(dtype)
        thr = cute.make_ordered_layout((L.rows_per_cta, L.threads_per_row), order=(1, 0))
        val = cute.make_layout((1, L.vec))
        return cute.make_tiled_copy_tv(atom, thr, val)

    def matrix(self, ptr, M, ld):
        """(M, N) view of a row-major matrix whose rows are ``ld`` elements apart."""
        ld = cute.assume(ld, divby=self.launch.vec)
        return cute.make_tensor(ptr, cute.make_layout((M, self.launch.N), stride=(ld, 1)))

    def shifted_matrix(self, ptr, M, ld):
        """(M, n) view of a row-major matrix whose rows start anywhere (read only through their windows,
        ``window``, or a value at a time): no alignment of ``ld`` assumed."""
        return cute.make_tensor(ptr, cute.make_layout((M, self.n), stride=(ld, 1)))

    def grid(self, M):
        return [cute.ceil_div(M, self.launch.rows_per_cta), self.launch.cluster_n, 1]

    @property
    def rows_in_grid(self) -> bool:
        """Whether a CTA's row loads go out unbranched: with one row a CTA the grid holds exactly M CTAs
        (``grid``), so every CTA's row lies in the tensor. Inside a ``row < M`` branch ptxas waits for each
        load before the branch closes, a round trip a vector where few rows leave the SMs idle between.
        SM90 only: on sm_100a the unbranched loads spilled a few bytes of some wide rows, and no SM100 card
        has timed them."""
        return self.launch.rows_per_cta == 1 and self.arch == "sm_90a"

    def cluster(self):
        return [1, self.launch.cluster_n, 1] if self.launch.cluster_n > 1 else None

    def launch_rows(self, kernel, M, stream, grid=None):
        """Launch a traced ``self.kernel(...)`` over M rows (or over ``grid``) with the launch's CTA
        and cluster shape, programmatic dependent launch as configured."""
        extra = {}
        if self.min_ctas > 1:  # (a carveout given, CuTeDSL asks no device for one: CPU compiles)
            extra = dict(min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=-1)
        kernel.launch(grid=self.grid(M) if grid is None else grid, block=[self.launch.num_threads, 1, 1],
                      cluster=self.cluster(), stream=stream, use_pdl=self.pdl, **extra)

    # ---- device-side helpers -------------------------------------------------------------
    @cute.jit
    def copy_row(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr,
                 op: cutlass.Constexpr = None):
        """Copy this thread's slice of a row, 128 bits (or vec elements) at a time (``op``: the copy's
        operation, ``atom``'s); a vector past N (uneven widths) is skipped: vec divides N, so vectors are
        all in or all out."""
        L = self.launch
        atom = self.atom(dtype, op)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            if const_expr(L.even_n):
                cute.copy(atom, src[None, None, i], dst[None, None, i])
            else:
                if tXcX[(0, 0), 0, i][1] < L.N:
                    cute.copy(atom, src[None, None, i], dst[None, None, i])

    @cute.jit
    def window(self, mX: cute.Tensor, row, M):
        """A shifted row's aligned window (a row of ``self.n`` columns that starts off a 16-byte boundary):
        (a (rows_per_cta, launch.N) tensor each of whose rows is this thread's row ``row`` from the 16-byte
        boundary at or before it (the base is 16-byte aligned), the row's first column in it). Only its
        vectors that hold columns of the row are read (``load_window``) or written (``store_window``), so
        no access leaves the memory the rows lie in."""
        L = self.launch
        start = Int64(0)
        if row < M:
            start = cute.crd2idx((row, 0), mX.layout)
        shift = Int32(start % L.vec)
        base = cute.make_ptr(mX.element_type, (mX.iterator + (start - shift)).toint(), cute.AddressSpace.gmem,
                             assumed_align=16)
        return cute.make_tensor(base, cute.make_layout((L.rows_per_cta, L.N), stride=(0, 1))), shift

    @cute.jit
    def row_window(self, mX: cute.Tensor, row, M, part):
        """``window`` as (column coordinates in the window, this thread's slice of it, the row's first
        column in it)."""
        window, shift = self.window(mX, row, M)
        return part(cute.make_identity_tensor(window.shape), 0), part(window, 0), shift

    @cute.jit
    def load_window(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, shift, fill: cutlass.Constexpr,
                    dtype: cutlass.Constexpr = None, each: cutlass.Constexpr = False):
        """Load this thread's slice of a shifted row from its window (``row_window``): the vectors holding
        columns of the row whole, the columns outside the row (of the rows beside it, or never read) as
        ``fill``. ``dtype``: the tensor's, if not x's. Every load goes out first, then one select: a
        vector's load and its edge fix-up in one branch made ptxas wait for each load in turn (a round trip
        a vector). ``each``: that per-vector form, which kept a softmax thread's 8 loads in one batch where
        the selects split them into 4 (SASS; 1.18x the time at 67 x 253687 columns)."""
        L = self.launch
        atom = self.atom(self.x_dtype) if const_expr(dtype is None) else self.atom(dtype)
        if const_expr(each):
            for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
                first = tXcX[(0, 0), 0, i][1]
                d_i = dst[None, None, i]
                if first < shift + self.n:
                    cute.copy(atom, src[None, None, i], d_i)
                if first < shift or first + L.vec > shift + self.n:  # an edge vector, or one past the row
                    c_i = tXcX[None, None, i]
                    for j in cutlass.range_constexpr(cute.size(d_i)):
                        if c_i[j][1] < shift or c_i[j][1] >= shift + self.n:
                            d_i[j] = d_i.element_type(fill)
        else:
            raw = cute.make_rmem_tensor_like(dst)
            for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
                if tXcX[(0, 0), 0, i][1] < shift + self.n:
                    cute.copy(atom, src[None, None, i], raw[None, None, i])
            dst.store(cute.where(self.window_columns(raw, tXcX, shift), raw.load(), cute.full_like(raw.load(), fill)))

    @cute.jit
    def window_columns(self, like: cute.Tensor, tXcX: cute.Tensor, shift):
        """Booleans shaped like the register tensor ``like``: whether each value of a shifted row's window
        (``row_window``) is a column of the row."""
        keep = cute.make_rmem_tensor_like(like, cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(keep)):
            col = tXcX[i][1]
            keep[i] = col >= shift and col < shift + self.n
        return keep.load()

    @cute.jit
    def store_window(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, shift,
                     dtype: cutlass.Constexpr = None):
        """Store a shifted row through its aligned window: whole vectors inside the row, the row's
        columns of its two edge vectors one at a time (their other columns are the rows beside it,
        which other CTAs write), nothing past the row. ``dtype``: the tensor's, if not x's."""
        L = self.launch
        atom = self.atom(self.x_dtype) if const_expr(dtype is None) else self.atom(dtype)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            first = tXcX[(0, 0), 0, i][1]
            if first >= shift and first + L.vec <= shift + self.n:
                cute.copy(atom, src[None, None, i], dst[None, None, i])
            elif first < shift + self.n:
                s_i, d_i, c_i = src[None, None, i], dst[None, None, i], tXcX[None, None, i]
                for j in cutlass.range_constexpr(cute.size(s_i)):
                    if c_i[j][1] >= shift and c_i[j][1] < shift + self.n:
                        d_i[j] = s_i[j]

    @cute.jit
    def zero_padding(self, vals, like: cute.Tensor, tXcX: cute.Tensor):
        """``vals`` (fp32, shaped like the register tensor ``like``) with the vectors past N set to 0,
        by selects (no branch, no register copy); only vectors that can pass N are tested."""
        return cute.where(self.inside_vectors(like, tXcX), vals, cute.full_like(vals, 0.0))

    @cute.jit
    def inside_vectors(self, like: cute.Tensor, tXcX: cute.Tensor, every: cutlass.Constexpr = False):
        """Booleans shaped like the register tensor ``like``: whether each value's vector lies before N
        (a vector is in or out: vec divides N). Only vectors that can pass N are tested, unless ``every``
        (a streamed tile's columns move with the tile)."""
        L = self.launch
        keep = cute.make_rmem_tensor_like(like, cutlass.Boolean)
        for i in cutlass.range_constexpr(cute.size(keep, mode=[2])):
            vec_i = keep[None, None, i]
            if const_expr(not every and L.cluster_n == 1 and (i + 1) * L.threads_per_row * L.vec <= L.N):
                for j in cutlass.range_constexpr(cute.size(vec_i)):
                    vec_i[j] = cutlass.Boolean(True)
            else:
                inside = cute.elem_less(tXcX[(0, 0), 0, i][1], L.N)
                for j in cutlass.range_constexpr(cute.size(vec_i)):
                    vec_i[j] = inside
        return keep.load()

    def cta_setup(self, tc):
        """Per-CTA prologue, traced inline into each kernel: the block index (row tile) and the
        cluster rank (y), the reduction buffer and cluster barriers, and ``part(tensor, tile)``
        giving this thread's slice of a row tile (``tile`` None: of a tensor one tile big)."""
        if const_expr(self.pdl):  # launched early (PDL): no read before the kernel ahead has ended
            cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cy, _ = cute.arch.block_idx()
        if const_expr(self.launch.cluster_n == 1):
            cy = Int32(0)
        smem = cutlass.memory.SmemAllocator()
        buf, mbar = self.alloc_reduction(smem)
        self.init_cluster(mbar)
        thr = tc.get_slice(tidx)
        tiler = self.tiler()

        def part(t, tile):
            if tile is None:  # a tensor of one tile's shape (shared memory)
                return thr.partition_S(t)
            return thr.partition_S(cute.local_tile(t, tiler, (tile, cy)))

        return bidx, cy, buf, mbar, part

    @cute.jit
    def launch_dependents(self):
        """After this CTA's last store is issued: the next kernel (launched with PDL) may launch; it
        waits for this grid's end before it reads."""
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()

    def alloc_reduction(self, smem):
        """Shared buffer [slot][row][warp-in-row x cluster rank] plus one mbarrier per slot."""
        L = self.launch
        width = L.warps_per_row * L.cluster_n
        buf = None
        mbar = None
        if const_expr(width > 1 and self.num_reductions > 0):
            buf = smem.allocate_tensor(
                Float32,
                cute.make_ordered_layout((L.rows_per_cta, width, self.num_reductions), order=(1, 0, 2)),
                byte_alignment=16,
            )
        if const_expr(L.cluster_n > 1 and self.num_reductions > 0):
            mbar = smem.allocate_array(Int64, num_elems=self.num_reductions)
        return buf, mbar

    @cute.jit
    def init_cluster(self, mbar):
        """Initialise the cluster barriers; peers must see them before any remote store."""
        if const_expr(self.launch.cluster_n > 1 and self.num_reductions > 0):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx < self.num_reductions:
                cute.arch.mbarrier_init(mbar + tidx, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.cluster_arrive_relaxed()

    @cute.jit
    def wait_cluster(self):
        if const_expr(self.launch.cluster_n > 1 and self.num_reductions > 0):
            cute.arch.cluster_wait()

    @cute.jit
    def row_allreduce(self, val: Float32, op: cutlass.Constexpr, init: Float32, buf, mbar, slot,
                      phase=0) -> Float32:
        """Combine one fp32 value per thread across its row: warp shuffles, then shared
        memory across the warps of a row, then DSMEM across the CTAs of a cluster.
        Every thread of the row gets the result. ``slot`` picks the buffer and mbarrier; a
        loop that reduces repeatedly alternates two slots (so no one overwrites a slot still
        being read) and passes each slot's mbarrier ``phase`` (0, 1, 0, ... per reuse)."""
        return self.row_allreduce_pair(val, None, op, init, buf, mbar, slot, None, phase)[0]

    @cute.jit
    def load_values(self, mX: cute.Tensor, mUp, dtype: cutlass.Constexpr, bidx, part, tXcX: cute.Tensor, row, M):
        """This thread's slice of its row in fp32 (rows past M read nothing: zeros), or with ``mUp``
        (the up half of a gated [gate | up] row) silu(gate) * up. Fast exp2 and reciprocal: a few
        ulp (an IEEE divide is ~10 instructions and a slow-path branch); the fused quantizing ops owe
        codes within one step. -> (fp32 values, the x registers)."""
        L = self.launch
        tXgX = part(mX, bidx)
        rX = cute.make_rmem_tensor_like(tXgX)
        rX.fill(0)
        rUp = None
        if const_expr(mUp is not None):
            rUp = cute.make_rmem_tensor_like(tXgX)
            rUp.fill(0)
        # one predicate guards both halves' copies of a unit (two copy_row calls would test it twice)
        atom = self.atom(dtype)
        if row < M:
            for i in cutlass.range_constexpr(cute.size(tXgX, mode=[2])):
                if const_expr(L.even_n) or tXcX[(0, 0), 0, i][1] < L.N:
                    cute.copy(atom, tXgX[None, None, i], rX[None, None, i])
                    if const_expr(mUp is not None):
                        cute.copy(atom, part(mUp, bidx)[None, None, i], rUp[None, None, i])
        rV = cute.make_rmem_tensor_like(rX, Float32)
        rV.store(rX.load().to(Float32))
        if const_expr(mUp is not None):
            rU = cute.make_rmem_tensor_like(rX, Float32)
            rU.store(rUp.load().to(Float32))
            for j in cutlass.range_constexpr(cute.size(rV)):
                g = rV[j]
                rV[j] = g * cute.arch.rcp_approx(1.0 + cute.math.exp2(g * -LOG2E, fastmath=True)) * rU[j]
        return rV, rX

    @cute.jit
    def row_exp_sum(self, x, buf, mbar):
        """(row max m, exp(x - m), the row's sum of it): reduction slots 0 and 1 (softmax, which needs
        exp(x - m) itself; the cross-entropy forward takes ``row_max_sum``)."""
        m = x.reduce(cute.ReductionOp.MAX, init_val=Float32(-math.inf), reduction_profile=0)
        m = self.row_allreduce(m, fmax, Float32(-math.inf), buf, mbar, 0)
        e = cute.math.exp2((x - m) * LOG2E, fastmath=True)
        s = e.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        return m, e, self.row_allreduce(s, add, Float32(0.0), buf, mbar, 1)

    @cute.jit
    def row_max_sum(self, x, buf, mbar, with_exp: cutlass.Constexpr = False, extra=None, also=None):
        """(row max m, the row's sum of exp(x - m)) in one reduction round (slots 0 and 1), where
        ``row_exp_sum`` takes two, one after the other: each thread's (max, sum of exp(x - its max))
        pairs merge by rescaling both sums to the larger max (online softmax). ``with_exp``: also
        exp(x - m), as the thread's exp(x - its max) times one rescale factor (softmax). ``extra``: a
        thread's partial of a further row sum, reduced in the same round (slot 2) and returned third.
        ``also``: a thread's value of the row held apart (or -inf), folded into its max only: the round's
        result is the same, and it completes only once that value is in."""
        m = x.reduce(cute.ReductionOp.MAX, init_val=Float32(-math.inf), reduction_profile=0)
        if const_expr(also is not None):
            m = cute.arch.fmax(m, also)
        shift = m
        if m == Float32(-math.inf):  # only padding (-inf) here: exp2(-inf) sums to 0, never NaN
            shift = Float32(0.0)
        e = cute.math.exp2((x - shift) * LOG2E, fastmath=True)
        s = e.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        if const_expr(extra is not None):
            return self.merge_max_sum(m, s, buf, mbar, extra)
        row_m, s = self.merge_max_sum(m, s, buf, mbar)
        if const_expr(with_exp):
            # a thread of -inf only has e = 0 and shift 0, whose factor may overflow: 0, not 0 * inf
            scale = Float32(0.0)
            if m != Float32(-math.inf):
                scale = cute.math.exp2((shift - row_m) * LOG2E, fastmath=True)
            return row_m, s, e * scale
        return row_m, s

    @cute.jit
    def merge_max_sum(self, m: Float32, s: Float32, buf, mbar, extra=None, posinf: cutlass.Constexpr = False):
        """Every thread's (max, sum of exp(x - max)) pair merged over its row: butterflies within the
        warp, then one exchange through shared memory (and DSMEM across a cluster). Slots 0 and 1;
        ``extra`` (a plain sum, or None) rides along in slot 2. ``posinf`` (the cross-entropy's streamed
        rows, whose threads count their +inf values where their max is +inf): see ``_merge_max_sum``."""
        L = self.launch
        group = min(L.threads_per_row, WARP)
        for i in cutlass.range_constexpr(int(math.log2(group))):
            if const_expr(extra is not None):
                extra = extra + cute.arch.shuffle_sync_bfly(extra, offset=group >> (i + 1), mask=-1,
                                                            mask_and_clamp=31)
            m, s = _merge_max_sum(m, s, *_bfly_pair(m, s, group >> (i + 1)), posinf)
        width = const_expr(L.warps_per_row * L.cluster_n)
        if const_expr(width > 1):
            buf_m, buf_s, row, lane = self._publish(m, s, buf, mbar, 0, 1, 0, extra)
            m, s = Float32(-math.inf), Float32(0.0)
            if const_expr(extra is not None):
                extra = self._combine(buf[None, None, 2], row, lane, width, add, Float32(0.0))
            for i in cutlass.range_constexpr(cute.ceil_div(width, WARP)):
                idx = lane + i * WARP
                if idx < width:
                    m, s = _merge_max_sum(m, s, buf_m[row, idx], buf_s[row, idx], posinf)
            for i in cutlass.range_constexpr(5):
                m, s = _merge_max_sum(m, s, *_bfly_pair(m, s, WARP >> (i + 1)), posinf)
        if const_expr(extra is not None):
            return m, s, extra
        return m, s

    @cute.jit
    def row_allreduce_pair(self, a: Float32, b, op: cutlass.Constexpr, init: Float32, buf, mbar, slot_a,
                           slot_b, phase=0, op_b: cutlass.Constexpr = None, init_b=None):
        """``row_allreduce`` of two independent values (b may be None) sharing one barrier round,
        each through its own slot; b combined by ``op_b`` from ``init_b`` where given, else as a. -> (a, b)."""
        L = self.launch
        group = min(L.threads_per_row, WARP)
        op_b = op if const_expr(op_b is None) else op_b
        init_b = init if const_expr(init_b is None) else init_b
        a = cute.arch.warp_reduction(a, op, threads_in_group=group)
        if const_expr(b is not None):
            b = cute.arch.warp_reduction(b, op_b, threads_in_group=group)
        width = const_expr(L.warps_per_row * L.cluster_n)
        if const_expr(width > 1):
            buf_a, buf_b, row, lane = self._publish(a, b, buf, mbar, slot_a, slot_b, phase)
            a = self._combine(buf_a, row, lane, width, op, init)
            if const_expr(b is not None):
                b = self._combine(buf_b, row, lane, width, op_b, init_b)
        return a, b

    @cute.jit
    def _publish(self, a: Float32, b, buf, mbar, slot_a, slot_b, phase, c=None):
        """Each warp's partial of its row (lane 0's ``a``, and ``b`` unless None) into the row's
        shared buffer of every CTA of the cluster (slots ``slot_a``, ``slot_b``; ``c`` unless None
        into slot 2), waiting until all have arrived. -> (buffer a, buffer b, row in the CTA, lane) to
        read them back."""
        L = self.launch
        width = const_expr(L.warps_per_row * L.cluster_n)
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = warp // L.warps_per_row
        col = warp % L.warps_per_row
        buf_a = buf[None, None, slot_a]
        buf_b = buf[None, None, slot_b] if const_expr(b is not None) else None
        if const_expr(L.cluster_n == 1):
            if lane == 0:
                buf_a[row, col] = a
                if const_expr(b is not None):
                    buf_b[row, col] = b
                if const_expr(c is not None):
                    buf[row, col, 2] = c
            cute.arch.barrier()
        else:
            rank = cute.arch.block_idx_in_cluster()
            nbytes = L.rows_per_cta * width * 4
            if warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar + slot_a, nbytes)
                    if const_expr(b is not None):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + slot_b, nbytes)
                    if const_expr(c is not None):
                        cute.arch.mbarrier_arrive_and_expect_tx(mbar + 2, nbytes)
            if lane < L.cluster_n:
                at = cute.crd2idx((row, col + rank * L.warps_per_row), buf_a.layout)
                _store_remote_f32(a, buf_a.iterator + at, mbar + slot_a, lane)
                if const_expr(b is not None):
                    _store_remote_f32(b, buf_b.iterator + at, mbar + slot_b, lane)
                if const_expr(c is not None):
                    buf_c = buf[None, None, 2]
                    _store_remote_f32(c, buf_c.iterator + at, mbar + 2, lane)
            cute.arch.mbarrier_wait(mbar + slot_a, phase=phase)
            if const_expr(b is not None):
                cute.arch.mbarrier_wait(mbar + slot_b, phase=phase)
            if const_expr(c is not None):
                cute.arch.mbarrier_wait(mbar + 2, phase=phase)
        return buf_a, buf_b, row, lane

    @cute.jit
    def _combine(self, sbuf, row, lane, width: cutlass.Constexpr, op: cutlass.Constexpr, init: Float32) -> Float32:
        """Reduce the ``width`` partials of a row held in shared memory (every lane gets it)."""
        acc = init
        for i in cutlass.range_constexpr(cute.ceil_div(width, WARP)):
            idx = lane + i * WARP
            if idx < width:
                acc = op(acc, sbuf[row, idx])
        return cute.arch.warp_reduction(acc, op)


@cutlass.cutlass_dsl.dsl_user_op
def _store_remote_f32(val, smem_ptr, mbar_ptr, peer, *, loc=None, ip=None):
    """st.async of one fp32 into a peer CTA's shared memory, completing bytes on its mbarrier."""
    remote = cute.arch.map_dsmem_ptr(smem_ptr, peer, loc=loc, ip=ip)
    remote_bar = cute.arch.map_dsmem_ptr(mbar_ptr, peer, loc=loc, ip=ip)
    cute.arch.inline_ptx(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [{$r0}], {$r1}, [{$r2}];",
        read_only_args=[
            Int32(remote.toint(loc=loc, ip=ip)),
            Float32(val),
            Int32(remote_bar.toint(loc=loc, ip=ip)),
        ],
        loc=loc,
        ip=ip,
    )


add = operator.add


@cute.jit
def _bfly_pair(m: Float32, s: Float32, offset: cutlass.Constexpr):
    """The (max, sum) pair of the lane ``offset`` away (butterfly)."""
    return (cute.arch.shuffle_sync_bfly(m, offset=offset, mask=-1, mask_and_clamp=31),
            cute.arch.shuffle_sync_bfly(s, offset=offset, mask=-1, mask_and_clamp=31))


@cute.jit
def _merge_max_sum(m1: Float32, s1: Float32, m2: Float32, s2: Float32, posinf: cutlass.Constexpr = False):
    """Two (max, sum of exp(x - max)) partials as one, at the larger max. Two all-padding partials
    (max -inf, sum 0) stay (-inf, 0), where exp2(-inf - -inf) would make the sum NaN. ``posinf``: a
    partial at the merged max keeps its sum as it is (factor 1, exact for finite maxes too), so at a
    max of +inf the partials' counts of +inf values add and the others drop (exp2(-inf) = 0)."""
    m = cute.arch.fmax(m1, m2)
    s = s1 + s2
    if const_expr(posinf):
        f1 = cute.math.exp2((m1 - m) * LOG2E, fastmath=True)
        f2 = cute.math.exp2((m2 - m) * LOG2E, fastmath=True)
        if m1 == m:
            f1 = Float32(1.0)
        if m2 == m:
            f2 = Float32(1.0)
        s = s1 * f1 + s2 * f2
    else:
        if m != Float32(-math.inf):
            s = s1 * cute.math.exp2((m1 - m) * LOG2E, fastmath=True) + s2 * cute.math.exp2((m2 - m) * LOG2E,
                                                                                           fastmath=True)
    return m, s


@cute.jit
def fmax(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b)


def pure_asm(res_type, ptx: str, constraints: str, args, loc=None, ip=None):
    """Pure (side-effect free) inline PTX: LLVM may schedule, CSE and drop it like arithmetic."""
    return llvm.inline_asm(res_type, args, ptx, constraints, has_side_effects=False, is_align_stack=False,
                           loc=loc, ip=ip)
