"""Benchmark rows and what is written from them: CSV, a Markdown summary with geomean speedups, and
the regression gate against a baseline JSON (the SVG plots: ``plots``)."""
from __future__ import annotations

import csv
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from .comparisons import best_peer_table, geomean, memory_ratios, ours, speedups
from .modes import DEFAULT, of_method
from .modes import describe as describe_modes
from .suites import row_title

CSV_FIELDS = ("suite", "seed", "op", "provider", "label", "M", "N", "dtype", "device", "status", "method", "mode",
              "median_ms", "min_ms", "spread", "bytes", "tbs", "roofline_frac", "max_abs_err", "rel_l2_err",
              "p99_abs_err", "registers", "spill_bytes", "static_smem", "occupancy", "test", "sm_mhz_min", "throttled",
              "peak_mem_mib", "batch_invariant")
PEAK_MEMORY = ("memory allocated during one untimed call beyond what was allocated before it (the inputs and all "
               "else held): the call's workspace and outputs; n/a where not measured (CPU rows: torch counts CUDA "
               "allocations only)")


@dataclass
class Row:
    suite: str
    op: str
    provider: str
    M: int
    N: int
    dtype: str
    device: str
    status: str  # "ok" or "failed" (gate) — failed rows are never timed
    label: str = ""
    method: str = ""
    mode: str = "cold"  # the --oink-timing mode it was timed in (modes.MODES)
    median_s: float | None = None
    min_s: float | None = None
    spread: float | None = None  # the samples' relative spread (timing.relative_spread): the gate's noise
    bytes: int = 0
    roofline_tbs: float | None = None
    gate: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)
    test: str = ""
    wall_s: float = 0.0  # the row's session time: inputs, gate (first calls compile), timing
    gate_s: float = 0.0  # of which the gate
    seed: int | None = None  # the --oink-seed of a random suite's row
    samples: list = field(default_factory=list)  # per-call seconds timed: the JSON keeps them for the gate's verdicts
    retimes: int = 0  # extra rounds timed because the gate was unsure of the row (verdicts.RETIME_ROUNDS at most)
    clocks: dict = field(default_factory=dict)  # SM clocks and clock-event reasons around its rounds (clocks.Watch)
    throttled: bool = False  # timed while the GPU was held down, after one re-timing: never SLOWER in the gate
    peak_mem_bytes: int | None = None  # PEAK_MEMORY of one call, in bytes; None where not measured (CPU)
    batch_invariant: bool | None = None  # --oink-batch-invariance's verdict at this width; None where not checked

    @property
    def key(self):
        return (self.op, self.provider, self.M, self.N, self.dtype)

    @property
    def tbs(self) -> float | None:
        return self.bytes / self.median_s / 1e12 if self.median_s else None

    @property
    def roofline_frac(self) -> float | None:
        return self.tbs / self.roofline_tbs if self.tbs and self.roofline_tbs else None

    def extra_info(self) -> dict:
        d = {"suite": self.suite, "seed": self.seed, "op": self.op, "provider": self.provider, "label": self.label,
             "M": self.M, "N": self.N, "dtype": self.dtype, "device": self.device, "bytes": self.bytes, "tbs": self.tbs,
             "roofline_tbs": self.roofline_tbs, "roofline_frac": self.roofline_frac, "method": self.method,
             "mode": self.mode,
             "spread": self.spread, "gate": self.gate, "samples": list(self.samples), "retimes": self.retimes,
             "clocks": self.clocks, "throttled": self.throttled, "peak_mem_bytes": self.peak_mem_bytes,
             "batch_invariant": self.batch_invariant}
        if self.profile:
            d["profile"] = self.profile
        return d

    def csv_row(self) -> dict:
        g, p = self.gate or {}, self.profile or {}
        fmt = lambda v, k=1e3: "" if v is None else f"{v * k:.6g}"  # noqa: E731  (a closure over this scope)
        return {
            "suite": self.suite, "seed": "" if self.seed is None else self.seed, "op": self.op,
            "provider": self.provider,
            "label": self.label, "M": self.M,
            "N": self.N, "dtype": self.dtype, "device": self.device, "status": self.status, "method": self.method,
            "mode": self.mode,
            "median_ms": fmt(self.median_s), "min_ms": fmt(self.min_s), "spread": fmt(self.spread, 1),
            "bytes": self.bytes,
            "tbs": fmt(self.tbs, 1), "roofline_frac": fmt(self.roofline_frac, 1),
            "max_abs_err": g.get("max_abs", ""), "rel_l2_err": g.get("rel_l2", ""), "p99_abs_err": g.get("p99_abs", ""),
            "registers": p.get("registers", ""), "spill_bytes": p.get("spill_bytes", ""),
            "static_smem": p.get("static_smem", ""), "occupancy": p.get("occupancy", ""), "test": self.test,
            # the lowest SM clock read around its rounds, and 1 where it ran held down ("" where not read)
            "sm_mhz_min": min((m for m in self.clocks.get("sm_mhz", ()) if m), default=""),
            "throttled": int(self.throttled) if self.clocks else "",
            "peak_mem_mib": mib(self.peak_mem_bytes),
            "batch_invariant": "" if self.batch_invariant is None else int(self.batch_invariant),
        }


