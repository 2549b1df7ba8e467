"""The cross-entropy kernels' rules, in one place: which rows stream (``stream_rows``), the launch of a
streamed row (``stream_launch``), of a register-held one (``cross_entropy_launch``, ``wide_rows``), with
options (``CEOptions``, ``option_launch``), and the softcap's dlogits form (``softcap_form``). A table entry
measured on a card overrides a launch rule (``launch_table.pick``, where ``compiled_cross_entropy`` asks)."""
from __future__ import annotations

import dataclasses
import math

from .. import config
from .row_rules import MAX_CLUSTER, RowLaunch, cluster_rows, least_padding, pick_row_launch


@dataclasses.dataclass(frozen=True)
class CEOptions:
    """The cross-entropy options, compile-time constants of a kernel (``oink.reference.cross_entropy``
    says what they mean); the default is the plain kernel."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return not self.label_smoothing and not self.z_loss and self.softcap is None


PLAIN = CEOptions()


# the largest softcap whose sums of exp(t - c) take the fixed shift c (the fused kernel's ``held_exp``, the forward's
# ``capped_sum``): exp(t - c) of a capped logit t >= -c is at least exp(-2c), a normal fp32 (>= 2^-126 = exp(-87.3))
SOFTCAP_LEAN_MAX = 40.0


def softcap_form(mode: str, options: CEOptions, stream: bool) -> str | None:
    """The softcap's dlogits form of the kernel of ``mode`` with ``options`` (a softcap): "held", the fused mode on
    register-held rows with a softcap of at most ``SOFTCAP_LEAN_MAX`` and no label smoothing
    (``CrossEntropy.held_exp``); "raw", the backward and a streamed fused row's dlogits pass (``capped_exp_slope``
    from the logits as loaded); else None: the forward, and a fused register-held row with label smoothing or a
    larger softcap, which hold the capped logits (``capped``) and take their exp for the gradient (``dlogits``)."""
    if options.softcap is None or mode == "forward":
        return None
    if mode == "backward" or stream:
        return "raw"
    if options.softcap <= SOFTCAP_LEAN_MAX and not options.label_smoothing:
        return "held"
    return None


# A register-held forward row takes one CTA of this many threads, each holding up to HELD_MAX_UNITS
# accesses: few threads a row, each with many loads in flight, many CTAs a SM (Quack's rule holds rows
# so too); wider forward rows stream (CHANGELOG.md)
HELD_THREADS = 64
HELD_MAX_UNITS = 18
# fp32 forward rows stream past this many accesses: held over the older rule's CTAs up to here, they were as
# fast as streamed or faster
STREAM_MIN_UNITS = 4096


def stream_rows(N: int, x_bits: int, mode: str = "forward") -> bool:
    """Whether ``mode`` streams rows of N columns (a shifted row's N: its window's width);
    the ``ce_stream`` development setting forces it off/on. Only the forward does by default: the dlogits
    modes read a streamed row twice (the second time mostly from L2), which timed slower than the
    register-held kernel over the sweep's shapes for fwd_bwd and mixed for the backward (no rule by width)."""
    forced = config.get().ce_stream
    if forced is not None:
        return forced
    held = HELD_THREADS * HELD_MAX_UNITS if x_bits == 16 else STREAM_MIN_UNITS
    return mode == "forward" and N // math.gcd(N, 128 // x_bits) > held


