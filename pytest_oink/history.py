"""``--oink-history=DIR`` (issue #34 item 6): each run appends one JSON file to DIR (commit, machine,
versions, time, and per row its median and the gate's verdict), and DIR/plots holds one SVG per op
of time over those runs, one line per shape, the verdicts marked."""
from __future__ import annotations

import datetime
import glob
import json
import os
import subprocess

# marker per gate verdict (SAME and rows the gate did not judge: the line's plain dots)
VERDICT_MARKERS = {"SLOWER": ("^", "red"), "FASTER": ("v", "green"), "UNSURE": ("X", "orange")}


def git_commit(directory) -> str:
    """HEAD's commit where ``directory`` is in a git work tree, else "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def run_record(config, rows, verdicts: dict) -> dict:
    """One run: where and when it ran, and per timed row what the history plots (``verdicts``:
    {row key: verdict name} of the rows the regression gate judged)."""
    from . import machine
    from .benchmark_hooks import run_info

    info = machine.this_machine()
    gpu = info.get("gpu") or {}
    return {"commit": git_commit(config.rootpath),
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "card": gpu.get("name") or "no GPU", "machine": machine.describe(machine.identity(info)),
            "versions": info.get("oink_versions") or {}, "run": run_info(config),
            "rows": [{"suite": r.suite, "op": r.op, "provider": r.provider, "M": r.M, "N": r.N, "dtype": r.dtype,
                      "mode": r.mode, "method": r.method, "median_s": r.median_s, "verdict": verdicts.get(r.key)}
                     for r in rows if r.status == "ok" and r.median_s]}


def append(directory, record: dict) -> str:
    """Write ``record`` as a new file in ``directory``, named by its time and commit (a file per run:
    runs sharing a directory, e.g. CI jobs, never write the same file)."""
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.datetime.fromisoformat(record["timestamp"]).strftime("%Y%m%dT%H%M%S%fZ")
    path = os.path.join(directory, f"{stamp}-{record['commit'][:12]}.json")
    with open(path, "x") as f:
        json.dump(record, f, indent=1)
    return path


def load(directory) -> list[dict]:
    """The runs in ``directory``, oldest first (files that are not run records are skipped)."""
    runs = []
    for path in glob.glob(os.path.join(glob.escape(str(directory)), "*.json")):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and "timestamp" in data and isinstance(data.get("rows"), list):
            runs.append(data)
    return sorted(runs, key=lambda d: d["timestamp"])


def write_plots(runs, directory) -> list[str]:
    """One SVG per op in ``directory``: each shape's (and provider's, mode's) median over the runs,
    markers where the gate gave a verdict other than SAME. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    labels = [f"{d['commit'][:7]}\n{d['timestamp'][:10]}" for d in runs]
    written = []
    for op in sorted({r["op"] for d in runs for r in d["rows"]}):
        lines: dict = {}  # (provider, M, N, dtype, mode) -> [(run index, ms, verdict)]
        for i, d in enumerate(runs):
            for r in d["rows"]:
                if r["op"] == op:
                    key = (r["provider"], r["M"], r["N"], r["dtype"], r.get("mode", "cold"))
                    lines.setdefault(key, []).append((i, r["median_s"] * 1e3, r.get("verdict")))
        with matplotlib.rc_context({"svg.fonttype": "none"}):  # text stays text: the SVG names its op
            fig, ax = plt.subplots(figsize=(max(6, len(runs) * 0.8), 4))
            for (prov, M, N, dtype, mode), pts in sorted(lines.items()):
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"{prov} {M}x{N} {dtype} {mode}")
                for verdict, (marker, color) in VERDICT_MARKERS.items():
                    hit = [p for p in pts if p[2] == verdict]
                    if hit:
                        ax.scatter([p[0] for p in hit], [p[1] for p in hit], marker=marker, color=color, s=60,
                                   zorder=3)
            for verdict, (marker, color) in VERDICT_MARKERS.items():  # the markers' legend, once
                ax.scatter([], [], marker=marker, color=color, label=verdict)
            ax.set_xticks(range(len(runs)))
            ax.set_xticklabels(labels, fontsize=6)
            ax.set_yscale("log")
            ax.set_ylabel("median ms per call")
            ax.set_title(f"{op}: time over runs")
            ax.legend(fontsize=6)
            fig.tight_layout()
            path = os.path.join(directory, f"{op}.svg")
            fig.savefig(path, format="svg")
            plt.close(fig)
        written.append(path)
    return written


def record(config, rows) -> None:
    """Session end: append this run to ``--oink-history`` and redraw its plots (skipped, said in the
    summary, without matplotlib)."""
    from . import options
    from .state import STATE

    directory = options.get(config, "--oink-history")
    state = config.stash[STATE]
    comparison = state.get("comparison")
    path = append(directory, run_record(config, rows, comparison.verdicts if comparison else {}))
    state["written"].append(path)
    try:
        state["written"] += write_plots(load(directory), os.path.join(directory, "plots"))
    except ImportError:
        state["history_note"] = "history plots skipped: matplotlib is not installed (pip install 'oink[plot]')"
