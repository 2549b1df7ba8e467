"""The norm backwards' launch rules (RMSNorm, LayerNorm; no cutlass here): what a backward is compiled for
(``BackwardKey``), its launch (``backward_launch``; per-head ``head_launch``), the persistent grid
(``backward_tpsm``, ``persistent_ctas``), the pipeline depth (``backward_depth``), whether the grid writes the
parameter gradients itself (``direct_sums``), and when a row is too wide for one cluster and takes the split
kernels (``split_rows``, ``split_launches``). The kernels are in ``rmsnorm_bwd``."""
from __future__ import annotations

import dataclasses
import math

from .. import config
from .launch_table import grid, pick
from .memo import memo
from .row_rules import WIDE_CLUSTER, RowLaunch, pick_row_launch, whole_warp_rows

# Tuning knobs per family: (128-bit units per thread, resident threads per SM the persistent grid
# is sized for, pipeline depth), chosen by sweeps of each dial (``python -m oink.tune --set``; docs/tuning.md).
# Both kernels hold ~110-255 registers a thread, so a SM holds one or two CTAs; the grid is counted
# in the clusters the GPU runs at once (``persistent_ctas``). A grid of more runs in waves and writes
# more dweight/dbias partial rows, all read again by the sum: slower but where a table entry says so ("grid").
# Depth 1: the next tile is loaded into a second register set that is moved into place after each
# tile; depth D >= 2: D register sets in rotation (the loop body unrolled D times), D - 1 tiles
# ahead. RMSNorm gains from the rotation at depth 2 (depth 3 spills at 8192); LayerNorm, near 255
# registers, loses.
# The development settings (oink.config) bwd_upt / bwd_tpsm / bwd_depth override, for sweeps; a row
# takes whole warps where they tile it (``whole_warp_rows``, which replaced power-of-two rows).
TUNING = {"rmsnorm": (2, 512, 2), "layernorm": (4, 256, 1)}
# A backward thread holds x, dout and (RMSNorm, depth 2) the next tile's: 128-145 registers for
# RMSNorm's 2 units, 216-255 for LayerNorm's 4, so CTAs stop where the register file allows them
# (64K / threads); a wider row takes a cluster.
BWD_MAX_THREADS = {"rmsnorm": 512, "layernorm": 256}
# The most x values a thread holds without spilling (scripts/spill_scan.py; 24 and 40 spilled at
# 73728 bf16). A row the portable cluster of 8 leaves wider than that takes a cluster of 16 where
# the arch takes one (``WIDE_CLUSTER``: a spilling thread's local-memory traffic costs far more than twice the
# CTAs, which spill nothing); a row wider even then, the split kernels (``split_rows``).
BWD_MAX_VALUES = {"rmsnorm": 16, "layernorm": 32}


# A row of 16-bit values whose width is not a multiple of 8 reads in narrower accesses (``vec`` elements):
# its threads hold as many values as an aligned row's, in 8 / vec times the accesses, over CTAs of at most
# NARROW_MAX_THREADS threads and at most NARROW_MAX_VALUES values a thread (LayerNorm: 26 held in 255
# registers at 6571 columns, 30 spilled). Counted in accesses, such rows took 8 / vec times the threads, in
# clusters (a DSMEM exchange a row, many short loads); CTAs of 512 threads leave a SM one, and a cluster of 2
# costs LayerNorm more than one CTA's more values a thread. Timings: docs/tuning.md, "The numbers behind the rules".
NARROW_MAX_THREADS = 256
NARROW_MAX_VALUES = {"rmsnorm": 16, "layernorm": 26}
# An RMSNorm row of 2-element accesses too wide for that budget in one CTA (past 4096 columns) takes rows of
# 128 threads holding up to this many values, two rows a CTA, not a cluster of 2 (the DSMEM exchange a row costs
# more than the values' registers up to here; past it the registers cost more, and 64 values spilled). Not with a
# dresidual: an fp32 one took 254 registers and spilled at 4702. Timings: docs/tuning.md.
NARROW_PAIR_VALUES = 38


def _knobs(layernorm: bool) -> tuple[int, int, int]:
    upt, tpsm, depth = TUNING["layernorm" if layernorm else "rmsnorm"]
    c = config.get()
    return c.bwd_upt or upt, c.bwd_tpsm or tpsm, c.bwd_depth or depth


