"""The regression gate's session side (``--oink-baseline``): compare the session's rows with the
baseline, fail the session on a regression or on a gate that compared nothing, and say why."""
from __future__ import annotations

import pytest

from . import markers, options, report, suites
from .state import CASES, ROWS, STATE


def why_no_rows(config) -> str:
    """Why a session measured no row (said in the summary and by a gate that compared nothing)."""
    pairs = config.stash.get(CASES, None)
    if pairs is None:
        return "no --oink-suite given, and no test called oink_measure"
    suite = options.get(config, "--oink-suite")
    if (suites.ABOUT[suite][1] and markers.device_capability() is None
            and not options.get(config, "--oink-run-on-cpu")):
        return (f"suite {suite!r} is sized for a GPU and there is none ({len(pairs)} rows skipped; "
                "--oink-run-on-cpu forces them)")
    return f"none of the suite's {len(pairs)} rows was timed (skipped or failed: see the test summary)"


def no_rows_note(config) -> str | None:
    """Why a session that ran a suite (not just collected it) has no rows; None where it has rows."""
    if config.stash.get(CASES, None) is None or config.stash[ROWS] or config.option.collectonly:
        return None
    return why_no_rows(config)


def why_nothing_compared(config, rows, comparison) -> str:
    if not rows:
        return "no rows measured: " + why_no_rows(config)
    providers = tuple(options.split_list(options.get(config, "--oink-gate-providers")))
    timed = [r for r in rows if r.provider in providers and r.status == "ok" and r.median_s]
    if not timed:
        return f"no row of the gated providers ({', '.join(providers)}) was timed"
    if not options.get(config, "--oink-gate-cpu") and all(r.device == "cpu" for r in timed):
        return "CPU rows are gated only with --oink-gate-cpu"
    if comparison.mismatched and not comparison.missing:
        return "the baseline's rows of these shapes are of another suite, timing or --oink-timing mode"
    return "no gated row has a baseline entry"


def refusal(config) -> str | None:
    """Why a gate against the --oink-baseline file would compare nothing, known from the selection before any
    row runs (a baseline of another suite, no GPU without --oink-gate-cpu, no gated row with an entry); None
    where it may compare something (or no suite selects the rows: a test's own oink_measure calls)."""
    baseline, pairs = config.stash[STATE].get("baseline"), config.stash.get(CASES, None)
    if not baseline or pairs is None:
        return None
    suite = options.get(config, "--oink-suite")
    theirs = {e.suite for entries in baseline.values() for e in entries}
    if None not in theirs and suite not in theirs:
        return (f"recorded from suite {', '.join(sorted(theirs))}, not from --oink-suite={suite}: its rows compare "
                f"with no row of this run (record one with --oink-suite={suite} --oink-json=PATH)")
    _, providers, gate_cpu = gate_settings(config)
    nothing = "the gate would compare nothing: "
    if markers.device_capability() is None:
        if suites.ABOUT[suite][1] and not options.get(config, "--oink-run-on-cpu"):
            return nothing + why_no_rows(config)
        if not gate_cpu:
            return nothing + "there is no GPU here, and CPU rows are gated only with --oink-gate-cpu"
    gated = [(c, p) for c, p in pairs if p in providers]
    if not gated:  # the default's (oink) only: a provider given is of some row (stray_gate_providers)
        return nothing + f"no selected row is of the gated providers ({', '.join(providers)}: --oink-gate-providers)"
    if not any((c.op, p, c.M, c.N, c.dtype) in baseline for c, p in gated):
        return nothing + (f"none of the {len(gated)} gated rows selected (op, provider, shape, dtype) has an entry in "
                          "it")
    return None


def stray_gate_providers(config) -> str | None:
    """Why the --oink-gate-providers given don't fit the suite's selection: one that none of its rows is of (a
    misspelt name would gate fewer rows than asked, or none, found out only after the run). None where each is of
    some row, where none is given (the default's mismatch: ``refusal``), where no gate runs, or without a suite
    (a test's own oink_measure rows name their providers as they run)."""
    pairs, value = config.stash.get(CASES, None), options.given(config, "--oink-gate-providers")
    if pairs is None or not value or not (options.get(config, "--oink-baseline")
                                          or options.get(config, "--oink-against")):
        return None
    from .registry import ALL_PROVIDERS

    theirs = sorted({p for _, p in pairs}, key=lambda p: ALL_PROVIDERS.index(p) if p in ALL_PROVIDERS else 99)
    stray = [p for p in options.split_list(value) or [] if p not in theirs]
    if not stray:
        return None
    return (f"--oink-gate-providers={value}: {', '.join(map(repr, stray))} is no provider of this "
            f"session's rows (theirs: {', '.join(theirs)}; known providers: {', '.join(ALL_PROVIDERS)})")


