"""Search the launch shapes of Oink's row kernels on this GPU and write the tuned table.

``python -m oink.tune --ops ... --widths ...`` writes the user's overlay (``launch_table.overlay_path``,
beside the compiled kernels' cache), which the library reads at import over the shipped table;
``scripts/tune_launch.py`` writes the shipped table (``oink/kernels/launch_table.json``). Needs a CUDA GPU
(not the plugin's stack): every trial passes the benchmark's gate first (``oink.measure``, the plugin's too).
The table is written once, whole, when the search ends: a failed or interrupted search leaves it as it
was (what it found so far is in ``<out>.partial``, and every trial in ``--log``).

For each op and width: run the op once to learn which launch keys it looks up (and the heuristic's
choice for each), then for every candidate shape (``oink.kernels.launch_table.candidates``) gate
the op against its reference (the benchmark gate: 3 seeds, at the timed row count and at an odd
one that leaves a partial CTA) and time it (CUDA-graph replay, inputs cycled past L2). A shape
that fails the gate or raises is never chosen; a table entry is written only where the fastest
passing shape beats the heuristic's by more than ``--min-gain``. Entries for other keys, widths
and arches in the table are kept. ``--grids`` then sizes a persistent kernel's grid (the norm
backward's, ``launch_table.PERSISTENT``) for the launch the key now takes: each size (threads a SM)
gated and timed the same way, kept as the entry's "grid" where it beats the family's default by
more than ``--min-gain``; ``--grid-only`` skips the shape search and sizes the current launch's grid.
``--stage`` tries each norm forward shape three ways: rows in registers, and staged in shared memory with
the weight and bias loaded before or after the reduction (the entry's "stage": "early" / "late").
Row counts of at most ``launch_table.FEW_ROWS`` tune the ops' "/few" keys (the launches calls of so
few rows take), larger ones the keys themselves. ``--set NAME=VALUE`` runs the whole search under a
development setting (``oink.config.DEV_DEFAULTS``: a rule's side forced, a sweep's dial such as the norm
backward's pipeline depth), the sweeps' way to time one; entries found so hold for that setting only.

    python3 -m oink.tune --ops rmsnorm_forward,softmax_forward --widths 40960,98304 --rows 2048 --clusters 4,8,16
    python3 scripts/tune_launch.py --ops rmsnorm_fp8quant,silu_mul_fp8quant --widths 7168,18432 \
        --rows 4096,16384 [--dtype bfloat16] [--max-iters 4] [--out oink/kernels/launch_table.json]
    python3 scripts/tune_launch.py --ops rmsnorm_backward --widths 65536 --rows 4096 --grids 1024,2048 --grid-only
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

import oink
import oink.ops  # noqa: F401  (the declarations name each op's kernels to dispatch: scripts prepare launches by name)
from oink import config
from oink.kernels import launch_table
from oink.kernels.compile import CACHE
from oink.kernels.fp8_rules import UNIT as FP8_UNIT
from oink.kernels.rmsnorm_rules import ran_staged
from oink.measure.gate import Case, gate, spec_of
from oink.measure.gate import inputs as _inputs
from oink.measure.timer import Rotation, copies_for_cold_cache, median, time_cuda_graph

ODD_ROWS = 37  # a partial last CTA for every rows-per-CTA the candidates use
ODD_FEW_ROWS = 29  # the same within launch_table.FEW_ROWS (the "/few" keys)


def spec_and_run(op: str):
    """``op``'s bench spec (from its entry in ``oink.reference.BENCH``) and its Oink call: what the benchmark's
    provider "oink" gates and times."""
    from oink.reference import BENCH

    spec = spec_of(BENCH[op])
    return spec, lambda a: spec.oink(oink, a)


def time_op(spec, run, case, dtype, device) -> float:
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    n_sets = copies_for_cold_cache(spec.nbytes(case.M, case.N, dtype.itemsize), l2)
    rot = Rotation([_inputs(spec, case, dtype, device, 100 + i) for i in range(n_sets)])
    return median(time_cuda_graph(run, rot).samples)


@dataclasses.dataclass
class Trial:
    """What the tuner forces while it runs an op, and what it learns (``launch_table.TRIAL``), keyed
    (key, arch, N): ``launches`` (threads_per_row, num_threads, cluster_n), ``grids`` (threads a SM; 0:
    the family's default), ``stages`` (False, "early" or "late"); ``seen``: the rule's RowLaunch of
    every key looked up."""
    launches: dict = dataclasses.field(default_factory=dict)
    grids: dict = dataclasses.field(default_factory=dict)
    stages: dict = dataclasses.field(default_factory=dict)
    seen: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def trial(launches=None, grids=None, stages=None):
    """A ``Trial`` of ``launches``, ``grids`` and ``stages`` in effect inside the block (yielded: its
    ``seen`` fills as the block's calls look their keys up). The memoized launch choices are dropped
    on entry and on exit, so the block's calls choose under the trial and the later ones without it."""
    t = Trial(dict(launches or {}), dict(grids or {}), dict(stages or {}))
    before, launch_table.TRIAL = launch_table.TRIAL, t
    config.reload()
    try:
        yield t
    finally:
        launch_table.TRIAL = before
        config.reload()


def keys_of(spec, run, M, N, dtype, device) -> dict:
    """{(key, arch, width): heuristic RowLaunch} that one call of the op at M x N looks up (a call of
    ``launch_table.few_rows`` rows looks up the "/few" keys)."""
    with trial() as t:
        run(_inputs(spec, Case("tune", "", M, N, str(dtype).split(".")[-1]), dtype, device, 0))
        torch.cuda.synchronize()
    return t.seen


def try_shape(spec, run, op, N, rows, dtype, device, key, shape, grid=None, stage=None) -> tuple[bool, list, str]:
    """(passed, [seconds per row count], why) with ``shape`` forced for ``key`` (and ``grid``, threads
    a SM or 0 for the family's default, and ``stage``: False, or rows staged in shared memory with the
    parameters loaded "early" or "late", where given)."""
    with trial({key: shape}, {} if grid is None else {key: grid}, {} if stage is None else {key: stage}):
        return _gate_and_time(spec, run, op, N, rows, dtype, device, shape, stage)


def _gate_and_time(spec, run, op, N, rows, dtype, device, shape, stage) -> tuple[bool, list, str]:
    name = str(dtype).split(".")[-1]
    times = []
    for M in sorted({ODD_FEW_ROWS if launch_table.few_rows(rows[0]) else ODD_ROWS, *rows}):
        case = Case("tune", op, M, N, name)
        CACHE.clear_used()
        g = gate(spec, run, case, dtype, device)
        if not g["passed"]:
            return False, [], g.get("report", "gate failed")[:200]
        ran = CACHE.used_launches()
        if shape not in ran:
            return False, [], "the shape did not run (the op took another path)"
        if stage and not ran_staged(CACHE.used):
            return False, [], "not staged (too big a tile for shared memory)"
        if M in rows:
            times.append(time_op(spec, run, case, dtype, device))
    return True, times, ""


def main(argv=None, default_out: Path | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", required=True)
    ap.add_argument("--widths", required=True)
    ap.add_argument("--rows", default="4096,16384")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-iters", type=int, default=8, help="most accesses a thread (registers)")
    ap.add_argument("--clusters", default="1", help="cluster sizes to try, e.g. 1,2,4")
    ap.add_argument("--min-gain", type=float, default=0.03, help="keep a shape only this much faster (0.03 = 3%%)")
    ap.add_argument("--grids", default="", help="persistent grid sizes to try (threads a SM), e.g. 1024,2048")
    ap.add_argument("--grid-only", action="store_true", help="size the grid of each key's current launch only")
    ap.add_argument("--stage", action="store_true",
                    help="also try each shape with its rows staged in shared memory, its parameters loaded before "
                         "and after the reduction (the norm forward's keys)")
    out_default = default_out or launch_table.overlay_path()
    ap.add_argument("--out", default=str(out_default) if out_default else None,
                    help=f"the table to write (default: {out_default or 'none: OINK_CACHE_DIR is off, name one'})")
    ap.add_argument("--log", default=None, help="also write every trial as JSON lines here")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a development setting for the whole search (oink.config.DEV_DEFAULTS: an A/B switch "
                         "forced, a sweep's launch dial), e.g. bwd_depth=3; entries found under one hold for it "
                         "only, so name a scratch --out")
    a = ap.parse_args(argv)
    with config.override(**dev_settings(ap, a.set)):
        return _tune(ap, a)


def dev_settings(ap, items) -> dict:
    """``--set NAME=VALUE`` items as ``config.override``'s arguments, each value of its setting's type
    (``none`` for None); an unknown name or a bad value is the parser's error."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in config.DEV_DEFAULTS:
            ap.error(f"--set {item!r}: expected NAME=VALUE, NAME one of {', '.join(config.DEV_DEFAULTS)}")
        kind = next(f.type for f in dataclasses.fields(config.Config) if f.name == name)
        text = text.strip().lower()
        if text == "none" and "None" in kind:
            out[name] = None
        elif "bool" in kind and text in (*config.TRUTHY, *config.FALSY[1:]):
            out[name] = config.truthy(text)
        elif "int" in kind and text.isdigit():
            out[name] = int(text)
        else:
            ap.error(f"--set {item!r}: not a value for {name} ({kind})")
    return out


def _tune(ap, a) -> int:
    if not torch.cuda.is_available():
        print("oink.tune: needs a CUDA GPU", file=sys.stderr)
        return 2
    if not a.out:
        ap.error("--out: no default (the compiled kernels' cache is off: OINK_CACHE_DIR=0)")
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype)
    rows = [int(r) for r in a.rows.split(",")]
    if len({launch_table.few_rows(M) for M in rows}) > 1:
        ap.error(f"--rows: all at most {launch_table.FEW_ROWS} (the \"/few\" keys) or all above")
    clusters = tuple(int(c) for c in a.clusters.split(","))
    grids = [int(g) for g in a.grids.split(",") if g]
    if a.grid_only and not grids:
        ap.error("--grid-only needs --grids")
    out = Path(a.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    tables = data.setdefault("tables", {})
    log = open(a.log, "a") if a.log else None
    card = torch.cuda.get_device_name()
    started = time.time()
    record = {"card": card, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "oink": getattr(oink, "__version__", "?"), "seconds": 0, "command": " ".join(sys.argv)}
    data.setdefault("runs", []).append(record)
    searched = {}  # (key, arch, width) -> the op that searched it in this run
    for op in a.ops.split(","):
        spec, run = spec_and_run(op)
        for N in (int(n) for n in a.widths.split(",")):
            for (key, arch, width), default in keys_of(spec, run, rows[0], N, dtype, device).items():
                if not first_search(searched, (key, arch, width), op):
                    continue
                entries = tables.setdefault(arch, {}).setdefault(key, {})
                sized = grids and key.startswith(launch_table.PERSISTENT) and not key.endswith("/few")
                if a.grid_only:
                    if sized:
                        current = entries.get(str(width))
                        shape = tuple(current["launch"]) if current else (
                            default.threads_per_row, default.num_threads, default.cluster_n)
                        search_grid(a, grids, log, entries, spec, run, op, N, rows, dtype, device, (key, arch, width),
                                    shape, None, card)
                    continue
                # the FP8 kernels keep a 128-wide group on aligned lanes: try only such shapes
                lanes = 128 // FP8_UNIT if key.startswith("fp8/") and key.endswith("/group") else 1
                stages = (False, *launch_table.STAGINGS) if a.stage and key.startswith(launch_table.STAGEABLE) \
                    else (False,)
                trials = []
                for L in launch_table.candidates(default, a.max_iters, lanes, clusters):
                    if key.endswith("/few") and not launch_table.same_order(L, default):
                        continue  # a few rows' launch keeps the rows' order (batch invariance)
                    for stage in stages:
                        shape = (L.threads_per_row, L.num_threads, L.cluster_n)
                        # the heuristic's own shape is forced too: unforced, the op would take the table's entry
                        ok, times, why = try_shape(spec, run, op, N, rows, dtype, device, (key, arch, width), shape,
                                                   stage=stage)
                        geo = math.exp(sum(map(math.log, times)) / len(times)) if ok else None
                        trials.append(((L, stage), geo))
                        trial_line(log, {"op": op, "N": N, "key": key, "arch": arch, "launch": list(shape),
                                         "stage": stage, "iters": L.iters, "default": L == default and not stage,
                                         "passed": ok, "us": [t * 1e6 for t in times], "why": why})
                best, base, best_t = launch_table.choose(trials, (default, False), a.min_gain)
                if base is None:
                    print(f"# {key} N={width}: the heuristic's shape failed its gate: no entry", flush=True)
                    continue
                verdict = record_shape(entries, width, op, rows, a.dtype, card, default, best, base, best_t)
                print(f"# {key} N={width}: heuristic {base * 1e6:.1f} us, best {best_t * 1e6:.1f} us: {verdict}",
                      flush=True)
                if sized:
                    L = best[0] if best else default
                    search_grid(a, grids, log, entries, spec, run, op, N, rows, dtype, device, (key, arch, width),
                                (L.threads_per_row, L.num_threads, L.cluster_n),
                                (base, base if best is None else best_t), card)
            write(out.with_suffix(".partial"), data, record, started)  # a run cut off keeps what it found
    write(out, data, record, started)
    out.with_suffix(".partial").unlink(missing_ok=True)
    config.reload()  # this process's launches: the table just written
    print(f"oink.tune: wrote {out} after {time.time() - started:.0f} s")
    return 0


def first_search(searched: dict, key: tuple, op: str) -> bool:
    """Whether ``op`` searches ``key`` (key, arch, width): ops that share a key (fused_add_rmsnorm_ and
    rmsnorm_forward) search it once a run, with the first named, so a later op's verdict does not
    overwrite the entry the first one just wrote."""
    first = searched.setdefault(key, op)
    if first != op:
        print(f"# {key[0]} N={key[2]}: searched with {first} in this run; not again for {op}", flush=True)
    return first == op


def record_shape(entries, width, op, rows, dtype, card, default, best, base, best_t) -> str:
    """Write the shape search's verdict at ``width`` into ``entries`` (the best shape's entry, or none:
    the heuristic kept) and say it. An old entry's grid was sized for its launch, so it stays where
    that launch is still the key's (an entry at the heuristic's shape, kept for its grid, stays whole)
    and goes with a launch that changed; a grid search that follows decides it again."""
    old = entries.pop(str(width), None)
    heuristic = [default.threads_per_row, default.num_threads, default.cluster_n]
    if best is not None:
        best, stage = best
        launch = [best.threads_per_row, best.num_threads, best.cluster_n]
        entries[str(width)] = new_entry(op, rows, dtype, card, launch, best_t, heuristic, base, width, best.iters)
        verdict = f"tuned {launch}"
        if stage:
            entries[str(width)]["stage"] = stage
            verdict += f", staged ({stage} parameters)"
    else:
        launch, verdict = heuristic, "heuristic kept"
    if old and "grid" in old and old["launch"] == launch:
        if best is None:
            entries[str(width)] = old
        else:
            entries[str(width)].update({k: old[k] for k in ("grid", "grid_rows", "grid_us")})
        verdict += f", its grid {old['grid']} kept"
    return verdict


def new_entry(op, rows, dtype, card, launch, seconds, heuristic, heuristic_seconds, width, iters=None) -> dict:
    """A table entry: ``launch`` and its time, against the heuristic's shape and time, and where measured;
    it serves the widths around ``width`` (``launch_table.span``) on ``card``."""
    entry = {"launch": launch, "op": op, "rows": rows, "dtype": dtype, "us": round(seconds * 1e6, 2),
             "heuristic": heuristic, "heuristic_us": round(heuristic_seconds * 1e6, 2), "card": card,
             "date": datetime.date.today().isoformat(), "n": list(launch_table.span(width, {}))}
    if iters:
        entry["iters"] = iters
    return entry


def trial_line(log, line: dict) -> None:
    print(json.dumps(line), flush=True)
    if log:
        log.write(json.dumps(line) + "\n")
        log.flush()  # a search cut off by a timeout keeps its trials


def search_grid(a, grids, log, entries, spec, run, op, N, rows, dtype, device, key, shape, searched, card) -> None:
    """Size the persistent grid of ``key``'s launch ``shape``: each of ``grids`` (threads a SM) against
    the family's default (0), gated and timed; the fastest passing one is kept in the key's entry as
    "grid" (with "grid_rows" and "grid_us": the default's and its time) where it beats the default by
    more than --min-gain (an entry at the heuristic's shape is made for it), and an entry's old "grid"
    is dropped where none does. ``searched``: (the heuristic shape's seconds, ``shape``'s) at the
    default grid from the shape search just run, or None (--grid-only)."""
    trials = []
    for g in [0, *grids]:
        if g == 0 and searched is not None:  # the shape search timed it at the default grid
            trials.append((0, searched[1]))
            continue
        ok, times, why = try_shape(spec, run, op, N, rows, dtype, device, key, shape, g)
        trials.append((g, math.exp(sum(map(math.log, times)) / len(times)) if ok else None))
        trial_line(log, {"op": op, "N": N, "key": key[0], "arch": key[1], "launch": list(shape), "grid": g,
                         "passed": ok, "us": [t * 1e6 for t in times], "why": why})
    best, base, best_t = launch_table.choose(trials, 0, a.min_gain)
    width = str(key[2])
    if base is None:
        print(f"# {key[0]} N={width}: the default grid failed its gate: no grid", flush=True)
        return
    entry = entries.get(width)
    if best is None:
        for k in ("grid", "grid_rows", "grid_us"):
            (entry or {}).pop(k, None)
        print(f"# {key[0]} N={width} grid: default {base * 1e6:.1f} us, best {best_t * 1e6:.1f} us: default kept",
              flush=True)
        return
    if entry is None:  # the heuristic's shape, kept for its grid
        heuristic_s = searched[0] if searched is not None else base
        entry = entries[width] = new_entry(op, rows, a.dtype, card, list(shape), heuristic_s, list(shape), heuristic_s,
                                           key[2])
    entry.update(grid=best, grid_rows=rows, grid_us=[round(base * 1e6, 2), round(best_t * 1e6, 2)])
    print(f"# {key[0]} N={width} grid: default {base * 1e6:.1f} us, {best} threads a SM {best_t * 1e6:.1f} us: "
          "tuned", flush=True)


def write(out: Path, data: dict, record: dict, started: float) -> None:
    """The table with this run's record (``record``, in ``data["runs"]``) brought up to date, written
    whole under a temporary name and renamed."""
    record["seconds"] = round(time.time() - started)
    tables = data.setdefault("tables", {})
    for arch in tables:
        tables[arch] = {k: v for k, v in sorted(tables[arch].items()) if v}
    data["format"] = 2
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
