"""The training suite (linear cross-entropy per model) and the peak-memory column, on the CPU: the
suite's cases, its gate (scale-free gradients: right answers pass, wrong ones fail), out-of-memory
as a refusal, and the column in the CSV, JSON, summary and plots (n/a on a CPU, never 0)."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from pytest_oink import bench_runner, plots, report, suites
from pytest_oink.providers import SPECS, Unavailable, build, providers_for
from tests.helpers import ONE_ROW, PLUGIN, _plugin_runs_see_no_gpu, oink_on_pythonpath  # noqa: F401  (autouse fixture and helpers)

TRAINING_OPS = tuple(suites.TRAINING_MODELS)


def test_training_cases():
    cases = suites.expand("training")
    assert {c.op for c in cases} == set(TRAINING_OPS)
    for c in cases:
        model, V, H, softcap, tokens = suites.TRAINING_MODELS[c.op]
        assert c.N == V and c.M in tokens and 4096 <= c.M <= 32768
    assert {suites.TRAINING_MODELS[op][1:4] for op in TRAINING_OPS} == {
        (128256, 4096, None), (151936, 3584, None), (151936, 5120, None), (256000, 2304, 30.0)}
    for suite in ("smoke", "sweep", "dsv3", "quack"):  # the training ops run in their suite only
        assert not {c.op for c in suites.expand(suite)} & set(TRAINING_OPS)
    assert set(providers_for(TRAINING_OPS[0])) == {"oink", "quack", "liger", "torch", "torch.compile"}


def _case(op, M=24, N=96):
    return suites.Case("training", op, M, N, "bfloat16")


def _gate(op, run, M=24, N=96):
    return bench_runner.gate(SPECS[op], run, _case(op, M, N), torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("op", ["linear_cross_entropy_qwen7b", "linear_cross_entropy_gemma2"])
@pytest.mark.parametrize("provider", ["oink", "torch"])
def test_gate_passes_right_answers(op, provider):
    g = _gate(op, build(op, provider, torch.device("cpu")))
    assert g["passed"], g.get("report")


def _wrong(op, how):
    run = build(op, "torch", torch.device("cpu"))

    def wrong(a):
        loss, dh, dw = run(a)
        if how == "dweight x2":
            dw = dw * 2
        elif how == "dhidden row":
            dh = dh.clone()
            dh[0] = -dh[0]
        elif how == "loss":
            loss = loss * 1.01
        return loss, dh, dw

    return wrong


@pytest.mark.parametrize("how", ["dweight x2", "dhidden row", "loss"])
def test_gate_fails_wrong_answers(how):
    op = "linear_cross_entropy_llama3"
    g = _gate(op, _wrong(op, how))
    assert not g["passed"]


def test_gate_catches_a_missing_softcap():
    op = "linear_cross_entropy_gemma2"
    run = build(op, "torch", torch.device("cpu"))
    g = _gate(op, lambda a: run(dict(a, softcap=None)))
    assert not g["passed"]


def test_out_of_memory_is_a_refusal():
    def oom(a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    with pytest.raises(Unavailable, match="out of memory at this shape"):
        _gate("linear_cross_entropy_llama3", oom)


def test_a_reference_out_of_memory_is_a_refusal():
    import dataclasses

    op = "linear_cross_entropy_llama3"

    def oom(a):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    spec = dataclasses.replace(SPECS[op], reference=oom)
    bench_runner._EXPECTED.clear()
    with pytest.raises(Unavailable, match="the reference: out of memory at this shape"):
        bench_runner.gate(spec, build(op, "torch", torch.device("cpu")), _case(op), torch.bfloat16,
                          torch.device("cpu"))


class _HeldDown:
    """A clocks watch that says the first round was timed while the card was held down (re-time it)."""

    def wrap(self, f):
        return f

    def last_causes(self):
        return ["software power cap"]

    def drop_last(self):
        pass


def test_a_retiming_out_of_memory_is_a_refusal(monkeypatch):
    rounds = []

    def time_once():  # the re-timing's capture needs memory the first round's did not
        rounds.append(1)
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB")

    monkeypatch.setattr(bench_runner, "peak_memory", lambda *a: None)
    monkeypatch.setattr(bench_runner, "_time_row", lambda *a, **k: ([1e-3, 1e-3], time_once))
    op = "linear_cross_entropy_llama3"
    case = _case(op)
    row = report.Row("training", op, "torch", case.M, case.N, case.dtype, "GPU", "ok")
    with pytest.raises(Unavailable, match="out of memory at this shape"):
        bench_runner._timing(None, case, "torch", None, SPECS[op], torch.bfloat16, torch.device("cpu"), row,
                             _HeldDown(), None)
    assert rounds == [1]

    def broken():
        raise ValueError("not memory")

    monkeypatch.setattr(bench_runner, "_time_row", lambda *a, **k: ([1e-3], broken))
    with pytest.raises(ValueError, match="not memory"):  # other errors are not refusals
        bench_runner._timing(None, case, "torch", None, SPECS[op], torch.bfloat16, torch.device("cpu"), row,
                             _HeldDown(), None)


def test_peak_memory_is_none_off_a_gpu():
    assert bench_runner.peak_memory(lambda a: a, {}, torch.device("cpu")) is None


def test_gate_rows_whole_8_row_groups_when_capped():
    seen = []
    spec = SPECS["softmax_forward"]
    case = suites.Case("smoke", "softmax_forward", 1000, bench_runner.GATE_MAX_ELEMS // 301, "float32")

    def run(a):
        seen.append(a["x"].shape[0])
        return spec.reference(a)

    assert bench_runner.gate(spec, run, case, torch.float32, torch.device("cpu"))["passed"]
    assert seen and all(m % 8 == 0 and m <= 301 for m in seen)


def _row(**kw):
    base = dict(suite="training", op="linear_cross_entropy_llama3", provider="oink", M=4096, N=128256,
                dtype="bfloat16", device="NVIDIA H100", status="ok", median_s=0.02, min_s=0.02, samples=[0.02])
    return report.Row(**{**base, **kw})


def test_peak_memory_column(tmp_path):
    rows = [_row(peak_mem_bytes=1536 * 2**20), _row(provider="torch", peak_mem_bytes=9 * 2**30, median_s=0.03),
            _row(provider="liger", device="cpu", peak_mem_bytes=None)]
    path = tmp_path / "r.csv"
    report.write_csv(rows, path)
    cells = [r["peak_mem_mib"] for r in csv.DictReader(open(path))]
    assert cells == ["1536.0", "9216.0", "n/a"]
    assert [r.peak_mem_bytes for r in report.read_csv(path)] == [1536 * 2**20, 9 * 2**30, None]
    assert rows[0].extra_info()["peak_mem_bytes"] == 1536 * 2**20 and rows[2].extra_info()["peak_mem_bytes"] is None
    md = report.summary_markdown(rows)
    assert "Peak memory, MiB" in md and "| 4096 | 128256 | bfloat16 | 1536.0 | n/a | 9216.0 |" in md
    assert "Oink's peak memory over each provider's: vs torch 0.17x (max 0.17x, 1 shapes)" in md  # not liger: n/a
    data = report.benchmark_json(rows, {})
    assert [b["extra_info"]["peak_mem_bytes"] for b in data["benchmarks"]] == [1536 * 2**20, 9 * 2**30, None]


def test_summary_names_rows_not_timed_by_graph_replays():
    """Liger's calls read a value on the host and cannot be captured: the summary says its rows were timed
    by events (host work inside) while Oink's were graph replays; nothing is said where all were alike."""
    rows = [_row(method="cuda-graph"), _row(provider="liger", method="cuda-events"),
            _row(M=16384, method="cuda-graph"), _row(M=16384, provider="liger", method="cuda-events"),
            _row(M=16384, provider="torch", method="capped-synced-perf_counter"),
            _row(M=16384, provider="torch.compile", method="cuda-graph")]
    md = report.summary_markdown(rows)
    assert ("Not timed by graph replays, so each of these times holds the calls' host work and launch gaps (the other "
            "rows' are the GPU's alone): liger, 2 of 2 shapes, by CUDA events around each call (its capture failed); "
            "torch, 1 of 1 shapes, by a synced host timer (capped: far slower than the fastest row).") in md
    alike = [_row(method="cuda-events"), _row(provider="liger", method="cuda-events")]
    assert "Not timed by graph replays" not in report.summary_markdown(alike)
    assert report.timed_apart([_row(method="cuda-graph"), _row(provider="liger", method="cuda-graph")]) == ""