def gate_settings(config) -> tuple:
    """(threshold, gated providers, whether CPU rows are gated)."""
    return (options.parse_percent(options.get(config, "--oink-max-regression")),
            tuple(options.split_list(options.get(config, "--oink-gate-providers"))),
            bool(options.get(config, "--oink-gate-cpu")))


def verdict_for(config, row):
    """``samples -> Verdict`` for a row being timed (its re-timing asks while UNSURE), or None
    where the gate will not judge it (no baseline, not gated, no entry of its suite and timing)."""
    baseline = config.stash[STATE].get("baseline")
    threshold, providers, gate_cpu = gate_settings(config)
    if not baseline or not report.gated(row, providers, gate_cpu):
        return None
    entry = report.match_entry(row, baseline.get(row.key) or [])
    if entry is None:
        return None
    from .timing import median, relative_spread
    from .verdicts import judge

    return lambda samples: judge(samples, median(samples), relative_spread(samples), entry, threshold,
                                 report.cpu_rounds(row))


def judge(session) -> None:
    """Compare (at session finish) and fail the session on a regression, on rows without a
    baseline entry (unless --oink-allow-missing: it tolerates some), and on a gate that compared
    nothing (always: a gate that compared nothing proved nothing)."""
    config = session.config
    state, rows = config.stash[STATE], config.stash[ROWS]
    if "baseline" not in state or config.option.collectonly:  # nothing timed, nothing to judge
        return
    comparison = report.regressions(rows, state["baseline"], *gate_settings(config))
    state["comparison"] = comparison
    if not comparison.lines:
        state["nothing_compared"] = why_nothing_compared(config, rows, comparison)
    uncompared = comparison.missing or comparison.mismatched
    refused = not comparison.lines or (uncompared and not options.get(config, "--oink-allow-missing"))
    if (comparison.regressed or refused) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def summarize(terminalreporter, config) -> None:
    """The gate's section of the terminal summary (and the note of a session that measured nothing)."""
    state = config.stash[STATE]
    if no_rows_note(config):
        terminalreporter.write_line(f"[oink] no rows measured: {no_rows_note(config)}", yellow=True)
    comparison = state.get("comparison")
    if comparison is None:
        return
    tr = terminalreporter
    tr.section("oink regression gate")
    for line in comparison.lines:
        tr.write_line(line)
    threshold = options.get(config, "--oink-max-regression")
    if comparison.regressed:  # named with their intervals: what fails the session
        tr.write_line(f"SLOWER beyond {threshold} (fails the session): " + "; ".join(comparison.regressed), red=True)
    if comparison.unsure:
        tr.write_line(f"UNSURE after re-timing (passes; neither within nor beyond {threshold}): "
                      + "; ".join(comparison.unsure), yellow=True)
    strict = not options.get(config, "--oink-allow-missing")
    if comparison.missing:
        tr.write_line("not compared (no baseline entry): " + ", ".join(comparison.missing), red=strict)
    if comparison.mismatched:
        tr.write_line("not compared (the baseline's row is of another suite, timing or mode): "
                      + ", ".join(comparison.mismatched), red=strict)
    from .machine import summary_line

    if summary_line(config):
        tr.write_line(summary_line(config))
    if state.get("against"):
        tr.write_line(state["against"].summary_line())
        for note in state["against"].notes:
            tr.write_line(f"not timed on the other tree: {note}", yellow=True)
    if state.get("machine_mismatch"):
        tr.write_line("accepted (--oink-accept-machine): " + "; ".join(state["machine_mismatch"]), yellow=True)
    if state.get("machine_differences"):
        tr.write_line("baseline measured with other versions (timings may not compare): "
                      + "; ".join(state["machine_differences"]), yellow=True)
    if state.get("nothing_compared"):
        tr.write_line(f"the regression gate compared nothing: {state['nothing_compared']}", red=True)
    # pytest's final line then counts them: "... 4 passed, 2 regressed"
    tr.stats.setdefault("regressed", []).extend(comparison.regressed)
    tr.stats.setdefault("not compared", []).extend(comparison.missing + comparison.mismatched)
