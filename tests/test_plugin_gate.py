"""The regression gate's edge cases through pytester (issue #34): a gate that compared nothing,
rows of another suite or timing, thresholds that are no numbers, a GPU suite on a CPU runner,
and the baseline's machine. Every run here is one tiny CPU row (or none)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers import BENCH, ONE_ROW, PLUGIN  # the plugin runs' bench file and one gated CPU row


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def _baseline(path, **row):
    """Our rows JSON with one row (a softmax_forward 4x128 torch row of the smoke suite unless told)."""
    base = {"suite": "smoke", "op": "softmax_forward", "provider": "torch", "M": 4, "N": 128, "dtype": "bfloat16",
            "median_s": 1.0, "method": "cpu-one-thread"}
    path.write_text(json.dumps({"rows": [dict(base, **row)]}))
    return path


def test_allow_missing_does_not_pass_a_gate_that_compared_nothing(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    other = _baseline(tmp_path / "other.json", M=8)  # matches no row of this run: refused before any runs
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={other}", "--oink-allow-missing", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*the gate would compare nothing*"])
    # some rows missing is what --oink-allow-missing tolerates
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"rows": [json.loads(other.read_text())["rows"][0],
                                        json.loads(_baseline(tmp_path / "x.json", M=4).read_text())["rows"][0]]}))
    res = pytester.runpytest_subprocess(*ONE_ROW[:3], "--oink-configs=4x128,2x128", *ONE_ROW[4:],
                                        f"--oink-baseline={two}", "--oink-allow-missing", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    # compared (CPU timing against a 1 s baseline without samples: the spread rule, FASTER)
    res.stdout.fnmatch_lines(["*softmax_forward 4x128 bfloat16 torch: *, x* (spread rule*",
                              "*not compared (no baseline entry): softmax_forward-2x128-bfloat16-torch*"])


def test_rows_of_another_suite_or_timing_are_not_compared(pytester, tmp_path):
    """A launch-suite baseline (host time of eager calls) says nothing about a smoke row: not
    compared, never a verdict (its tiny time would read as a regression)."""
    pytester.makepyfile(BENCH)
    for i, row in enumerate(({"suite": "launch", "method": "eager-calls", "median_s": 1e-12},
                             {"suite": "launch", "median_s": 1e-12})):  # another suite: refused before any row runs
        base = _baseline(tmp_path / f"b{i}.json", **row)
        res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={base}", *PLUGIN)
        assert res.ret == pytest.ExitCode.USAGE_ERROR and "SLOWER" not in res.stdout.str()
        res.stderr.fnmatch_lines(["*recorded from suite launch, not from --oink-suite=smoke*"])
    base = _baseline(tmp_path / "b.json", method="eager-calls", median_s=1e-12)  # this suite, timed otherwise
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={base}", *PLUGIN)
    out = res.stdout.str()
    assert "SLOWER" not in out and res.ret == pytest.ExitCode.TESTS_FAILED, out[-2000:]
    res.stdout.fnmatch_lines(["*not compared (*): softmax_forward-4x128-bfloat16-torch*",
                              "*the regression gate compared nothing*"])
    assert "baseline row of suite smoke, timed host-eager" in out


@pytest.mark.parametrize("value", ["nan%", "inf%", "1e400%"])
def test_threshold_must_be_a_finite_percentage(pytester, value):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--collect-only", *ONE_ROW, f"--oink-max-regression={value}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--oink-max-regression=*: expected a finite, non-negative percentage*"])


def test_gpu_suite_on_a_cpu_runner_says_why_and_writes_valid_files(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    base = _baseline(tmp_path / "base.json", suite="dsv3", M=4096, N=6144)
    outputs = (f"--oink-csv={tmp_path / 'r.csv'}", f"--benchmark-json={tmp_path / 'b.json'}",
               f"--oink-summary={tmp_path / 's.md'}")
    args = ("--oink-suite=dsv3", "--oink-ops=softmax_forward", "--oink-providers=torch", *outputs, *PLUGIN)
    res = pytester.runpytest_subprocess(*args)
    assert res.ret == 0  # no gate asked: skipped rows are no failure, but the run says so
    res.stdout.fnmatch_lines(["*no rows measured: suite 'dsv3' is sized for a GPU and there is none*9 rows skipped*"])
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["benchmarks"] == [] and data["oink_run"]["suite"] == "dsv3"
    assert list(csv.reader(open(tmp_path / "r.csv"))) == [list(__import__("pytest_oink.report").report.CSV_FIELDS)]
    res = pytester.runpytest_subprocess(*args, f"--oink-baseline={base}", "--oink-allow-missing")
    assert res.ret == pytest.ExitCode.USAGE_ERROR  # said before its rows are collected and skipped
    res.stderr.fnmatch_lines(["*the gate would compare nothing: suite 'dsv3' is sized for a GPU and there is none*"])


def _benchmark_baseline(path, machine_info):
    """pytest-benchmark's JSON with one benchmark (the ONE_ROW row, 1 s) measured on ``machine_info``."""
    info = {"suite": "smoke", "op": "softmax_forward", "provider": "torch", "M": 4, "N": 128, "dtype": "bfloat16",
            "method": "cpu-one-thread"}
    bench = {"name": "test_benchmark[softmax_forward-4x128-bfloat16-torch]", "stats": {"median": 1.0},
             "extra_info": info}
    path.write_text(json.dumps({"machine_info": machine_info, "benchmarks": [bench]}))
    return path


