"""The FP8 quantizers' launch rules (no cutlass here): ``fp8_launch`` (a table entry, else ``fp8_rule``'s whole warps
a row, else the FP4 kernels' tiling of 16-value units). The kernels are ``fp8``'s."""
from __future__ import annotations

from .. import config
from .launch_table import pick
from .nvfp4_rules import fp4_launch
from .row_rules import RowLaunch

UNIT = 16  # values a thread unit holds: its codes are one 128-bit store


def whole_warp_launch(N: int, vec: int, max_iters: int = 4, iters: int = 2, max_threads: int = 1024,
                      cluster: int = 1) -> RowLaunch | None:
    """A row over whole warps (of each of ``cluster`` CTAs) with at most ``max_iters`` accesses a thread and the
    least padding (within 5% of the row, the accesses a thread nearest ``iters``): 2560 / 16 = 160 threads x 1,
    4992: 160 x 2, 11008: 352 x 2, where a power of two of threads leaves 96 of 256, 200 of 512 and 336 of 1024
    idle. None past ``max_threads`` threads a CTA, or where the cluster does not split the row in whole units."""
    units = N // vec
    if units % cluster:
        return None
    units //= cluster
    fits = [(tpr * -(-units // tpr) - units, -(-units // tpr), tpr) for tpr in range(32, max_threads + 1, 32)
            if -(-units // tpr) <= max_iters]
    if not fits:
        return None
    _, _, tpr = min(fits, key=lambda f: (f[0] > 0.05 * units, abs(f[1] - iters), f[0]))
    return RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=tpr * -(-128 // tpr),  # CTAs >= 128 threads
                     cluster_n=cluster)


# A thread of the FP8 kernels at 2 accesses holds about 64 registers, so a CTA of more than 512 threads leaves
# a SM one CTA, too few loads in flight (bench/RESULTS.md); wider rows split over a cluster instead.
CTA_THREADS = 512


def fp8_rule(N: int) -> RowLaunch | None:
    """Whole warps a row (``whole_warp_launch``); a row that takes more than ``CTA_THREADS`` threads that way
    spreads over the smallest cluster (up to 8) whose CTAs hold it in at most ``CTA_THREADS`` threads and two
    accesses a thread (registers grow with the accesses), else keeps its one CTA."""
    launch = whole_warp_launch(N, UNIT)
    if launch is None or launch.threads_per_row <= CTA_THREADS:
        return launch
    for cluster in (2, 4, 8):
        split = whole_warp_launch(N, UNIT, max_iters=2, max_threads=CTA_THREADS, cluster=cluster)
        if split is not None:
            return split
    return launch


def fp8_launch(N: int, arch: str, kind: str, group_size: int, op: str | None = None) -> RowLaunch:
    """Launch heuristic for the FP8 kernels (the one place it is chosen): the tuned table's shape for
    (op, group or row scales), else ``fp8_rule`` (rows past it: the FP4 kernels' tiling with 16-value units,
    clusters included); checked to keep a group within a warp's aligned lanes. ``fp4_upt`` (a sweep's dial)
    sets the FP4 tiling."""
    knob = config.get().fp4_upt
    rule = None if knob else fp8_rule(N)
    launch = pick(f"fp8/{op or kind}/{'group' if group_size else 'row'}", arch,
                  rule or fp4_launch(N, arch, kind, UNIT), knob)
    lanes = group_size // UNIT
    if group_size and (launch.threads_per_row % lanes or launch.vec != UNIT):
        raise ValueError(f"N={N}: no launch keeps a {group_size}-wide group on aligned lanes")
    return launch
