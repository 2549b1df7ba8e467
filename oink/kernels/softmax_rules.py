"""The softmax kernels' launch rules (no cutlass here): what a softmax kernel is compiled for (``SoftmaxKey``), its
launch (``softmax_launch_of``: a launch-table entry, else ``softmax_launch`` for its rows or their aligned windows,
``softmax_window``), and whether its max and sum of exp merge in one round (``online_reduction``). The kernel is
``softmax.Softmax``."""
from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

from .launch_table import pick
from .memo import memo
from .row_rules import (CLUSTER_ROWS_MIN_N, MAX_CLUSTER, WIDE_CLUSTER, RowLaunch, cluster_rows, dtype_bits, narrow_rows,
                        pick_row_launch, shifted_window)

MODES = ("forward", "backward", "fwd_bwd")


def softmax_launch(N: int, x_bits: int, arch: str, mode: str = "forward") -> RowLaunch:
    """Launch heuristic for the softmax family (the one place it is chosen): forward rows wider than
    ``CLUSTER_ROWS_MIN_N`` take the wide-row rule (``row_rules.cluster_rows``), 16-bit ones whose width is
    not a multiple of 8 ``row_rules.narrow_rows``; else at most 4 units a
    thread, wider rows over a cluster; the backward modes hold two rows' values (y and dy, or x
    and dy), so their CTAs stop at 512 threads (128 registers a thread), and where the portable
    cluster leaves a thread more than ``BWD_MAX_UNITS`` they take the arch's wider cluster; their full-width
    16-bit rows from ``BWD_WIDE_MIN_N`` columns take ``cluster_rows`` on sm_90a."""
    if mode == "forward" and N > CLUSTER_ROWS_MIN_N:
        return cluster_rows(N, math.gcd(N, 128 // x_bits), WIDE_CLUSTER.get(arch, MAX_CLUSTER))
    if mode != "forward" and x_bits == 16 and N % 8 == 0 and N >= BWD_WIDE_MIN_N and arch in WIDE_CLUSTER:
        wide = cluster_rows(N, 8, WIDE_CLUSTER[arch])
        if wide.num_threads * wide.iters <= BWD_WIDE_MAX_UNITS:
            return wide
    narrow = narrow_rows(N, x_bits) if mode == "forward" else None
    if narrow is not None:
        return narrow
    most = 1024 if mode == "forward" else 512
    launch = pick_row_launch(N, x_bits, max_units_per_thread=4, max_threads=most)
    if mode != "forward" and launch.iters > BWD_MAX_UNITS and arch in WIDE_CLUSTER:
        launch = pick_row_launch(N, x_bits, max_units_per_thread=4, max_threads=most, max_cluster=WIDE_CLUSTER[arch])
    return launch


# A backward-mode thread of more units spills (fwd_bwd fp32 over 8 CTAs: 14 units at 229376 hold in
# 128 registers, 15 at 245760 spill 728 bytes), and a spilling launch runs several times slower than
# one over 16 CTAs. Below it 8 CTAs are faster than 16 (timed with scripts/tune_launch.py at fp32
# 201088 and bf16 262144).
BWD_MAX_UNITS = 14
# Full-width 16-bit rows of the backward modes from BWD_WIDE_MIN_N columns take the wide-row rule on sm_90a
# (tuned there): 128-thread CTAs over a cluster of up to 16, as the cross-entropy dlogits' ``wide_rows``, while
# a CTA's share of the row is at most BWD_WIDE_MAX_UNITS accesses: more, smaller CTAs a SM keep more rows loading
# while others reduce; narrower rows gain nothing, and past the bound the rule's CTAs of 256 threads x 8 accesses
# lose to 512 x 8 (timings: docs/tuning.md).
BWD_WIDE_MIN_N = 16384
BWD_WIDE_MAX_UNITS = 1536


def online_reduction(launch: RowLaunch, mode: str) -> bool:
    """Whether the row's max and sum of exp merge in one reduction round (online softmax: a pair of
    values, rescaled at each merge) rather than two. One round saves a barrier (a DSMEM exchange
    over a cluster) but costs exps at every merge. Timed both ways over the sweep suite: the fused
    forward+backward gains at nearly every shape, the forward only over clusters of 16 (where the saved
    exchange weighs most), and it loses on rows within one CTA (the ``softmax_online`` setting forces it)."""
    return mode == "fwd_bwd" or (mode == "forward" and launch.cluster_n >= 16)


@dataclass(frozen=True, slots=True)
class SoftmaxKey:
    """What a softmax kernel is compiled for; M and strides are runtime. Built once where a launch is
    prepared, it is the memoized compile's one argument."""
    mode: str  # one of MODES
    dtype: str  # torch name
    N: int
    arch: str
    _: KW_ONLY
    few: bool = False  # for calls of ``launch_table.few_rows`` rows (their own launch where the table has one)
    # a forward whose rows start off 16-byte boundaries (N not a multiple of the 128-bit vector), its output's
    # rows at x's offsets: read and written through aligned windows (``RowKernelBase.window``) of 16-byte
    # accesses, launched as an aligned row of the window's width
    window: bool = False


def softmax_window(k: SoftmaxKey) -> int | None:
    """The width of the aligned windows the softmax for ``k`` reads its rows through, or None: a forward
    asked to, on rows whose widths allow accesses of at most 4 bytes: they gain the window's 16-byte accesses
    over the narrow kernel's (decode-sized calls too); rows of 8-byte accesses gain nothing (timings:
    docs/tuning.md)."""
    bits = dtype_bits(k.dtype)
    if not k.window or k.mode != "forward" or math.gcd(k.N, 128 // bits) * bits > 32:
        return None
    return shifted_window(k.N, bits)


@memo
def softmax_launch_of(k: SoftmaxKey) -> RowLaunch:
    """The launch of the softmax kernel for ``k``: a table entry's, or the rule's (``softmax_launch``) for its
    rows or their windows (``softmax_window``)."""
    bits = dtype_bits(k.dtype)
    width = softmax_window(k)
    key = f"softmax/{k.mode}{'_window' if width else ''}/x{bits}"
    return pick(key, k.arch, softmax_launch(width or k.N, bits, k.arch, k.mode), None, k.few)
