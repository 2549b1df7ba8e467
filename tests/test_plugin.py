"""pytest_oink through pytester: options, markers and skip reasons, suite expansion, output
files, the regression gate and xdist; plus the timer and gate logic as plain units."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from pytest_oink import report, suites, timing
from pytest_oink.gate import assert_close, compare

# Load the plugin explicitly too: the subprocess may run where the package is not installed
# (its entry point has this same name, so an installed plugin is not registered twice).
PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")

BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''


def test_plugin_import_is_light_and_help_lists_options(pytester):
    out = subprocess.run([sys.executable, "-c", "import sys, pytest_oink.plugin; print('torch' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    res = pytester.runpytest_subprocess("--help", *PLUGIN)
    for flag in ("--oink-suite", "--oink-configs", "--oink-csv", "--oink-svg", "--oink-summary", "--oink-baseline",
                 "--oink-max-regression", "--oink-providers", "--oink-profile"):
        res.stdout.fnmatch_lines([f"*{flag}*"])


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


MARKED = '''
import pytest

@pytest.mark.gpu
def test_gpu(): pass

@pytest.mark.sm(90)
def test_sm90(): pass

@pytest.mark.sm(100, exact=True)
def test_sm100_exact(): pass

@pytest.mark.sm(90, exact=True)
def test_sm90_exact(): pass

@pytest.mark.peer("no_such_peer_pkg")
def test_peer_missing(): pass

@pytest.mark.peer("pytest")
def test_peer_present(): pass
'''


def test_markers_without_gpu(pytester, monkeypatch):
    monkeypatch.delenv("OINK_FAKE_SM", raising=False)
    pytester.makepyfile(MARKED)
    res = pytester.runpytest_subprocess("--strict-markers", "-rs", *PLUGIN,
                                        "--import-mode=importlib")
    if "needs a CUDA GPU" not in res.stdout.str():
        pytest.skip("this machine has a GPU")
    res.assert_outcomes(passed=1, skipped=5)
    res.stdout.fnmatch_lines(["*needs a CUDA GPU; none is available*",
                              "*peer 'no_such_peer_pkg' not installed*"])


def test_markers_with_fake_sm(pytester, monkeypatch):
    monkeypatch.setenv("OINK_FAKE_SM", "100")
    pytester.makepyfile(MARKED)
    res = pytester.runpytest_subprocess("--strict-markers", "-rs", *PLUGIN)
    res.assert_outcomes(passed=4, skipped=2)
    res.stdout.fnmatch_lines(["*needs exactly sm_9x; this GPU is sm_100*"])
    monkeypatch.setenv("OINK_FAKE_SM", "90")
    res = pytester.runpytest_subprocess("--strict-markers", "-rs", *PLUGIN)
    res.assert_outcomes(passed=4, skipped=2)
    res.stdout.fnmatch_lines(["*needs exactly sm_10x; this GPU is sm_90*"])


def test_benchmarks_do_not_run_without_a_suite(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-rs", *PLUGIN)
    res.assert_outcomes(skipped=1)
    res.stdout.fnmatch_lines(["*benchmarks run only with --oink-suite=NAME*"])


def test_suite_expansion_options(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--collect-only", "-q", "--oink-suite=dsv3", "--oink-ops=rmsnorm_forward",
                             "--oink-providers=oink,quack", *PLUGIN)
    ids = [line for line in res.stdout.lines if "::test_benchmark[" in line]
    assert len(ids) == 9 * 2
    assert any("rmsnorm_forward-65536x7168-bfloat16-quack" in i for i in ids)
    res = pytester.runpytest_subprocess("--collect-only", "-q", "--oink-suite=smoke", "--oink-configs=8x64,2x32",
                             "--oink-ops=softmax_forward", "--oink-providers=torch", "--oink-dtype=float16",
                             *PLUGIN)
    ids = [line for line in res.stdout.lines if "::test_benchmark[" in line]
    assert sorted(ids) == sorted(f"test_suite_expansion_options.py::test_benchmark[softmax_forward-{s}-float16-torch]"
                                 for s in ("8x64", "2x32"))


def test_bad_suite_is_a_usage_error(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=nope", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--oink-suite='nope'*known suites*"])


def test_suite_registry():
    assert len(suites.SUITES["quack"]("rmsnorm_forward")) == 7  # M = 2^13 .. 2^19
    assert all(M * N <= 2**31 for M, N in suites.SUITES["quack"]("x"))
    assert suites.SUITES["dsv3"]("cross_entropy_forward")[-1] == (65536, 12288)
    with pytest.raises(ValueError, match="not MxN"):
        suites.parse_configs("12,3x4")


@pytest.fixture
def smoke_run(pytester, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    pytester.makepyfile(BENCH)

    def run(*extra):
        return pytester.runpytest_subprocess(
            "--oink-suite=smoke", "--oink-ops=rmsnorm_forward,fused_add_rmsnorm_", *PLUGIN,
            f"--oink-csv={out / 'r.csv'}", f"--oink-summary={out / 's.md'}", f"--oink-svg={out / 'svg'}",
            f"--benchmark-json={out / 'b.json'}", *extra)

    return run, out


def test_smoke_suite_writes_every_output(smoke_run):
    run, out = smoke_run
    res = run("-rs")
    # 22 rows: oink, torch and torch.compile run each of the 4 (op, shape) cases; the GPU-only
    # peers skip (the run sees no GPU), each for its reason
    res.assert_outcomes(passed=12, skipped=10)
    for line in ("SKIPPED [[]4[]] *quack: GPU-only provider; no CUDA device",
                 "SKIPPED [[]2[]] *liger: GPU-only provider; no CUDA device",
                 "SKIPPED [[]4[]] *flashinfer: GPU-only provider; no CUDA device"):
        res.stdout.fnmatch_lines([line])
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*?oink? ?1/22 rows, ETA * s? rmsnorm_forward 4x128 bfloat16 oink*ms*TB/s*"])
    assert not list(out.glob("*.partial"))  # the running CSV is replaced by the session's
    data = json.loads((out / "b.json").read_text())
    assert data["machine_info"]["oink_versions"]["torch"]
    names = {b["name"] for b in data["benchmarks"]}
    assert "test_benchmark[rmsnorm_forward-64x1024-bfloat16-oink]" in names
    for b in data["benchmarks"]:
        info = b["extra_info"]
        assert b["group"] == f"{info['op']} {info['M']}x{info['N']} {info['dtype']}"
        assert {"op", "provider", "M", "N", "dtype", "bytes", "tbs", "roofline_frac", "gate"} <= info.keys()
        assert info["gate"]["passed"] and b["stats"]["median"] > 0 and b["stats"]["rounds"] >= 5
        assert abs(info["tbs"] - info["bytes"] / b["stats"]["median"] / 1e12) < 1e-9 * max(1, info["tbs"])
    with open(out / "r.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0].keys()) == report.CSV_FIELDS and len(rows) == len(data["benchmarks"])
    assert all(r["status"] == "ok" for r in rows)
    md = (out / "s.md").read_text()
    assert "## rmsnorm_forward: reference timings on a CPU" in md and "| M | N | dtype | oink ms |" in md
    assert report.CPU_ROWS in md and "Geomean speedup of oink" not in md and "best peer" not in md  # no kernel ran
    svgs = sorted((out / "svg").iterdir())
    assert [p.name for p in svgs] == ["smoke-fused_add_rmsnorm_.svg", "smoke-rmsnorm_forward.svg"]
    for p in svgs:
        assert ET.parse(p).getroot().tag.endswith("svg")


def _doctored(data, path, factor, keep=None):
    """``data`` (pytest-benchmark JSON) with every median and sample times ``factor`` (rows whose
    name passes ``keep`` only), written to ``path``."""
    d = json.loads(json.dumps(data))
    d["benchmarks"] = [b for b in d["benchmarks"] if keep is None or keep(b["name"])]
    for b in d["benchmarks"]:
        b["stats"]["median"] *= factor
        b["extra_info"]["samples"] = [x * factor for x in b["extra_info"]["samples"]]
    path.write_text(json.dumps(d))
    return path


def test_regression_gate(smoke_run, tmp_path):
    run, out = smoke_run
    gate = ("--oink-providers=oink", "--oink-gate-cpu")  # smoke rows are CPU-timed: gated only when asked
    assert run(*gate).ret == 0
    data = json.loads((out / "b.json").read_text())
    fast, slow = _doctored(data, tmp_path / "fast.json", 1e-6), _doctored(data, tmp_path / "slow.json", 1e6)
    res = run(*gate, f"--oink-baseline={fast}", "--oink-max-regression=5%")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*oink regression gate*", "*: SLOWER, x*",
                              "*SLOWER beyond 5% (fails the session): *rmsnorm_forward 4x128 bfloat16 oink: SLOWER*"])
    assert "4 regressed" in res.stdout.lines[-1]  # pytest's final line counts them
    summary = (out / "s.md").read_text()  # the summary holds the gate's verdicts, row by row
    assert f"## Regression gate\n\nBaseline: {fast}. Threshold 5%; 4 rows compared: 4 SLOWER." in summary
    assert "| rmsnorm_forward 4x128 bfloat16 oink | SLOWER" in summary  # a CPU verdict says its floor after it
    assert "Geomean ratio per op: fused_add_rmsnorm_ oink " in summary
    res = run(*gate, f"--oink-baseline={slow}")
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*: FASTER, x*"])
    assert "4 rows compared: 4 FASTER." in (out / "s.md").read_text()
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"rows": [{"op": "rmsnorm_forward", "provider": "oink", "M": 4, "N": 128,
                                          "dtype": "bfloat16", "median_s": 1e-12}]}))
    assert run(*gate, f"--oink-baseline={ours}").ret == pytest.ExitCode.TESTS_FAILED


def test_regression_gate_refuses_to_compare_nothing(smoke_run, tmp_path):
    run, out = smoke_run
    gate = ("--oink-providers=oink", "--oink-gate-cpu")
    assert run(*gate).ret == 0
    data = json.loads((out / "b.json").read_text())
    # a baseline of other rows (here: only the fused op's) leaves the forward's rows uncompared; its
    # times are scaled up so CPU noise can't make a compared row regress
    part = _doctored(data, tmp_path / "part.json", 1e6, keep=lambda n: "fused_add" in n)
    res = run(*gate, f"--oink-baseline={part}")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*not compared (no baseline entry): *rmsnorm_forward-4x128-bfloat16-oink*"])
    assert "2 not compared" in res.stdout.lines[-1]
    assert "Not compared (no baseline entry): " in (out / "s.md").read_text()
    assert run(*gate, f"--oink-baseline={part}", "--oink-allow-missing").ret == 0
    # CPU rows without --oink-gate-cpu: nothing could be compared, refused before any row runs, saying why
    res = run("--oink-providers=oink", f"--oink-baseline={part}")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*the gate would compare nothing: there is no GPU here, and CPU rows are gated only "
                              "with --oink-gate-cpu*"])
    # a baseline of these rows timed in another mode: found out once timed; the summary says why too
    hot = json.loads(_doctored(data, tmp_path / "every.json", 1e6).read_text())
    for b in hot["benchmarks"]:
        b["extra_info"]["mode"] = "hot"
    (tmp_path / "hot.json").write_text(json.dumps(hot))
    res = run(*gate, f"--oink-baseline={tmp_path / 'hot.json'}")
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["*the regression gate compared nothing: the baseline's rows of these shapes are of "
                              "another suite, timing or --oink-timing mode*"])
    assert "0 rows compared. " in (out / "s.md").read_text()
    assert "The regression gate compared nothing: the baseline's rows of these" in (out / "s.md").read_text()
    # another provider's rows are gated when asked (the torch rows have no baseline entry here: said up front)
    res = run("--oink-providers=oink,torch", "--oink-gate-cpu", "--oink-gate-providers=torch",
              f"--oink-baseline={_doctored(data, tmp_path / 'all.json', 1e6)}")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*the gate would compare nothing: none of the 4 gated rows selected*"])


@pytest.mark.parametrize("args,message", [
    (("--oink-max-regression=5",), "*--oink-max-regression='5': expected a percentage with its unit*"),
    (("--oink-max-regression=-5%",), "*can't be negative*"),
    (("--oink-baseline=/nonexistent/base.json",), "*--oink-baseline=/nonexistent/base.json: not a readable*"),
    (("--oink-providers=nope",), "*--oink-providers: unknown *nope*known: oink*"),
    (("--oink-dtype=nope",), "*--oink-dtype='nope': expected one of bfloat16, float16, float32*"),
    (("--oink-providers=quack", "--oink-ops=mxfp4_quantize"), "*no (op, provider) pair selected*"),
])
def test_bad_options_are_usage_errors_before_any_test(pytester, args, message):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", *args, *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([message])


def test_baseline_that_is_not_json_is_a_usage_error(pytester, tmp_path):
    bad = tmp_path / "b.json"
    bad.write_text("not json")
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", f"--oink-baseline={bad}", *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines(["*--oink-baseline=*b.json: this is not JSON; a baseline is the JSON a run writes with "
                              "--oink-json=PATH or --benchmark-json=PATH*"])


def test_suite_runs_the_benchmarks_and_nothing_else(pytester):
    pytester.makepyfile(test_bench=BENCH, test_unit="def test_unit():\n    assert False\n")
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch",
                                        *PLUGIN)
    res.assert_outcomes(passed=2, deselected=1)
    res = pytester.runpytest_subprocess(*PLUGIN)  # no suite: the unit tests run, the benchmark skips
    res.assert_outcomes(failed=1, skipped=1)


def test_without_pytest_benchmark_plugin(pytester):
    pytester.makepyfile("def test_unit():\n    assert True\n")
    res = pytester.runpytest_subprocess("-p", "no:benchmark", *PLUGIN)
    assert res.ret == 0, res.stdout.str() + res.stderr.str()
    res.assert_outcomes(passed=1)


def test_failed_gate_marks_the_row_and_skips_timing(pytester, tmp_path):
    pytester.makeconftest('''
import pytest
from pytest_oink import providers

@providers.provider("softmax_forward", "broken")
def _broken(device):
    return lambda a: (a["x"] * 0 + 1,)

providers.ALL_PROVIDERS = providers.ALL_PROVIDERS + ("broken",)
''')
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=broken",
                             f"--oink-csv={tmp_path / 'r.csv'}", *PLUGIN)
    res.assert_outcomes(failed=2)
    res.stdout.fnmatch_lines(["*failed the correctness gate (not timed)*", "*max abs err*rel L2 err*p99 abs err*",
                              "*first mismatch at index*"])
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [r["status"] for r in rows] == ["failed", "failed"] and rows[0]["median_ms"] == ""


def test_xdist_workers_report_rows(pytester, tmp_path):
    pytest.importorskip("xdist")
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-n", "2", "--oink-suite=smoke", "--oink-ops=softmax_forward",
                                        "--oink-providers=oink,torch", f"--oink-csv={tmp_path / 'r.csv'}",
                                        f"--benchmark-json={tmp_path / 'b.json'}", *PLUGIN)
    res.assert_outcomes(passed=4)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert sorted((r["provider"], r["M"]) for r in rows) == [("oink", "4"), ("oink", "64"), ("torch", "4"),
                                                               ("torch", "64")]
    # pytest-benchmark is off under xdist: the controller writes its layout from the merged rows
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["benchmarks"]) == 4 and data["machine_info"]["oink_versions"]["torch"]
    assert all(b["stats"]["median"] > 0 for b in data["benchmarks"])
    assert report.load_baseline(tmp_path / "b.json")  # the regression gate reads it


# ---- units: timer logic with a fake clock, the gate's stats
class FakeClock:
    def __init__(self, steps):
        self.t, self.steps = 0.0, iter(steps)

    def __call__(self):
        self.t += next(self.steps, 0.0)
        return self.t


def test_time_host_with_fake_clock():
    calls = []
    clock = FakeClock([0.0, 2.0] * 3)
    rot = timing.Rotation(["a", "b"])
    samples = timing.time_host(calls.append, rot, repeats=3, warmup=1, clock=clock)
    assert samples == [2.0, 2.0, 2.0]
    assert calls == ["a", "b", "a", "b"]  # warm-up then the rotation continues


def test_median_and_cold_cache_copies():
    assert timing.median([3, 1, 2]) == 2 and timing.median([4, 1, 2, 3]) == 2.5
    with pytest.raises(ValueError):
        timing.median([])
    assert timing.copies_for_cold_cache(10 * 2**20, 50 * 2**20) == 15
    assert timing.copies_for_cold_cache(2**30, 50 * 2**20) == 1
    assert timing.copies_for_cold_cache(1, 50 * 2**20) == 64


def test_virtual_clock_feeds_pytest_benchmark_stats(pytester):
    pytester.makepyfile('''
from pytest_oink.timing import feed_benchmark

def test_feed(benchmark):
    feed_benchmark(benchmark, [3e-6, 1e-6, 2e-6, 5e-6, 4e-6])
    s = benchmark.stats.stats
    assert s.rounds == 5
    assert abs(s.median - 3e-6) < 1e-12 and abs(s.min - 1e-6) < 1e-12 and abs(s.max - 5e-6) < 1e-12
''')
    pytester.runpytest_subprocess(*PLUGIN).assert_outcomes(passed=1)


def test_gate_stats_and_report():
    import torch

    e = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = e.clone()
    a[1, 2] += 0.5
    st = compare(a, e, atol=1e-3, rtol=0)
    assert not st.passed and st.first_mismatch == (1, 2) and st.max_abs == 0.5 and st.mismatches == 1
    assert "max abs err 0.5" in st.report()
    a[0, 0] = float("nan")
    st = compare(a, e, atol=1.0, rtol=0)
    assert st.nonfinite_mismatches == 1 and not st.passed and "NaN/Inf mismatches: 1" in st.report()
    nan = torch.full((2,), float("nan"))
    assert not compare(nan, nan.clone(), 1.0, 1.0).passed  # NaN never passes
    inf = torch.tensor([float("inf")])
    assert compare(inf, inf.clone(), 0, 0).passed
    with pytest.raises(AssertionError, match="outside atol"):
        assert_close(e + 1, e, family="softmax", dtype=torch.float32)
    assert assert_close(e, e.clone()).passed


def test_profile_option_is_recorded(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=rmsnorm_forward", "--oink-providers=oink",
                                        "--oink-profile", f"--benchmark-json={tmp_path / 'b.json'}",
                                        f"--oink-summary={tmp_path / 's.md'}", *PLUGIN)
    assert res.ret == 0
    for b in json.loads((tmp_path / "b.json").read_text())["benchmarks"]:
        prof = b["extra_info"]["profile"]
        assert "registers" in prof or prof.get("error")
    assert "Kernel profile (oink)" in (tmp_path / "s.md").read_text()


def test_crashing_provider_is_a_failed_row(pytester, tmp_path):
    pytester.makeconftest('''
from pytest_oink import providers

@providers.provider("softmax_forward", "crashes")
def _crashes(device):
    def run(a):
        raise RuntimeError("boom")
    return run

providers.ALL_PROVIDERS = providers.ALL_PROVIDERS + ("crashes",)
''')
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=crashes",
                                        f"--oink-csv={tmp_path / 'r.csv'}", *PLUGIN)
    res.assert_outcomes(failed=2)
    res.stdout.fnmatch_lines(["*raised RuntimeError: boom*"])
    assert [r["status"] for r in csv.DictReader(open(tmp_path / "r.csv"))] == ["failed", "failed"]


def test_pytest_benchmark_compare_fail_works_on_our_numbers(pytester, tmp_path, monkeypatch):
    """Our samples are what pytest-benchmark stores, so its own --benchmark-compare-fail gates on
    them: a 2x slower median (deterministic samples) fails a 5% threshold; equal ones pass."""
    pytester.makepyfile('''
import os
from pytest_oink.timing import feed_benchmark

def test_kernel(benchmark):
    scale = float(os.environ["SCALE"])
    feed_benchmark(benchmark, [s * scale for s in (1e-5, 1.1e-5, 0.9e-5, 1e-5, 1.05e-5)])
''')
    store = f"--benchmark-storage=file://{tmp_path}"
    common = (store, "--benchmark-compare", "--benchmark-compare-fail=median:5%", *PLUGIN)
    monkeypatch.setenv("SCALE", "1")
    assert pytester.runpytest_subprocess(store, "--benchmark-autosave", *PLUGIN).ret == 0
    assert pytester.runpytest_subprocess(*common).ret == 0
    monkeypatch.setenv("SCALE", "2")
    res = pytester.runpytest_subprocess(*common)
    assert res.ret != 0
    assert "Performance has regressed" in res.stdout.str() + res.stderr.str()


def test_fp4_gate_view_counts_rounding_steps():
    """The fused FP4 gate compares codes as signed E2M1 indices and scales as numbers: one
    rounding step passes, two fail, and -0 (code 0x8) equals +0."""
    import torch

    from oink.measure.gate import _fp4_code_steps
    from pytest_oink.tolerances import tolerance

    q = torch.tensor([[0x21, 0x08]], dtype=torch.uint8)  # codes 1, 2, 8 (-0), 0
    sf = torch.tensor([[100]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes, scales = _fp4_code_steps((q, sf))
    assert codes.tolist() == [[1.0, 2.0, -0.0, 0.0]] and scales.tolist() == [[100.0]]
    atol, rtol = tolerance("nvfp4_code_step", codes.dtype)
    one_step = _fp4_code_steps((torch.tensor([[0x32, 0x00]], dtype=torch.uint8), sf))[0]
    two_steps = _fp4_code_steps((torch.tensor([[0x43, 0x00]], dtype=torch.uint8), sf))[0]
    assert compare(one_step, codes, atol, rtol).passed
    assert not compare(two_steps, codes, atol, rtol).passed


def test_mx_fused_gate_view_survives_a_scale_step():
    """The fused MXFP4 gate: a block whose power-of-two scale moved up one (every code halves)
    passes, codes shuffled inside a block fail, and the scale bytes must stay within one."""
    import torch

    from oink.measure.gate import _mx_block_ratios
    from pytest_oink.providers import MX_FUSED_GATE
    from pytest_oink.tolerances import tolerance

    def block(codes, scale):  # 32 codes -> (q [1, 16], sf [1, 1] e8m0)
        c = torch.tensor(codes, dtype=torch.uint8)
        return (c[0::2] | (c[1::2] << 4)).unsqueeze(0), torch.tensor([[scale]], dtype=torch.uint8).view(
            torch.float8_e8m0fnu)

    ref_codes = [7, 6, 5, 4, 3, 2, 1, 0] * 4  # 6, 4, 3, 2, 1.5, 1, 0.5, 0 at scale 2^0
    halved = [6, 4, 3, 2, 1, 1, 0, 0] * 4  # the same values at scale 2^1: 4, 2, 1.5, 1, 0.5, 0.5, 0, 0
    shuffled = [0, 1, 2, 3, 4, 5, 6, 7] * 4
    ref = _mx_block_ratios(block(ref_codes, 127))
    tol = [tolerance(f, torch.float32) for f in MX_FUSED_GATE]
    ok = lambda view: all(compare(a, b, *t).passed for a, b, t in zip(view, ref, tol))  # noqa: E731  (a closure over this scope)
    assert ok(_mx_block_ratios(block(halved, 128)))
    assert not ok(_mx_block_ratios(block(shuffled, 127)))
    assert not ok(_mx_block_ratios(block(ref_codes, 129)))


def test_nvfp4_suite_shapes():
    mx_ops = ["mxfp4_quantize", "add_rmsnorm_mxfp4quant", "silu_mul_mxfp4quant"]
    cases = suites.expand("nvfp4", ["add_rmsnorm_fp4quant", *mx_ops])
    shapes = {(c.M, c.N) for c in cases}
    assert {(128, 2048), (128, 14336), (2048, 7168), (65536, 14336)} <= shapes
    assert all(c.N % 32 == 0 for c in cases if c.op in mx_ops)
    assert {c.op for c in cases} == {"add_rmsnorm_fp4quant", *mx_ops}


def test_peer_compile_failure_is_a_skip(pytester):
    # torch.compile that cannot compile (Inductor on CPU has no float8_e8m0fnu type) is an
    # unavailable provider, skipped with its reason, not a failed correctness gate
    pytester.makeconftest('''
from pytest_oink import providers

@providers.provider("softmax_forward", "nocompile")
def _nocompile(device):
    def run(a):
        from torch._inductor.exc import InductorError
        raise InductorError(AssertionError("no C++ type for this dtype"), None)
    return run

providers.ALL_PROVIDERS = providers.ALL_PROVIDERS + ("nocompile",)
''')
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-rs", "--oink-suite=smoke", "--oink-ops=softmax_forward",
                                        "--oink-providers=nocompile", *PLUGIN)
    res.assert_outcomes(skipped=2)
    res.stdout.fnmatch_lines(["*nocompile: torch.compile could not compile it here: InductorError*no C++ type*"])


def test_whole_smoke_suite_passes_with_every_output(pytester, tmp_path):
    # the README's command for a CPU machine: every op, every provider available here
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", f"--benchmark-json={tmp_path / 'out.json'}",
                                        f"--oink-csv={tmp_path / 'r.csv'}", f"--oink-summary={tmp_path / 's.md'}",
                                        *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-3000:]
    outcomes = res.parseoutcomes()
    smoke_ops = {c.op for c in suites.expand("smoke")}
    assert outcomes["passed"] >= len(smoke_ops) * 2 * 2  # oink and torch at least, 2 shapes each
    assert len(json.loads((tmp_path / "out.json").read_text())["benchmarks"]) == outcomes["passed"]


def test_csv_rows_append_as_they_complete(tmp_path):
    row = report.Row(suite="smoke", op="softmax_forward", provider="torch", M=4, N=128, dtype="bfloat16",
                     device="cpu", status="ok", median_s=1e-5, bytes=2048)
    path = tmp_path / "r.csv.partial"
    report.write_csv([row], path, append=True)
    report.write_csv([row], path, append=True)
    rows = list(csv.DictReader(open(path)))
    assert len(rows) == 2 and rows[1]["op"] == "softmax_forward"  # one header, two rows


def test_list_and_gpu_sized_suites_on_cpu(pytester, monkeypatch):
    res = pytester.runpytest_subprocess("--oink-list", *PLUGIN)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["suites (--oink-suite):", "*dsv3*(GPU); 135 op x shape cases; measured 219 s*",
                              "*sweep*; measured 7.5 min on one H100 for its 12*", "*smoke*",
                              "*rmsnorm_forward_gemma*oink, quack*",
                              "providers (--oink-providers, --oink-gate-providers): oink, *"])
    monkeypatch.delenv("OINK_FAKE_SM", raising=False)
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-rs", "--oink-suite=dsv3", "--oink-ops=softmax_forward",
                                        "--oink-providers=torch", *PLUGIN)
    res.assert_outcomes(skipped=9)
    res.stdout.fnmatch_lines(["oink suite dsv3: DeepSeek-V3 widths*; measured 219 s on one H100*",
                              "*suite 'dsv3' is sized for a GPU and there is none*"])


OWN = '''
import torch
from pytest_oink import OpSpec

SPEC = OpSpec(family="softmax", nbytes=lambda M, N, e: 2 * M * N * e,
              make_inputs=lambda M, N, dtype, device, gen: {"x": torch.randn(M, N, generator=gen).to(dtype)},
              reference=lambda a: (torch.softmax(a["x"].float(), -1).to(a["x"].dtype),))

def test_right(oink_measure):
    oink_measure(SPEC, lambda a: (torch.softmax(a["x"], -1),), 8, 64, name="my_softmax")

def test_wrong(oink_measure):
    oink_measure(SPEC, lambda a: (torch.softmax(a["x"], 0),), 8, 64, name="my_softmax", provider="buggy")
'''


def test_own_kernel_is_gated_timed_and_reported(pytester, tmp_path):
    pytester.makepyfile(OWN)
    res = pytester.runpytest_subprocess(f"--oink-csv={tmp_path / 'r.csv'}", *PLUGIN)
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*my_softmax 8x64 bfloat16 [[]buggy[]] failed the correctness gate*"])
    rows = {r["provider"]: r for r in csv.DictReader(open(tmp_path / "r.csv"))}
    assert rows["mine"]["status"] == "ok" and float(rows["mine"]["median_ms"]) > 0
    assert rows["buggy"]["status"] == "failed" and rows["buggy"]["median_ms"] == ""


def test_benchmark_timing_options_say_they_do_not_apply(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch",
                                        "--benchmark-min-rounds=50", *PLUGIN)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*--benchmark-min-rounds: not applied to Oink's rows*"])


def test_merge_result_files_of_several_runs(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    for ops in ("softmax_forward", "rmsnorm_forward"):  # two "runners", one op each
        res = pytester.runpytest_subprocess("--oink-suite=smoke", f"--oink-ops={ops}", "--oink-providers=oink,torch",
                                            f"--oink-csv={tmp_path / (ops + '.csv')}", *PLUGIN)
        assert res.ret == 0
    files = f"{tmp_path / 'softmax_forward.csv'},{tmp_path / 'rmsnorm_forward.csv'}"
    res = pytester.runpytest_subprocess(f"--oink-merge={files}", f"--oink-csv={tmp_path / 'all.csv'}",
                                        f"--oink-summary={tmp_path / 'all.md'}", *PLUGIN)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*merged 8 rows from 2 files*"])
    rows = list(csv.DictReader(open(tmp_path / "all.csv")))
    assert sorted({r["op"] for r in rows}) == ["rmsnorm_forward", "softmax_forward"] and len(rows) == 8
    back = report.read_csv(tmp_path / "all.csv")
    assert all(r.median_s > 0 and r.roofline_tbs for r in back)
    md = (tmp_path / "all.md").read_text()
    assert "## rmsnorm_forward" in md and "## softmax_forward" in md and report.CPU_ROWS in md and "Device: cpu." in md
    res = pytester.runpytest_subprocess(f"--oink-merge={tmp_path / 'missing.csv'}", f"--oink-csv={tmp_path / 'x.csv'}",
                                        *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR


def test_gate_noise_floor():
    """A change inside 3 spreads of either run's samples is noise; beyond it and the threshold, a regression."""
    def row(median, spread):
        return report.Row(suite="s", op="rmsnorm_forward", provider="oink", M=4, N=128, dtype="bfloat16",
                          device="cuda:0", status="ok", median_s=median, spread=spread)

    base = {("rmsnorm_forward", "oink", 4, 128, "bfloat16"): [report.BaselineEntry(1.0, 0.02)]}
    lines, bad, *_ = report.regressions([row(1.2, 0.10)], base, 0.05)  # floor 30%: +20% is noise
    assert not bad and "noise floor 30.0%" in lines[0] and ": SAME, x1.20 (spread rule" in lines[0]
    lines, bad, *_ = report.regressions([row(1.5, 0.10)], base, 0.05)
    assert bad and ": SLOWER, x1.50" in lines[0]
    lines, bad, *_ = report.regressions([row(1.1, None)], base, 0.05)  # the baseline's own 2% spread: floor 6%
    assert bad and "noise floor 6.0%" in lines[0]
    lines, bad, *_ = report.regressions([row(1.1, 0.001)], {k: [report.BaselineEntry(1.0)] for k in base}, 0.05)
    assert bad and "noise floor" not in lines[0]  # below the threshold, the floor is not mentioned
    assert timing.relative_spread([1.0, 1.0, 1.0]) == 0.0
    assert abs(timing.relative_spread([1.0, 1.1, 0.9, 1.0, 1.0]) - 0.0) < 1e-12  # MAD ignores the two outliers
    assert abs(timing.relative_spread([1.0, 1.1, 0.9]) - 1.4826 * 0.1) < 1e-9


