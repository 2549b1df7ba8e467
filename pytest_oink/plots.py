"""The SVG plots of a session's rows (``--oink-svg``): per (suite, op), TB/s per shape with one line per
provider and dtype (ms per call for ops that count no bytes), and peak memory where rows have it. A plot
says what it measured: rows timed on a CPU are reference timings (Oink's kernels run on CUDA only), and
their titles and labels say so."""
from __future__ import annotations

import os

CPU_WHAT = "reference timings on a CPU (host timer; no kernel ran)"


def on_cpu(rows) -> bool:
    """Whether every row was timed on a CPU (reference timings, not kernels)."""
    rows = list(rows)
    return bool(rows) and all(r.device == "cpu" for r in rows)


def what_was_measured(rows) -> str:
    """The plot's subtitle: the device (card) the rows were timed on, and on a CPU that they are
    reference timings."""
    if on_cpu(rows):
        return CPU_WHAT
    devices = sorted({r.device for r in rows})
    cpu = " (CPU rows: reference timings)" if "cpu" in devices else ""
    return ", ".join(devices) + cpu


def series(sel, value) -> dict:
    """{label: {(M, N): value(row)}}: one series per provider and dtype (named by its dtype where the
    rows hold several), Oink's first; a point is keyed by (dtype, provider, M, N), so a float16 row
    never replaces a bfloat16 one."""
    dtypes = sorted({r.dtype for r in sel})
    devices = sorted({r.device for r in sel})
    out: dict = {}
    for r in sorted(sel, key=lambda r: (r.provider != "oink", r.provider, r.dtype, r.device)):
        label = r.provider + (f" {r.dtype}" if len(dtypes) > 1 else "") + (f" ({r.device})" if len(devices) > 1 else "")
        out.setdefault(label, {})[(r.M, r.N)] = value(r)
    return out


def write_svg(rows, directory, roofline=None) -> list[str]:
    """Per (suite, op): an SVG of TB/s per shape per provider and dtype with the measured roofline
    drawn (ms for ops that count no bytes: the training suite's), and one of peak memory where rows
    have it."""
    os.makedirs(directory, exist_ok=True)
    written = []
    for suite, op in sorted({(r.suite, r.op) for r in rows}):
        ok = [r for r in rows if r.suite == suite and r.op == op and r.status == "ok"]
        sel = [r for r in ok if r.tbs]
        title = f"{op} ({suite})"
        cpu = " (reference, CPU)" if on_cpu(ok) else ""
        if sel:
            line = (roofline.copy_tbs, f"copy {roofline.copy_tbs:.2f} TB/s") if roofline is not None else None
            written.append(_plot(sel, lambda r: r.tbs, f"TB/s{cpu}", title, line,
                                 os.path.join(directory, f"{suite}-{op}.svg")))
        elif any(r.median_s for r in ok):
            written.append(_plot([r for r in ok if r.median_s], lambda r: r.median_s * 1e3, f"ms per call{cpu}",
                                 title, None, os.path.join(directory, f"{suite}-{op}.svg")))
        mem = [r for r in ok if r.peak_mem_bytes is not None]
        if mem:
            written.append(_plot(mem, lambda r: r.peak_mem_bytes / 2**20, "peak MiB (beyond the inputs)",
                                 f"{title}: peak memory", None, os.path.join(directory, f"{suite}-{op}-memory.svg")))
    return written


def _plot(sel, value, ylabel: str, title: str, hline, path: str) -> str:
    """``value(row)`` per shape, one line per provider and dtype (Oink first), titled with what was
    measured (``what_was_measured``); ``hline``: (y, label) or None."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r.M, r.N) for r in sel})
    fig, ax = plt.subplots(figsize=(max(6, len(shapes) * 0.6), 4))
    for label, pts in series(sel, value).items():
        xs = [i for i, s in enumerate(shapes) if s in pts]
        ax.plot(xs, [pts[shapes[i]] for i in xs], marker="o", label=label)
    if hline is not None:
        ax.axhline(hline[0], color="black", linestyle="--", label=hline[1])
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"{M}x{N}" for M, N in shapes], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{what_was_measured(sel)}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)
    return path
