"""Row-reduction base shared by every row-wise kernel family (norms, softmax, cross-entropy).

A CTA owns ``rows_per_cta`` rows; each row is spread over ``threads_per_row`` threads that
move ``vec`` elements per 128-bit access, and for wide rows over ``cluster_n`` CTAs of a
thread-block cluster that combine their partial results through distributed shared memory.
Values stay in registers between the load and the store, so a kernel reads and writes each
element of memory once.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

from .. import config

WARP = 32
MAX_CLUSTER = 8  # the portable cluster size on SM90 and SM100
WIDE_CLUSTER = {"sm_90a": 16}  # the non-portable cluster size an arch's heuristics take (measured on H100)
MAX_N = 262144  # the widest row the row kernels take (wider rows use the reference)
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class RowLaunch:
    """How rows map onto threads: the knobs every row kernel's heuristic chooses."""

    N: int
    vec: int  # elements per thread per access (128 bits of the widest dtype)
    threads_per_row: int
    num_threads: int
    cluster_n: int = 1

    def __post_init__(self) -> None:
        tpr, nt = self.threads_per_row, self.num_threads
        # within a warp a row's threads must tile it (shuffle groups); above, any whole warps
        if (tpr < WARP and tpr & (tpr - 1)) or (tpr > WARP and tpr % WARP) or nt % WARP or nt % tpr or tpr > nt:
            raise ValueError(f"bad launch shape {self}: threads_per_row must be a power of two below "
                             f"{WARP} or whole warps, and divide num_threads (a multiple of {WARP})")
        if self.N % self.vec:
            raise ValueError(f"N={self.N} is not a multiple of vec={self.vec}")

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def iters(self) -> int:
        """128-bit accesses per thread per row (a row may end mid-tile: predicated)."""
        return math.ceil(self.N // self.vec / (self.threads_per_row * self.cluster_n))

    @property
    def cols_per_cta(self) -> int:
        return self.iters * self.vec * self.threads_per_row

    @property
    def even_n(self) -> bool:
        return self.cols_per_cta * self.cluster_n == self.N

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // WARP)


def pick_row_launch(N: int, widest_bits: int, units_per_thread: int = 4,
                    max_units_per_thread: int = 8, max_threads: int = 1024,
                    max_cluster: int = MAX_CLUSTER) -> RowLaunch:
    """Default heuristic. A "unit" is one 128-bit access of the widest dtype. Rows get the
    fewest threads (a power of two, at most ``max_threads``) that leave <= ``units_per_thread``
    units each; rows too wide for that are split over a cluster of up to ``max_cluster`` CTAs (8:
    the portable size) so that no thread holds more than ``max_units_per_thread`` units. The
    register file is 64K a SM, so a CTA of 1024 threads has 64 registers a thread: families whose
    threads hold more than 4 units' worth of live values pass a smaller ``max_threads``
    (``scripts/spill_scan.py`` shows what spills)."""
    vec = math.gcd(N, 128 // widest_bits)
    units = N // vec
    tpr = 1 << max(0, (math.ceil(units / units_per_thread) - 1).bit_length())
    tpr = min(tpr, 1024, 1 << (max_threads.bit_length() - 1))
    cluster_n = 1
    while units > tpr * cluster_n * max_units_per_thread and cluster_n < max_cluster:
        cluster_n *= 2
    return RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=max(128, tpr), cluster_n=cluster_n)


# Rows wider than this take ``cluster_rows``' launch in the norm and softmax forwards: a bf16 row would need
# more than 512 threads of one CTA at 4 units a thread. Counted in columns, not units, so rows whose width
# is not a multiple of 8 (narrower accesses) and fp32 rows take it from the same width on, the narrowest
# it was measured at (20480, bf16 and fp32).
CLUSTER_ROWS_MIN_N = 16384


# Rows of 16-bit values whose width is not a multiple of 8 (accesses narrower than 16 bytes) within these
# widths count a thread's budget in values, not accesses (``narrow_rows``): measured from 4619 to 8077.
# With ``short`` (the norm forwards), rows of 2-element accesses (widths of 2 x an odd number) from that width on
# (1030-3078 columns: 0.65-0.79 of the access-counted launch's time; rows of 4-element accesses 0.85-1.07x, and
# stay), below it rows of 2 and 4 too (a row then fits a warp; 138-1020: RMSNorm 0.45-1.02, LayerNorm 0.53-1.10; H200).
NARROW_ROWS_N = (4096, CLUSTER_ROWS_MIN_N)
NARROW_SHORT_N = 1024


def narrow_rows(N: int, x_bits: int, units_per_thread: int = 4, short: int | None = None) -> RowLaunch | None:
    """The one-CTA launch for a row of 16-bit values whose accesses are narrower than 16 bytes (``vec`` < 8):
    as many values a thread as an aligned row's ``units_per_thread`` accesses hold, in more, narrower
    accesses, rather than 8 / ``vec`` times the threads (each a few short loads, and a cluster sooner).
    None where the row is aligned, not 16-bit, or outside ``NARROW_ROWS_N``; with ``short``, rows of 2- and
    4-element accesses up to ``short`` columns and those of 2 from there on count values too."""
    vec = math.gcd(N, 128 // x_bits)
    lo = 0 if short is not None and (vec == 2 or (vec == 4 and N <= short)) else NARROW_ROWS_N[0]
    if x_bits != 16 or vec == 8 or not lo < N <= NARROW_ROWS_N[1]:
        return None
    scale = 8 // vec
    return pick_row_launch(N, x_bits, units_per_thread=units_per_thread * scale,
                           max_units_per_thread=units_per_thread * scale)


# Past ``CLUSTER_ROWS_MIN_N``, a thread of ``narrow_cluster_rows`` holds up to this many values (and one padded
# access more): 16 accesses of 2 elements, twice the accesses an aligned row's thread takes there
NARROW_CLUSTER_VALUES = 32


def narrow_cluster_rows(N: int, x_bits: int, max_cluster: int) -> RowLaunch | None:
    """The cluster launch for a row of 16-bit values whose accesses hold 2 elements, wider than
    ``CLUSTER_ROWS_MIN_N``: ``cluster_rows`` over CTAs of 256 threads, a thread's accesses capped at
    ``NARROW_CLUSTER_VALUES`` values (and one more access), not 8 accesses: counted in accesses, such a row
    took 4x an aligned row's threads, CTAs of 512-1024 (one a SM, its loads stopped at each barrier).
    RMSNorm forward on an H200, 20482-180226 columns: 0.65-0.85 of that launch's time. None where the row
    is aligned, not 16-bit, of 1-element accesses (odd widths: ``shifted_window``) or of 4 (their cap of
    9 accesses is an aligned row's 8: only the CTAs grew, 0.84-1.34x the time)."""
    vec = math.gcd(N, 128 // x_bits)
    if x_bits != 16 or vec != 2 or N <= CLUSTER_ROWS_MIN_N:
        return None
    return cluster_rows(N, vec, max_cluster, 256, NARROW_CLUSTER_VALUES // vec + 1)


def shifted_window(N: int, x_bits: int) -> int | None:
    """The width of the aligned window a row of N columns is read through where rows start off 16-byte
    boundaries (``RowKernelBase.window``): N plus up to a vector less one of lead, in whole vectors; None
    where N is a multiple of the 128-bit vector (every row starts aligned)."""
    vec = 128 // x_bits
    return None if N % vec == 0 else -(-(N + vec - 1) // vec) * vec


def cluster_rows(N: int, vec: int, max_cluster: int, cta_threads: int = 128, max_iters: int = 8,
                 min_iters: int = 3, max_threads: int = 1024, exact: bool = True) -> RowLaunch:
    """The launch rule for rows wider than one CTA holds well: many small CTAs over a cluster. The
    smallest cluster (a power of two, at most ``max_cluster``) whose CTAs of ``cta_threads`` threads
    hold the row in at most ``max_iters`` accesses a thread; past the widest cluster the CTAs grow (to
    ``max_threads``). Small CTAs share a SM, so some load while others wait at the cluster's barriers;
    a 1024-thread CTA holding its share in registers fills a SM alone and its loads stop at each
    barrier. Each CTA's share is then covered exactly by whole warps where a tiling exists (a padded
    last access costs more than a few threads more or less); where that tiling leaves a thread fewer
    than ``min_iters`` accesses, the cluster halves (fewer barriers' worth of exchanges a byte)."""
    units = N // vec
    cluster_n = 1
    while units > cluster_n * cta_threads * max_iters and cluster_n < max_cluster:
        cluster_n *= 2
    tpr = cta_threads
    while units > cluster_n * tpr * max_iters and tpr < max_threads:
        tpr *= 2
    launch = RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=max(128, tpr), cluster_n=cluster_n)
    if not exact:
        return launch
    launch = exact_share(launch, max_iters, max_threads)
    while launch.even_n and launch.iters < min_iters and launch.cluster_n > 1:
        wider = exact_share(dataclasses.replace(launch, cluster_n=launch.cluster_n // 2), max_iters, max_threads)
        if not wider.even_n:
            break
        launch = wider
    return launch


def exact_share(launch: RowLaunch, max_iters: int, max_threads: int = 1024) -> RowLaunch:
    """``launch`` with each CTA's share of the row covered exactly by whole warps in at most ``max_iters``
    accesses a thread, its cluster kept: the thread count nearest the launch's, at most the launch's where one
    fits (a larger CTA shares a SM with fewer others); unchanged where no such tiling exists."""
    units = launch.N // launch.vec
    if units % launch.cluster_n:
        return launch
    fits = [t for _, t in share_tilings(units // launch.cluster_n, max_iters, max_threads)
            if t >= 128 or 128 % t == 0]
    if not fits:
        return launch
    tpr = min(fits, key=lambda t: (t > launch.threads_per_row, abs(math.log2(t / launch.threads_per_row)), -t))
    return dataclasses.replace(launch, threads_per_row=tpr, num_threads=max(tpr, 128))


def least_padding(launch: RowLaunch, max_iters: int, max_threads: int = 512) -> RowLaunch:
    """``launch`` with each CTA's share of the row retiled over the whole warps (128 to ``max_threads``
    threads, at most ``max_iters`` accesses a thread) that pad its last access least, where the launch's own
    tiling pads more than an eighth of the share (a last access mostly idle costs its whole pass); else
    unchanged."""
    share = -(-(launch.N // launch.vec) // launch.cluster_n)

    def pad(t: int) -> int:
        return t * -(-share // t) - share

    if pad(launch.threads_per_row) * 8 <= share:
        return launch
    fits = [t for t in range(128, max_threads + 1, WARP) if -(-share // t) <= max_iters]
    best = min(fits, key=lambda t: (pad(t), t), default=None)
    if best is None or pad(best) >= pad(launch.threads_per_row):
        return launch
    return dataclasses.replace(launch, threads_per_row=best, num_threads=best)


def fewest_warps(launch: RowLaunch, max_iters: int, max_threads: int = 1024) -> RowLaunch:
    """``launch``'s row (one CTA) over the fewest whole warps that hold it in at most ``max_iters`` accesses a
    thread, CTAs of at least 128 threads (whole rows); unchanged where that needs more than ``max_threads``
    threads or a cluster. Fewer threads a row leave a SM room for more rows, so more bytes in flight, where a
    power of two pads: LayerNorm at 4240 bf16 ran 160 x 4 in 0.66 of 256 x 3's time (H200)."""
    units = launch.N // launch.vec
    tpr = WARP * -(-units // (max_iters * WARP))
    if launch.cluster_n > 1 or launch.threads_per_row < WARP or tpr > max_threads:
        return launch
    return dataclasses.replace(launch, threads_per_row=tpr, num_threads=tpr * -(-128 // tpr))


def share_tilings(share: int, max_iters: int, max_threads: int = 1024) -> list[tuple[int, int]]:
    """(accesses a thread, threads) of every whole-warp tiling that covers ``share`` 128-bit units exactly
    in at most ``max_iters`` accesses a thread and at most ``max_threads`` threads."""
    return [(it, share // it) for it in range(1, max_iters + 1)
            if share % it == 0 and (share // it) % WARP == 0 and share // it <= max_threads]


def whole_warp_rows(launch: RowLaunch, max_iters: int, max_threads: int = 1024) -> RowLaunch:
    """``launch`` retiled so a whole number of warps covers a row exactly in at most ``max_iters``
    accesses a thread (7168 bf16 = 224 threads x 4 x 8), where the power-of-two tiling leaves an idle
    padded tail (256 x 4 x 8 > 7168). A clustered launch first tries one CTA (a cluster costs a
    DSMEM exchange a row; 18432 bf16 = 576 x 4 x 8), then each of its CTAs' share tiled exactly
    (14336 bf16 over 2 CTAs = 448 x 2 x 8 each). Unchanged if already exact or no such tiling exists."""
    if launch.even_n:
        return launch
    units = launch.N // launch.vec
    for cluster_n in dict.fromkeys((1, launch.cluster_n)):
        per_cta = units // cluster_n
        if units % cluster_n:
            continue
        for iters in range(max_iters, 0, -1):
            tpr = per_cta // iters
            if per_cta % iters == 0 and tpr % WARP == 0 and tpr <= min(max_threads, 1024):
                return dataclasses.replace(launch, threads_per_row=tpr, num_threads=tpr, cluster_n=cluster_n)
    return launch


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
