"""The regression gate's verdicts from samples (issue #34 item 1): the bootstrap interval of the
ratio of medians on synthetic samples, the spread rule for baselines without samples, the
re-timing of UNSURE rows, and whole runs against doctored baselines (CPU rows, --oink-gate-cpu)."""
from __future__ import annotations

import json
import random

import pytest

from pytest_oink import report, verdicts
from pytest_oink.timing import CPU_SAMPLES, median

from tests.helpers import BENCH, ONE_ROW, PLUGIN  # the plugin runs' bench file and one gated CPU row


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def _samples(center, noise, n=30, seed=0):
    rng = random.Random(seed)
    return [center * (1 + rng.gauss(0, noise)) for _ in range(n)]


def test_identical_distributions_are_same():
    v = verdicts.from_samples(_samples(1e-4, 0.005, seed=1), _samples(1e-4, 0.005, seed=2), 0.05)
    assert v.name == "SAME" and 0.95 <= v.interval[0] <= v.ratio <= v.interval[1] <= 1.05


def test_ten_percent_slower_with_small_noise_is_slower():
    v = verdicts.from_samples(_samples(1.1e-4, 0.01, seed=1), _samples(1e-4, 0.01, seed=2), 0.05)
    assert v.name == "SLOWER" and 1.05 < v.interval[0] <= v.ratio <= v.interval[1] < 1.15
    assert v.describe(0.05).startswith("SLOWER, x1.1") and v.describe(0.05).endswith("]")
    fast = verdicts.from_samples(_samples(0.9e-4, 0.01, seed=1), _samples(1e-4, 0.01, seed=2), 0.05)
    assert fast.name == "FASTER" and fast.interval[1] < 0.95


def test_noisy_overlapping_samples_are_unsure():
    v = verdicts.from_samples(_samples(1.05e-4, 0.3, n=8, seed=1), _samples(1e-4, 0.3, n=8, seed=2), 0.05)
    assert v.name == "UNSURE" and v.interval[0] < 1.05 < v.interval[1]
    # a real change under the threshold is no SLOWER either: SAME only when the interval lies within it
    small = verdicts.from_samples(_samples(1.04e-4, 0.002, seed=1), _samples(1e-4, 0.002, seed=2), 0.05)
    assert small.name == "SAME"


def test_bootstrap_is_seeded_and_brackets_the_ratio():
    new, old = _samples(2.0, 0.05, seed=3), _samples(1.0, 0.05, seed=4)
    assert verdicts.ratio_interval(new, old) == verdicts.ratio_interval(new, old)
    ratio, low, high = verdicts.ratio_interval(new, old)
    assert low < ratio < high and abs(ratio - 2.0) < 0.05


def test_baseline_without_samples_keeps_the_spread_rule():
    no_samples = report.BaselineEntry(1e-4, 0.02)
    v = verdicts.judge(_samples(1.2e-4, 0.001), 1.2e-4, 0.001, no_samples, 0.05)
    assert v.name == "SLOWER" and v.interval is None and "spread rule" in v.describe(0.05)
    v = verdicts.judge([], 1.05e-4, 0.10, no_samples, 0.05)  # floor 30%: noise
    assert v.name == "SAME" and "noise floor 30.0%" in v.describe(0.05)
    # a floor of 100% or more (a noisy CPU run) still lets a large speed-up read FASTER, on a log scale
    v = verdicts.from_spread(1e-5, 0.40, 1.0, 0.0, 0.05)
    assert v.name == "FASTER" and v.floor > 1
    assert verdicts.from_spread(0.5, 0.40, 1.0, 0.0, 0.05).name == "SAME"  # within 1 / (1 + 1.2)
    assert verdicts.from_spread(0.4, 0.40, 1.0, 0.0, 0.05).name == "FASTER"
    # too few samples on either side for an interval: the spread rule too
    few = report.BaselineEntry(1e-4, 0.0, samples=(1e-4,) * 4)
    assert verdicts.judge(_samples(2e-4, 0.001), 2e-4, 0.001, few, 0.05).interval is None


