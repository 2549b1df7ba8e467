"""--oink-against (issue #34 item 2) on a CPU: the same rows timed for another tree of Oink in the
same run, rounds alternating, and gated against it. The trees are a tiny git repository holding a
copy of this Oink, whose second commit makes softmax_forward deliberately slower, and a directory."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import oink
from tests.helpers import PLUGIN
from tests.helpers import _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

ROW = ("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=oink", "--oink-configs=4x128",
       "--oink-gate-cpu")
# appended to the slow commit's oink/__init__.py: every softmax_forward call sleeps first
SLOWER = '''

import time as _time


def softmax_forward(*args, **kwargs):
    _time.sleep(0.02)
    from .ops import softmax_forward as fast

    return fast(*args, **kwargs)
'''


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


def _copy_of_oink(root: Path) -> Path:
    shutil.copytree(Path(oink.__file__).parent, root / "oink", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture
def slow_repo(tmp_path, monkeypatch):
    """A git repository of Oink: HEAD~1 as this Oink, HEAD (and the working tree, which the runs
    import) with softmax_forward slower; the plugin comes from this checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = _copy_of_oink(tmp_path / "repo")
    _git(repo, "init", "-q")
    _git(repo, "add", "oink")
    _git(repo, "commit", "-q", "-m", "fast")
    with open(repo / "oink" / "__init__.py", "a") as f:
        f.write(SLOWER)
    _git(repo, "commit", "-q", "-am", "slow")
    harness = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(repo), harness, os.environ.get("PYTHONPATH")])))
    return repo


def test_a_slower_tree_is_slower_than_its_parent_commit(pytester, slow_repo, tmp_path):
    res = pytester.runpytest_subprocess(*ROW, "--oink-against=HEAD~1", f"--oink-summary={tmp_path / 's.md'}", *PLUGIN)
    out = res.stdout.str()
    assert res.ret == pytest.ExitCode.TESTS_FAILED, out[-3000:]
    res.stdout.fnmatch_lines(["SLOWER beyond 5% (fails the session): softmax_forward 4x128 bfloat16 oink: SLOWER, x*",
                              f"A/B in one run: this tree {slow_repo} (commit *) against HEAD~1 (commit * of "
                              f"{slow_repo}, exported to *), rounds alternating on the same device"])
    summary = (tmp_path / "s.md").read_text()
    assert f"this tree {slow_repo} (commit" in summary and "against HEAD~1 (commit" in summary
    exported = out.split("exported to ")[1].split(")")[0]
    assert not Path(exported).exists()  # the exported tree is removed at the end


def test_the_same_code_is_not_slower(pytester, slow_repo, tmp_path):
    res = pytester.runpytest_subprocess(*ROW, "--oink-against=HEAD", f"--oink-summary={tmp_path / 's.md'}", *PLUGIN)
    out = res.stdout.str()
    assert res.ret == 0 and "SLOWER" not in out, out[-3000:]
    res.stdout.fnmatch_lines(["softmax_forward 4x128 bfloat16 oink: * (* ms -> * ms, * -> * samples*)"])
    summary = (tmp_path / "s.md").read_text()  # the A/B's ratio per row, in the summary too
    assert "Baseline: the other tree of --oink-against, timed in this run. Threshold 5%; 1 rows compared" in summary
    assert "| softmax_forward 4x128 bfloat16 oink | " in summary
    assert "Geomean ratio per op: softmax_forward oink" in summary


