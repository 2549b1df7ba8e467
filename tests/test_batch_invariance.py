"""Batch invariance: the plugin's check (``pytest_oink.invariance``) on every op's reference path, on kernels
that break it, through ``--oink-batch-invariance`` / the invariance suite and the ``oink_batch_invariance``
fixture; and ``oink.batch_invariant``, the promise users query. On a CPU the ops run their references; the
kernels' check is the suite's on a GPU (bench/RESULTS.md)."""
from __future__ import annotations

import csv

import pytest
import torch

import oink
from pytest_oink import OpSpec, invariance
from pytest_oink.providers import SPECS, build

from tests.helpers import _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")
CPU = torch.device("cpu")
SMALL = dict(sizes=(1, 3, 16, 255, 256, 300), big=512)  # vLLM's sizes, rows alone and a decode batch
ROW_WISE = sorted(op for op, spec in SPECS.items() if spec.batch_invariant)


@pytest.mark.parametrize("N", [384, 391])
@pytest.mark.parametrize("op", ROW_WISE)
def test_every_reference_is_batch_invariant(op, N):
    """Every op's reference path (what a CPU runs, and the oracle) gives a row the same bits alone, in batches of
    vLLM's sizes and as slices, at an aligned width and an odd one."""
    spec = SPECS[op]
    N = N * spec.block if spec.block > 1 else N
    verdict = invariance.check(spec, build(op, "oink", CPU), N, torch.bfloat16, CPU, op=op, **SMALL)
    assert verdict.held, verdict.report()
    assert verdict.outputs and verdict.big == 512 and verdict.sizes == SMALL["sizes"]


def test_the_torch_rows_sum_as_a_user_would(monkeypatch):
    """The references keep a fixed tree of adds for their row sums (``oink.reference.sums``: batch-invariant
    fallbacks); the benchmark's torch and torch.compile rows time them with torch's own sum, as a user's PyTorch
    would run, not with a cost the tree puts on them."""
    from oink.reference import sums

    def refused(t):
        raise AssertionError("the fixed tree in a torch row")

    monkeypatch.setattr(sums, "_tree", refused)
    spec = SPECS["rmsnorm_fp8quant"]
    N = 7 * spec.block if spec.block > 1 else 391  # not a power of two: the tree pads
    args = spec.make_inputs(4, N, torch.bfloat16, CPU, torch.Generator().manual_seed(5))
    with pytest.raises(AssertionError, match="fixed tree"):
        spec.reference(args)
    torch_row = build("rmsnorm_fp8quant", "torch", CPU)(args)
    compiled_row = build("rmsnorm_fp8quant", "torch.compile", CPU)(args)
    # Inductor sums in its own order and skips the bf16 rounding before the scale: a code step, a bf16 ulp apart
    a, b = compiled_row[0].float(), torch_row[0].float()
    assert ((a - b).abs() <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2 ** -9).all()
    torch.testing.assert_close(compiled_row[1], torch_row[1], rtol=2 ** -7, atol=0)
    assert sums._TREE  # restored after each row


def _rms(a):
    x = a["x"].float()
    return ((x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)).to(a["x"].dtype),)


ROWS = OpSpec(family="rmsnorm", make_inputs=lambda M, N, dtype, device, gen: {
    "x": torch.randn(M, N, generator=gen, device=device).to(dtype)}, reference=_rms,
    nbytes=lambda M, N, e: 2 * M * N * e)


def _batch_dependent(a):
    """A row norm whose sum of squares goes in another order past 256 rows (as a launch chosen by the row count
    would): the rows' bits then depend on the batch."""
    x = a["x"].float()
    sq = x.square()
    total = sq.sum(-1, keepdim=True) * (1 if x.shape[0] <= 256 else 1 + 2 ** -16)  # an ulp or so of another order
    return ((x * torch.rsqrt(total / x.shape[-1] + 1e-6)).to(a["x"].dtype),)