def test_unsure_rows_are_retimed_a_bounded_number_of_rounds():
    old = _samples(1e-4, 0.005, seed=2)
    entry = report.BaselineEntry(1e-4, 0.0, samples=tuple(old))

    def verdict_of(samples):
        return verdicts.judge(samples, None, None, entry, 0.05)

    noisy = _samples(1e-4, 0.4, n=5, seed=5)
    assert verdict_of(noisy).name == "UNSURE"
    rounds = iter([_samples(1e-4, 0.002, n=40, seed=6)])  # one quiet round settles it
    samples, done = verdicts.retime_while_unsure(noisy, verdict_of, lambda: next(rounds))
    assert done == 1 and len(samples) == 45 and verdict_of(samples).name == "SAME"
    calls, unsure = [], verdicts.Verdict("UNSURE", 1.0, (0.5, 2.0))
    samples, done = verdicts.retime_while_unsure(noisy, lambda s: unsure, lambda: calls.append(1) or noisy)
    assert done == len(calls) == verdicts.RETIME_ROUNDS and len(samples) == 5 * (1 + verdicts.RETIME_ROUNDS)
    assert verdicts.retime_while_unsure(noisy, verdict_of, None) == (noisy, 0)  # an untimeable row stays as is


def test_regressions_name_slower_rows_with_their_interval():
    def row(M, samples):
        return report.Row("dsv3", "rmsnorm_forward", "oink", M, 7168, "bfloat16", "cuda:0", "ok", method="cuda-graph",
                          median_s=median(samples), samples=samples, retimes=int(M == 16384))

    old = _samples(1e-4, 0.005, seed=2)
    base = {("rmsnorm_forward", "oink", M, 7168, "bfloat16"): [report.BaselineEntry(1e-4, 0.0, "dsv3", "kernel",
                                                                                   tuple(old))]
            for M in (4096, 8192, 16384)}
    rows = [row(4096, _samples(1.12e-4, 0.005)), row(8192, _samples(1e-4, 0.005)),
            row(16384, _samples(1.05e-4, 0.3, n=8, seed=1))]
    out = report.regressions(rows, base, 0.05)
    assert len(out.regressed) == 1
    assert out.regressed[0].startswith("rmsnorm_forward 4096x7168 bfloat16 oink: SLOWER, x1.1")
    assert out.regressed[0].endswith("]") and " [1.1" in out.regressed[0]
    assert "rmsnorm_forward 8192x7168 bfloat16 oink: SAME" in out.lines[1]
    assert out.unsure == [out.lines[2].split(" (")[0]] and "UNSURE" in out.unsure[0]
    assert "30 -> 8 samples; re-timed 1x" in out.lines[2]


def test_baseline_samples_are_read_from_each_layout(tmp_path):
    info = {"op": "softmax_forward", "provider": "torch", "M": 4, "N": 128, "dtype": "bfloat16"}
    layouts = {"extra_info": {"benchmarks": [{"stats": {"median": 2.0}, "extra_info": dict(info, samples=[1, 2, 3])}]},
               "stats.data": {"benchmarks": [{"stats": {"median": 2.0, "data": [1, 2, 3]}, "extra_info": info}]},
               "rows": {"rows": [dict(info, median_s=2.0, samples=[1, 2, 3])]}}
    for name, data in layouts.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        entry, = report.load_baseline(tmp_path / f"{name}.json")[("softmax_forward", "torch", 4, 128, "bfloat16")]
        assert entry.samples == (1.0, 2.0, 3.0), name


def _scaled(data, factor, samples=None):
    """pytest-benchmark JSON ``data`` with its median and samples times ``factor`` (or ``samples``)."""
    d = json.loads(json.dumps(data))
    for b in d["benchmarks"]:
        b["stats"]["median"] *= factor
        b["extra_info"]["samples"] = samples or [x * factor for x in b["extra_info"]["samples"]]
    return d