def test_best_peer_table_counts_what_the_shape_targets_ask():
    """Oink over the fastest peer per shape (the eager reference is no peer), the worst shape, the
    shapes over 1.05, the shapes no peer ran, and big shapes under 0.92 of the copy ceiling."""
    from pytest_oink.report import Row, best_peer_table

    def row(provider, M, ms, nbytes=0):
        return Row("sweep", "rmsnorm_forward", provider, M, 4096, "bfloat16", "H100", "ok", median_s=ms / 1e3,
                   bytes=nbytes, roofline_tbs=3e0)

    rows = [row("oink", 4096, 0.1, 2**28), row("quack", 4096, 0.12), row("torch", 4096, 0.05),
            row("oink", 1, 0.01), row("liger", 1, 0.009), row("quack", 1, 0.02), row("oink", 8, 0.01)]
    lines = best_peer_table(rows)
    assert lines[0] == "## Oink against the best peer"
    assert lines[-2] == ("| rmsnorm_forward | 2 | 0.962 | 1.111 (1x4096 vs liger) | 1 | 1 | 1 | 4096x4096 0.89 |")
    assert best_peer_table([row("quack", 1, 0.01)]) == []


def test_time_by_provider_sums_each_providers_rows():
    from pytest_oink.report import Row, time_by_provider

    rows = [Row("s", "op", p, 1, 8, "bfloat16", "cpu", "ok", wall_s=w, gate_s=g)
            for p, w, g in (("oink", 2.0, 1.0), ("torch.compile", 5.0, 4.0), ("oink", 1.0, 0.5))]
    assert time_by_provider(rows) == ("torch.compile 5 s (1 rows; gate and first calls 4 s); "
                                      "oink 3 s (2 rows; gate and first calls 2 s)")
    assert time_by_provider([]) == ""