def test_a_directory_tree_and_rows_it_cannot_time(pytester, tmp_path):
    """A directory holding oink/ is a tree too; a row whose op the other tree lacks is named, not compared."""
    other = _copy_of_oink(tmp_path / "other")
    with open(other / "oink" / "__init__.py", "a") as f:
        f.write("\n\ndef softmax_forward(*args, **kwargs):\n    raise AttributeError('softmax_forward')\n")
    res = pytester.runpytest_subprocess(*ROW, f"--oink-against={other}", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED  # its one row was not compared: the gate compared nothing
    res.stdout.fnmatch_lines(["*not timed on the other tree: softmax_forward 4x128 bfloat16 oink: the other tree's "
                              "row failed its gate (seed 1: raised AttributeError*softmax_forward*)",
                              "*the regression gate compared nothing*"])


@pytest.mark.parametrize("args, message", [
    (("--oink-against=no-such-ref-or-dir",), "--oink-against=no-such-ref-or-dir: neither a directory nor a git ref"),
    (("--oink-against=.",), "--oink-against=.: the directory * holds no oink/ package"),
    (("--oink-against=HEAD", "--oink-baseline=b.json"), "--oink-against and --oink-baseline: give one*"),
])
def test_bad_against_is_a_usage_error(pytester, slow_repo, args, message):
    res = pytester.runpytest_subprocess("--collect-only", *ROW, *args, *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([f"*{message}*"])


def test_a_ref_needs_oink_in_a_git_repository(pytester, tmp_path, monkeypatch):
    """An Oink installed from a wheel has no history: a ref is refused, naming where Oink is."""
    plain = _copy_of_oink(tmp_path / "plain")
    harness = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plain), harness, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above it either
    res = pytester.runpytest_subprocess("--collect-only", *ROW, "--oink-against=HEAD~1", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([f"*--oink-against=HEAD~1: no such directory, and Oink at {plain} is not in a git "
                              "repository to find a ref in*"])


def test_under_xdist_the_controller_gates_on_the_workers_rows(pytester, slow_repo):
    pytest.importorskip("xdist")
    res = pytester.runpytest_subprocess("-n", "2", *ROW[:3], "--oink-configs=4x128,8x128", *ROW[4:],
                                        "--oink-against=HEAD~1", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED, res.stdout.str()[-3000:]
    res.stdout.fnmatch_lines(["SLOWER beyond 5% (fails the session): softmax_forward 4x128 bfloat16 oink: SLOWER, "
                              "x*; softmax_forward 8x128 bfloat16 oink: SLOWER, x*"])
    assert "not compared" not in res.stdout.str()


def _rounds(this_factor, first_round_factor, log):
    """Timers of one row on both trees: 20 samples a round around 1 ms x the tree's factor; this
    tree's first round (timed right after another row) x first_round_factor as well."""
    import random

    rng = random.Random(7)

    def timer(name, factor):
        def time_once():
            slow = first_round_factor if name == "this" and not log else 1.0
            log.append(name)
            return [1e-3 * factor * slow * (1 + rng.gauss(0, 0.004)) for _ in range(20)]
        return time_once
    return timer("this", this_factor), timer("other", 1.0)


@pytest.mark.parametrize("this_factor, first_round_factor, verdict, order", [
    # the same code, its first round 10% slow for going first: SLOWER alone, not once both orders are judged
    (1.0, 1.10, "SAME", ["this", "other", "other", "this", "this", "other"]),
    # a real 10% slowdown reads SLOWER in both orders (one round more), with or without the first-round bias
    (1.10, 1.0, "SLOWER", ["this", "other", "other", "this"]),
    (1.10, 1.10, "SLOWER", ["this", "other", "other", "this"]),
    # nothing to confirm: no round more
    (1.0, 1.0, "SAME", ["this", "other"]),
])
def test_rounds_flip_order_before_a_regression_is_called(this_factor, first_round_factor, verdict, order):
    from pytest_oink import against, report, verdicts
    from pytest_oink.timing import median, relative_spread

    log = []
    this, other_timer = _rounds(this_factor, first_round_factor, log)
    first, other = this(), other_timer()

    def verdict_of(samples):
        entry = report.BaselineEntry(median(other), relative_spread(other), samples=tuple(other))
        return verdicts.judge(samples, median(samples), relative_spread(samples), entry, 0.05).name

    assert verdict_of(first) == ("SAME" if this_factor * first_round_factor == 1 else "SLOWER")
    samples, rounds = against.counterbalanced(first, verdict_of, this, lambda: other.extend(other_timer()))
    assert verdict_of(samples) == verdict and log == order and rounds == len(order) // 2 - 1


def test_the_other_tree_keeps_its_compiles_in_a_cache_of_its_own(tmp_path, monkeypatch):
    """Under this session's kernel cache, one directory a tree's content: the same code at another path
    shares it (a later run loads what an earlier one compiled), changed code does not, the cache off is off."""
    from oink import config
    from pytest_oink.against import tree_cache

    def tree(name, text):
        (tmp_path / name / "oink" / "kernels").mkdir(parents=True)
        (tmp_path / name / "oink" / "__init__.py").write_text("")
        (tmp_path / name / "oink" / "kernels" / "k.py").write_text(text)
        (tmp_path / name / "oink" / "kernels" / "__pycache__").mkdir()  # not part of the tree's code
        (tmp_path / name / "oink" / "kernels" / "__pycache__" / "k.pyc").write_bytes(os.urandom(8))
        return tmp_path / name

    monkeypatch.setenv("OINK_CACHE_DIR", str(tmp_path / "cache"))
    config.reload()
    try:
        a, same, changed = tree("a", "x = 1\n"), tree("b", "x = 1\n"), tree("c", "x = 2\n")
        assert tree_cache(a).parent == tmp_path / "cache" / "against"
        assert tree_cache(a) == tree_cache(same) != tree_cache(changed)
        monkeypatch.setenv("OINK_CACHE_DIR", "0")
        config.reload()
        assert tree_cache(a) is None
    finally:
        monkeypatch.undo()
        config.reload()


class _FakeWorker:
    """A worker process stand-in: records each request, answers from a script, and notes what was
    going on when: ``events`` interleaves its requests with the session's own steps."""

    def __init__(self, events, answers):
        import json

        self.events, self.answers, self.json = events, dict(answers), json
        self.stdin = self.stdout = self
        self.lines = []

    def write(self, text):
        cmd = self.json.loads(text)["cmd"]
        self.events.append(f"worker {cmd}")
        self.lines.append(self.json.dumps(self.answers.get(cmd, {})) + "\n")

    def flush(self):
        pass

    def readline(self):
        return self.lines.pop(0) if self.lines else ""

    def poll(self):
        return None


def test_the_other_tree_gates_while_this_one_does_and_never_while_it_times(monkeypatch, tmp_path):
    """The worker is asked for its gate before this session gates (the two run at once: compiles and
    correctness checks, nothing timed), its answer is read before this session times its first round,
    and its rounds come after; a row this session's gate failed leaves an answer the next row drops."""
    from types import SimpleNamespace

    from pytest_oink import against, report
    from pytest_oink.state import STATE
    from pytest_oink.suites import Case

    events = []
    other = against.OtherTree.__new__(against.OtherTree)
    other.name, other.notes, other.pending, other.prepared, other.gated = "other", [], False, None, None
    sample = [1e-3] * 10
    other.proc = _FakeWorker(events, {"row": {"status": "ok"}, "round": {"samples": sample, "throttled": False},
                                      "time": {"status": "ok", "samples": sample, "method": "cuda-graph",
                                               "throttled": False}})
    config = SimpleNamespace(stash={STATE: {"baseline": {}}})
    monkeypatch.setattr(against.regression, "gate_settings", lambda config: (0.05, ("oink",), False))
    case = Case("smoke", "softmax_forward", 4, 128, "bfloat16", None)

    def row_of():
        return report.Row(suite="smoke", op="softmax_forward", provider="oink", M=4, N=128, dtype="bfloat16",
                          device="NVIDIA H200", status="ok", mode="cold", median_s=1e-3, method="cuda-graph")

    # a row whose gate fails here: the worker's answer is never read by it
    other.prepare(config, row_of(), case, "cuda:0")
    events.append("session gate (failed)")
    # the next row, all the way
    row = row_of()
    other.prepare(config, row, case, "cuda:0")
    events.append("session gate")
    other.settle()
    events.append("session times its first round")
    samples, rounds = other.interleave(config, row, case, list(sample), lambda: sample, "cuda:0")
    assert events == ["worker row", "session gate (failed)", "worker row", "session gate",
                      "session times its first round", "worker time", "worker done"]
    assert rounds == 0 and config.stash[STATE]["baseline"][row.key][0].samples == tuple(sample)
    assert not other.pending or other.proc.lines  # the done's answer is read by the next request