def test_runs_keep_samples_and_fail_on_slower_only(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--benchmark-json={tmp_path / 'b.json'}",
                                        f"--oink-json={tmp_path / 'o.json'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    data = json.loads((tmp_path / "b.json").read_text())
    for path in ("b.json", "o.json"):  # pytest-benchmark's own file and ours both keep the samples
        bench, = json.loads((tmp_path / path).read_text())["benchmarks"]
        assert len(bench["extra_info"]["samples"]) == bench["stats"]["rounds"] == CPU_SAMPLES
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(_scaled(data, 1e-6)))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={slow}", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    slower = "softmax_forward 4x128 bfloat16 torch: SLOWER, x* [[]*, *[]]"
    # a CPU row is SLOWER after two rounds of this run (verdicts.from_cpu_rounds)
    res.stdout.fnmatch_lines([f"*{slower} (CPU: 2 x 1 rounds*) (* ms -> * ms, {CPU_SAMPLES} -> {2 * CPU_SAMPLES} "
                              "samples; re-timed 1x)",
                              f"SLOWER beyond 5% (fails the session): {slower} (CPU: 2 x 1 rounds*)"])
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(_scaled(data, 1e6)))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={fast}", *PLUGIN)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*softmax_forward 4x128 bfloat16 torch: FASTER, x* [[]*[]]*"])


def test_unsure_row_is_retimed_then_passes(pytester, tmp_path):
    """A baseline whose samples straddle this run's by 10^5 either way can't tell: the row is timed
    RETIME_ROUNDS more rounds (its samples all kept), stays UNSURE, and the session passes. (The spread is
    that wide because a loaded CPU timed the first run up to 1000x slow: 100x read FASTER once in CI.)"""
    pytester.makepyfile(BENCH)
    assert pytester.runpytest_subprocess(*ONE_ROW, f"--benchmark-json={tmp_path / 'b.json'}", *PLUGIN).ret == 0
    data = json.loads((tmp_path / "b.json").read_text())
    m = data["benchmarks"][0]["stats"]["median"]
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(_scaled(data, 1.0, samples=[m / 1e5, m * 1e5] * 3)))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={wide}", f"--oink-json={tmp_path / 'o.json'}",
                                        *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    rounds = 1 + verdicts.RETIME_ROUNDS
    res.stdout.fnmatch_lines([f"*softmax_forward 4x128 bfloat16 torch: UNSURE, x* (*6 -> {CPU_SAMPLES * rounds} "
                              f"samples; re-timed {verdicts.RETIME_ROUNDS}x)",
                              "UNSURE after re-timing (passes*): softmax_forward 4x128 bfloat16 torch: UNSURE*"])
    bench, = json.loads((tmp_path / "o.json").read_text())["benchmarks"]
    assert len(bench["extra_info"]["samples"]) == bench["stats"]["rounds"] == CPU_SAMPLES * rounds


def _busy(seconds):
    import time

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def _cpu_row_timer(run):
    """(samples, time_once) of a CPU row of ``run`` by the plugin's own timer (bench_runner.row_timer)."""
    import torch

    from pytest_oink import bench_runner
    from pytest_oink.providers import OpSpec
    from pytest_oink.suites import Case

    spec = OpSpec("default", lambda M, N, dtype, device, gen: {"x": torch.zeros(M, N, dtype=dtype)},
                  lambda a: (a["x"],), lambda M, N, e: 0)
    case = Case("custom", "busy", 4, 8, "float32")
    row = report.Row(suite="custom", op="busy", provider="mine", M=4, N=8, dtype="float32", device="cpu",
                     status="ok", mode="cold")
    return bench_runner.row_timer(case, run, spec, torch.float32, torch.device("cpu"), row)