def test_torch_compile_provider_marks_rows_dynamic_not_parameters():
    """One compile serves every M: the rows dimension of each activation is marked dynamic before
    the first call, never a weight's (whose first dim is N, equal to M at 4096 x 4096)."""
    import torch

    from pytest_oink.registry import compiled

    seen = []
    orig = torch.compile
    try:
        torch.compile = lambda fn: (lambda a: seen.append({k: getattr(v, "_dynamo_weak_dynamic_indices", None)
                                                            for k, v in a.items()}))
        run = compiled(lambda a: None)
    finally:
        torch.compile = orig
    run({"x": torch.randn(8, 8), "weight": torch.randn(8), "target": torch.zeros(8, dtype=torch.long), "eps": 1e-6})
    assert seen == [{"x": {0}, "weight": None, "target": {0}, "eps": None}]


def test_eager_reference_cap_rule():
    from pytest_oink.bench_runner import EAGER_CAP, cap_applies

    assert cap_applies("torch", 11e-3, 1e-3) and EAGER_CAP == 10.0
    assert not cap_applies("torch", 9e-3, 1e-3)  # within 10x: timed in full
    assert not cap_applies("torch", 1.0, None)  # nothing to compare with yet
    assert not cap_applies("torch.compile", 1.0, 1e-3) and not cap_applies("quack", 1.0, 1e-3)


