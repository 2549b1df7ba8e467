"""The row kernels' launch rules (pure Python, no cutlass): how a row of N columns maps onto threads, CTAs and a
cluster (``RowLaunch``), the default heuristic (``pick_row_launch``) and the shared rules each family's heuristic
builds on (wide rows over a cluster, narrow accesses, exact whole-warp tilings). The kernels that take a
``RowLaunch`` are in ``reduction`` (``RowKernelBase``) and each family's module."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

WARP = 32
MAX_CLUSTER = 8  # the portable cluster size on SM90 and SM100
WIDE_CLUSTER = {"sm_90a": 16}  # the non-portable cluster size an arch's heuristics take (only where tuned with it)
MAX_N = 262144  # the widest row the row kernels take (wider rows use the reference)


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
# is not a multiple of 8 (narrower accesses) and fp32 rows take it from the same width on (the rule was tuned
# from there up: docs/tuning.md, "The numbers behind the rules").
CLUSTER_ROWS_MIN_N = 16384


# Rows of 16-bit values whose width is not a multiple of 8 (accesses narrower than 16 bytes) within these
# widths count a thread's budget in values, not accesses (``narrow_rows``): counted in accesses, such a row takes
# 8 / vec times the threads, each a few short loads, and a cluster sooner.
# With ``short`` (the norm forwards), rows of 2-element accesses (widths of 2 x an odd number) from that width on
# (rows of 4-element accesses, whose loads are twice as wide, gain nothing there and stay), below it rows of 2 and
# 4 too (a row then fits a warp). Timings: docs/tuning.md, "The numbers behind the rules".
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
    took 4x an aligned row's threads, CTAs of 512-1024 (one a SM, its loads stopped at each barrier). None
    where the row is aligned, not 16-bit, of 1-element accesses (odd widths: ``shifted_window``) or of 4 (their
    cap of 9 accesses is an aligned row's 8: only the CTAs would grow, no faster)."""
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
    power of two pads (LayerNorm at 4240 bf16: 160 threads of 4 accesses, not 256 of 3)."""
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


# torch dtype name -> bits: what a rule needs of a dtype (``compile.cute_dtype`` maps the same names to CuTe types)
DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "int32": 32, "int64": 64, "uint8": 8, "float8_e4m3fn": 8}


def dtype_bits(name: str) -> int:
    """Bits of a torch dtype name such as ``"bfloat16"``."""
    name = str(name).removeprefix("torch.")
    try:
        return DTYPE_BITS[name]
    except KeyError:
        raise TypeError(f"no CuTe dtype for {name!r}") from None
