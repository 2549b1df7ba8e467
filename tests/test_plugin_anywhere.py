"""The used-by commands from any directory (issue #34): the suites' items are the plugin's own
(pytest_oink/benchmarks.py), so ``pytest --oink-suite=NAME`` runs in a project with no conftest and
no benchmark file of its own, and writes every output."""
from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from tests.helpers import BENCH, PLUGIN, oink_on_pythonpath
from tests.helpers import _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

TINY = ("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch")


@pytest.fixture
def elsewhere(pytester, monkeypatch):
    """A directory that is not this repository: no conftest, no bench/, no test file; Oink importable
    as an installed package would be (its parent directory on PYTHONPATH), not through the repo's rootdir."""
    oink_on_pythonpath(monkeypatch)
    assert not list(pytester.path.iterdir())
    return pytester


def test_smoke_suite_runs_from_an_empty_directory(elsewhere, tmp_path):
    svg = importlib.util.find_spec("matplotlib") is not None  # oink[test] installs it; drawn where it is
    outputs = [f"--oink-csv={tmp_path / 'r.csv'}", f"--oink-summary={tmp_path / 's.md'}",
               f"--benchmark-json={tmp_path / 'b.json'}"] + ([f"--oink-svg={tmp_path / 'svg'}"] if svg else [])
    res = elsewhere.runpytest_subprocess(*TINY, *outputs, *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-3000:]
    res.assert_outcomes(passed=2)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [(r["op"], r["M"], r["N"], r["status"]) for r in rows] == [("softmax_forward", "4", "128", "ok"),
                                                                       ("softmax_forward", "64", "1024", "ok")]
    assert all(float(r["median_ms"]) > 0 for r in rows)
    assert rows[0]["test"] == "pytest_oink/benchmarks.py::test_benchmark[softmax_forward-4x128-bfloat16-torch]"
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["benchmarks"]) == 2 and all(b["stats"]["median"] > 0 for b in data["benchmarks"])
    assert "| 64 | 1024 | bfloat16 |" in (tmp_path / "s.md").read_text()
    if svg:
        assert (tmp_path / "svg" / "smoke-softmax_forward.svg").read_text().lstrip().startswith("<?xml")


def test_the_suites_items_take_selection_options(elsewhere):
    res = elsewhere.runpytest_subprocess("--collect-only", "-q", "--oink-suite=smoke", "--oink-ops=softmax_forward",
                                         "-k", "64x1024 and torch and not compile", *PLUGIN)
    ids = [line for line in res.stdout.lines if "::test_benchmark[" in line]
    assert ids == ["pytest_oink/benchmarks.py::test_benchmark[softmax_forward-64x1024-bfloat16-torch]"]


def test_a_projects_own_benchmark_module_runs_once(pytester):
    """A project that kept a module of its own taking ``oink_case`` runs that one, not both."""
    pytester.makepyfile(test_mine=BENCH)
    res = pytester.runpytest_subprocess("--collect-only", "-q", *TINY, *PLUGIN)
    ids = [line for line in res.stdout.lines if "::test_benchmark[" in line]
    assert sorted(ids) == [f"test_mine.py::test_benchmark[softmax_forward-{s}-bfloat16-torch]"
                           for s in ("4x128", "64x1024")]


def test_no_suite_collects_no_benchmark(elsewhere):
    elsewhere.makepyfile(test_unit="def test_unit():\n    pass\n")
    res = elsewhere.runpytest_subprocess("-q", *PLUGIN)
    res.assert_outcomes(passed=1)


def test_gpu_suite_on_a_cpu_says_why_from_an_empty_directory(elsewhere, tmp_path):
    res = elsewhere.runpytest_subprocess("-rs", "--oink-suite=dsv3", "--oink-ops=softmax_forward",
                                         "--oink-providers=torch", f"--oink-json={tmp_path / 'o.json'}", *PLUGIN)
    res.assert_outcomes(skipped=9)
    res.stdout.fnmatch_lines(["SKIPPED*suite 'dsv3' is sized for a GPU and there is none*"])
    res.stdout.fnmatch_lines(["*no rows measured: suite 'dsv3' is sized for a GPU and there is none*"])
    run = json.loads((tmp_path / "o.json").read_text())["oink_run"]
    assert run["suite"] == "dsv3" and "sized for a GPU and there is none" in run["no_rows"]