def test_launch_suite_times_eager_calls(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=launch", "--oink-ops=softmax_forward,fp8_quantize,vllm_rmsnorm",
                                        "--oink-providers=oink,torch", f"--oink-csv={tmp_path / 'r.csv'}", *PLUGIN)
    res.assert_outcomes(passed=12)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    ops = ("softmax_forward", "fp8_quantize", "vllm_rmsnorm")
    assert {(r["op"], r["M"], r["N"]) for r in rows} == {(op, M, "4096") for op in ops for M in ("1", "128")}
    assert all(r["method"] == "eager-calls" and float(r["median_ms"]) > 0 and r["bytes"] == "0" for r in rows)


def test_baseline_machine_differences_are_reported(smoke_run, tmp_path):
    assert report.machine_differences({"gpu": {"name": "NVIDIA H100"}, "oink_versions": {"torch": "2.11", "x": "1"}},
                                      {"gpu": {"name": "NVIDIA H200"}, "oink_versions": {"torch": "2.13"}}) == [
        "GPU NVIDIA H100 -> NVIDIA H200", "torch 2.11 -> 2.13"]
    assert report.machine_differences({}, {"gpu": None}) == []
    run, out = smoke_run
    assert run("--oink-providers=oink").ret == 0  # writes b.json
    data = json.loads((out / "b.json").read_text())
    data["machine_info"]["oink_versions"]["torch"] = "0.0.1"
    data["machine_info"]["gpu"] = {"name": "NVIDIA H100 80GB HBM3"}
    data["machine_info"]["oink_versions"]["oink"] = "0.0.2"  # Oink's own version: reported, never refused
    other = _doctored(data, tmp_path / "other.json", 1e6)
    gate = ("--oink-providers=oink", "--oink-gate-cpu", f"--oink-baseline={other}")
    assert run(*gate).ret == pytest.ExitCode.USAGE_ERROR  # another GPU and torch: refused
    res = run(*gate, "--oink-accept-machine")
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*accepted (--oink-accept-machine): GPU NVIDIA H100 80GB HBM3 -> no GPU; torch 0.0.1*",
                              "*baseline measured with other versions (timings may not compare): oink 0.0.2 -> *"])