def mib(nbytes: int | None) -> str:
    """Bytes as MiB for the CSV and summary; "n/a" where not measured (never 0)."""
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.1f}"


def from_mib(text) -> int | None:
    return None if text in (None, "", "n/a") else round(float(text) * 2**20)


def read_csv(path) -> list:
    """Rows back from a file ``write_csv`` wrote (``--oink-merge``)."""
    def num(v, cast=float, scale=1.0):
        return None if v in ("", None) else cast(v) * scale

    rows = []
    with open(path, newline="") as f:
        for d in csv.DictReader(f):
            tbs, frac = num(d["tbs"]), num(d["roofline_frac"])
            gate = {k: num(d[c]) for k, c in (("max_abs", "max_abs_err"), ("rel_l2", "rel_l2_err"),
                                              ("p99_abs", "p99_abs_err")) if d[c] != ""}
            profile = {k: num(d[k]) for k in ("registers", "spill_bytes", "static_smem", "occupancy") if d[k] != ""}
            rows.append(Row(suite=d["suite"], op=d["op"], provider=d["provider"], M=int(d["M"]), N=int(d["N"]),
                            dtype=d["dtype"], device=d["device"], status=d["status"], label=d["label"],
                            method=d["method"], mode=d.get("mode") or of_method(d["method"]) or DEFAULT,
                            median_s=num(d["median_ms"], scale=1e-3),
                            min_s=num(d["min_ms"], scale=1e-3), spread=num(d.get("spread")),
                            bytes=int(d["bytes"] or 0),
                            roofline_tbs=tbs / frac if tbs and frac else None, gate=gate, profile=profile,
                            test=d["test"], seed=int(d["seed"]) if d.get("seed") else None,
                            throttled=d.get("throttled") == "1",
                            clocks={"sm_mhz": [int(d["sm_mhz_min"])]} if d.get("sm_mhz_min") else {},
                            peak_mem_bytes=from_mib(d.get("peak_mem_mib")),
                            batch_invariant=(None if d.get("batch_invariant", "") == ""
                                             else d["batch_invariant"] == "1")))
    return rows


