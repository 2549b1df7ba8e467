"""``--oink-against=<git ref or path>`` (issue #34 item 2): the gated rows timed for another tree of
Oink in the same pytest run, on the same device, rounds alternating between the trees, so a CI job
needs no stored baseline. The other tree is a directory holding ``oink/``, or a git ref of the
repository this Oink was imported from, exported (``git archive``) into a temporary directory.

A worker process imports Oink from the other tree, with a kernel cache of its own (``tree_cache``: its
compiles are its own, and kept for a later run against the same code), and this tree's harness and bench
entries (pytest_oink and this Oink's oink.reference.BENCH: the same gate, inputs and timers on both
sides). For each gated row this session times its first round, the worker gates and times the same row,
and while the verdict from both sides' samples (verdicts.judge) is UNSURE, or SLOWER after the first
round, one more round is timed on each side, the trees' order flipping every round (the other tree first
in the second round). The other tree's samples become the row's baseline entry, so the regression gate,
its lines and its failing on SLOWER are the same as against a stored baseline."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from . import clocks, options, regression, report
from .state import STATE


def _git(repo: Path, *args, binary: bool = False):
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, timeout=300)
    if out.returncode != 0:
        return None
    return out.stdout if binary else out.stdout.decode().strip()


def oink_root() -> Path:
    """The directory this session's Oink is imported from (found, not imported: no torch at configure)."""
    import importlib.util

    spec = importlib.util.find_spec("oink")
    if spec is None or not spec.origin:
        raise ValueError("--oink-against: Oink itself is not importable here")
    return Path(spec.origin).resolve().parents[1]


def describe_tree(root: Path) -> str:
    commit = _git(root, "rev-parse", "--short=12", "HEAD")
    if commit is None:
        return str(root)
    dirty = " with uncommitted changes" if _git(root, "status", "--porcelain", "--untracked-files=no") else ""
    return f"{root} (commit {commit}{dirty})"


