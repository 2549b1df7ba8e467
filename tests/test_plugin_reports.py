"""What the reports say they measured: the Markdown summary and the SVG plots of a CPU run are reference
timings (no kernel ran), named as such; plots keep one series per provider and dtype; a suite's output is
the plugin's lines (pytest-benchmark's tables with -v), its progress counting the rows that run. CPU only."""
from __future__ import annotations

import pytest

from pytest_oink import plots, report
from tests.helpers import BENCH, PLUGIN, _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)


def _row(provider="oink", M=4, N=128, dtype="bfloat16", device="cpu", ms=0.1, **kw):
    return report.Row(suite="smoke", op="rmsnorm_forward", provider=provider, M=M, N=N, dtype=dtype, device=device,
                      status="ok", median_s=ms / 1e3, bytes=2 * M * N * 2, roofline_tbs=1.0, **kw)


def test_plot_series_are_keyed_by_dtype_and_provider():
    """A float16 row of a shape does not replace the bfloat16 row of that shape and provider."""
    rows = [_row(dtype="bfloat16", ms=1.0), _row(dtype="float16", ms=2.0), _row(provider="torch", ms=3.0)]
    got = plots.series(rows, lambda r: r.median_s * 1e3)
    assert got == {"oink bfloat16": {(4, 128): 1.0}, "oink float16": {(4, 128): 2.0},
                   "torch bfloat16": {(4, 128): 3.0}}
    assert plots.series(rows[:1], lambda r: r.M) == {"oink": {(4, 128): 4}}  # one dtype: named by provider alone


def test_svg_of_a_cpu_run_says_reference_timings_and_keeps_every_dtype(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(dtype=dt, M=M) for dt in ("bfloat16", "float16") for M in (4, 64)]
    [path] = plots.write_svg(rows, tmp_path)
    text = open(path).read()  # matplotlib keeps each text as a comment beside its glyphs
    assert "<!-- oink bfloat16 -->" in text and "<!-- oink float16 -->" in text
    assert f"<!-- {plots.CPU_WHAT} -->" in text and "TB/s (reference, CPU)" in text
    gpu = [_row(device="NVIDIA H100 80GB HBM3")]
    [path] = plots.write_svg(gpu, tmp_path / "gpu")
    text = open(path).read()
    assert "<!-- NVIDIA H100 80GB HBM3 -->" in text and "reference" not in text


def test_summary_of_a_cpu_run_says_reference_timings_not_a_kernel_comparison():
    rows = [_row(), _row(provider="torch", ms=0.05), _row(provider="torch.compile", ms=0.2), _row(M=64, N=1024)]
    md = report.summary_markdown(rows)
    assert "Oink against the best peer" not in md and "Geomean speedup of oink" not in md
    assert "CUDA-graph" not in md and "cold (" not in md
    assert "Device: cpu." in md and "reference timings on a CPU" in md.splitlines()[4]  # said at the top
    assert "## rmsnorm_forward: reference timings on a CPU" in md
    from pytest_oink import modes

    cpu = modes.describe({"cold"}, {"cpu"})
    assert "host timer" in cpu and "CUDA-graph" not in cpu and "reference" in cpu
    # rows of a GPU: the comparison stands, and the card is named
    gpu = [_row(device="NVIDIA H100 80GB HBM3", **{"provider": p, "ms": ms}) for p, ms in (("oink", 0.1),
                                                                                          ("quack", 0.2))]
    md = report.summary_markdown(gpu)
    assert "## Oink against the best peer" in md and "Geomean speedup of oink: vs quack 2.00x" in md
    assert "Device: NVIDIA H100 80GB HBM3." in md and "reference timings" not in md
    assert f"Timing: cold ({modes.MODES['cold']})." in md


def test_suite_output_is_quiet_and_counts_the_rows_that_run(pytester):
    """pytest-benchmark's wide tables only with -v, no "fixture was not used" warning for a skipped row (the
    GPU-only peers on a CPU), and the progress line's count ends at the rows that ran."""
    pytester.makepyfile(BENCH)
    args = ("--oink-suite=smoke", "--oink-ops=rmsnorm_forward", "--oink-configs=4x128", *PLUGIN)
    res = pytester.runpytest_subprocess(*args)
    res.assert_outcomes(passed=3, skipped=3)  # oink, torch, torch.compile; quack, liger, flashinfer need a GPU
    out = res.stdout.str()
    assert "Name (time in" not in out and "was not used" not in out, out
    res.stdout.fnmatch_lines(["*?oink? ?3/3 rows, ETA 0 s? rmsnorm_forward 4x128 bfloat16 torch.compile*"])
    res = pytester.runpytest_subprocess(*args, "-v")
    assert "Name (time in" in res.stdout.str()  # -v: pytest-benchmark's table back


OWN_AND_PEER = '''
import pytest
import torch
from pytest_oink import OpSpec

SPEC = OpSpec("softmax", lambda M, N, dtype, device, gen: {"x": torch.randn(M, N, generator=gen).to(dtype)},
              lambda a: (a["x"].float().relu().to(a["x"].dtype),), lambda M, N, e: 2 * M * N * e)

@pytest.mark.parametrize("provider", [None, "torch.compile"])
def test_relu(oink_measure, provider):
    oink_measure(SPEC, lambda a: (a["x"].relu(),), 4, 128, name="relu", **({"provider": provider} if provider else {}))
'''


def test_a_users_own_rows_are_ours_in_the_summary(pytester, tmp_path):
    """oink_measure's rows (provider "mine") get the summary's TB/s and roofline columns and are set against a
    peer's rows (best-peer table, speedups) as Oink's are, unnamed; --oink-gate-providers names ours instead.
    The comparisons are of GPU rows: the run's CSV, its rows relabelled as a GPU's, is merged back."""
    import csv

    pytester.makepyfile(OWN_AND_PEER)
    out = tmp_path / "rows.csv"
    res = pytester.runpytest_subprocess(f"--oink-csv={out}", f"--oink-summary={tmp_path / 'cpu.md'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    cpu = (tmp_path / "cpu.md").read_text()
    assert "| M | N | dtype | mine ms | torch.compile ms | mine TB/s | mine / roofline |" in cpu, cpu
    mine = next(line for line in cpu.splitlines() if line.startswith("| 4 | 128 | bfloat16 |"))
    assert mine.split("|")[5].strip() not in ("", "-"), mine  # mine's TB/s
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:  # a GPU's rows: mine twice as fast as the peer
        r.update(device="NVIDIA H100 80GB HBM3", median_ms="0.1" if r["provider"] == "mine" else "0.2")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    res = pytester.runpytest_subprocess(f"--oink-merge={out}", f"--oink-summary={tmp_path / 'gpu.md'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:] + res.stderr.str()[-2000:]
    gpu = (tmp_path / "gpu.md").read_text()
    assert "## mine against the best peer" in gpu, gpu
    assert "| relu (mine) | 1 | 0.500 | 0.500 (4x128 vs torch.compile) | 0 | 0 | 0 | - |" in gpu
    assert "Geomean speedup of mine: vs torch.compile 2.00x" in gpu
    res = pytester.runpytest_subprocess(f"--oink-merge={out}", f"--oink-summary={tmp_path / 'peer.md'}",
                                        "--oink-gate-providers=torch.compile", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:] + res.stderr.str()[-2000:]
    assert "Geomean speedup of torch.compile: vs mine 0.50x" in (tmp_path / "peer.md").read_text()