def write_csv(rows, path, append: bool = False) -> None:
    """All ``rows`` to ``path``; with ``append``, added to it (the header only if the file is new),
    so an interrupted run keeps the rows it measured."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    new = not append or not os.path.exists(path)
    with open(path, "w" if new else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r.csv_row())


def time_by_provider(rows) -> str:
    """Where a session's time went: each provider's rows' wall time (of which the gate, where the
    first calls compile), slowest first; "" without timed rows."""
    total: dict = {}
    for r in rows:
        t = total.setdefault(r.provider, [0.0, 0.0, 0])
        t[0], t[1], t[2] = t[0] + r.wall_s, t[1] + r.gate_s, t[2] + 1
    parts = [f"{p} {w:.0f} s ({n} rows; gate and first calls {g:.0f} s)"
             for p, (w, g, n) in sorted(total.items(), key=lambda kv: -kv[1][0]) if w > 0]
    return "; ".join(parts)


# methods that time a call from the host's side of it (its host work and launch gaps inside the time), where
# a graph replay times the GPU's work alone
UNREPLAYED = {"cuda-events": "CUDA events around each call (its capture failed)",
              "capped-synced-perf_counter": "a synced host timer (capped: far slower than the fastest row)"}


def invariance_table(rows, mine=("oink",)) -> list[str]:
    """Which providers held batch invariance on this run (``--oink-batch-invariance``), per op: a provider's
    widths that held out of those checked, and the widths where it broke."""
    checked = [r for r in rows if r.batch_invariant is not None]
    if not checked:
        return []
    lines = ["## Batch invariance", "",
             "Each (op, provider, width) checked once: rows alone, batches of 1-4096 rows and slices mid-batch, bit "
             "for bit against one large batch (`--oink-batch-invariance`).", "",
             "| op | provider | widths held | broke at N |", "|---|---|---|---|"]
    seen: dict = {}
    for r in checked:
        seen.setdefault((r.op, r.provider), {})[(r.N, r.dtype)] = r.batch_invariant
    for (op, prov), by_n in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[0][1] not in mine, kv[0][1])):
        broke = sorted(n for (n, _), held in by_n.items() if not held)
        lines.append(f"| {op} | {prov} | {len(by_n) - len(broke)} of {len(by_n)} | "
                     f"{', '.join(map(str, broke)) or '-'} |")
    return lines + [""]


def timed_apart(op_rows) -> str:
    """A sentence naming the providers of an op whose rows were not timed by graph replays while others'
    were (a call that would not capture: a host read, a sync; or the eager cap), "" where every row was
    timed alike."""
    ok = [r for r in op_rows if r.status == "ok" and r.median_s]
    if not any(r.method == "cuda-graph" for r in ok):
        return ""
    apart: dict = {}
    for r in ok:
        if r.method in UNREPLAYED:
            apart.setdefault((r.provider, UNREPLAYED[r.method]), []).append(r)
    if not apart:
        return ""
    shapes = {p: sum(1 for r in ok if r.provider == p) for p, _ in apart}
    parts = [f"{p}, {len(rs)} of {shapes[p]} shapes, by {how}" for (p, how), rs in sorted(apart.items())]
    return ("Not timed by graph replays, so each of these times holds the calls' host work and launch gaps (the "
            "other rows' are the GPU's alone): " + "; ".join(parts) + ".")


CPU_ROWS = ("These are reference timings on a CPU, not kernel numbers: with no GPU, every row (Oink's too: its "
            "kernels run on CUDA only, its CPU path is the PyTorch reference) timed PyTorch code by the host "
            "timer, so no provider is compared with another here.")


def summary_markdown(rows, roofline=None, gated=None) -> str:
    """The Markdown summary of ``rows``; ``gated``: the --oink-gate-providers given, whose rows are ours (ours:
    comparisons.ours), set against the others' (peers, speedups, TB/s and roofline columns)."""
    mine = ours(rows, gated)
    lines = ["# Oink benchmark summary", ""]
    runs = sorted({(r.suite, r.seed) for r in rows}, key=str)
    if runs:  # which suite (and a random suite's seed) the rows are from
        lines += ["Suite: " + ", ".join(s + (f" (seed {seed})" if seed is not None else "") for s, seed in runs) + ".",
                  ""]
    on_cpu = sum(r.device == "cpu" for r in rows)
    if on_cpu:  # said first: what follows was not a kernel's time
        lines += [CPU_ROWS if on_cpu == len(rows) else f"{on_cpu} of the {len(rows)} rows ran on a CPU: reference "
                  "timings (PyTorch code by the host timer), not kernel numbers, left out of the comparisons.", ""]
    if roofline is not None:
        floor = (f"; launch floor (one tiny kernel, graph-replayed) {roofline.launch_floor_us:.2f} us"
                 if roofline.launch_floor_us else "")
        lines += [f"Device: {roofline.device}; measured copy {roofline.copy_tbs:.3f} TB/s, triad "
                  f"{roofline.triad_tbs:.3f} TB/s ({roofline.method}){floor}.", ""]
    elif rows:  # rows read back from CSVs (--oink-merge): the devices they name
        lines += [f"Device: {', '.join(sorted({r.device for r in rows}))}.", ""]
    if rows:
        lines += [f"Timing: {describe_modes({r.mode for r in rows}, {r.device for r in rows})}.", ""]
    from .clocks import summary as clock_summary

    if clock_summary(rows):
        lines += [f"Clocks: {clock_summary(rows)}.", ""]
    spent = time_by_provider(rows)
    if spent:
        lines += [f"Session time by provider: {spent}.", ""]
    lines += best_peer_table(rows, mine)
    lines += invariance_table(rows, mine)
    sp = speedups(rows, mine)
    ops = sorted({r.op for r in rows})
    for op in ops:
        op_rows = [r for r in rows if r.op == op]
        provs = sorted({r.provider for r in op_rows}, key=lambda p: (p not in mine, p))
        own = [p for p in mine if p in provs] or [mine[0]]  # a column of each of ours this op has rows of
        shapes = sorted({(r.M, r.N, r.dtype) for r in op_rows})
        cpu = ": reference timings on a CPU" if all(r.device == "cpu" for r in op_rows) else ""
        lines += [f"## {op}{cpu}", "",
                  "| M | N | dtype | " + " | ".join(f"{p} ms" for p in provs)
                  + "".join(f" | {p} TB/s | {p} / roofline" for p in own) + " |",
                  "|" + "---|" * (len(provs) + 3 + 2 * len(own))]
        cell = {(r.provider, r.M, r.N, r.dtype): r for r in op_rows}
        for M, N, dt in shapes:
            cs = []
            for p in provs:
                r = cell.get((p, M, N, dt))
                cs.append("-" if r is None else ("FAILED" if r.status != "ok" else f"{r.median_s * 1e3:.4f}"))
            for o in (cell.get((p, M, N, dt)) for p in own):
                cs += [f"{o.tbs:.3f}" if o and o.tbs else "-",
                       f"{o.roofline_frac:.2f}" if o and o.roofline_frac else "-"]
            lines.append(f"| {M} | {N} | {dt} | " + " | ".join(cs) + " |")
        profiled = [r for r in op_rows if r.provider == "oink" and r.profile]
        if profiled:
            lines += ["", "Kernel profile (oink): " + "; ".join(
                f"{r.M}x{r.N}: " + (f"{r.profile['registers']} regs, {r.profile['spill_bytes']} B local, "
                                    f"{r.profile['static_smem']} B smem, occupancy {r.profile['occupancy']}"
                                    if "registers" in r.profile else r.profile.get("error", "n/a"))
                for r in profiled)]
        lines += ["", f"Peak memory, MiB ({PEAK_MEMORY}):", "",
                  "| M | N | dtype | " + " | ".join(f"{p} MiB" for p in provs) + " |", "|" + "---|" * (len(provs) + 3)]
        for M, N, dt in shapes:
            cs = ["-" if (p, M, N, dt) not in cell else mib(cell[(p, M, N, dt)].peak_mem_bytes) for p in provs]
            lines.append(f"| {M} | {N} | {dt} | " + " | ".join(cs) + " |")
        mem_of = memory_ratios(op_rows, mine)
        for who, mem in ((p, mem_of[p]) for p in mine if p in mem_of):
            lines += ["", f"{'Oink' if who == 'oink' else who}'s peak memory over each provider's: " + ", ".join(
                f"vs {p} {geomean(v):.2f}x (max {max(v):.2f}x, {len(v)} shapes)" for p, v in sorted(mem.items()))]
        apart = timed_apart(op_rows)
        if apart:
            lines += ["", apart]
        for who, by_peer in ((p, sp[op][p]) for p in mine if p in sp.get(op, {})):
            lines += ["", f"Geomean speedup of {who}: " + ", ".join(
                f"vs {p} {geomean(v):.2f}x (min {min(v):.2f}x, {len(v)} shapes)" for p, v in sorted(by_peer.items()))]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class BaselineEntry:
    median_s: float
    spread: float = 0.0  # relative spread of its samples (0: unknown)
    suite: str | None = None  # None: a file from before rows named their suite (matches any)
    timed: str | None = None  # what_was_timed(its method); None matches any
    samples: tuple = ()  # its per-call seconds (none in files from before they were kept: the spread rule)
    mode: str | None = None  # its --oink-timing mode (modes.of_method where the file names none); None matches any
    throttled: bool = False  # timed while its GPU was held down (clocks): it can't make a row FASTER
    this_run: bool = False  # timed in this run (--oink-against's other tree), not read from a file


