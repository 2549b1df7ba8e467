"""The module pytest loads (entry point ``pytest11``). Import-light: no torch at import time;
the benchmark machinery loads when a benchmark actually runs."""
from __future__ import annotations

import importlib.util
import os
import time

import pytest

from . import markers, modes, options, suites
from .state import CASES, ROWS, STATE


def pytest_addoption(parser):
    options.add_options(parser)


def pytest_configure(config):
    for line in markers.MARKERS:
        config.addinivalue_line("markers", line)
    config.stash[ROWS] = []
    config.stash[STATE] = {"written": [], "started": time.monotonic()}
    try:
        options.parse_percent(options.get(config, "--oink-max-regression"))
        modes.parse(options.get(config, "--oink-timing"))
        validate_names(config)
        config.stash[CASES] = selected_cases(config)
        if options.get(config, "--oink-against"):
            from . import against

            against.configure(config)
        baseline = options.get(config, "--oink-baseline")
        threshold = config.getoption("oink_max_regression")  # given on the command line (an ini's is a default)
        if threshold is not None and not baseline and not options.get(config, "--oink-against"):
            raise ValueError(f"--oink-max-regression={threshold}: the regression gate runs only against a baseline: "
                             "give --oink-baseline=FILE (or --oink-against=REF)")
        from .regression import stray_gate_providers

        stray = stray_gate_providers(config)  # a misspelt gate provider: said before any row runs
        if stray:
            raise ValueError(stray)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if baseline:  # read now: a bad file must not cost a whole benchmark run
        from .report import NotResults, load_baseline, load_baseline_machine

        try:
            config.stash[STATE]["baseline"] = load_baseline(baseline)
            config.stash[STATE]["baseline_machine"] = load_baseline_machine(baseline)
        except NotResults as e:
            raise pytest.UsageError(f"--oink-baseline={baseline}: {e}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise pytest.UsageError(f"--oink-baseline={baseline}: not a readable results file ({e})") from None
        from .machine import check_baseline
        from .regression import refusal

        check_baseline(config, baseline, config.stash[STATE]["baseline_machine"])
        reason = refusal(config)  # what would make the gate compare nothing, said before any row runs
        if reason:
            raise pytest.UsageError(f"--oink-baseline={baseline}: {reason}")
    given = [str(a).split("=")[0] for a in config.invocation_params.args]
    ignored = [a for a in given if a in BENCHMARK_TIMING_OPTIONS]
    if ignored and config.stash[CASES] is not None:
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"{', '.join(ignored)}: not applied to Oink's rows, which time themselves (CUDA-graph replays, "
            "median; host timer on a CPU) and hand pytest-benchmark the samples"), stacklevel=2)
    if options.get(config, "--oink-profile"):
        os.environ["OINK_KEEP_CUBIN"] = "1"  # before any kernel compiles: profiles read the cubin
        from oink import config as oink_config

        oink_config.reload()
    if options.get(config, "--oink-svg") and importlib.util.find_spec("matplotlib") is None:
        raise pytest.UsageError("--oink-svg needs matplotlib: pip install 'oink[plot]'")
    if importlib.util.find_spec("hypothesis") is not None:
        from .strategies import register_profiles

        register_profiles()
    if config.pluginmanager.hasplugin("benchmark"):  # not with -p no:benchmark: its hook specs are absent
        if config.stash[CASES] is not None and config.option.verbose <= 0:
            # a suite reports itself ([oink] lines, --oink-summary): pytest-benchmark's wide tables with -v only
            config.option.benchmark_quiet = True
        from . import benchmark_hooks

        config.pluginmanager.register(benchmark_hooks, "oink-benchmark-hooks")
    if config.pluginmanager.hasplugin("xdist"):
        from . import xdist_hooks

        config.pluginmanager.register(xdist_hooks, "oink-xdist-hooks")


def pytest_cmdline_main(config):
    """``--oink-merge`` and ``--oink-list`` answer and exit (no tests run)."""
    if options.get(config, "--oink-merge"):
        from .commands import merge

        return merge(config)
    if options.get(config, "--oink-list"):
        from .commands import listing

        print(listing())
        return 0
    return None


def pytest_runtest_setup(item):
    reason = markers.skip_reason(item)
    if reason:
        pytest.skip(reason)


