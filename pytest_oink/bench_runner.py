"""One benchmark row: correctness gate on 3 independently seeded inputs (``oink.measure.gate``'s, re-exported
here), then timing."""
from __future__ import annotations

import time

import pytest

# the gate, the inputs it draws and its out-of-memory refusals: oink.measure.gate's (the tuner's too)
from oink.measure.gate import _EXPECTED, GATE_MAX_ELEMS, GATE_SEEDS, gate  # noqa: F401  (re-exported for the plugin's modules and tests)
from oink.measure.gate import inputs as _inputs
from oink.measure.gate import refusing_out_of_memory

from . import modes, options, regression
from .comparisons import ours
from .providers import LABELS, SPECS, Unavailable, build
from .report import Row
from .state import ROWS, STATE
from .suites import CHECKS_INVARIANCE, HOST_TIMED
from .timing import (CPU_METHOD, Rotation, copies_for_cold_cache, eager_calls_for, feed_benchmark, median,
                     one_cpu_thread, relative_spread, time_cpu, time_cuda_graph, time_eager_calls, time_host)
from .verdicts import retime_while_unsure


def peak_memory(run, args, device) -> int | None:
    """The most memory allocated during one untimed call of ``run`` beyond what was allocated just
    before it (the inputs and everything else held then): the call's workspace and outputs, in
    bytes. None off a GPU (torch counts CUDA allocations only)."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run(args)
    torch.cuda.synchronize(device)
    del out
    return torch.cuda.max_memory_allocated(device) - base


def _check_invariance(config, row, spec, run, dtype, device) -> None:
    """``row.batch_invariant``: the batch-invariance check's verdict for (op, provider, N, dtype), run once a
    session; a row whose spec promises invariance fails with the verdict's report where the row is Oink's or a
    user's own kernel's (``comparisons.ours``: a provider the plugin does not register, whose spec is the user's
    promise); a peer's verdict is reported."""
    from . import invariance

    seen = config.stash[STATE].setdefault("invariance", {})
    key = (row.op, row.provider, row.N, row.dtype, str(device))
    if key not in seen:
        seen[key] = refusing_out_of_memory(
            lambda: invariance.check(spec, run, row.N, dtype, device, op=row.op), "the batch-invariance check: ")
    verdict = seen[key]
    row.batch_invariant = verdict.held
    promised = spec.batch_invariant(row.N, dtype) if callable(spec.batch_invariant) else spec.batch_invariant
    if not verdict.held and promised and row.provider in ours([row]):
        row.status = "failed"
        row.gate = dict(row.gate, passed=False, report=verdict.report())


# A row's timed replays take about this long at most: 15 replays of 10 calls, fewer (down to 7)
# for calls over ~1 ms, which vary least and cost a suite most of its time.
REPLAY_BUDGET_S = 0.15
EAGER_SAMPLES = 15  # eager mode's samples a row (as many as graph replays), each about REPLAY_BUDGET_S / 15
EAGER_CAP = 10.0  # the eager reference is timed briefly where one call takes this many times the fastest row


def cap_applies(provider: str, probe_s: float, fastest_s: float | None) -> bool:
    """Whether a row is timed briefly: the eager torch reference (what no user compares against at
    scale), where one call takes over EAGER_CAP x the fastest row of the same case so far."""
    return provider == "torch" and fastest_s is not None and probe_s > EAGER_CAP * fastest_s


def _eager_cap(request, case, provider, run, spec, dtype, device):
    """(samples, method) of a capped row, or None to time it fully (CUDA-graph replay)."""
    import torch

    if provider != "torch":
        return None
    same = [r.median_s for r in request.config.stash.get(ROWS, []) if r.status == "ok" and r.median_s
            and (r.op, r.M, r.N, r.dtype) == (case.op, case.M, case.N, case.dtype)]
    rot = Rotation([_inputs(spec, case, dtype, device, 100)])
    # the probe follows a warm-up call (a first call at a new size is several times slower), and
    # is the first of a capped row's 2 samples
    probe = time_host(run, rot, repeats=1, warmup=1, sync=torch.cuda.synchronize)
    if not cap_applies(provider, probe[0], min(same) if same else None):
        return None
    return probe + time_host(run, rot, repeats=1, warmup=0, sync=torch.cuda.synchronize), "capped-synced-perf_counter"