def what_was_timed(method: str | None) -> str | None:
    """What a row's time measures: the host's cost of eager calls (the launch suite), a host timer
    on the CPU, or the kernel on a GPU (graph replays, events, synced calls). Times of two kinds
    say nothing about each other."""
    if not method:
        return None
    if method == "eager-calls":
        return "host-eager"
    if method == "cpu-one-thread":  # rounds of one-thread calls (timing.time_cpu): not comparable with older CPU rows
        return "cpu-one-thread"
    return "cpu" if method.startswith("cpu") else "kernel"


def cpu_rounds(r) -> bool:
    """Whether the row's samples are rounds of timing.time_cpu (the gate judges them round by round)."""
    return r.method == "cpu-one-thread"


class NotResults(ValueError):
    """A --oink-baseline file that is no results JSON (a CSV, a text): the message says what is expected."""


def load_baseline(path) -> dict:
    """{(op, provider, M, N, dtype): [BaselineEntry, ...]} from our rows JSON or pytest-benchmark's
    (a file may hold one shape of several suites). Samples are read from ``extra_info`` (where we
    write them) or pytest-benchmark's ``stats.data`` (--benchmark-save-data)."""
    with open(path) as f:
        text = f.read()
    if text.lstrip()[:1] not in ("{", "["):  # no JSON: say what was given and what is expected, not a parse error
        first = text.partition("\n")[0]
        what = ("this is a CSV of rows (--oink-csv)" if first.startswith("suite,") and ",provider," in first
                else "this is not JSON")
        raise NotResults(f"{what}; a baseline is the JSON a run writes with --oink-json=PATH or --benchmark-json=PATH"
                         " (pytest-benchmark's), or our rows JSON")
    data = json.loads(text)
    out: dict = {}

    def add(d, median, spread, samples):
        entry = BaselineEntry(float(median), spread or 0.0, d.get("suite"), what_was_timed(d.get("method")),
                              tuple(float(x) for x in samples or ()), d.get("mode") or of_method(d.get("method")),
                              bool(d.get("throttled")))
        out.setdefault((d["op"], d["provider"], int(d["M"]), int(d["N"]), d["dtype"]), []).append(entry)

    if isinstance(data, dict) and "benchmarks" in data:
        for b in data["benchmarks"]:
            info = b.get("extra_info") or {}
            if {"op", "provider", "M", "N", "dtype"} <= info.keys():
                add(info, b["stats"]["median"], info.get("spread"), info.get("samples") or b["stats"].get("data"))
    else:
        for r in data["rows"] if isinstance(data, dict) else data:
            add(r, r["median_s"], r.get("spread"), r.get("samples"))
    if not out:
        raise ValueError(f"{path}: no benchmark rows with op/provider/M/N/dtype found")
    return out


