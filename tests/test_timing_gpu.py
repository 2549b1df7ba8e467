"""The plugin's CUDA-graph timer on a real card: a callable that captures is timed by graph replays, one
that reads a value on the host falls back to events, and with ``capture=False`` no capture is tried (the
timer's callers pass it for a row whose capture failed once: a failed capture can keep its memory pool
to the end of the process)."""
from __future__ import annotations

import pytest
import torch

from pytest_oink import timing

pytestmark = [pytest.mark.gpu]


def _inputs():
    x = torch.randn(1 << 20, device="cuda")
    return timing.Rotation([x])


def test_a_capturable_call_is_timed_by_graph_replays():
    out = timing.time_cuda_graph(lambda x: x.mul(2.0), _inputs(), replays=7)
    assert out.method == "cuda-graph" and out.calls_per_replay >= 1
    assert len(out.samples) == 7 and all(s > 0 for s in out.samples)


def test_a_host_read_falls_back_to_events():
    out = timing.time_cuda_graph(lambda x: x.sum().item(), _inputs(), replays=7)
    assert out.method == "cuda-events" and out.calls_per_replay == 1
    assert len(out.samples) == 7 and all(s > 0 for s in out.samples)
    # the failed capture left torch's default generator free: random draws outside a capture work again
    x = torch.randn(1000, device="cuda")
    assert x.isfinite().all() and x.std() > 0.5


def test_no_capture_is_tried_where_told(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("a capture was tried")

    rotation = _inputs()  # before the patch: torch's RNG consults the graph state
    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    out = timing.time_cuda_graph(lambda x: x.mul(2.0), rotation, replays=7, capture=False)
    assert out.method == "cuda-events" and len(out.samples) == 7 and all(s > 0 for s in out.samples)


def test_captures_share_one_stream_and_leave_nothing_allocated():
    # a new stream a capture left a cuBLAS workspace behind each time (torch keeps one a stream), each pinning
    # the cached segment it was cut from: the training suite's rows then ran out of memory
    a = torch.randn(512, 512, device="cuda")
    rotation = timing.Rotation([a])
    timing.time_cuda_graph(lambda x: x @ x, rotation, replays=7)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(4):
        timing.time_cuda_graph(lambda x: x @ x, rotation, replays=7)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
