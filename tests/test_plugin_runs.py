"""Plugin runs beyond the usual (issue #34): without pytest-benchmark, under xdist (the merged
JSON pytest-benchmark's own tools must read), bad --oink-configs, and a bring-your-own spec's
mistakes told plainly."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from pytest_oink.suites import Case, parse_configs

PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")
BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''
TINY = ("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch")
# every stat pytest-benchmark 5 writes per benchmark
BENCHMARK_STATS = {"min", "max", "mean", "stddev", "rounds", "median", "iqr", "q1", "q3", "iqr_outliers",
                   "stddev_outliers", "outliers", "ld15iqr", "hd15iqr", "ops", "total", "iterations"}


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def test_benchmarks_run_without_pytest_benchmark(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-p", "no:benchmark", *TINY, f"--oink-csv={tmp_path / 'r.csv'}",
                                        f"--oink-json={tmp_path / 'o.json'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    res.assert_outcomes(passed=2)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(float(r["median_ms"]) > 0 for r in rows)
    data = json.loads((tmp_path / "o.json").read_text())
    assert len(data["benchmarks"]) == 2 and all(b["stats"]["median"] > 0 for b in data["benchmarks"])


def test_xdist_json_carries_pytest_benchmarks_stats(pytester, tmp_path):
    pytest.importorskip("xdist")
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-n", "2", *TINY[:2], "--oink-providers=oink,torch",
                                        f"--benchmark-json={tmp_path / 'b.json'}", f"--oink-json={tmp_path / 'o.json'}",
                                        *PLUGIN)
    res.assert_outcomes(passed=4)
    for name in ("b.json", "o.json"):
        data = json.loads((tmp_path / name).read_text())
        assert len(data["benchmarks"]) == 4
        for b in data["benchmarks"]:
            assert BENCHMARK_STATS <= b["stats"].keys(), sorted(BENCHMARK_STATS - b["stats"].keys())
            assert b["stats"]["min"] <= b["stats"]["median"] <= b["stats"]["max"] and b["stats"]["rounds"] >= 5
    # pytest-benchmark's own compare reads it
    out = subprocess.run([sys.executable, "-m", "pytest_benchmark", "compare", str(tmp_path / "b.json"),
                          "--columns=min,median,max,mean,stddev,iqr,outliers,ops,rounds"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_benchmark[softmax_forward-64x1024-bfloat16-oink]" in out.stdout
    assert "Failed to load" not in out.stdout + out.stderr


@pytest.mark.parametrize("configs", ["4x-1", "0x128", "4x0"])
def test_configs_need_positive_sizes(pytester, configs):
    with pytest.raises(ValueError, match="at least 1"):
        parse_configs(configs)
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--collect-only", *TINY, f"--oink-configs={configs}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([f"*--oink-configs: '{configs}': M and N must be at least 1*"])


def _softmax_spec(**kw):
    import torch

    from pytest_oink import OpSpec

    def inputs(M, N, dtype, device, gen):
        return {"x": torch.randn(M, N, generator=gen, dtype=dtype, device=device)}

    return OpSpec(**dict(dict(family="softmax", make_inputs=inputs, reference=lambda a: (torch.softmax(a["x"], -1),),
                              nbytes=lambda M, N, e: 2 * M * N * e), **kw))


def test_own_spec_with_an_unknown_family_is_refused():
    with pytest.raises(ValueError, match=r"unknown tolerance family 'sofmax'.*known: .*softmax"):
        _softmax_spec(family="sofmax")
    with pytest.raises(ValueError, match=r"unknown tolerance family 'nope'"):
        _softmax_spec(family=("softmax", "nope"))
    _softmax_spec(family=("softmax", "weight_grad"))


def test_own_kernel_mistakes_are_told_plainly():
    import torch

    from pytest_oink.bench_runner import gate

    spec, case, cpu = _softmax_spec(), Case("custom", "my_op", 4, 64, "float32"), torch.device("cpu")
    wrong = gate(spec, lambda a: (torch.softmax(a["x"], -1)[:, :32],), case, torch.float32, cpu)
    assert not wrong["passed"] and "output 0 has shape (4, 32); expected (4, 64)" in wrong["report"]
    # a single tensor returned bare is one output (not one per row)
    assert gate(spec, lambda a: torch.softmax(a["x"], -1), case, torch.float32, cpu)["passed"]
    bare_ref = _softmax_spec(reference=lambda a: torch.softmax(a["x"], -1))
    assert gate(bare_ref, lambda a: (torch.softmax(a["x"], -1),), case, torch.float32, cpu)["passed"]


def test_torch_compile_rows_bring_no_torch_jit_deprecation_warnings():
    """torch.compile's first import of Inductor imports torch.utils.mkldnn, whose ScriptModules use the
    deprecated torch.jit.script_method (torch's own code): 14 warnings in every session's summary before."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import warnings\nwith warnings.catch_warnings(record=True) as seen:\n    warnings.simplefilter('always')\n"
            "    from pytest_oink.registry import compiled\n    compiled(lambda a: a)\n"
            "print([str(w.message) for w in seen if 'torch.jit' in str(w.message)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:] + out.stderr[-2000:]