def load_baseline_machine(path) -> dict:
    """The machine_info of a pytest-benchmark JSON baseline ({} for our rows JSON, which has none)."""
    with open(path) as f:
        data = json.load(f)
    return data.get("machine_info") or {} if isinstance(data, dict) else {}


def machine_differences(baseline: dict, current: dict) -> list[str]:
    """What differs between the machine a baseline was measured on and this one: the GPU and the
    versions of torch, CuTeDSL, Oink and the peers (only where both sides name them)."""
    out = []
    gpu_b, gpu_c = (baseline.get("gpu") or {}).get("name"), (current.get("gpu") or {}).get("name")
    if gpu_b and gpu_b != gpu_c:
        out.append(f"GPU {gpu_b} -> {gpu_c or 'none'}")
    ver_b, ver_c = baseline.get("oink_versions") or {}, current.get("oink_versions") or {}
    out += [f"{pkg} {ver_b[pkg]} -> {ver_c[pkg]}" for pkg in sorted(ver_b.keys() & ver_c.keys())
            if ver_b[pkg] != ver_c[pkg]]
    return out


class Comparison(NamedTuple):
    lines: list  # one verdict line per compared row
    regressed: list  # "row: SLOWER, x1.12 [1.09, 1.15]" of the rows that fail the session
    missing: list  # names of the rows the baseline has no entry for
    mismatched: list  # "name (why)" of rows whose baseline entry is of another suite or timing
    unsure: list  # "row: UNSURE, ..." of rows still unsure after their re-timing (they pass)
    table: list  # (row, Verdict, baseline median s, this median s, samples: baseline, this, re-timed) per compared row

    @property
    def verdicts(self) -> dict:
        """{row key: FASTER / SAME / SLOWER / UNSURE} of every compared row (--oink-history marks them)."""
        return {r.key: v.name for r, v, *_ in self.table}