def _budgets(N: int, x_bits: int, layernorm: bool, values: bool) -> list[tuple[int, int, int, int]]:
    """(accesses a thread, at most, threads a CTA at most, values a thread at most) to fit a row of N columns
    to, in turn: for a 16-bit row in narrow accesses, the budget in values (with ``values``, not under
    ``bwd_upt``); the family's."""
    family = "layernorm" if layernorm else "rmsnorm"
    upt, most = _knobs(layernorm)[0], BWD_MAX_THREADS[family]
    aligned = (upt, upt, most, BWD_MAX_VALUES[family])
    vec = math.gcd(N, 8)
    if not values or x_bits != 16 or vec == 8 or config.get().bwd_upt:
        return [aligned]
    most_values = NARROW_MAX_VALUES[family]
    return [(upt * 8 // vec, most_values // vec, min(most, NARROW_MAX_THREADS), most_values), aligned]


@memo
def head_launch(launch: RowLaunch, heads: int) -> RowLaunch | None:
    """``launch`` with rows_per_cta a multiple of ``heads`` (more rows a CTA), or None if that would
    pass 1024 threads: a thread's dweight partial must hold one head's rows only."""
    rows = launch.rows_per_cta * heads // math.gcd(launch.rows_per_cta, heads)
    if rows * launch.threads_per_row > 1024 or launch.cluster_n > 1:
        return None
    return dataclasses.replace(launch, num_threads=rows * launch.threads_per_row)


def _table_key(x_bits: int, layernorm: bool) -> tuple[str, bool]:
    """(the backward's launch-table key, whether a setting makes it ignore the table: ``bwd_upt``
    asks for the heuristic's variant)."""
    c = config.get()
    return f"{'layernorm' if layernorm else 'rmsnorm'}_bwd/x{x_bits}", bool(c.bwd_upt)


@memo
def backward_launch(N: int, x_bits: int, arch: str, layernorm: bool = False, few: bool = False,
                    values: bool = True, dres: bool = False) -> RowLaunch:
    """Launch heuristic for the norm backward (the one place it is chosen); SM100 reuses SM90's, but
    over at most the portable cluster of 8 (``WIDE_CLUSTER`` is SM90's).
    Where a whole number of warps covers a row exactly in at most ``upt`` accesses a thread
    (6144 = 384 threads x 2 x 8 bf16), a row takes that many threads rather than the next power
    of two, whose last access would be idle on a quarter of the threads (512 x 2 x 8 > 6144).
    The launch table's entry for (``rmsnorm_bwd/x<bits>`` or ``layernorm_bwd/x<bits>``, N) wins
    unless a setting (``bwd_upt``) asks for the heuristic's variant; ``few``: for
    calls of ``launch_table.few_rows`` rows (the key's "/few" entry where there is one); ``values``: a
    narrow row's budget counted in values (``NARROW_MAX_THREADS``, what every launch takes), else in accesses (the
    rule's other side, kept for its tests); ``dres``: a
    dresidual is added to dx (its registers: no ``NARROW_PAIR_VALUES`` rows)."""
    launch, upt, most, _ = _fitted_launch(N, x_bits, arch, layernorm, values, dres)
    # whole warps where they tile the row exactly (power-of-two rows otherwise)
    launch = whole_warp_rows(launch, upt, most)
    key, knob = _table_key(x_bits, layernorm)
    return pick(key, arch, launch, knob, few)


@memo
def _fitted_launch(N: int, x_bits: int, arch: str, layernorm: bool,
                   values: bool = True, dres: bool = False) -> tuple[RowLaunch, int, int, int]:
    """(the heuristic's power-of-two launch, over a cluster of ``WIDE_CLUSTER`` where the portable
    one would leave a thread more than its budget's values; the most accesses a thread, threads a CTA
    and values a thread it was fitted to): the first of ``_budgets`` whose launch holds the row."""
    budgets = _budgets(N, x_bits, layernorm, values)
    for i, (upt, most_upt, most, most_values) in enumerate(budgets):
        fit = dict(units_per_thread=upt, max_units_per_thread=most_upt, max_threads=most)
        launch = pick_row_launch(N, x_bits, **fit)
        values_budget = i == 0 and len(budgets) > 1  # a narrow row's budget counted in values
        if values_budget and launch.cluster_n > 1 and not (layernorm or dres) and launch.vec == 2 \
                and N <= 128 * NARROW_PAIR_VALUES:
            accesses = NARROW_PAIR_VALUES // 2
            pair = pick_row_launch(N, x_bits, units_per_thread=accesses, max_units_per_thread=accesses,
                                   max_threads=128)
            return dataclasses.replace(pair, num_threads=256), accesses, 128, NARROW_PAIR_VALUES
        if thread_values(launch) > most_values and arch in WIDE_CLUSTER:
            launch = pick_row_launch(N, x_bits, **fit, max_cluster=WIDE_CLUSTER[arch])
        if thread_values(launch) <= most_values:
            break
    return launch, most_upt, most, most_values


def thread_values(launch: RowLaunch) -> int:
    """Values of a row a thread of ``launch`` holds (its last access may be partly idle)."""
    return launch.iters * launch.vec


@memo
def backward_tpsm(N: int, x_bits: int, arch: str, layernorm: bool = False, few: bool = False) -> int:
    """Threads a SM the persistent grid is sized for: ``bwd_tpsm``, else the launch table's "grid"
    for the launch ``backward_launch`` takes (its knobs likewise make it ignore the table), else the
    family's default (``TUNING``)."""
    key, knob = _table_key(x_bits, layernorm)
    return config.get().bwd_tpsm or grid(key, arch, N, knob, few) or _knobs(layernorm)[1]


def backward_depth(launch: RowLaunch, layernorm: bool) -> int:
    """The pipeline depth of the backward for ``launch``: ``bwd_depth``, else the family's (``TUNING``), but 1 for
    CTAs of several rows whose last access is partly idle (RMSNorm's rows of 4 or 2 a CTA, ``even_n`` false: such
    short rows leave little latency for a second register set to hide, and depth 2 ran slower; docs/tuning.md)."""
    depth = _knobs(layernorm)[2]
    if config.get().bwd_depth or launch.rows_per_cta == 1 or launch.even_n:
        return depth
    return 1


@memo
def persistent_ctas(launch: RowLaunch, clusters: int, tpsm: int) -> int:
    """CTAs in x of the persistent grid (clusters of ``launch.cluster_n``): ``tpsm`` threads a SM
    (``backward_tpsm``) in each of the ``clusters`` the device runs at once with one CTA a SM
    (``host.resident_clusters``)."""
    return max(1, clusters * max(1, tpsm // launch.num_threads))


def direct_sums(launch: RowLaunch, ctas: int, M: int, heads: int = 1) -> bool:
    """Whether the backward's grid writes dweight and dbias itself, in the weight's dtype: one CTA (or
    cluster) whose first row's sums are the whole sums (one row a CTA, or one row in all), so that the
    partials' sum, a second launch, is left out (at a row or two the second launch costs about as
    much as the first)."""
    return ctas == 1 and heads == 1 and (launch.rows_per_cta == 1 or M == 1)


@dataclasses.dataclass(frozen=True, slots=True)
class BackwardKey:
    """What a norm backward is compiled for: dtypes (torch names; None for an absent tensor), N, flags
    and arch; M and strides are runtime. Built once where a launch is prepared, it is the memoized
    compile's one argument (``compiled_backward``'s; ``compiled_split_backward`` reads the fields up to
    ``weight_offset``)."""
    x_dtype: str
    N: int
    arch: str
    _: dataclasses.KW_ONLY
    dout_dtype: str
    w_dtype: str | None = None
    dres_dtype: str | None = None  # the gradient reaching the residual's sum (added to dx)
    has_db: bool = False
    layernorm: bool = False  # LayerNorm's backward (the row mean read)
    weight_offset: float = 0.0  # compiled in: dx's weight is w + offset (dw is unchanged)
    heads: int = 1  # per-head weights, rows_per_cta a multiple of them (``head_launch``)
    few: bool = False  # for calls of ``launch_table.few_rows`` rows
    direct: bool = False  # dweight and dbias stored in the weight's dtype, not fp32 partials (``direct_sums``)


# the split backward (``rmsnorm_bwd.SplitRowDots``, ``rmsnorm_bwd.SplitDx``) of rows too wide for one cluster
SPLIT_DOTS_THREADS, SPLIT_DOTS_UNITS = 256, 4  # kernel A: a CTA covers 256 x 4 vectors of a row
SPLIT_DX_THREADS, SPLIT_DX_UNITS = 128, 2  # kernel B: narrower chunks, so more CTAs share the rows
SPLIT_ROW_GROUPS, SPLIT_DEPTH = 4, 4  # B: CTAs along the rows (partial rows), rows loaded ahead


@memo
def split_rows(N: int, x_bits: int, arch: str, layernorm: bool) -> bool:
    """Whether the norm backward of rows of N columns takes the split kernels: where a thread of
    the heuristic's launch would hold more than ``BWD_MAX_VALUES`` or its budget's values (the ``bwd_split``
    setting forces it off/on, for A/B runs)."""
    forced = config.get().bwd_split
    if forced is not None:
        return forced
    family = "layernorm" if layernorm else "rmsnorm"
    launch, _, _, most_values = _fitted_launch(N, x_bits, arch, layernorm)
    return thread_values(launch) > max(BWD_MAX_VALUES[family], most_values)


def split_groups(M: int) -> int:
    """CTAs along the rows of the split backward's kernel B (its partial rows)."""
    return max(1, min(SPLIT_ROW_GROUPS, -(-M // SPLIT_DEPTH)))


@memo
def split_launches(N: int, x_bits: int) -> tuple[RowLaunch, RowLaunch]:
    """(kernel A's, kernel B's) launch: one row a CTA, its chunks as the launch's "cluster" (CTAs along
    y that are not a hardware cluster); the chunk count of A is the width of its shares buffer."""
    vec = math.gcd(N, 128 // x_bits)
    out = []
    for tpr, upt in ((SPLIT_DOTS_THREADS, SPLIT_DOTS_UNITS), (SPLIT_DX_THREADS, SPLIT_DX_UNITS)):
        chunks = -(-(N // vec) // (tpr * upt))
        out.append(RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=tpr, cluster_n=chunks))
    return tuple(out)