def test_device_specific_label_only_on_its_device():
    # the out-of-place torch.compile of the in-place fused add is a CPU workaround: only CPU rows say so
    import torch

    from pytest_oink.providers import LABELS, build

    run = build("fused_add_rmsnorm_", "torch.compile", torch.device("cpu"))
    assert run.label.startswith("on CPU")
    assert ("fused_add_rmsnorm_", "torch.compile") not in LABELS  # a GPU row gets no such label


def test_gate_compares_each_spec_with_its_own_reference():
    # the gate keeps a case's reference outputs for the next provider: never for another spec
    import torch

    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import OpSpec
    from pytest_oink.suites import Case

    def inputs(M, N, dtype, device, gen):
        return {"x": torch.randn(M, N, generator=gen, dtype=dtype, device=device)}

    twice = OpSpec("softmax", inputs, lambda a: (a["x"] * 2,), lambda M, N, e: 2 * M * N * e)
    thrice = OpSpec("softmax", inputs, lambda a: (a["x"] * 3,), lambda M, N, e: 2 * M * N * e)
    run = lambda a: (a["x"] * 3,)  # noqa: E731  (a closure over this scope)
    case, cpu = Case("t", "my_op", 4, 64, "float32"), torch.device("cpu")
    assert not gate(twice, run, case, torch.float32, cpu)["passed"]
    assert gate(thrice, run, case, torch.float32, cpu)["passed"]
    assert not gate(twice, run, case, torch.float32, cpu)["passed"]