def gated(r, providers=("oink",), gate_cpu: bool = False) -> bool:
    """Whether the regression gate judges this row: a timed row of ``providers``, on a GPU unless ``gate_cpu``."""
    return r.status == "ok" and bool(r.median_s) and may_gate(r, providers, gate_cpu)


def may_gate(r, providers=("oink",), gate_cpu: bool = False) -> bool:
    """Whether the gate would judge the row once timed: a row of ``providers``, on a GPU unless ``gate_cpu``."""
    return r.provider in providers and (gate_cpu or r.device != "cpu")


def match_entry(r, entries):
    """The baseline entry of the row's suite, timing and mode, or None (then ``entries`` may hold others)."""
    timed = what_was_timed(r.method)
    same = [e for e in entries if e.suite in (None, r.suite) and e.timed in (None, timed) and e.mode in (None, r.mode)]
    return same[0] if same else None


def regressions(rows, baseline: dict, max_regression: float, providers=("oink",), gate_cpu: bool = False):
    """Compare the timed rows of ``providers`` (GPU rows only unless ``gate_cpu``) with the baseline
    entries of the same suite, timing and mode (a launch suite's host time says nothing of a kernel's,
    nor an L2-warm time of a cold one).
    Each compared row gets a verdict (verdicts.judge): only SLOWER ones regressed. -> Comparison."""
    from .verdicts import held_down, judge

    out = Comparison([], [], [], [], [], [])
    for r in sorted((r for r in rows if gated(r, providers, gate_cpu)), key=lambda r: r.key):
        name = f"{r.op}-{r.M}x{r.N}-{r.dtype}-{r.provider}"
        entries = baseline.get(r.key) or []
        if not entries:
            out.missing.append(name)
            continue
        entry = match_entry(r, entries)
        if entry is None:
            e = entries[0]
            out.mismatched.append(f"{name} (baseline row of suite {e.suite or '?'}, timed {e.timed or '?'}, mode "
                                  f"{e.mode or '?'}; this row of suite {r.suite}, timed {what_was_timed(r.method)}, "
                                  f"mode {r.mode})")
            continue
        verdict = held_down(judge(r.samples, r.median_s, r.spread, entry, max_regression, cpu_rounds(r)),
                            r.throttled, entry.throttled)
        head = f"{row_title(r)}: {verdict.describe(max_regression)}"
        retimed = f"; re-timed {r.retimes}x" if r.retimes else ""
        old_median = r.median_s / verdict.ratio  # the baseline's median the verdict used (of its samples, if any)
        out.lines.append(f"{head} ({old_median * 1e3:.4f} ms -> {r.median_s * 1e3:.4f} ms, "
                         f"{len(entry.samples)} -> {len(r.samples)} samples{retimed})")
        out.table.append((r, verdict, old_median, r.median_s, len(entry.samples), len(r.samples), r.retimes))
        if verdict.name == "SLOWER":
            out.regressed.append(head)
        elif verdict.name == "UNSURE":
            out.unsure.append(head)
    return out


