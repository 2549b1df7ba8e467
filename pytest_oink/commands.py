"""The plugin's commands that answer and exit instead of running tests: ``--oink-list`` and
``--oink-merge``."""
from __future__ import annotations

import pytest

from . import options, suites


def listing() -> str:
    """The suites (what each is), the ops with their providers, and every provider."""
    from .providers import ALL_PROVIDERS, providers_for

    lines = ["suites (--oink-suite):"]
    for name, (about, gpu) in suites.ABOUT.items():
        seeded = name in suites.SEEDED  # its count is one seed's: another seed's differs a little
        count = len(suites.expand(name, seed=0 if seeded else None))
        count = f"{count} op x shape cases{' (seed 0)' if seeded else ''}"
        lines.append(f"  {name:8s} {about}{' (GPU)' if gpu else ''}; {count}; {suites.duration(name)}")
    lines.append("ops (--oink-ops) and their providers:")
    lines += [f"  {op:24s} {', '.join(providers_for(op))}" for op in suites.bench_ops()]
    lines.append(f"providers (--oink-providers, --oink-gate-providers): {', '.join(ALL_PROVIDERS)}")
    return "\n".join(lines)


def merge(config) -> int:
    """``--oink-merge``: rows of several runs' CSVs into one set of reports; no tests run. A row
    measured in two files (same op, provider, shape, dtype) keeps the later file's and is named."""
    from . import plots, report
    from .outputs import gated_given

    merged, repeated = {}, []
    for path in options.split_list(options.get(config, "--oink-merge")):
        try:
            rows = report.read_csv(path)
        except (OSError, KeyError, ValueError) as e:
            raise pytest.UsageError(f"--oink-merge: {path} is not an --oink-csv file ({e})") from None
        for r in rows:
            if r.key in merged:
                repeated.append("-".join(map(str, r.key)))
            merged[r.key] = r
    rows = list(merged.values())
    written = []
    if options.get(config, "--oink-csv"):
        report.write_csv(rows, options.get(config, "--oink-csv"))
        written.append(options.get(config, "--oink-csv"))
    if options.get(config, "--oink-summary"):
        with open(options.get(config, "--oink-summary"), "w") as f:
            f.write(report.summary_markdown(rows, gated=gated_given(config)))
        written.append(options.get(config, "--oink-summary"))
    if options.get(config, "--oink-svg"):
        written += plots.write_svg(rows, options.get(config, "--oink-svg"))
    if not written:
        raise pytest.UsageError("--oink-merge writes --oink-csv, --oink-summary or --oink-svg: give at least one")
    print(f"[oink] merged {len(rows)} rows from {len(options.split_list(options.get(config, '--oink-merge')))} files"
          + (f"; repeated rows (later file kept): {', '.join(repeated)}" if repeated else ""))
    for path in written:
        print(f"[oink] wrote {path}")
    return 0
