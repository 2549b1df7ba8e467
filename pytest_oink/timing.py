"""Timing: CUDA-graph replay with L2 cycling on the GPU, an event-timed fallback for callables
that can't be captured, a perf-counter timer on the CPU, and a measured roofline.

Every timer returns per-call seconds, one sample per repetition; the median is what reports use.
``VirtualClock`` hands those samples to pytest-benchmark so its stats (and --benchmark-json)
describe our GPU times instead of host wall time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass


def median(xs):
    s = sorted(xs)
    n = len(s)
    if not n:
        raise ValueError("median of no samples")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def relative_spread(xs) -> float:
    """The samples' spread relative to their median: 1.4826 x the median absolute deviation (a
    standard deviation for normal noise, unmoved by a few outliers) over the median."""
    m = median(xs)
    return 1.4826 * median([abs(x - m) for x in xs]) / m if m else 0.0


def copies_for_cold_cache(bytes_per_set: int, l2_bytes: int, factor: int = 3, cap: int = 64) -> int:
    """Input sets to rotate through so that the working set exceeds ``factor`` x L2."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(cap, math.ceil(factor * l2_bytes / bytes_per_set)))


class Rotation:
    """Cycles through input sets: each call gets the next one."""

    def __init__(self, sets):
        if not sets:
            raise ValueError("no input sets")
        self.sets, self.i = list(sets), 0

    def __call__(self):
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


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


def time_cuda_events(fn, rotation, repeats: int = 20, warmup: int = 3):
    """Per-call seconds from CUDA events around each call (callables that can't be captured)."""
    import torch

    for _ in range(warmup):
        fn(rotation())
    samples = []
    for _ in range(repeats):
        args = rotation()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(args)
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3)
    return samples


@dataclass
class GraphTiming:
    samples: list  # per-call seconds, one per replay
    method: str  # "cuda-graph" or "cuda-events"
    calls_per_replay: int


_streams: dict = {}


def _capture_stream():
    """One side stream a device for every capture: torch keeps a cuBLAS workspace for each stream a matmul
    ran on, never freed, so a new stream a row left one more block behind each time, each pinning the cached
    segment it was cut from (H200, the training suite: 135 GiB reserved around 4 GiB allocated after 12 rows,
    and eager torch out of memory at rows that fit)."""
    import torch

    device = torch.cuda.current_device()
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def _end_generators_capture() -> None:
    """After a capture that raised: torch's CUDA generators are left marked as capturing (the capture's end
    raised before releasing them), so every later random op outside a capture raises "Offset increment
    outside graph capture encountered unexpectedly"; one empty capture, which ends, releases them."""
    import torch

    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pass
    except Exception:  # noqa: BLE001  (nothing more to do: the next random op says what is wrong)
        pass


def time_cuda_graph(fn, rotation, calls_per_replay: int | None = None, replays: int = 15, warmup: int = 3,
                    budget_s: float | None = None, min_replays: int = 7, capture: bool = True):
    """Capture ``calls_per_replay`` calls (cycling the input sets) in one CUDA graph and time its
    replays with events; falls back to event timing if capture fails, or without trying where
    ``capture`` is False (a callable known not to capture: a failed capture keeps its memory pool, and
    what was allocated in it, to the end of the process in torch without pytorch/pytorch#190348).
    With ``budget_s``, a graph whose warm-up replay shows that ``replays`` replays would take longer is
    replayed fewer times (never under ``min_replays``): long rows, whose samples vary least, cost less
    session time."""
    import torch

    if not capture:
        return GraphTiming(time_cuda_events(fn, rotation, repeats=replays), "cuda-events", 1)

    calls = calls_per_replay or max(10, len(rotation.sets))
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, len(rotation.sets))):  # every input set once: per-set lazy work stays out
            fn(rotation())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if calls_per_replay is None and budget_s is not None:
        # calls of tens of ms (a training step's lm head): fewer a replay, so that the replays fit the budget
        per_call = (time.perf_counter() - t0) / max(warmup, len(rotation.sets))
        calls = max(len(rotation.sets), min(calls, math.ceil(budget_s / per_call)))
    # the graph's private pool takes fresh device memory: blocks the general cache holds free (a gate's fp32
    # reference, the warm-up calls) are given back first, as an out-of-memory retry may not during a capture
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn(rotation())
    except Exception:  # noqa: BLE001  (uncapturable callable: host syncs, allocations the graph forbids)
        torch.cuda.synchronize()
        _end_generators_capture()
        return GraphTiming(time_cuda_events(fn, rotation, repeats=replays), "cuda-events", 1)
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    if budget_s is not None:
        replays = max(min(replays, min_replays), min(replays, math.ceil(budget_s / (time.perf_counter() - t0))))
    samples = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3 / calls)
    return GraphTiming(samples, "cuda-graph", calls)


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