def test_plots_time_and_memory(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(M=M, provider=p, peak_mem_bytes=(M // 4096) * 2**30, median_s=M * 1e-6)
            for M in (4096, 16384) for p in ("oink", "torch")]
    written = plots.write_svg(rows, tmp_path)
    names = sorted(p.split("/")[-1] for p in written)
    assert names == ["training-linear_cross_entropy_llama3-memory.svg", "training-linear_cross_entropy_llama3.svg"]
    assert "ms per call" in (tmp_path / "training-linear_cross_entropy_llama3.svg").read_text()


def test_cpu_row_says_n_a(pytester, tmp_path, monkeypatch):
    """A plugin run on a CPU: the column is there, and says n/a (torch counts CUDA memory only)."""
    oink_on_pythonpath(monkeypatch)
    pytester.makepyfile("def test_benchmark(oink_case, oink_benchmark):\n    oink_benchmark(oink_case)\n")
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json", "md")}
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-csv={out['csv']}", f"--oink-json={out['json']}",
                                        f"--oink-summary={out['md']}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    assert [r["peak_mem_mib"] for r in csv.DictReader(open(out["csv"]))] == ["n/a"]
    bench = json.loads(out["json"].read_text())["benchmarks"]
    assert len(bench) == 1 and "peak_mem_bytes" in bench[0]["extra_info"]
    assert bench[0]["extra_info"]["peak_mem_bytes"] is None
    assert "Peak memory, MiB" in out["md"].read_text() and "| n/a |" in out["md"].read_text()


def test_training_suite_runs_on_cpu(pytester, tmp_path, monkeypatch):
    """The suite end to end at a tiny vocabulary (its hidden sizes are the models'): rows gated and
    timed for Oink and eager torch, the peers refused with their reasons."""
    oink_on_pythonpath(monkeypatch)
    pytester.makepyfile("def test_benchmark(oink_case, oink_benchmark):\n    oink_benchmark(oink_case)\n")
    res = pytester.runpytest_subprocess("--oink-suite=training", "--oink-run-on-cpu", "--oink-configs=16x96",
                                        "--oink-ops=linear_cross_entropy_qwen7b,linear_cross_entropy_gemma2",
                                        "--oink-providers=oink,torch,liger,quack", f"--oink-csv={tmp_path / 'r.csv'}",
                                        *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-3000:]
    res.assert_outcomes(passed=4, skipped=4)  # liger and quack: GPU-only
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    ops = ("linear_cross_entropy_qwen7b", "linear_cross_entropy_gemma2")
    assert sorted((r["op"], r["provider"], r["status"]) for r in rows) == sorted(
        (op, p, "ok") for op in ops for p in ("oink", "torch"))
    assert all(float(r["median_ms"]) > 0 and r["peak_mem_mib"] == "n/a" for r in rows)



@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["oink", "liger", "quack", "torch", "torch.compile"])
@pytest.mark.parametrize("op", ["linear_cross_entropy_llama3", "linear_cross_entropy_gemma2"])
def test_every_provider_passes_the_gate_on_a_gpu(op, provider):
    """Each peer's call as the suite makes it (signatures, dtypes, the softcap), at a small vocabulary:
    a quick check before the suite's full shapes."""
    device, case = torch.device("cuda"), suites.Case("training", op, 1024, 32000, "bfloat16")
    try:
        run = build(op, provider, device)
        g = bench_runner.gate(SPECS[op], run, case, torch.bfloat16, device)
    except Unavailable as e:
        pytest.skip(f"{provider}: {e}")
    assert g["passed"], g.get("report")
    args = bench_runner._inputs(SPECS[op], case, torch.bfloat16, device, 100)
    assert bench_runner.peak_memory(run, args, device) > 0