def test_a_scheduler_stall_over_a_cpu_round_is_no_regression():
    """A loaded CPU deschedules the timing process for ms at a time: here 5 calls in a row stall 4 ms
    (those a 5-sample round of one call each timed, as a 2-thread op's barriers did every call), the others
    take 50 us. The same code timed clean is the baseline: the stalled run must not read SLOWER, and a
    row's calls run on one torch thread."""
    import torch

    calls, threads = [], set()

    def stalled(a):
        calls.append(1)
        threads.add(torch.get_num_threads())
        _busy(4e-3 if 2 <= len(calls) <= 6 else 5e-5)

    def clean(a):
        _busy(5e-5)

    base_first, base_more = _cpu_row_timer(clean)
    base = base_first + base_more()
    samples, time_once = _cpu_row_timer(stalled)
    samples += time_once()
    entry = report.BaselineEntry(median(base), 0.0, samples=tuple(base))
    verdict = verdicts.judge(samples, median(samples), 0.0, entry, 0.05, cpu=True)
    assert verdict.name != "SLOWER" and median(samples) < 2 * median(base), (verdict, samples)
    assert threads == {1}


@pytest.mark.parametrize("mine, theirs, rounds, expected", [
    ((1.0, 1.0), (1.0, 1.0), 2, "SAME"),
    ((1.0,), (1.0,), 1, "UNSURE"),  # one round of this run: no interval yet (the gate re-times it)
    ((1.67, 1.6), (1.0, 1.0), 2, "UNSURE"),  # the same code in two processes (seen): within the CPU floor
    ((1.0, 1.1), (1.0, 1.0), 2, "UNSURE"),  # rounds disagree: neither within nor beyond the threshold
    ((3.0, 3.0), (1.0, 1.0), 2, "SLOWER"),  # beyond x2 in every round
    ((3.0,), (1.0, 1.0), 1, "UNSURE"),  # ... but once only
    ((3.0, 1.0), (1.0, 1.0), 2, "UNSURE"),  # ... or not in every round
    ((0.3, 0.3), (1.0,), 2, "FASTER"),
    ((2.5, 2.5), (1.0, 1.0), 2, "SLOWER"),  # beyond x2 against the other tree, within x3 of a file's
    ((4.0, 4.5), (1.0, 1.0), 2, "SLOWER"),  # beyond x3: a file's too
    ((0.4, 0.4), (1.0,), 2, "FASTER"),
])
def test_cpu_rows_are_judged_round_by_round(mine, theirs, rounds, expected):
    """Each round's samples are alike (tight) but the rounds are not: the bootstrap of all samples took a
    process's steady x1.6 for a regression; the CPU rule takes the range of the rounds' medians and a floor."""
    from pytest_oink.timing import CPU_SAMPLES

    def rounds_of(levels, seed):
        return [x for i, level in enumerate(levels) for x in _samples(1e-4 * level, 0.002, CPU_SAMPLES, seed + i)]

    new, old = rounds_of(mine, 1), rounds_of(theirs, 50)
    entry = report.BaselineEntry(median(old), 0.0, samples=tuple(old), this_run=True)  # --oink-against's
    assert verdicts.judge(new, median(new), 0.0, entry, 0.05, cpu=True).name == expected
    # a baseline file's rows (another run, another moment's load): beyond three times only
    from_file = report.BaselineEntry(median(old), 0.0, samples=tuple(old))
    file_expected = {(2.5, 2.5): "UNSURE", (3.0, 3.0): "UNSURE", (0.4, 0.4): "UNSURE"}.get(mine, expected)
    assert verdicts.judge(new, median(new), 0.0, from_file, 0.05, cpu=True).name == file_expected
    if mine == (1.67, 1.6):
        assert verdicts.judge(new, median(new), 0.0, entry, 0.05).name == "SLOWER"  # the GPU rule: not for CPU rows
