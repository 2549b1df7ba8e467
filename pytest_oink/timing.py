"""Timing: CUDA-graph replay with L2 cycling on the GPU, an event-timed fallback for callables
that can't be captured (both ``oink.measure.timer``'s, which the tuner times with too: re-exported here),
a perf-counter timer on the CPU, and a measured roofline.

Every timer returns per-call seconds, one sample per repetition; the median is what reports use.
``VirtualClock`` hands those samples to pytest-benchmark so its stats (and --benchmark-json)
describe our GPU times instead of host wall time.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

from oink.measure.timer import (GraphTiming, Rotation, copies_for_cold_cache, median,  # noqa: F401  (re-exported for the plugin's modules and tests)
                                time_cuda_events, time_cuda_graph)


def relative_spread(xs) -> float:
    """The samples' spread relative to their median: 1.4826 x the median absolute deviation (a
    standard deviation for normal noise, unmoved by a few outliers) over the median."""
    m = median(xs)
    return 1.4826 * median([abs(x - m) for x in xs]) / m if m else 0.0


def time_host(fn, rotation, repeats: int = 10, warmup: int = 2, clock=time.perf_counter, sync=None):
    """Per-call seconds by a host clock (CPU runs; ``sync`` waits for a device if given)."""
    for _ in range(warmup):
        fn(rotation())
    samples = []
    for _ in range(repeats):
        args = rotation()
        if sync:
            sync()
        t0 = clock()
        fn(args)
        if sync:
            sync()
        samples.append(clock() - t0)
    return samples


@contextmanager
def one_cpu_thread(device):
    """torch's CPU ops on one intra-op thread while a CPU row runs (``device`` a CPU; else nothing
    changes). Each parallel region of a 2-thread op waits at its barrier for a thread that a loaded
    CPU has descheduled: 64x1024 rows took 30-140 ms a call instead of 0.1 ms, by the scheduler's
    whim, so two runs of the same code compared as x500 apart."""
    if getattr(device, "type", device) != "cpu":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


CPU_METHOD = "cpu-one-thread"  # rows' method: report.what_was_timed keeps them apart from the multi-threaded ones
CPU_SAMPLES = 15  # samples a round on the CPU
CPU_SAMPLE_S = 2e-3  # about this long a sample: its calls' fastest is kept
CPU_CALLS = (2, 64)  # calls a sample, at least and at most


def time_cpu(fn, rotation, samples: int = CPU_SAMPLES, sample_s: float = CPU_SAMPLE_S, clock=time.perf_counter):
    """Per-call seconds on the CPU: each sample the fastest of k calls in a row, k (a power of two,
    the same for the same code) such that a sample takes about ``sample_s``. A scheduler stall (a
    loaded CPU deschedules the process for ms) lands in one call: a sample is stalled only if all
    its k calls were, where one-call samples taken within one stall read as a tight, wrong time."""
    fn(rotation())  # warm-up
    probe = float("inf")
    for _ in range(3):  # the fastest of 3: k from a stalled probe would differ between two runs of the same code
        args = rotation()
        t0 = clock()
        fn(args)
        probe = min(probe, clock() - t0)
    want = sample_s / max(probe, 1e-9)
    calls = max(CPU_CALLS[0], min(CPU_CALLS[1], 2 ** int(math.log2(want)) if want >= 1 else 1))
    out = []
    for _ in range(samples):
        best = float("inf")
        for _ in range(calls):
            args = rotation()
            t0 = clock()
            fn(args)
            best = min(best, clock() - t0)
        out.append(best)
    return out


def time_eager_calls(fn, args, calls: int = 400, repeats: int = 5, sync=None):
    """Host cost of one eager call: ``calls`` calls back to back on the same inputs, then one sync,
    per call; ``repeats`` such samples. Small inputs keep the device idle between launches, so this
    is the Python, dispatch and launch cost a caller pays."""
    fn(args)
    if sync:
        sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(args)
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) / calls)
    return samples


def eager_calls_for(probe_s: float, sample_s: float, cap: int = 400) -> int:
    """Calls per eager sample so that one sample takes about ``sample_s`` (one call at least, ``cap``
    at most: the launch suite's count), given one synchronized call's ``probe_s``."""
    return max(1, min(cap, int(sample_s / max(probe_s, 1e-9))))


class VirtualClock:
    """A clock for pytest-benchmark that advances by our measured samples: each call of the
    target advances it by the next sample, so benchmark stats are our per-call GPU times."""

    def __init__(self, samples):
        self.samples, self.i, self.now = list(samples), 0, 0.0

    def __call__(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.samples[self.i]
        self.i += 1

    def __repr__(self) -> str:
        return "pytest_oink.VirtualClock(cuda-graph median per call)"


def feed_benchmark(benchmark, samples) -> None:
    """Record ``samples`` as pytest-benchmark rounds (stats, JSON, compare all work)."""
    clock = VirtualClock(samples)
    benchmark._timer = clock  # the runner reads the timer when it is created, per round
    benchmark.pedantic(clock.step, rounds=len(samples), iterations=1, warmup_rounds=0)


@dataclass
class Roofline:
    copy_tbs: float
    triad_tbs: float
    device: str
    method: str
    launch_floor_us: float | None = None  # one tiny kernel's graph-replayed time: small shapes' floor

    @property
    def ceiling_tbs(self) -> float:
        return max(self.copy_tbs, self.triad_tbs)


def measure_roofline(device) -> Roofline:
    """STREAM-like copy (read + write) and triad (2 reads + 1 write) bandwidth, measured now."""
    import torch

    if device.type == "cuda":
        # The better of 256 MiB and 512 MiB buffers (both far past L2): one size alone can read
        # well below the card's copy bandwidth where the better of the two reaches it.
        best = {"copy": 0.0, "triad": 0.0}
        for n in (2**27, 2**28):
            a = torch.randn(n, device=device, dtype=torch.bfloat16)
            b, c = torch.empty_like(a), torch.randn_like(a)
            rot = Rotation([None])
            e = a.element_size()
            t = median(time_cuda_graph(lambda _: b.copy_(a), rot, calls_per_replay=4, replays=7).samples)
            best["copy"] = max(best["copy"], 2 * n * e / t / 1e12)
            t = median(time_cuda_graph(lambda _: torch.add(a, c, alpha=0.5, out=b), rot, calls_per_replay=4,
                                       replays=7).samples)
            best["triad"] = max(best["triad"], 3 * n * e / t / 1e12)
            del a, b, c
        one = torch.zeros(1, device=device)
        floor = median(time_cuda_graph(lambda _: one.zero_(), rot, calls_per_replay=20, replays=7).samples) * 1e6
        return Roofline(best["copy"], best["triad"], torch.cuda.get_device_name(device), "cuda-graph", floor)
    n = 2**23
    a = torch.randn(n, dtype=torch.float32)
    b, c = torch.empty_like(a), torch.randn_like(a)
    rot = Rotation([None])
    t_copy = median(time_host(lambda _: b.copy_(a), rot, repeats=5))
    t_triad = median(time_host(lambda _: torch.add(a, c, alpha=0.5, out=b), rot, repeats=5))
    e = a.element_size()
    return Roofline(2 * n * e / t_copy / 1e12, 3 * n * e / t_triad / 1e12, "cpu", "perf_counter")
