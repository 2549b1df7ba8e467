"""The GPU timer: an op's calls captured in one CUDA graph and its replays timed with events, cycling input sets
past L2 (``Rotation``, ``copies_for_cold_cache``), with an event-timed fallback for callables that can't be
captured. Every timer returns per-call seconds, one sample per repetition; the median is what reports use.
The pytest plugin (``pytest_oink.timing``, which re-exports these) and the tuner (``oink.tune``) time with it.
Imports of torch happen inside functions only.
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
    segment it was cut from (a long suite's reserved memory grew to dozens of times its allocated, and eager
    torch ran out of memory at rows that fit)."""
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

