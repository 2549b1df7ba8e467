"""--oink-history (issue #34 item 6): each run appends one JSON file (commit, machine, versions,
rows with their gate verdicts) and one SVG per op is drawn over the runs. CPU rows only."""
from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET

import pytest

from pytest_oink import history

PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")
BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''
TWO_ROWS = ("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch", "--oink-gate-cpu",
            "--oink-gate-providers=torch")


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def test_two_runs_append_two_files_and_plot_each_op(pytester, tmp_path):
    import importlib.metadata as md

    pytest.importorskip("matplotlib")
    pytester.makepyfile(BENCH)
    hist = tmp_path / "hist"
    res = pytester.runpytest_subprocess(*TWO_ROWS, f"--oink-history={hist}", f"--oink-json={tmp_path / 'o.json'}",
                                        *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    # the second run is gated against the first, scaled 1e6 slower: its rows are FASTER
    data = json.loads((tmp_path / "o.json").read_text())
    for b in data["benchmarks"]:
        b["stats"]["median"] *= 1e6
        b["extra_info"]["samples"] = [x * 1e6 for x in b["extra_info"]["samples"]]
    (tmp_path / "base.json").write_text(json.dumps(data))
    gated = (*TWO_ROWS, f"--oink-history={hist}", f"--oink-baseline={tmp_path / 'base.json'}", *PLUGIN)
    res = pytester.runpytest_subprocess(*gated, "--oink-timing=hot")
    assert res.ret == pytest.ExitCode.TESTS_FAILED  # hot rows against a cold baseline: not compared
    res = pytester.runpytest_subprocess(*gated)
    assert res.ret == 0, res.stdout.str()[-2000:]
    res.stdout.fnmatch_lines([f"[[]oink[]] wrote {hist}/*.json", f"[[]oink[]] wrote {hist}/plots/softmax_forward.svg"])
    files = sorted(hist.glob("*.json"))
    assert len(files) == 3
    runs = history.load(hist)
    assert [r["run"]["timing"] for r in runs] == ["cold", "hot", "cold"]
    for run in runs:
        assert run["commit"] == "unknown"  # pytester's directory is no git work tree
        assert run["card"] == "no GPU" and run["versions"]["torch"] == md.version("torch")
        assert run["machine"].startswith("no GPU, torch ")
        assert {(r["op"], r["provider"], r["M"], r["N"], r["dtype"]) for r in run["rows"]} == {
            ("softmax_forward", "torch", 4, 128, "bfloat16"), ("softmax_forward", "torch", 64, 1024, "bfloat16")}
        assert all(r["median_s"] > 0 for r in run["rows"])
    assert [r["verdict"] for r in runs[0]["rows"]] == [None, None]
    assert [r["verdict"] for r in runs[2]["rows"]] == ["FASTER", "FASTER"]
    assert [r["mode"] for r in runs[1]["rows"]] == ["hot", "hot"]
    svg = hist / "plots" / "softmax_forward.svg"
    assert ET.parse(svg).getroot().tag.endswith("svg")
    text = svg.read_text()
    assert "softmax_forward: time over runs" in text and "torch 4x128 bfloat16 cold" in text and "FASTER" in text


def test_git_commit_of_a_work_tree(tmp_path):
    assert history.git_commit(tmp_path) == "unknown"
    try:
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                        "--allow-empty", "-m", "x"], check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no usable git here")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert history.git_commit(tmp_path) == head.strip() and len(head.strip()) == 40


def test_without_matplotlib_the_run_is_recorded_and_the_plot_skipped(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    pytester.makeconftest("import sys\nsys.modules['matplotlib'] = None  # as if not installed\n")
    hist = tmp_path / "hist"
    res = pytester.runpytest_subprocess(*TWO_ROWS[:3], "--oink-configs=4x128", f"--oink-history={hist}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    res.stdout.fnmatch_lines(["*history plots skipped: matplotlib is not installed*"])
    assert len(list(hist.glob("*.json"))) == 1 and not (hist / "plots").exists()