def run_case(case, provider, device, roofline, benchmark, request, spec=None, run=None) -> Row:
    """Gate, then time one (case, provider). ``spec`` and ``run`` default to the registry's (an op of
    ours); a user's own kernel passes them (the ``oink_measure`` fixture). A CPU row runs on one
    thread throughout (its gate too: on a loaded CPU, 2 threads made it 100x slower)."""
    with one_cpu_thread(device):
        return _run_case(case, provider, device, roofline, benchmark, request, spec, run)


def _run_case(case, provider, device, roofline, benchmark, request, spec, run) -> Row:
    import torch

    started = time.perf_counter()
    dtype = getattr(torch, case.dtype)
    spec = spec or SPECS[case.op]
    if run is None:
        try:
            run = build(case.op, provider, device)
        except Unavailable as e:
            pytest.skip(f"{provider}: {e}")
    label = getattr(run, "label", None) or LABELS.get((case.op, provider), "")
    if device.type != "cuda":
        label = (label + "; " if label else "") + "CPU (reference timing, not a kernel number)"
    row = Row(suite=case.suite, op=case.op, provider=provider, M=case.M, N=case.N, dtype=case.dtype,
              device=str(roofline.device), status="ok", label=label, bytes=spec.nbytes(case.M, case.N, dtype.itemsize),
              roofline_tbs=roofline.copy_tbs, test=request.node.nodeid, seed=case.seed)
    row.mode = modes.for_suite(modes.parse(options.get(request.config, "--oink-timing")), case.suite)
    request.config.stash[STATE]["roofline"] = roofline
    if device.type == "cuda":
        torch.cuda.empty_cache()  # previous rows' tensors must not crowd out this one
    profiling = provider == "oink" and bool(options.get(request.config, "--oink-profile"))
    if profiling:
        import oink.profiling

        oink.profiling.start()
    against = request.config.stash[STATE].get("against")
    if against is not None:  # the other tree gates the row while this session does
        against.prepare(request.config, row, case, device)
    try:
        row.gate = gate(spec, run, case, dtype, device)
    except Unavailable as e:
        pytest.skip(f"{provider}: {e}")
    row.gate_s = row.wall_s = time.perf_counter() - started
    if not row.gate["passed"]:
        row.status = "failed"
        return row
    if options.get(request.config, "--oink-batch-invariance") or case.suite in CHECKS_INVARIANCE:
        _check_invariance(request.config, row, spec, run, dtype, device)
        if row.status != "ok":
            return row
    if against is not None:  # the other tree's gate done too: nothing of it runs while this one times
        against.settle()
    watch = _clock_watch(request.config, device)
    try:
        samples, retimed = _timing(request, case, provider, run, spec, dtype, device, row, watch, against)
    except Unavailable as e:
        pytest.skip(f"{provider}: {e}")
    if watch is not None and watch.rounds:
        row.clocks, row.throttled = watch.record(retimed)
    row.median_s, row.min_s, row.spread = median(samples), min(samples), relative_spread(samples)
    row.samples = list(samples)
    if profiling:
        row.profile = _profile(device)
    if benchmark is not None:  # None without pytest-benchmark (-p no:benchmark): the row is ours alone
        benchmark.group = f"{case.op} {case.M}x{case.N} {case.dtype}"  # its table compares like with like
        feed_benchmark(benchmark, samples)
        benchmark.extra_info.update(row.extra_info())
    row.wall_s = time.perf_counter() - started
    return row


def _timing(request, case, provider, run, spec, dtype, device, row, watch, against):
    """(samples, retimed): the row's peak memory (set on ``row``) and timing rounds: the first, once more
    where the clocks were held down, and those --oink-against or the regression gate ask for
    (``row.retimes``). Out of memory in any of them (a re-timing's capture too) raises Unavailable: a refusal."""

    def rounds():
        row.peak_mem_bytes = peak_memory(run, _inputs(spec, case, dtype, device, 100), device)
        samples, time_once = _time_row(request, case, provider, run, spec, dtype, device, row,
                                       wrap=watch.wrap if watch else None)
        retimed = False
        if watch is not None and watch.last_causes() and time_once is not None:
            watch.drop_last()  # timed while the card was held down: once more, the first round's samples dropped
            samples, retimed = time_once(), True
        row.median_s = median(samples)
        if against is not None:  # the other tree times this row too, rounds alternating while the gate is unsure
            samples, row.retimes = against.interleave(request.config, row, case, samples, time_once, device)
        else:
            verdict_of = regression.verdict_for(request.config, row)
            if verdict_of is not None:  # a row the gate is unsure of is timed again before the session decides
                samples, row.retimes = retime_while_unsure(samples, verdict_of, time_once)
        return samples, retimed

    return refusing_out_of_memory(rounds)


