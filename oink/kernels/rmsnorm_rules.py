"""The norm forwards' launch rules (RMSNorm, LayerNorm; no cutlass here): what a forward is compiled for
(``ForwardKey``), its launch (``forward_launch_of``: a launch-table entry, the staged rule ``staged_rows``, else
``forward_launch``, for its rows or their aligned windows ``forward_window``), and the kernel's forms for that
launch: parameters loaded late (``late_params``), rows staged in shared memory (``stage_rows``,
``staged_min_ctas``). The kernel is ``rmsnorm.RMSNormForward``."""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, replace

from .. import config
from .launch_table import pick
from .memo import memo
from .row_rules import (CLUSTER_ROWS_MIN_N, MAX_CLUSTER, MAX_N, NARROW_SHORT_N, WIDE_CLUSTER, RowLaunch, cluster_rows,
                        dtype_bits, fewest_warps, narrow_cluster_rows, narrow_rows, pick_row_launch, shifted_window,
                        whole_warp_rows)


# The forward's thread holds its units of x (and residual) live between the reduction and the
# store; 4 units a thread fill the 64 registers a thread of a 1024-thread CTA has, so a wider row
# takes a cluster rather than more units. LayerNorm's centred values need about 1.5x RMSNorm's
# registers, and a weight wider than x doubles the weight's: those CTAs stop at 640 and 512 threads.
FWD_MAX_UNITS = 4
LAYERNORM_MAX_THREADS = 640
# LayerNorm's rows of narrower accesses than 16 bytes past this width, a thread holding more than this many values,
# load their parameters late (``late_params``; 12288 columns for the others): a thread holding that many values has
# no registers to spare for the parameters across the reduction, while one holding fewer overlaps their loads with
# the row's (narrower rows untried; timings: docs/tuning.md)
LAYERNORM_LATE_NARROW_N = 4096
LAYERNORM_LATE_NARROW_VALUES = 20
# LayerNorm's windows (``forward_window``) up to this width: past it their CTAs of 512-1024 threads spilled
# (180225 and 262137 columns, both archs), and near it the window gained nothing over the narrow kernel
LAYERNORM_WINDOW_MAX_N = 131072
# LayerNorm's rows counted in values (``narrow_rows``) keep one CTA of at most this many threads, up to
# LAYERNORM_NARROW_MAX_VALUES a thread (else the CTA of 512): CTAs of 512 held 73-77 registers, one CTA a SM, while
# two CTAs of 256 keep more loads in flight; at more values a thread the 512 threads' fewer values a thread win
# (timings: docs/tuning.md).
LAYERNORM_NARROW_MAX_THREADS = 256
LAYERNORM_NARROW_MAX_VALUES = 56
WIDE_WEIGHT_MAX_THREADS = 512
WIDE_WEIGHT_NARROW_VALUES = 24  # values of x a thread holds before a narrow row with a wider weight takes a cluster