DTYPES = ("bfloat16", "float16", "float32")
# pytest-benchmark's own timing knobs: Oink's rows are timed by pytest_oink.timing instead
BENCHMARK_TIMING_OPTIONS = ("--benchmark-min-rounds", "--benchmark-max-time", "--benchmark-min-time",
                            "--benchmark-warmup", "--benchmark-warmup-iterations", "--benchmark-calibration-precision",
                            "--benchmark-timer", "--benchmark-disable-gc")


def validate_names(config) -> None:
    """Dtype and provider names checked before collection: one usage error, not one per test."""
    from .providers import ALL_PROVIDERS

    dtype = options.get(config, "--oink-dtype")
    if dtype not in DTYPES:
        raise ValueError(f"--oink-dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    # --oink-gate-providers is not checked: oink_measure's rows name any provider (a user's kernel, "mine" by
    # default), and a gate whose providers match no row fails anyway, naming them
    unknown = [p for p in options.split_list(options.get(config, "--oink-providers")) or [] if p not in ALL_PROVIDERS]
    if unknown:
        raise ValueError(f"--oink-providers: unknown {unknown}; known: {', '.join(ALL_PROVIDERS)}")


def selected_cases(config):
    suite = options.get(config, "--oink-suite")
    if not suite:
        return None
    from .providers import providers_for

    seed = options.parse_seed(options.get(config, "--oink-seed"), suite) if suite in suites.SEEDED else None
    cases = suites.expand(suite, options.split_list(options.get(config, "--oink-ops")),
                          options.get(config, "--oink-configs"), options.get(config, "--oink-dtype"), seed)
    wanted = options.split_list(options.get(config, "--oink-providers"))
    pairs = [(c, p) for c in cases for p in providers_for(c.op, wanted)]
    if not pairs:
        raise ValueError(f"--oink-suite={suite}: no (op, provider) pair selected (providers {wanted} have none "
                         f"of the ops {sorted({c.op for c in cases})})")
    return pairs


class SuiteModule(pytest.Module):
    """pytest_oink/benchmarks.py as a test module wherever pytest runs: imported as the package's
    module (not by path: no sys.path entry for site-packages), its one test function collected
    whatever the project's ``python_functions`` say."""

    def _getobj(self):
        import importlib

        return importlib.import_module("pytest_oink.benchmarks")

    def istestfunction(self, obj, name):
        return name == "test_benchmark"

    def istestclass(self, obj, name):
        return False


SUITE_NODEID = "pytest_oink/benchmarks.py"  # the same in this repository and in an installed package


def suite_items(session) -> list:
    """The plugin's own benchmark items (pytest_oink/benchmarks.py), parametrized by
    pytest_generate_tests like any module's."""
    from pathlib import Path

    from . import benchmarks

    module = SuiteModule.from_parent(session, path=Path(benchmarks.__file__), nodeid=SUITE_NODEID)
    return list(session.genitems(module))


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: they apply to the suite's items too
def pytest_collection_modifyitems(session, config, items):
    """With a suite, the session is the benchmark and nothing else, wherever pytest is pointed. The
    benchmark items are the plugin's own (pytest_oink/benchmarks.py), unless the paths collected
    hold a test of their own that takes ``oink_case`` (then that one is the benchmark, run once)."""
    if config.stash.get(CASES, None) is None:
        return
    if not any("oink_case" in getattr(it, "fixturenames", ()) for it in items):
        items.extend(suite_items(session))
    keep = [it for it in items if "oink_case" in getattr(it, "fixturenames", ())]
    dropped = [it for it in items if "oink_case" not in getattr(it, "fixturenames", ())]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_finish(session):
    """How many of the suite's rows this session holds (after -k, -m): the progress line's count."""
    state = session.config.stash[STATE]
    state["row_items"] = sum("oink_case" in getattr(it, "fixturenames", ()) for it in session.items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and report.when in ("setup", "call") and "oink_case" in getattr(item, "fixturenames", ()):
        state = item.config.stash[STATE]
        state["skipped_rows"] = state.get("skipped_rows", 0) + 1
    return report


def pytest_report_header(config):
    suite = options.get(config, "--oink-suite")
    if suite in suites.ABOUT:
        seed = f" (seed {options.get(config, '--oink-seed')})" if suite in suites.SEEDED else ""
        return f"oink suite {suite}{seed}: {suites.ABOUT[suite][0]}; {suites.duration(suite)}"
    return None


def pytest_generate_tests(metafunc):
    if "oink_case" not in metafunc.fixturenames:
        return
    pairs = metafunc.config.stash[CASES]
    if pairs is None:
        metafunc.parametrize("oink_case", [pytest.param(None, marks=pytest.mark.skip(
            reason="benchmarks run only with --oink-suite=NAME"))], ids=["no-suite"])
        return
    ids = [f"{c.id}-{p}" for c, p in pairs]
    suite = options.get(metafunc.config, "--oink-suite")
    if (suites.ABOUT[suite][1] and markers.device_capability() is None
            and not options.get(metafunc.config, "--oink-run-on-cpu")):
        skip = pytest.mark.skip(reason=f"suite {suite!r} is sized for a GPU and there is none "
                                       "(--oink-suite=smoke runs on a CPU; --oink-run-on-cpu forces it)")
        pairs = [pytest.param(pair, marks=skip) for pair in pairs]
    metafunc.parametrize("oink_case", pairs, ids=ids)


@pytest.fixture(scope="session")
def oink_device(request):
    """The device benchmarks run on: this xdist worker's own GPU, or the CPU without one."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % torch.cuda.device_count() if worker.startswith("gw") else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@pytest.fixture(scope="session")
def oink_roofline(oink_device):
    """Measured copy and triad bandwidth of this device (session-scoped, STREAM-like)."""
    from .timing import measure_roofline

    return measure_roofline(oink_device)


@pytest.fixture
def oink_batch_invariance(oink_device):
    """``oink_batch_invariance(spec, fn, N, dtype="bfloat16", sizes=None, big=None)``: fails the test unless
    ``fn`` (the inputs' dict -> outputs, as for ``oink_measure``) gives every row-wise output bit for bit the
    same whatever the batch: rows alone, batches of ``sizes`` rows and slices mid-batch against one batch of
    ``big`` rows (``pytest_oink.invariance``: its SIZES and BIG by default); returns the verdict."""
    import torch

    from . import invariance

    def check(spec, fn, N: int, dtype: str = "bfloat16", sizes=None, big=None, name: str = "custom"):
        verdict = invariance.check(spec, fn, N, getattr(torch, dtype), oink_device, sizes=sizes or invariance.SIZES,
                                   big=big or invariance.BIG, op=name)
        if not verdict.held:
            pytest.fail(verdict.report(), pytrace=False)
        return verdict

    return check


@pytest.fixture
def oink_assert_close():
    """``oink_assert_close(actual, expected, family=..., dtype=...)``: the gate, with error stats."""
    from .gate import assert_close

    return assert_close


def _benchmark_fixture(request):
    """pytest-benchmark's fixture, or None where it is not loaded (-p no:benchmark): the rows are
    timed by pytest_oink either way, and --oink-csv/--oink-json written. Kept among the test's
    arguments, where pytest-benchmark looks for it: a row skipped (a GPU-only peer on a CPU) then
    draws no "fixture was not used" warning."""
    if not request.config.pluginmanager.hasplugin("benchmark"):
        return None
    fixture = request.getfixturevalue("benchmark")
    request.node.funcargs.setdefault("benchmark", fixture)
    return fixture


@pytest.fixture
def oink_benchmark(request, oink_device, oink_roofline):
    """Run one (case, provider): gate on 3 seeded inputs, then time, record and report."""
    from .bench_runner import run_case

    benchmark = _benchmark_fixture(request)

    def run(pair):
        case, provider = pair
        return _record(request.config, run_case(case, provider, oink_device, oink_roofline, benchmark, request))

    return run


@pytest.fixture
def oink_measure(request, oink_device, oink_roofline):
    """Your own kernel through the same machinery: ``oink_measure(spec, fn, M, N, dtype="bfloat16",
    name="my_op", provider="mine")`` gates ``fn`` against ``spec.reference`` on 3 seeded inputs from
    ``spec.make_inputs``, then times it (CUDA-graph replay on a GPU) and adds the row to every output
    (JSON, CSV, summary, SVG, regression gate). ``spec`` is a ``pytest_oink.OpSpec``; ``fn`` and the
    reference take the inputs' dict and return a tuple of outputs. One call per test (pytest-benchmark
    times one thing a test): parametrize the shapes."""
    from .bench_runner import run_case
    from .suites import Case

    benchmark = _benchmark_fixture(request)

    def measure(spec, fn, M: int, N: int, dtype: str = "bfloat16", name: str = "custom", provider: str = "mine"):
        row = run_case(Case("custom", name, M, N, dtype), provider, oink_device, oink_roofline, benchmark, request,
                       spec=spec, run=fn)
        return _record(request.config, row)

    return measure


def _record(config, row):
    """A finished row: kept for the reports, shown, appended to the running CSV; a failed gate fails the test."""
    config.stash[ROWS].append(row)
    _progress(config, row)
    partial = _partial_csv(config)
    if partial:  # rows as they complete: an interrupted run keeps what it measured
        from .report import write_csv

        write_csv([row], partial, append=True)
    if row.status != "ok":
        pytest.fail(f"{row.op} {row.M}x{row.N} {row.dtype} [{row.provider}] failed the correctness gate (not timed):\n"
                    f"{row.gate.get('report', '')}")
    return row


def _partial_csv(config) -> str | None:
    """Where rows go as they complete: ``--oink-csv`` + ``.partial`` (this process's; the full CSV
    is written at the end)."""
    path = options.get(config, "--oink-csv")
    if not path:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{path}.{worker}.partial" if worker else f"{path}.partial"


def _progress(config, row):
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    if row.status == "ok":
        frac = f", {row.roofline_frac:.2f} of roofline" if row.roofline_frac else ""
        tbs = f", {row.tbs:.3f} TB/s{frac}" if row.tbs else ""  # eager host time (launch suite): no bandwidth
        msg = f"{row.median_s * 1e3:.4f} ms{tbs} ({row.method}, {row.mode})"
    else:
        msg = "GATE FAILED (not timed)"
    # the suite's rows in this session less those skipped so far (a GPU-only peer on a CPU): the rows that run
    done = len(config.stash[ROWS])
    total = config.stash[STATE].get("row_items", 0) - config.stash[STATE].get("skipped_rows", 0)
    eta = (time.monotonic() - config.stash[STATE]["started"]) / done * max(total - done, 0)
    # an xdist worker runs a share of the rows it cannot count: no count there
    count = f"[{done}/{total} rows, ETA {eta:.0f} s] " if total and "PYTEST_XDIST_WORKER" not in os.environ else ""
    line = (f"[oink] {count}{row.op} {row.M}x{row.N} {row.dtype} {row.provider}"
            f"{' ' + row.label if row.label else ''}: {msg}")
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        tr.write_line(line)
        return
    with capman.global_and_fixture_disabled():  # the line shows while the session runs
        tr.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workerinput"):  # xdist worker: hand rows to the controller
        from .report import rows_json

        config.workeroutput["oink_rows"] = rows_json(config.stash[ROWS])
        config.workeroutput["oink_clock_note"] = config.stash[STATE].get("clock_note")
        if config.stash[STATE].get("against"):  # the other tree's rows are the controller's baseline
            from . import against

            config.workeroutput["oink_against"] = against.worker_output(config)
        return
    from . import machine, outputs, regression

    rows = config.stash[ROWS]
    no_rows, machines = regression.no_rows_note(config), machine.summary_line(config)
    notes = ([f"No rows measured: {no_rows}."] if no_rows else []) + ([machines + "."] if machines else [])
    if config.stash[STATE].get("against"):  # the worker ended, the exported tree removed
        from . import against

        notes += against.finish(config)
    if config.stash[STATE].get("clock_note"):  # NVML missing: the rows' clocks were not read (said once)
        notes.append(f"GPU {config.stash[STATE]['clock_note']}.")
    regression.judge(session)  # first: the summary holds the gate's verdicts
    outputs.write_outputs(config, rows, notes)
    if options.get(config, "--oink-history") and not config.option.collectonly:
        from . import history

        history.record(config, rows)


def pytest_unconfigure(config):
    state = config.stash.get(STATE, None)
    if state and state.get("against"):  # an interrupted session too: no worker or exported tree left behind
        state["against"].close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    state = config.stash.get(STATE, None)
    if not state:
        return
    from .regression import summarize
    from .report import time_by_provider

    summarize(terminalreporter, config)
    rows = config.stash[ROWS]
    if rows:
        timing = modes.describe({r.mode for r in rows}, {r.device for r in rows})
        terminalreporter.write_line(f"[oink] timing: {timing}")
        from .clocks import summary as clock_summary

        held = clock_summary(rows)
        if held:
            terminalreporter.write_line(f"[oink] clocks: {held}", yellow=any(r.throttled for r in rows))
    if state.get("clock_note"):
        terminalreporter.write_line(f"[oink] GPU {state['clock_note']}", yellow=True)
    spent = time_by_provider(config.stash[ROWS])
    if spent:
        terminalreporter.write_line(f"[oink] time by provider: {spent}")
    for path in state["written"]:
        terminalreporter.write_line(f"[oink] wrote {path}")
    if state.get("history_note"):
        terminalreporter.write_line(f"[oink] {state['history_note']}", yellow=True)
