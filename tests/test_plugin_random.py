"""The random-width suite (``--oink-suite=random --oink-seed=N``): its draws as plain units, and
the options, ids and recorded seed through pytester."""
from __future__ import annotations

import csv
import json

import pytest

from pytest_oink import suites
from pytest_oink.providers import SPECS

PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")
BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''


from tests.helpers import _plugin_runs_see_no_gpu  # noqa: E402,F401  (autouse: plugin runs see no GPU)


def _by_op(cases):
    out: dict = {}
    for c in cases:
        out.setdefault(c.op, []).append((c.M, c.N))
    return out


def _pow2(n):
    return n & (n - 1) == 0


def test_same_seed_same_cases_other_seed_other_widths():
    one = suites.expand("random", seed=1)
    assert one == suites.expand("random", seed=1)
    assert all(c.seed == 1 and c.suite == "random" for c in one)
    two = _by_op(suites.expand("random", seed=2))
    for op, shapes in _by_op(one).items():
        assert {N for _, N in shapes} != {N for _, N in two[op]}, op
    # every op draws its own widths
    widths = [frozenset(N for _, N in shapes) for shapes in _by_op(one).values()]
    assert len(set(widths)) == len(widths)


@pytest.mark.parametrize("seed", [1, 2, 12345])
def test_widths_are_varied_and_in_range(seed):
    by_op = _by_op(suites.expand("random", seed=seed))
    # every op runs in the random suite except the launch-only vLLM ops and the training suite's
    # (linear cross-entropy per model), FP4 and FP8 ones included
    assert set(by_op) == {op for op in SPECS if not op.startswith(("vllm_", "linear_cross_entropy_"))}
    for op, shapes in by_op.items():
        widths = sorted({N for _, N in shapes})
        block = SPECS[op].block
        lo = 3072 if op.startswith("cross_entropy") else 256
        assert len(widths) == 10 and lo <= widths[0] and widths[-1] <= 262144, op
        assert all(N % block == 0 for N in widths), op
        if block == 1:
            assert sum(N % 2 for N in widths) >= 2, op
        assert sum(N % 8 == 0 and not _pow2(N) for N in widths) >= 2, op
        assert sum(_pow2(N) for N in widths) <= 2, op


@pytest.mark.parametrize("dtype,elem", [("bfloat16", 2), ("float32", 4)])
def test_rows_move_64mb_or_hit_the_cap_and_decode_tier(dtype, elem):
    for op, shapes in _by_op(suites.expand("random", seed=7, dtype=dtype)).items():
        nbytes = SPECS[op].nbytes
        widths = sorted({N for _, N in shapes})
        decode = []
        for N in widths:
            big = suites.rows_moving(nbytes, N, elem)
            assert (big, N) in shapes and big * N <= 2**28
            assert nbytes(big, N, elem) >= 64 * 2**20 or (big + 1) * N > 2**28, (op, big, N)
            assert big == 1 or nbytes(big - 1, N, elem) < 64 * 2**20  # the fewest rows that do
            decode += [(M, n) for M, n in shapes if n == N and M != big]
        # the decode tier: 2 row counts in 1..1024 at each of the 3 narrowest widths, all <= 16384
        assert sorted({N for _, N in decode}) == widths[:3] and widths[2] <= 16384, op
        assert len(decode) == 6 and all(1 <= M <= 1024 for M, _ in decode), op
        assert len(shapes) == 16


def test_rows_cap():
    assert suites.rows_moving(lambda M, N, e: M * N * e, 262144, 2) == 128  # 64 MiB at 128 rows
    assert suites.rows_moving(lambda M, N, e: 0, 262144, 2) == 2**28 // 262144  # never 64 MB: the cap


def test_random_needs_an_integer_seed():
    with pytest.raises(ValueError, match="--oink-seed=N"):
        suites.expand("random")


@pytest.mark.parametrize("args,message", [
    ((), "*--oink-suite=random draws its shapes from a seed: give --oink-seed=N (ini oink_seed)*"),
    (("--oink-seed=abc",), "*--oink-seed='abc': expected an integer*"),
])
def test_seed_errors_are_usage_errors(pytester, args, message):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--oink-suite=random", *args, *PLUGIN)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    res.stderr.fnmatch_lines([message])


def test_collects_unique_ids_and_skips_without_gpu(pytester):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("--collect-only", "-q", "--oink-suite=random", "--oink-seed=1", *PLUGIN)
    ids = [line for line in res.stdout.lines if "::test_benchmark[" in line]
    assert len(ids) > 400 and len(set(ids)) == len(ids)
    want = {f"{c.op}-{c.M}x{c.N}-bfloat16" for c in suites.expand("random", seed=1)}
    assert {i.split("[")[1].split("-bfloat16-")[0] + "-bfloat16" for i in ids} == want
    pytester.makeini("[pytest]\noink_seed = 1\n")  # the ini key serves too
    res = pytester.runpytest_subprocess("-rs", "--oink-suite=random", "--oink-ops=softmax_forward",
                                        "--oink-providers=torch", *PLUGIN)
    res.assert_outcomes(skipped=16)
    res.stdout.fnmatch_lines(["oink suite random (seed 1): random widths 256-262144*",
                              "*suite 'random' is sized for a GPU and there is none*"])


def test_results_name_the_seed(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess(
        "--oink-suite=random", "--oink-seed=42", "--oink-configs=4x128", "--oink-run-on-cpu",
        "--oink-ops=softmax_forward", "--oink-providers=torch", f"--oink-csv={tmp_path / 'r.csv'}",
        f"--oink-summary={tmp_path / 's.md'}", f"--benchmark-json={tmp_path / 'b.json'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert [(r["suite"], r["seed"]) for r in rows] == [("random", "42")]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["oink_run"] == {"suite": "random", "seed": 42, "timing": "cold"}
    assert [(b["extra_info"]["suite"], b["extra_info"]["seed"]) for b in data["benchmarks"]] == [("random", 42)]
    assert "Suite: random (seed 42)." in (tmp_path / "s.md").read_text()


def test_list_counts_the_random_suite(pytester):
    res = pytester.runpytest_subprocess("--oink-list", *PLUGIN)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*random*random widths 256-262144*(GPU); * op x shape cases (seed 0); "
                              "duration not measured yet*"])