def _by_address(a):
    """A row norm that splits a row by the row's offset in memory (as a window read through its address would)."""
    x = a["x"].float()
    shift = (a["x"].storage_offset() // x.shape[-1]) % 2
    sq = x.square()
    total = sq.sum(-1, keepdim=True) * (1 + shift * 2 ** -16)
    return ((x * torch.rsqrt(total / x.shape[-1] + 1e-6)).to(a["x"].dtype),)


def test_the_check_holds_for_a_row_wise_op_and_names_what_breaks():
    """An op whose rows go the same way whatever the batch holds; one whose reduction order follows the row count
    fails, naming op, N, each M and the count of differing elements; one that follows the row's address fails
    where a slice starts elsewhere."""
    held = invariance.check(ROWS, _rms, 1000, torch.bfloat16, CPU, op="mine", **SMALL)
    assert held.held and held.outputs == (0,) and "batch-invariant" in held.report()
    broke = invariance.check(ROWS, _batch_dependent, 1000, torch.bfloat16, CPU, op="mine", **SMALL)
    assert not broke.held
    assert {m for m, _, _, _ in broke.differing} == {1, 3, 16, 255, 256}  # 300 rows took the big batch's order
    text = broke.report()
    assert "mine N=1000 bfloat16: NOT batch-invariant against a batch of 512 rows" in text
    assert "M=255 (rows 0..254): output 0:" in text and "elements differ" in text
    by_address = invariance.check(ROWS, _by_address, 1000, torch.bfloat16, CPU, op="mine", **SMALL)
    assert not by_address.held and all(start % 2 for _, start, _, _ in by_address.differing)


def test_sums_over_the_rows_are_left_out():
    """rmsnorm_backward's dweight (a sum over the rows) is not compared and said so; dx is."""
    verdict = invariance.check(SPECS["rmsnorm_backward"], build("rmsnorm_backward", "oink", CPU), 384,
                               torch.bfloat16, CPU, op="rmsnorm_backward", **SMALL)
    assert verdict.held and verdict.outputs == (0,) and verdict.left_out == (1,)
    assert "[1] not row-wise" in verdict.report()


def test_wide_rows_check_fewer_rows():
    """The large batch keeps each row tensor within ``MAX_TENSOR_BYTES``; sizes it can't hold are not checked."""
    assert invariance.big_rows(4096, 2) == invariance.BIG
    assert invariance.big_rows(262144, 2) == invariance.MAX_TENSOR_BYTES // (262144 * 4)
    assert invariance.big_rows(262144, 4, sizes=(1, 3)) == 1024


def test_batch_invariant_is_the_promise_per_op_and_width():
    """``oink.batch_invariant``: every declared op promises it at rows of a multiple of 16 bytes; rows off 16-byte
    boundaries are not promised, nor rows wider than the kernels' ``MAX_N``; an unknown op is refused."""
    assert oink.batch_invariant("rmsnorm_forward") and oink.batch_invariant("fused_add_rms_norm")
    assert oink.batch_invariant("layernorm", 4096, torch.bfloat16)
    assert not oink.batch_invariant("layernorm", 20234, torch.bfloat16)
    assert oink.batch_invariant("softmax_forward", 20236, torch.float32)  # 80944 bytes
    assert oink.batch_invariant("softmax_forward", 20234, torch.float32) is False
    # wider than the kernels take: the reference's torch reductions serve a GPU call
    assert oink.batch_invariant("rmsnorm_forward", 262144, torch.bfloat16)
    assert not oink.batch_invariant("rmsnorm_forward", 262144 + 8, torch.bfloat16)
    assert not oink.batch_invariant("cross_entropy_forward", 300000)
    assert oink.batch_invariant("per_token_group_fp8_quant")  # Oink's group kernel on a GPU
    assert oink.batch_invariant("rms_norm_static_fp8_quant")  # the fused FP8 kernel in vLLM's order on a GPU
    assert "batch_invariant" in oink.__all__
    with pytest.raises(ValueError, match="unknown op"):
        oink.batch_invariant("no_such_op")


SUITE = ("--oink-seed=1", "--oink-run-on-cpu", "--oink-providers=oink,torch", "--oink-configs=1x384,1x391")


def test_the_invariance_suite_reports_each_provider(pytester, tmp_path):
    """``--oink-suite=invariance``: every row checked once a width; the CSV's column and the summary's table say
    which providers held it."""
    pytester.makepyfile("def test_benchmark(oink_case, oink_benchmark):\n    oink_benchmark(oink_case)\n")
    out = tmp_path / "s.md"
    res = pytester.runpytest_subprocess("--oink-suite=invariance", "--oink-ops=rmsnorm_forward,softmax_forward",
                                        *SUITE, f"--oink-csv={tmp_path / 'r.csv'}", f"--oink-summary={out}", *PLUGIN)
    res.assert_outcomes(passed=8)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 8 and {r["batch_invariant"] for r in rows} == {"1"}
    text = out.read_text()
    assert "## Batch invariance" in text and "| rmsnorm_forward | oink | 2 of 2 | - |" in text


def test_the_option_checks_any_suite_and_a_broken_oink_row_fails(pytester, tmp_path):
    """``--oink-batch-invariance`` on another suite; an Oink row whose promise breaks (here, the promise made for a
    spec whose call depends on the batch) fails with the check's report."""
    pytester.makeconftest('''
import torch
from pytest_oink import providers

import dataclasses
def broken(o, a):
    x = a["x"].float()
    return (torch.softmax(x, -1) * (1 + 2 ** -7 * (x.shape[0] > 256))).to(a["x"].dtype)
providers.SPECS["softmax_forward"] = dataclasses.replace(providers.SPECS["softmax_forward"], oink=broken)
''')
    pytester.makepyfile("def test_benchmark(oink_case, oink_benchmark):\n    oink_benchmark(oink_case)\n")
    res = pytester.runpytest_subprocess("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=oink",
                                        "--oink-configs=4x256", "--oink-batch-invariance", *PLUGIN)
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*softmax_forward N=256 bfloat16: NOT batch-invariant*", "*M=1 (rows 0..0)*"])


def test_the_option_fails_a_users_kernel_that_breaks_its_specs_promise(pytester):
    """``--oink-batch-invariance`` on ``oink_measure`` rows: a user's kernel whose spec promises invariance and whose
    rows depend on the batch fails with the check's report; the same kernel under a spec that promises nothing is
    reported, not failed."""
    pytester.makepyfile('''
import dataclasses

import pytest
import torch
from pytest_oink import OpSpec

SPEC = OpSpec(family="softmax", make_inputs=lambda M, N, dtype, device, gen: {
    "x": torch.randn(M, N, generator=gen, device=device).to(dtype)},
    reference=lambda a: (torch.softmax(a["x"].float(), -1).to(a["x"].dtype),), nbytes=lambda M, N, e: 2 * M * N * e,
    batch_invariant=True)

def batch_dependent(a):
    x = a["x"].float()
    return ((torch.softmax(x, -1) * (1 + 2 ** -7 * (x.shape[0] > 256))).to(a["x"].dtype),)

@pytest.mark.parametrize("promised", [True, False])
def test_mine(oink_measure, promised):
    oink_measure(dataclasses.replace(SPEC, batch_invariant=promised), batch_dependent, 4, 256, name="my_softmax")
''')
    res = pytester.runpytest_subprocess("--oink-batch-invariance", "--oink-run-on-cpu", *PLUGIN)
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*test_mine[[]True[]]*", "*my_softmax N=256 bfloat16: NOT batch-invariant*"])
    assert "test_mine[False] FAILED" not in res.stdout.str()


def test_the_fixture_certifies_a_users_kernel(pytester):
    """``oink_batch_invariance(spec, fn, N)``: passes for a row-wise kernel, fails naming the sizes for one whose
    rows depend on the batch."""
    pytester.makepyfile('''
import torch
from pytest_oink import OpSpec

SPEC = OpSpec(family="softmax", make_inputs=lambda M, N, dtype, device, gen: {
    "x": torch.randn(M, N, generator=gen, device=device).to(dtype)},
    reference=lambda a: (torch.softmax(a["x"].float(), -1).to(a["x"].dtype),), nbytes=lambda M, N, e: 2 * M * N * e)

def good(a):
    return (torch.softmax(a["x"].float(), -1).to(a["x"].dtype),)

def bad(a):
    return (torch.softmax(a["x"].float() * (1 + a["x"].shape[0] * 1e-3), -1).to(a["x"].dtype),)

def test_good(oink_batch_invariance):
    assert oink_batch_invariance(SPEC, good, 300, sizes=(1, 3, 255), big=300).held

def test_bad(oink_batch_invariance):
    oink_batch_invariance(SPEC, bad, 300, sizes=(1, 3, 255), big=300)
''')
    res = pytester.runpytest_subprocess(*PLUGIN)
    res.assert_outcomes(passed=1, failed=1)
    res.stdout.fnmatch_lines(["*custom N=300 bfloat16: NOT batch-invariant against a batch of 300 rows*"])