def stream_launch(N: int, x_bits: int) -> RowLaunch:
    """A streamed forward's launch: one row a CTA of 256 threads, over a cluster of up to 8 CTAs
    so a thread passes over about 32 units; 128 threads up to 32 units each."""
    vec = math.gcd(N, 128 // x_bits)
    units = N // vec
    threads = 128 if units <= 128 * 32 else 256
    cluster_n = 1
    while units > threads * 32 * cluster_n and cluster_n < MAX_CLUSTER:
        cluster_n *= 2
    return RowLaunch(N=N, vec=vec, threads_per_row=threads, num_threads=threads, cluster_n=cluster_n)


def cross_entropy_launch(N: int, x_bits: int, arch: str, mode: str = "forward", shifted: bool = False) -> RowLaunch:
    """Launch heuristic for the cross-entropy family's register-held rows (with ``stream_launch``,
    the one place it is chosen). A forward row of more than 4 and at most ``HELD_MAX_UNITS`` accesses
    a thread at ``HELD_THREADS`` threads takes one CTA of those threads, aligned or ``shifted`` (rows
    off 16-byte boundaries; N is their window). Wider forward rows held in registers (fp32 rows short
    of streaming, or streaming off) take CTAs of 256 threads over a cluster of up to 8: more, smaller
    CTAs a SM keep more rows loading while others reduce; a 16-bit sm_90a forward past 8 CTAs of 256
    takes a cluster of 16 (a non-portable size, as Quack's); a shifted one, one CTA of up to 1024
    threads as long as it can. The modes that write dlogits lose more to a spill: 5 units a thread,
    then a larger cluster; but their full-width 16-bit rows of 8192 columns or more (``wide_rows``) take the
    wide norms' rule, 128-thread CTAs over the smallest cluster that holds the row in 8 accesses a thread (16
    CTAs on sm_90a, 8 on sm_100a), the backward's retiled where that leaves its last access mostly idle
    (``least_padding``): more, smaller CTAs a SM keep more rows loading while others reduce, as in the norms; the
    fused mode's gives the shapes the table's search had found there (timings: docs/tuning.md)."""
    vec = math.gcd(N, 128 // x_bits)
    if mode == "forward" and HELD_THREADS * 4 < N // vec <= HELD_THREADS * HELD_MAX_UNITS:
        return RowLaunch(N=N, vec=vec, threads_per_row=HELD_THREADS, num_threads=HELD_THREADS)
    if mode == "forward" and not shifted:
        small = pick_row_launch(N, x_bits, units_per_thread=8, max_units_per_thread=8, max_threads=256)
        units = N // small.vec
        if 256 * 8 < units <= small.threads_per_row * small.cluster_n * 8:
            return small
        if arch == "sm_90a" and x_bits == 16 and 256 * 8 * 8 < units <= 256 * 16 * 8:
            return dataclasses.replace(small, cluster_n=16)
    if wide_rows(N, x_bits, arch, mode, shifted):
        # dlogits rows of 8192 columns or more: 128-thread CTAs over a cluster (``cluster_rows``); the backward's
        # CTAs retiled where that leaves a mostly idle last access (``least_padding``)
        launch = cluster_rows(N, vec, 16 if arch == "sm_90a" else MAX_CLUSTER, 128, 8)
        return launch if mode == "fwd_bwd" else least_padding(launch, 8)
    return pick_row_launch(N, x_bits, max_units_per_thread=8 if mode == "forward" else 5)


def wide_rows(N: int, x_bits: int, arch: str, mode: str, shifted: bool) -> bool:
    """Whether a dlogits row of N columns takes ``cluster_rows``: full-width (16-byte aligned, unshifted)
    16-bit rows of 8192 columns or more, in the fused mode, and in the backward on sm_90a (the arch it was
    tuned on; on sm_100a its options' kernels spilled at 7-8 accesses a thread)."""
    fits = mode == "fwd_bwd" or (mode == "backward" and arch == "sm_90a")
    return fits and x_bits == 16 and not shifted and N % 8 == 0 and N >= 8192


def option_launch(N: int, x_bits: int, arch: str, mode: str, shifted: bool = False) -> RowLaunch:
    """The dlogits modes' heuristic launch with options (a table entry for the card in use still wins):
    ``wide_rows`` take the plain kernels' rule (``cross_entropy_launch``: CTAs of 128-512 threads over a
    cluster); other rows CTAs of at most 512 threads (128 registers a thread, where the plain kernels' 1024
    leave 64: the options keep a few more values live, and spilled at 1024) while a cluster of 8 holds the row
    in 5 units a thread, else the plain kernels' launch."""
    if wide_rows(N, x_bits, arch, mode, shifted):
        return cross_entropy_launch(N, x_bits, arch, mode, shifted)
    launch = pick_row_launch(N, x_bits, max_units_per_thread=5, max_threads=512)
    return launch if launch.iters <= 8 else pick_row_launch(N, x_bits, max_units_per_thread=5)


def backward_min_ctas(launch: RowLaunch, x_bits: int, plain: bool) -> int:
    """CTAs a SM a register-held 16-bit backward keeps room for (``RowKernelBase.min_ctas``, a cap on a thread's
    registers), where ptxas left to itself took a CTA a SM more than the row needs: the plain kernel holding 48-56
    values a thread (7 accesses: 96-128 registers) to 80 and a few to spare (at 81, 160-thread CTAs spilled 8
    bytes), the options' holding 64 or more (88 registers to the plain kernel's 79) to values + 16. Elsewhere
    none: ptxas takes what a cap leaves, and capped there grew kernels to it (48 to 64 registers) or spilled (the
    plain one at 64 values). Where capped, a SM keeps a CTA more, so more loads in flight (timings:
    docs/tuning.md)."""
    values, threads = launch.iters * launch.vec, launch.num_threads
    if x_bits != 16:
        return 0
    if plain:
        ctas = 65536 // (threads * 80) if 48 <= values <= 56 else 0
        return ctas if ctas > 1 and 65536 // (ctas * threads) >= 84 else 0
    return 65536 // (threads * (-(-(values + 16) // 8) * 8)) if values >= 64 else 0