def _clock_watch(config, device):
    """A clocks.Watch for this row, or None where the clocks can't be read (on a GPU, the reason is
    kept once for the summaries)."""
    from . import clocks

    read, why = clocks.reader(device)
    if read is None:
        if device.type == "cuda":
            config.stash[STATE].setdefault("clock_note", why)
        return None
    return clocks.Watch(read)


def _time_row(request, case, provider, run, spec, dtype, device, row, wrap=None):
    """(samples, time_once): the row's first samples, by its suite's and device's timer (its method
    set on ``row``), and a callable timing one more round the same way (None: not re-timed). ``wrap``
    wraps that callable before its first round (clocks.Watch.wrap reads the clocks around each)."""
    if row.mode != "eager" and device.type == "cuda":
        capped = _eager_cap(request, case, provider, run, spec, dtype, device)
        if capped is not None:
            samples, row.method = capped
            row.label = (row.label + "; " if row.label else "") + (
                f"capped: over {EAGER_CAP:.0f}x the fastest row, {len(samples)} synced calls timed")
            return samples, None
    return row_timer(case, run, spec, dtype, device, row, wrap)


# (op, provider, device) whose CUDA-graph capture failed once this process: timed by events from then on,
# without another capture (each failed one may keep its pool's memory: see time_cuda_graph)
UNCAPTURED: set = set()


def row_timer(case, run, spec, dtype, device, row, wrap=None):
    """(samples, time_once) of a row by its suite's, mode's (``row.mode``) and device's timer, its
    method set on ``row``: the first round's samples and a callable timing one more round the same
    way, ``wrap``-ped before its first round. The --oink-against worker times the other tree's rows
    with it too."""
    import torch

    wrap = wrap or (lambda f: f)
    if case.suite in HOST_TIMED:  # the host's cost of an eager call, not the kernel's time
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        args = _inputs(spec, case, dtype, device, 100)
        time_once, row.method = (lambda: time_eager_calls(run, args, sync=sync)), "eager-calls"
        row.bytes = 0  # no bandwidth: the device is idle between calls
    elif row.mode == "eager" and device.type == "cuda":  # what a caller pays a call: host cost and kernel
        args = _inputs(spec, case, dtype, device, 100)
        probe = median(time_host(run, Rotation([args]), repeats=3, warmup=1, sync=torch.cuda.synchronize))
        calls = eager_calls_for(probe, REPLAY_BUDGET_S / EAGER_SAMPLES)

        def time_once():
            return time_eager_calls(run, args, calls=calls, repeats=EAGER_SAMPLES, sync=torch.cuda.synchronize)
        row.method = "eager-calls"
    elif device.type == "cuda":
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        # hot: one input set, so what fits stays in L2 between calls
        n_sets = 1 if row.mode == "hot" else copies_for_cold_cache(row.bytes, l2)
        rot = Rotation([_inputs(spec, case, dtype, device, 100 + i) for i in range(n_sets)])
        timings = []  # the method is the first round's (events where the graph would not capture)
        key = (case.op, row.provider, str(device))

        def time_once():
            timings.append(time_cuda_graph(run, rot, budget_s=REPLAY_BUDGET_S, capture=key not in UNCAPTURED))
            if timings[-1].method != "cuda-graph":
                UNCAPTURED.add(key)
            return timings[-1].samples
        time_once = wrap(time_once)
        samples = time_once()
        row.method = timings[0].method
        return samples, time_once
    else:  # the CPU: every mode is the host timer (modes.CPU_NOTE), on one thread (timing.one_cpu_thread)
        rot = Rotation([_inputs(spec, case, dtype, device, 100)])

        def time_once():
            with one_cpu_thread(device):
                return time_cpu(run, rot)
        row.method = CPU_METHOD
    time_once = wrap(time_once)
    return time_once(), time_once


def _profile(device) -> dict:
    """Resource usage of the kernels this row's calls used (``--oink-profile``)."""
    if device.type != "cuda":
        return {"error": "kernel profiles need a GPU"}
    try:
        import oink.profiling

        return oink.profiling.report(device.index or 0) or {"error": "no CuTeDSL kernel ran (reference path)"}
    except Exception as e:  # noqa: BLE001  (a profile failure is reported in the row, never fatal)
        return {"error": repr(e)}