@memo
def forward_launch(N: int, x_bits: int, arch: str, w_bits: int = 0, layernorm: bool = False,
                   residual: bool = False) -> RowLaunch:
    """Launch heuristic for the forward (the one place it is chosen, but for the keys ``staged_rows`` takes, which
    ``forward_launch_of`` asks first: they hold more than a width). Tuned on SM90 only;
    SM100 takes the same shapes until they can be tuned there. Rows wider than
    ``CLUSTER_ROWS_MIN_N`` take the wide-row rule (``row_rules.cluster_rows``; 16-bit rows of 2-element
    accesses ``row_rules.narrow_cluster_rows``), 16-bit rows whose width is not a multiple of 8 (but a
    weight wider than x) ``row_rules.narrow_rows``, those of 2-element accesses at any width and of 4 up to
    1024 columns too (``NARROW_SHORT_N``). A ``residual`` (the fused add: twice the loads, more registers)
    keeps the access count for rows of 2- and 4-element accesses outside 4097-16384: counted in values, rows
    of 2 gained nothing there (twice the loads a value; timings: docs/tuning.md).
    A unit is one 128-bit access of x, 4 a thread; a weight or residual wider than x (fp32 with bf16 x:
    ``w_bits``, the widest) costs two accesses a unit, so rows then take 2 units a thread where that still
    covers the row exactly in one CTA (faster there, as at N = 4096; where the tile would not be exact, as at
    6144 and 7168, 4 units a thread stay faster); such rows whose width is not a multiple of x's vector
    hold as many values a thread, in narrower accesses, and up to ``WIDE_WEIGHT_NARROW_VALUES`` in one CTA
    (counted in accesses, such rows took clusters of 512-thread CTAs, one a SM; past that many values a thread
    the registers cost more than a cluster of 2's exchange; timings: docs/tuning.md).
    LayerNorm's rows counted in values keep CTAs of 256 threads (``LAYERNORM_NARROW_MAX_THREADS``); its other
    rows take whole warps where that tiles them exactly (7168 bf16: 224 threads): its
    padded tail costs registers (mask, corrected mean: 105 instead of 80 at 256 threads).
    The ``fwd_upt`` development setting (units a thread, oink.config) overrides, for sweeps."""
    if config.get().fwd_upt:
        return pick_row_launch(N, x_bits, units_per_thread=config.get().fwd_upt)
    if N > CLUSTER_ROWS_MIN_N:
        counted = w_bits <= x_bits and not residual  # a row's values counted, not its accesses
        spread = narrow_cluster_rows(N, x_bits, WIDE_CLUSTER.get(arch, MAX_CLUSTER)) if counted else None
        # not LayerNorm's clusters of 16 CTAs of 512 threads: slower than a cluster of 8 of 1024 (docs/tuning.md)
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
# this many accesses a thread (the staged tile is no register's), then CTAs of 512 (not 1024: one a SM), then
# on sm_90a a cluster of 16 CTAs of 256 (more, smaller CTAs a SM rather than 512 x 8 at 16 accesses). Held in
# registers, such a thread stopped at 5-6 accesses and the row took 16 CTAs. Timings: docs/tuning.md.
STAGED_MAX_ITERS = 12
# Rows of 2-element accesses (N % 4 == 2) keep ``narrow_cluster_rows``' CTAs of 256 threads past its 17 accesses,
# up to this many (on sm_90a every width: 16 CTAs), where it takes CTAs of 512: a staged thread's accesses hold no
# registers, so more of them cost little, and smaller CTAs share a SM (timings: docs/tuning.md).
STAGED_NARROW_MAX_ITERS = 32
# CTAs of 256 threads a SM the staged kernel keeps room for (``RMSNormForward.min_ctas``), by the row's elements an
# access and up to how many accesses a thread: ptxas left to itself holds a staged row's values in 66-94 registers
# (2-3 CTAs a SM), while the loads in flight that hide HBM's latency come from more CTAs (the capped kernel's
# timings: docs/tuning.md). Each cap is the most CTAs that compile without a spill on sm_90a and sm_100a (test_spills):
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
    return max([dtype_bits(d) for d in dtypes if d is not None], default=0)


def forward_window(k: ForwardKey) -> int | None:
    """The width of the aligned windows the forward for ``k`` reads its rows through, or None (aligned rows,
    or no window asked): RMSNorm or LayerNorm of one head, without a residual, its parameters of x's width, on
    rows of an odd width outside ``narrow_rows``' (whose launch stays), the window no wider than ``MAX_N``
    (LayerNorm's: ``LAYERNORM_WINDOW_MAX_N``). Against the narrow kernel, rows of odd widths gain the window's
    16-byte accesses for 1-element ones; rows whose accesses already held 4 or 8 bytes do not (the weight gathered a
    value at a time costs more than the wider accesses save), nor do rows with a residual (its window held 60%
    more registers a thread) or an fp32 weight (timings: docs/tuning.md)."""
    bits = dtype_bits(k.x_dtype)
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
    bits = dtype_bits(k.x_dtype)
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
        return launch if launch.num_threads <= 512 else None  # (1024 threads staged: untried)
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
    x_bits = dtype_bits(k.x_dtype)
    wide = widest_bits(k.w_dtype, k.res_dtype, k.res_out_dtype)
    width = forward_window(k)
    table_key = f"{'layernorm' if k.layernorm else 'rmsnorm'}_fwd{'_window' if width else ''}/x{x_bits}w{wide}"
    default = staged_rows(k) or forward_launch(width or k.N, x_bits, k.arch, wide, k.layernorm,
                                               k.res_dtype is not None)
    return table_key, pick(table_key, k.arch, default, config.get().fwd_upt, k.few)
