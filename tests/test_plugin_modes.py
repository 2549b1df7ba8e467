"""Timing modes (issue #34 item 5): --oink-timing=cold|hot|eager is recorded in every output, and
the regression gate compares rows of one mode only. CPU runs: every mode is the host timer there."""
from __future__ import annotations

import csv
import json

import pytest

from pytest_oink import modes, report
from pytest_oink.timing import eager_calls_for

from tests.helpers import BENCH, ONE_ROW, PLUGIN  # the plugin runs' bench file and one gated CPU row


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def test_mode_names_and_old_rows():
    assert modes.parse(None) == "cold" and modes.parse(" hot ") == "hot"
    with pytest.raises(ValueError, match="--oink-timing='warm': expected one of cold, hot, eager"):
        modes.parse("warm")
    # rows from before the option: the launch suite's eager calls, graph replays (cold) otherwise
    assert modes.of_method("eager-calls") == "eager" and modes.of_method("cuda-graph") == "cold"
    assert modes.of_method("cpu-perf_counter") == "cold" and modes.of_method(None) is None
    assert modes.for_suite("hot", "launch") == "eager" and modes.for_suite("hot", "smoke") == "hot"
    assert modes.CPU_NOTE in modes.describe({"hot"}, {"cpu", "cuda:0"})
    assert "CPU" not in modes.describe({"hot"}, {"cuda:0"})
    cpu = modes.describe({"hot"}, {"cpu"})  # rows of a CPU alone: its timer, not the mode's GPU meaning
    assert cpu == f"{modes.CPU_TIMING} (--oink-timing=hot asked: a CPU times every mode alike)"
    assert eager_calls_for(1e-3, 0.01) == 10 and eager_calls_for(1.0, 0.01) == 1 and eager_calls_for(1e-9, 1) == 400


def test_baseline_rows_match_one_mode_only():
    row = report.Row("dsv3", "rmsnorm_forward", "oink", 4096, 7168, "bfloat16", "cuda:0", "ok", method="cuda-graph",
                     median_s=1e-4, mode="hot")
    cold = report.BaselineEntry(1e-4, 0.0, "dsv3", "kernel", mode="cold")
    hot = report.BaselineEntry(2e-4, 0.0, "dsv3", "kernel", mode="hot")
    assert report.match_entry(row, [cold]) is None and report.match_entry(row, [cold, hot]) is hot
    out = report.regressions([row], {row.key: [cold]}, 0.05)
    assert not out.lines and "mode cold; this row of suite dsv3, timed kernel, mode hot" in out.mismatched[0]


def test_invalid_mode_is_a_usage_error(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess(*ONE_ROW, "--oink-timing=warm", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--oink-timing='warm': expected one of cold, hot, eager*"])


def test_mode_is_recorded_and_other_modes_are_not_compared(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    outputs = (f"--oink-csv={tmp_path / 'r.csv'}", f"--oink-json={tmp_path / 'o.json'}",
               f"--benchmark-json={tmp_path / 'b.json'}", f"--oink-summary={tmp_path / 's.md'}")
    res = pytester.runpytest_subprocess(*ONE_ROW, "--oink-timing=hot", *outputs, *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    res.stdout.fnmatch_lines(["*softmax_forward 4x128 bfloat16 torch*(cpu-one-thread, hot)*",
                              f"[[]oink[]] timing: {modes.describe({'hot'}, {'cpu'})}"])
    assert [r["mode"] for r in csv.DictReader(open(tmp_path / "r.csv"))] == ["hot"]
    for name in ("o.json", "b.json"):
        data = json.loads((tmp_path / name).read_text())
        assert data["oink_run"]["timing"] == "hot" and data["benchmarks"][0]["extra_info"]["mode"] == "hot"
    assert f"Timing: {modes.describe({'hot'}, {'cpu'})}." in (tmp_path / "s.md").read_text()
    # the hot run as a baseline: a cold run (the default) is not compared with it, and says why
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={tmp_path / 'b.json'}", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*not compared (*): softmax_forward-4x128-bfloat16-torch (*mode hot; *mode cold)*",
                              "*the regression gate compared nothing: the baseline's rows of these shapes are of "
                              "another suite, timing or --oink-timing mode*"])
    assert pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={tmp_path / 'b.json'}", "--oink-timing=hot",
                                         "--oink-max-regression=1000000%", *PLUGIN).ret == 0
    # a file from before modes were recorded was timed cold: compared with cold rows only
    old = tmp_path / "old.json"
    row = {"suite": "smoke", "op": "softmax_forward", "provider": "torch", "M": 4, "N": 128, "dtype": "bfloat16",
           "median_s": 1.0, "method": "cpu-one-thread"}
    old.write_text(json.dumps({"rows": [row]}))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={old}", *PLUGIN)
    assert res.ret == 0 and "softmax_forward 4x128 bfloat16 torch: FASTER" in res.stdout.str()
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={old}", "--oink-timing=eager", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*not compared (*mode cold; *mode eager)*"])