def resolve(spec: str, repo: Path) -> tuple[Path, str, Path | None]:
    """(the other tree's root, how to name it, a temporary directory to remove or None). ValueError
    naming the argument when it is neither a tree of Oink nor a ref of ``repo``'s git repository."""
    given = Path(spec).expanduser()
    if given.is_dir():
        if not (given / "oink" / "__init__.py").is_file():
            raise ValueError(f"--oink-against={spec}: the directory {given} holds no oink/ package")
        return given.resolve(), f"{given.resolve()} (a directory)", None
    if _git(repo, "rev-parse", "--git-dir") is None:
        raise ValueError(f"--oink-against={spec}: no such directory, and Oink at {repo} is not in a git repository "
                         "to find a ref in")
    commit = _git(repo, "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    if not commit:
        raise ValueError(f"--oink-against={spec}: neither a directory nor a git ref of {repo}")
    tree = Path(tempfile.mkdtemp(prefix="oink-against-"))
    archive = _git(repo, "archive", "--format=tar", commit, binary=True)
    if archive is None:
        shutil.rmtree(tree, ignore_errors=True)
        raise ValueError(f"--oink-against={spec}: git archive {commit} failed in {repo}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tree)
    if not (tree / "oink" / "__init__.py").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        raise ValueError(f"--oink-against={spec}: commit {commit[:12]} has no oink/ package at the root of {repo}")
    return tree, f"{spec} (commit {commit[:12]} of {repo}, exported to {tree})", tree


def tree_digest(root: Path) -> str:
    """A digest of the Oink package under ``root`` (its Python sources and data files)."""
    h = hashlib.sha256()
    package = root / "oink"
    for path in sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def tree_cache(root: Path) -> Path | None:
    """Where the other tree's worker keeps its compiled kernels: a directory of its own under this
    session's kernel cache (``oink.config``'s), named by the tree's digest, so that a later run against
    the same code loads what this one compiled; None where the cache is off."""
    from oink import config

    cache_dir = config.get().cache_dir
    return Path(cache_dir) / "against" / tree_digest(root) if cache_dir else None


class OtherTree:
    """The other tree and its worker process (started at the first gated row)."""

    def __init__(self, spec: str):
        self.repo = repo = oink_root()
        self.root, self.name, self.tmp = resolve(spec, repo)
        if self.root == repo:
            raise ValueError(f"--oink-against={spec}: that is this session's own Oink ({repo})")
        self.this = describe_tree(repo)
        self.proc = None
        self.pending = False  # a request sent whose reply is not read yet
        self.prepared = None  # the row whose gate the worker was asked for (``prepare``)
        self.gated = None  # and the worker's answer (``settle``)
        self.notes: list[str] = []  # rows the other tree did not time, and why

    def summary_line(self) -> str:
        return f"A/B in one run: this tree {self.this} against {self.name}, rounds alternating on the same device"

    def _start(self) -> None:
        env = dict(os.environ, OINK_AGAINST_TREE=str(self.root), OINK_AGAINST_THIS=str(self.repo))
        cache = tree_cache(self.root)
        if cache is not None:  # its compiles are its own (the cache off stays off)
            env["OINK_CACHE_DIR"] = str(cache)
        harness = str(Path(__file__).resolve().parents[1])
        # this session's Oink imported first, from its tree (the harness's modules import oink.measure from it),
        # then the harness, pytest_oink, from this file's tree
        code = (f"import os, sys; sys.path.insert(0, os.environ['OINK_AGAINST_THIS']); import oink; "
                f"sys.path[0] = {harness!r}; from pytest_oink.against import worker_main; worker_main()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        clocks.own_pid(self.proc.pid)  # its rounds on the GPU do not make this session's rows shared

    def send(self, message: dict) -> None:
        """A request to the worker, its reply read later by ``receive`` (a reply not read by the next
        send is dropped: the row it answered ended here first)."""
        if self.proc is None:
            self._start()
        if self.pending:
            self.receive()
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        self.pending = True

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        self.pending = False
        if not line:
            raise RuntimeError(f"--oink-against: the worker for {self.name} ended (exit {self.proc.wait()}); "
                               "its stderr is above")
        return json.loads(line)

    def ask(self, message: dict) -> dict:
        self.send(message)
        return self.receive()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.ask({"cmd": "quit"})
            except (OSError, RuntimeError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def prepare(self, config, row, case, device) -> None:
        """Before this session gates a row the regression gate may judge, the worker is asked to gate
        it too: the two trees' gates (and first compiles) run at once, nothing is timed while they do
        (``interleave`` reads the worker's answer before either tree times the row)."""
        _, providers, gate_cpu = regression.gate_settings(config)
        self.prepared = self.gated = None
        if not report.may_gate(row, providers, gate_cpu):
            return
        self.send({"cmd": "row", "suite": case.suite, "op": case.op, "provider": row.provider, "M": case.M,
                   "N": case.N, "dtype": case.dtype, "seed": case.seed, "mode": row.mode, "device": str(device)})
        self.prepared = (case, row.provider, row.mode)

    def settle(self) -> None:
        """This session's gate is done: the worker's answer waited for, so nothing of the other tree
        runs while this session times the row."""
        if self.prepared is not None and self.pending:
            self.gated = self.receive()

    def interleave(self, config, row, case, samples, time_once, device):
        """(this tree's samples, rounds re-timed) of a gated row, with the other tree's samples of
        the same row recorded as its baseline entry; ungated rows untouched. This session's first
        round is timed first, the worker's gate (``prepare``) done before it."""
        from .timing import median, relative_spread
        from .verdicts import judge

        threshold, providers, gate_cpu = regression.gate_settings(config)
        prepared, reply, self.prepared, self.gated = self.prepared, self.gated, None, None
        if not report.gated(row, providers, gate_cpu) or prepared != (case, row.provider, row.mode) or not reply:
            return samples, 0
        if reply["status"] == "ok":
            reply = self.ask({"cmd": "time"})
        if reply["status"] != "ok":
            self.notes.append(f"{report.row_title(row)}: the other tree's row {reply['status']} ({reply['why']})")
            return samples, 0
        other = list(reply["samples"])

        def entry():
            return report.BaselineEntry(median(other), relative_spread(other), row.suite,
                                        report.what_was_timed(reply["method"]), tuple(other), row.mode,
                                        reply["throttled"], this_run=True)

        def other_round():
            more = self.ask({"cmd": "round"})
            other.extend(more["samples"])
            reply["throttled"] = more["throttled"]

        def verdict_of(samples):
            return judge(samples, median(samples), relative_spread(samples), entry(), threshold,
                         report.cpu_rounds(row)).name

        samples, rounds = counterbalanced(samples, verdict_of, time_once, other_round)
        self.send({"cmd": "done"})  # the worker frees the row's tensors while this session goes on
        config.stash[STATE]["baseline"].setdefault(row.key, []).insert(0, entry())
        return samples, rounds


def counterbalanced(samples, verdict_of, time_once, other_round, most: int | None = None):
    """(this tree's samples, rounds re-timed) after the first round of each tree, this tree's
    timed first: while ``verdict_of(samples)`` is UNSURE, or SLOWER from that first round alone, one
    more round of each tree, the order flipping every round (this, other; other, this; this,
    other; ...), at most ``most`` rounds (verdicts.RETIME_ROUNDS). A regression must show in both
    orders: a round slow for being timed first is judged together with one that was timed second."""
    from .verdicts import RETIME_ROUNDS

    samples, rounds = list(samples), 0
    most = RETIME_ROUNDS if most is None else most
    while rounds < most and time_once is not None:
        verdict = verdict_of(samples)
        if verdict != "UNSURE" and not (verdict == "SLOWER" and rounds == 0):
            break
        if rounds % 2 == 0:
            other_round()
            samples += list(time_once())
        else:
            samples += list(time_once())
            other_round()
        rounds += 1
    return samples, rounds


def configure(config) -> None:
    """At configure: the other tree resolved (a usage error names what is wrong) and the gate armed
    with an empty baseline that the other tree's rows fill."""
    spec = options.get(config, "--oink-against")
    if not spec:
        return
    if options.get(config, "--oink-baseline"):
        raise ValueError("--oink-against and --oink-baseline: give one (the other tree is the baseline)")
    state = config.stash[STATE]
    state["against"] = OtherTree(spec)
    state["baseline"] = {}


def worker_output(config) -> str:
    """An xdist worker's share for the controller, which gates: the other tree's entries and notes."""
    import dataclasses

    state = config.stash[STATE]
    entries = [[list(key), [dataclasses.asdict(e) for e in found]] for key, found in state["baseline"].items()]
    return json.dumps({"entries": entries, "notes": state["against"].notes})


def merge_worker_output(config, payload: str) -> None:
    state, data = config.stash[STATE], json.loads(payload)
    for key, found in data["entries"]:
        entries = [report.BaselineEntry(**dict(e, samples=tuple(e["samples"]))) for e in found]
        state["baseline"].setdefault(tuple(key), []).extend(entries)
    state["against"].notes.extend(data["notes"])


def finish(config) -> list[str]:
    """The worker ended, the exported tree removed; the summary's lines on the A/B."""
    other = config.stash[STATE].get("against")
    if other is None:
        return []
    other.close()
    return [other.summary_line() + "."] + [f"Not timed on the other tree: {note}." for note in other.notes]


# ---- the worker: this tree's harness, the other tree's Oink ----

def worker_main() -> None:
    """Answers one JSON line per request on stdout (whatever else is printed goes to stderr):
    {"cmd": "row", ...} gates a row; {"cmd": "time"} times its first round; {"cmd": "round"} once
    more; {"cmd": "done"} frees the row; {"cmd": "quit"} ends."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # kernels' and libraries' prints must not break the protocol
    from . import bench_runner  # noqa: F401  (the gate and the timers: this tree's oink.measure, bound before the swap)
    from .providers import specs

    clocks.own_pid(os.getppid())  # the session times on the same GPU: its work does not make a row shared

    # this session's specs: its Oink's bench entries (oink.reference), imported from this session's tree
    # before the other tree's Oink takes the name (the entries find oink and oink.reference when they call them)
    sys.path.insert(0, os.environ["OINK_AGAINST_THIS"])
    specs()
    del sys.path[0]
    for name in [m for m in sys.modules if m == "oink" or m.startswith("oink.")]:
        del sys.modules[name]
    sys.path.insert(0, os.environ["OINK_AGAINST_TREE"])
    import oink

    tree = Path(os.environ["OINK_AGAINST_TREE"]).resolve()
    imported = Path(oink.__file__).resolve()
    current = None  # the row: what its gate built, then its timer
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if tree not in imported.parents:
            reply = {"status": "not run", "why": f"the worker imported Oink from {imported}, not from {tree}"}
        elif msg["cmd"] in ("row", "done"):
            if current is not None:  # the last row's tensors go (and its cached blocks: the GPU is shared)
                current = None
                _free_memory()
            reply, current = _worker_gate(msg) if msg["cmd"] == "row" else ({}, None)
        elif msg["cmd"] == "time":
            reply, current = _worker_time(*current) if current else ({"status": "not run", "why": "not gated"}, None)
        else:  # one more round of the current row
            time_once, watch = current
            reply = {"samples": list(time_once()), "throttled": watch.record(False)[1] if watch else False}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


def _free_memory() -> None:
    """The cached blocks back to the device (no full collection: in a process holding torch and CuTeDSL
    it took longer than timing a row, and this session frees its rows the same way)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _worker_gate(msg):
    """(reply, the row's state for ``_worker_time``) for one row of the other tree: gated (a row that
    fails there is not compared)."""
    import torch

    from .bench_runner import gate
    from .providers import SPECS, Unavailable, build
    from .suites import Case
    from .timing import one_cpu_thread

    device = torch.device(msg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    case = Case(msg["suite"], msg["op"], msg["M"], msg["N"], msg["dtype"], msg["seed"])
    spec, dtype = SPECS[case.op], getattr(torch, case.dtype)
    try:
        run = build(case.op, msg["provider"], device)
        with one_cpu_thread(device):  # as this session gates a CPU row
            checked = gate(spec, run, case, dtype, device)
    except Unavailable as e:
        return {"status": "unavailable", "why": str(e)}, None
    except Exception as e:  # noqa: BLE001  (an op the other tree lacks, an API it spells otherwise)
        return {"status": "not run", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    if not checked["passed"]:
        return {"status": "failed its gate", "why": checked.get("report", "")[:300]}, None
    row = report.Row(suite=case.suite, op=case.op, provider=msg["provider"], M=case.M, N=case.N, dtype=case.dtype,
                     device=str(device), status="ok", mode=msg["mode"],
                     bytes=spec.nbytes(case.M, case.N, dtype.itemsize))
    return {"status": "ok"}, (case, run, spec, dtype, device, row)


def _worker_time(case, run, spec, dtype, device, row):
    """(reply, (time_once, clock watch)): the gated row's first round, re-timed once if the clocks say
    the card was held down."""
    from .bench_runner import row_timer

    read, _ = clocks.reader(device)
    watch = clocks.Watch(read) if read else None
    try:
        samples, time_once = row_timer(case, run, spec, dtype, device, row, wrap=watch.wrap if watch else None)
        if watch is not None and watch.last_causes() and time_once is not None:
            watch.drop_last()  # as this session does: once more where the card was held down
            samples = time_once()
    except Exception as e:  # noqa: BLE001  (out of memory beside this session's tensors, ...)
        return {"status": "not run", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None
    if time_once is None:
        return {"status": "not run", "why": "its timer can't time another round"}, None
    throttled = watch.record(False)[1] if watch is not None and watch.rounds else False
    return ({"status": "ok", "samples": list(samples), "method": row.method, "throttled": throttled},
            (time_once, watch))