H100 = {"gpu": {"name": "NVIDIA H100 80GB HBM3", "driver": "570.86", "cuda": "12.8"},
        "oink_versions": {"torch": "2.9.0", "nvidia-cutlass-dsl": "4.2.0", "oink": "0.1.0"}}


def test_machine_identity_differences():
    from pytest_oink import machine

    h100 = machine.identity(H100)
    assert machine.describe(h100) == "NVIDIA H100 80GB HBM3, driver 570.86, CUDA 12.8, torch 2.9.0, CuTeDSL 4.2.0"
    for field, change in (("driver", {"gpu": dict(H100["gpu"], driver="575.1")}),
                          ("CUDA", {"gpu": dict(H100["gpu"], cuda="13.0")}),
                          ("GPU", {"gpu": dict(H100["gpu"], name="NVIDIA H200")}),
                          ("torch", {"oink_versions": dict(H100["oink_versions"], torch="2.10.0")}),
                          ("CuTeDSL", {"oink_versions": dict(H100["oink_versions"], **{"nvidia-cutlass-dsl": "4.3"})})):
        diff = machine.mismatches(h100, machine.identity(dict(H100, **change)))
        assert len(diff) == 1 and diff[0].startswith(field + " "), diff
    # Oink's own version is what a regression gate compares: never a refusal; nor a file naming no machine
    assert machine.mismatches(h100, machine.identity(dict(H100, oink_versions=dict(H100["oink_versions"],
                                                                                   oink="0.2.0")))) == []
    assert machine.identity({}) is None and machine.mismatches(None, h100) == []
    cpu = machine.identity({"gpu": None, "oink_versions": {"torch": "2.9.0"}})
    assert machine.mismatches(h100, cpu) == ["GPU NVIDIA H100 80GB HBM3 -> no GPU"]


