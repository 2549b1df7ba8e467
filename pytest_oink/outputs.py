"""What a session writes from its rows at the end: the CSV, the Markdown summary, SVG plots, and
pytest-benchmark's JSON layout where pytest-benchmark writes none itself (under xdist, with no
benchmark run, without pytest-benchmark: ``--oink-json``). A session that measured nothing still
writes valid files, so a CI step reading them fails on their content, not on their absence."""
from __future__ import annotations

import glob
import json
import os

from . import options, plots, report
from .state import STATE


def machine_info(config) -> dict:
    """pytest-benchmark's machine_info (its hooks, ours among them) where it is loaded, else ours."""
    if config.pluginmanager.hasplugin("benchmark"):
        info = config.hook.pytest_benchmark_generate_machine_info(config=config)
        config.hook.pytest_benchmark_update_machine_info(config=config, machine_info=info)
        return info
    from .benchmark_hooks import pytest_benchmark_update_machine_info

    info: dict = {}
    pytest_benchmark_update_machine_info(config, info)
    return info


def results_json(config, rows) -> str:
    from .benchmark_hooks import run_info

    commit = (config.hook.pytest_benchmark_generate_commit_info(config=config)
              if config.pluginmanager.hasplugin("benchmark") else {})
    data = dict(report.benchmark_json(rows, machine_info(config), commit), oink_run=run_info(config))
    return json.dumps(data, indent=1)


def _benchmark_json_target(config):
    """--benchmark-json where pytest-benchmark wrote nothing to it (it writes only benchmarks it
    ran itself: none under xdist, none when every row was skipped), else None."""
    if not config.pluginmanager.hasplugin("benchmark"):
        return None
    target = config.getoption("benchmark_json", None)
    session = getattr(config, "_benchmarksession", None)
    return None if session is not None and session.benchmarks else target


def _write(target, text: str) -> str:
    if hasattr(target, "write"):  # pytest-benchmark < 5.3 opens the file itself (argparse.FileType("wb"))
        with target as f:
            f.write(text.encode())
        return target.name
    with open(target, "w") as f:
        f.write(text)
    return str(target)


def _gate_section(config) -> list[str]:
    """The regression gate's lines of the Markdown summary ([] where no gate ran)."""
    state = config.stash[STATE]
    if state.get("comparison") is None:
        return []
    baseline = ("the other tree of --oink-against, timed in this run" if state.get("against")
                else options.get(config, "--oink-baseline"))
    return report.gate_markdown(state["comparison"], options.get(config, "--oink-max-regression"), baseline,
                                state.get("nothing_compared", ""))


def gated_given(config):
    """The providers --oink-gate-providers names where given: the summary's "ours" (else Oink's and a user's own)."""
    return options.split_list(options.given(config, "--oink-gate-providers"))


def write_outputs(config, rows, notes=()) -> None:
    """Every output asked for; ``notes`` end the Markdown summary (why there are no rows, the
    baseline's machine and this one)."""
    state = config.stash[STATE]
    roof = state.get("roofline")
    csv_path = options.get(config, "--oink-csv")
    if csv_path:
        report.write_csv(rows, csv_path)
        state["written"].append(csv_path)
        for partial in glob.glob(glob.escape(csv_path) + "*.partial"):  # the session's CSV replaces them
            os.remove(partial)
    summary = options.get(config, "--oink-summary")
    if summary:
        with open(summary, "w") as f:
            f.write(report.summary_markdown(rows, roof, gated_given(config)) + "\n".join(_gate_section(config))
                    + "".join(f"\n{note}\n" for note in notes))
        state["written"].append(summary)
    svg_dir = options.get(config, "--oink-svg")
    if svg_dir:
        state["written"] += plots.write_svg(rows, svg_dir, roof)
    targets = [t for t in (_benchmark_json_target(config), options.get(config, "--oink-json")) if t]
    if targets:
        text = results_json(config, rows)
        state["written"] += [_write(t, text) for t in targets]
