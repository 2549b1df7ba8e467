"""Command-line options (group ``oink``) and their ini twins (``oink_*``)."""
from __future__ import annotations

import math

OPTIONS = [
    # (flag, ini key, help, default, is_flag)
    ("--oink-suite", "oink_suite",
     "run the benchmark suite NAME (quack, dsv3, nvfp4, fp8, sweep, launch, smoke, random; --oink-list "
     "describes them); the session then runs the benchmarks only", None, False),
    ("--oink-seed", "oink_seed",
     "the seed --oink-suite=random draws its widths and rows from (required there; recorded in the "
     "results)", None, False),
    ("--oink-configs", "oink_configs", "benchmark these shapes instead of the suite's: MxN,MxN,...", None, False),
    ("--oink-dtype", "oink_dtype", "benchmark dtype (bfloat16, float16, float32)", "bfloat16", False),
    ("--oink-ops", "oink_ops", "comma-separated ops to benchmark (default: the suite's)", None, False),
    ("--oink-providers", "oink_providers",
     "comma-separated providers (oink, oink-unfused, quack, liger, flashinfer, flashinfer-cuda, torch, "
     "torch.compile)", None, False),
    ("--oink-timing", "oink_timing",
     "how rows are timed: cold (CUDA-graph replays, inputs cycled past L2), hot (graph replays on one input "
     "set, L2-warm) or eager (wall time per eager call, host cost included); a CPU times every mode by the "
     "host timer; baseline rows compare only within one mode", "cold", False),
    ("--oink-csv", "oink_csv", "write one CSV row per benchmark to PATH", None, False),
    ("--oink-svg", "oink_svg",
     "write per-suite SVG plots (TB/s per shape per provider, roofline drawn) into DIR", None, False),
    ("--oink-summary", "oink_summary", "write Markdown tables with per-op geomean speedups to PATH", None, False),
    ("--oink-json", "oink_json",
     "write pytest-benchmark's JSON layout (its full stats) from Oink's rows to PATH; also without "
     "pytest-benchmark and under xdist", None, False),
    ("--oink-baseline", "oink_baseline",
     "compare Oink rows with this saved JSON (ours or pytest-benchmark's)", None, False),
    ("--oink-max-regression", "oink_max_regression",
     "slowdown vs the baseline that fails the session, with its unit (e.g. 5%): a row is SLOWER when the 95% "
     "bootstrap interval of its ratio of medians lies wholly above 1 + this (UNSURE rows are re-timed first; "
     "baselines without samples: the spread rule)", "5%", False),
    ("--oink-against", "oink_against",
     "time the gated rows for another tree of Oink too, in this run on the same device, rounds alternating, "
     "and gate this tree against it (no stored baseline): a git ref of the repository this Oink is imported "
     "from (exported to a temporary directory) or a directory holding oink/", None, False),
    ("--oink-gate-providers", "oink_gate_providers",
     "comma-separated providers whose rows the regression gate compares", "oink", False),
    ("--oink-accept-machine", "oink_accept_machine",
     "gate against a baseline measured on another machine (GPU, driver, CUDA, torch or CuTeDSL differ: refused"
     " otherwise)", False, True),
    ("--oink-allow-missing", "oink_allow_missing",
     "let the regression gate pass when some gated rows have no baseline entry (they are still listed; a gate "
     "that compared nothing still fails)", False, True),
    ("--oink-gate-cpu", "oink_gate_cpu",
     "gate CPU-timed rows too (off by default: CPU timings are too noisy to gate)", False, True),
    ("--oink-history", "oink_history",
     "append this run (commit, machine, versions, time, each row's median and gate verdict) as one JSON file "
     "to DIR, and draw DIR/plots/OP.svg: time over the runs, one line per shape, verdicts marked (plots need "
     "matplotlib)", None, False),
    ("--oink-batch-invariance", "oink_batch_invariance",
     "check each (op, provider, width) once for batch invariance: rows alone, batches of 1-4096 rows (vLLM's "
     "255/256/300 among them) and slices mid-batch, each bit for bit against one batch of up to 16384 rows; an"
     " Oink row that breaks it fails, a peer's is reported (summary, CSV, JSON)", False, True),
    ("--oink-profile", "oink_profile",
     "add per-kernel resource usage (registers, spills, smem, occupancy) to results", False, True),
    ("--oink-run-on-cpu", "oink_run_on_cpu",
     "run a GPU-sized suite on a CPU anyway (skipped there by default)", False, True),
    ("--oink-list", "oink_list", "list the suites, ops and providers, then exit", False, True),
    ("--oink-merge", "oink_merge",
     "merge these --oink-csv files (e.g. from several CI runners) into the "
     "--oink-csv/--oink-summary/--oink-svg outputs, then exit: FILE,FILE,...", None, False),
]


def add_options(parser) -> None:
    group = parser.getgroup("oink", "Oink kernels: correctness gates and benchmarks")
    for flag, ini, help_, default, is_flag in OPTIONS:
        if is_flag:
            group.addoption(flag, action="store_true", default=None, help=help_)
            parser.addini(ini, help_, type="bool", default=default)
        else:
            shown = f"; default {default}" if default else ""
            group.addoption(flag, default=None, help=f"{help_} (ini: {ini}{shown})".replace("%", "%%"))
            # no ini default: ``get`` applies it, and ``given`` tells a value set apart from the default
            parser.addini(ini, f"{help_} (default {default})" if default else help_, default=None)


def get(config, flag: str):
    """The option's value: command line first, then the ini key, then the default."""
    for f, ini, _help, default, _is_flag in OPTIONS:
        if f == flag:
            value = config.getoption(f.lstrip("-").replace("-", "_"))
            if value is None:
                value = config.getini(ini)
            return default if value in (None, "") else value
    raise KeyError(flag)


def given(config, flag: str):
    """The option's value where the command line or the ini names it, else None (its default not taken)."""
    ini = next(ini for f, ini, *_ in OPTIONS if f == flag)
    return config.getoption(flag.lstrip("-").replace("-", "_")) or config.getini(ini) or None


def parse_percent(text: str, flag: str = "--oink-max-regression") -> float:
    """'5%' -> 0.05. The unit is required (a bare 5 would be ambiguous) and negatives are refused."""
    text = str(text).strip()
    try:
        if not text.endswith("%"):
            raise ValueError
        value = float(text[:-1]) / 100
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected a percentage with its unit, e.g. 5%") from None
    if math.isnan(value) or value == math.inf:  # a NaN or infinite threshold would pass every row
        raise ValueError(f"{flag}={text!r}: expected a finite, non-negative percentage, e.g. 5%")
    if value < 0:
        raise ValueError(f"{flag}={text!r}: a regression threshold can't be negative")
    return value


def parse_seed(text, suite: str) -> int:
    """The random suite's seed: required, an integer."""
    if text in (None, ""):
        raise ValueError(f"--oink-suite={suite} draws its shapes from a seed: give --oink-seed=N (ini oink_seed)")
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"--oink-seed={text!r}: expected an integer") from None


def split_list(text) -> list[str] | None:
    if not text:
        return None
    return [t.strip() for t in str(text).split(",") if t.strip()]