def test_baseline_of_another_machine_is_refused_unless_accepted(pytester, tmp_path):
    import importlib.metadata as md

    pytester.makepyfile(BENCH)
    other = _benchmark_baseline(tmp_path / "h100.json", H100)
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={other}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR  # before any row is timed
    res.stderr.fnmatch_lines([
        "*--oink-baseline=*h100.json: measured on another machine (GPU NVIDIA H100 80GB HBM3 -> no GPU*",
        "*baseline: NVIDIA H100 80GB HBM3, driver 570.86, CUDA 12.8, torch 2.9.0, CuTeDSL 4.2.0*",
        f"*this run: no GPU, torch {md.version('torch')}*",
        "*--oink-accept-machine*"])
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={other}", "--oink-accept-machine", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    # compared (CPU timing against a 1 s baseline without samples: the spread rule, FASTER)
    res.stdout.fnmatch_lines(["*softmax_forward 4x128 bfloat16 torch: *, x* (spread rule*",
                              "Baseline machine: NVIDIA H100 80GB HBM3, driver 570.86, CUDA 12.8, torch 2.9.0, "
                              f"CuTeDSL 4.2.0; this machine: no GPU, torch {md.version('torch')}*",
                              "*accepted (--oink-accept-machine): GPU NVIDIA H100 80GB HBM3 -> no GPU*"])
    # this machine's own baseline needs no flag
    here = {"gpu": None, "oink_versions": {"torch": md.version("torch"),
                                           "nvidia-cutlass-dsl": md.version("nvidia-cutlass-dsl")}}
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={_benchmark_baseline(tmp_path / 'h.json', here)}",
                                        f"--oink-summary={tmp_path / 's.md'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    assert "Baseline machine: no GPU, torch" in (tmp_path / "s.md").read_text()


REAL_H100 = Path(__file__).parent / "data" / "h100-quack-2026-12-07.json"  # a real quack-suite run (data/README)


def test_a_real_h100_baseline_is_refused_on_another_card(pytester, monkeypatch):
    """The quack suite's JSON from a real H100 run, gated against on an H200 (this machine's record made so, in
    process) and on this CPU: refused before any row runs, naming both machines."""
    from pytest_oink import machine

    real = json.loads(REAL_H100.read_text())["machine_info"]
    h200 = dict(real, gpu=dict(real["gpu"], name="NVIDIA H200", memory_bytes=150_000_000_000))
    monkeypatch.setattr(machine, "this_machine", lambda: h200)
    pytester.makepyfile(BENCH)
    suite = ("--oink-suite=quack", "--oink-ops=rmsnorm_forward", "--oink-configs=8192x4096")
    res = pytester.runpytest_inprocess("--collect-only", *suite, f"--oink-baseline={REAL_H100}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    out = res.stdout.str() + res.stderr.str()
    assert "measured on another machine (GPU NVIDIA H100 80GB HBM3 -> NVIDIA H200)" in out, out[-2000:]
    assert "baseline: NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch 2.11.0, CuTeDSL 4.8.1" in out
    assert "this run: NVIDIA H200, driver 580.159.04, CUDA 13.0, torch 2.11.0, CuTeDSL 4.8.1" in out
    monkeypatch.undo()
    res = pytester.runpytest_subprocess("--collect-only", *suite, f"--oink-baseline={REAL_H100}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*measured on another machine (GPU NVIDIA H100 80GB HBM3 -> no GPU*",
                              "*baseline: NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0, torch 2.11.0*"])


def _usage_error(pytester, *args):
    """A --collect-only run of ONE_ROW with ``args``: refused before collection ends, nothing timed."""
    res = pytester.runpytest_subprocess("--collect-only", *ONE_ROW, *args, *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()[-2000:] + res.stderr.str()[-2000:]
    return res


def test_gate_preconditions_are_checked_before_any_row_runs(pytester, tmp_path):
    """What would make the gate compare nothing, or not run at all, is a usage error naming the reason."""
    from pytest_oink import report

    pytester.makepyfile(BENCH)
    res = _usage_error(pytester, "--oink-max-regression=10%")  # no baseline: the threshold would gate nothing
    res.stderr.fnmatch_lines(["*--oink-max-regression=10%: the regression gate runs only against a baseline: give "
                              "--oink-baseline=FILE (or --oink-against=REF)*"])
    rows = report.Row(suite="smoke", op="softmax_forward", provider="torch", M=4, N=128, dtype="bfloat16",
                      device="cpu", status="ok", median_s=1.0)
    report.write_csv([rows], tmp_path / "r.csv")  # the plugin's own CSV is no baseline: named as such
    res = _usage_error(pytester, f"--oink-baseline={tmp_path / 'r.csv'}")
    res.stderr.fnmatch_lines(["*--oink-baseline=*r.csv: this is a CSV of rows (--oink-csv); a baseline is the JSON a "
                              "run writes with --oink-json=PATH or --benchmark-json=PATH*"])
    assert "Expecting value" not in res.stderr.str()
    res = _usage_error(pytester, f"--oink-baseline={_baseline(tmp_path / 'q.json', suite='quack')}")
    res.stderr.fnmatch_lines(["*--oink-baseline=*q.json: recorded from suite quack, not from --oink-suite=smoke*"])
    res = _usage_error(pytester, f"--oink-baseline={_baseline(tmp_path / 'm.json', M=8)}")
    res.stderr.fnmatch_lines(["*--oink-baseline=*m.json: the gate would compare nothing: none of the 1 gated rows "
                              "selected (op, provider, shape, dtype) has an entry in it*"])
    ok = _baseline(tmp_path / "ok.json")
    res = pytester.runpytest_subprocess("--collect-only", *ONE_ROW[:-2], f"--oink-baseline={ok}",
                                        "--oink-gate-providers=torch", *PLUGIN)  # no --oink-gate-cpu, no GPU
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*the gate would compare nothing: there is no GPU here, and CPU rows are gated only "
                              "with --oink-gate-cpu*"])
    res = pytester.runpytest_subprocess("--collect-only", *ONE_ROW, f"--oink-baseline={ok}", *PLUGIN)
    assert res.ret == 0, res.stderr.str()  # a baseline of the selected row: collected, no refusal