def test_a_row_whose_capture_failed_is_not_captured_again(monkeypatch):
    """Once a (op, provider)'s CUDA-graph capture fails (a host read in the call), its later rows are timed by
    events without another capture: a failed capture can keep its memory pool to the end of the process."""
    import types

    import torch

    from pytest_oink import bench_runner, timing
    from pytest_oink.report import Row
    from pytest_oink.suites import Case

    tried = []

    def fake_graph_timer(run, rot, budget_s=None, capture=True):
        tried.append((run, capture))
        captured = capture and run == "capturable"
        return timing.GraphTiming([1e-3], "cuda-graph" if captured else "cuda-events", 1)

    monkeypatch.setattr(bench_runner, "time_cuda_graph", fake_graph_timer)
    monkeypatch.setattr(bench_runner, "_inputs", lambda *a: {})
    monkeypatch.setattr(bench_runner, "UNCAPTURED", set())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=2**25))
    device = torch.device("cuda", 0)

    def time(provider, run, M):
        case = Case("training", "linear_cross_entropy_llama3", M, 128256, "bfloat16")
        row = Row("training", case.op, provider, M, case.N, case.dtype, "GPU", "ok")
        samples, time_once = bench_runner.row_timer(case, run, None, torch.bfloat16, device, row)
        return row.method, time_once

    assert time("liger", "syncs", 4096)[0] == "cuda-events"
    method, again = time("liger", "syncs", 16384)
    again()  # a re-timing round of the same row
    assert method == "cuda-events"
    assert time("oink", "capturable", 4096)[0] == "cuda-graph"
    assert time("oink", "capturable", 16384)[0] == "cuda-graph"
    assert tried == [("syncs", True), ("syncs", False), ("syncs", False), ("capturable", True), ("capturable", True)]