def gate_markdown(comparison, threshold: str, baseline: str, nothing_compared: str = "") -> list[str]:
    """The regression gate's section of the Markdown summary: each compared row's verdict, ratio
    (this run's median over the baseline's) and interval, a geomean of the ratios per op, and the
    rows not compared. ``baseline``: what the rows were compared with."""
    from .verdicts import ratio_text

    counts = Counter(v.name for _, v, *_ in comparison.table)
    told = ", ".join(f"{counts[n]} {n}" for n in ("SLOWER", "UNSURE", "SAME", "FASTER") if n in counts)
    lines = ["## Regression gate", "", f"Baseline: {baseline}. "
             + f"Threshold {threshold}; {len(comparison.table)} rows compared" + (f": {told}." if told else ".")
             + " Ratio: this run's median / the baseline's (< 1: faster); interval: its bootstrap 95% interval "
               "(- where the baseline kept no samples).", ""]
    if comparison.table:
        lines += ["| row | verdict | ratio | interval | baseline ms | this ms | samples (baseline, this) | re-timed |",
                  "|---|---|---|---|---|---|---|---|"]
        for r, v, old, new, n_old, n_new, retimes in comparison.table:
            interval = f"{ratio_text(v.interval[0], 3)}-{ratio_text(v.interval[1], 3)}" if v.interval else "-"
            name = v.name + (f" ({v.note})" if v.note else "")
            lines.append(f"| {row_title(r)} | {name} | {ratio_text(v.ratio, 3)} | {interval} | {old * 1e3:.4g} | "
                         f"{new * 1e3:.4g} | {n_old}, {n_new} | {retimes} |")
        by_op = {}
        for r, v, *_ in comparison.table:
            by_op.setdefault((r.op, r.provider), []).append(v.ratio)
        per_op = [f"{op} {prov} {ratio_text(geomean(ratios), 3)} ({len(ratios)} rows)"
                  for (op, prov), ratios in sorted(by_op.items())]
        lines += ["", "Geomean ratio per op: " + "; ".join(per_op) + "."]
    for label, names in (("no baseline entry", comparison.missing),
                         ("the baseline's row is of another suite, timing or mode", comparison.mismatched)):
        if names:
            lines += ["", f"Not compared ({label}): " + ", ".join(names) + "."]
    if nothing_compared:
        lines += ["", f"The regression gate compared nothing: {nothing_compared}."]
    return lines + [""]


def benchmark_stats(row) -> dict:
    """pytest-benchmark's stats of a row's samples (its own Stats class: every field its JSON holds,
    so ``pytest-benchmark compare`` reads the file); the median and min alone where pytest-benchmark
    is not installed or the row kept no samples (rows read back from a CSV)."""
    try:
        from pytest_benchmark.stats import Stats
    except ImportError:
        Stats = None
    if Stats is None or not row.samples:
        return {"median": row.median_s, "min": row.min_s}
    stats = Stats()
    for s in row.samples:
        stats.update(s)
    return dict(stats.as_dict(), iterations=1, data=list(row.samples))


def benchmark_json(rows, machine_info: dict, commit_info: dict | None = None) -> dict:
    """pytest-benchmark's JSON layout from rows, for sessions where it can't write its own (under
    xdist it disables itself; -p no:benchmark; ``--oink-json``): each benchmark's stats as its own
    file holds them, ``extra_info`` as in its own file, so ``--oink-baseline`` and
    ``pytest-benchmark compare`` read either."""
    import datetime

    benches = [{"group": f"{r.op} {r.M}x{r.N} {r.dtype}", "name": r.test.split("::")[-1], "fullname": r.test,
                "params": None, "param": None, "extra_info": r.extra_info(), "options": {"timer": r.method},
                "stats": benchmark_stats(r)}
               for r in rows if r.status == "ok" and r.median_s]
    return {"machine_info": machine_info, "commit_info": commit_info or {}, "benchmarks": benches,
            "datetime": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": "pytest_oink"}


def rows_json(rows) -> str:
    return json.dumps({"rows": [dict(asdict(r), tbs=r.tbs) for r in rows]}, indent=1)