OWN_KERNEL = '''
import torch
from pytest_oink import OpSpec

SPEC = OpSpec("softmax", lambda M, N, dtype, device, gen: {"x": torch.randn(M, N, generator=gen).to(dtype)},
              lambda a: (a["x"].float().relu().to(a["x"].dtype),), lambda M, N, e: 2 * M * N * e)

def test_relu(oink_measure):
    oink_measure(SPEC, lambda a: (a["x"].relu(),), 4, 128, name="relu")
'''


def test_a_users_own_kernel_rows_are_gated_under_their_provider_name(pytester, tmp_path):
    """oink_measure's rows are of provider "mine" unless named: --oink-gate-providers=mine gates them
    (it was refused as an unknown provider: only the registry's names were accepted)."""
    pytester.makepyfile(OWN_KERNEL)
    res = pytester.runpytest_subprocess(f"--oink-json={tmp_path / 'base.json'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    res = pytester.runpytest_subprocess(f"--oink-baseline={tmp_path / 'base.json'}", "--oink-gate-cpu",
                                        "--oink-gate-providers=mine", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:] + res.stderr.str()[-2000:]
    res.stdout.fnmatch_lines(["*oink regression gate*", "relu 4x128 bfloat16 mine: *"])



def test_a_misspelt_gate_provider_is_refused_before_any_row_runs(pytester, tmp_path):
    """A gate provider that none of the suite's rows is of, alone or beside one that is, is a usage error naming
    it and the known providers before any row runs: not a gate that compares fewer rows than asked (or none)
    after the whole run, nor a refusal for another reason (here: no GPU) that hides the typo."""
    pytester.makepyfile(BENCH)
    base = _baseline(tmp_path / "base.json")  # an entry for the selected row
    for gate in ("trch", "torch,trch"):
        res = pytester.runpytest_subprocess(*ONE_ROW[:-2], f"--oink-gate-providers={gate}", f"--oink-baseline={base}",
                                            *PLUGIN)
        assert res.ret == pytest.ExitCode.USAGE_ERROR, res.stdout.str()[-2000:]
        res.stderr.fnmatch_lines([f"*--oink-gate-providers={gate}: 'trch' is no provider of this session's rows "
                                  "(theirs: torch; known providers: oink, oink-unfused, *, torch, torch.compile)*"])
        assert "passed" not in res.stdout.str() and "[oink]" not in res.stdout.str()  # no row ran
    # the default gate (oink) where the selection has no Oink row: no typo, but still refused up front
    res = pytester.runpytest_subprocess(*ONE_ROW[:-1], f"--oink-baseline={base}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*the gate would compare nothing: no selected row is of the gated providers (oink: "
                              "--oink-gate-providers)*"])
