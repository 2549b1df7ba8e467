"""The tuned launch table (oink/kernels/launch_table.json): lookups, the search's candidates, every
entry compiled for its arch on CPU, and every entry run against its op's reference on a GPU."""
from __future__ import annotations

import pytest

from oink import config
from oink.kernels import launch_table
from oink.kernels.reduction import RowLaunch, pick_row_launch

ENTRIES = [(arch, key, N, e) for arch, keys in launch_table.table().items() for key, by_n in keys.items()
           for N, e in by_n.items()]
IDS = [f"{arch}-{key}-{N}" for arch, key, N, _ in ENTRIES]


@pytest.fixture
def override():
    yield launch_table.OVERRIDES
    launch_table.OVERRIDES.clear()
    config.reload()


def test_pick_prefers_override_then_table_then_heuristic(override, monkeypatch):
    default = pick_row_launch(18432, 8)
    assert launch_table.pick("test/none", "sm_90a", default) == default
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {"test/k": {18432: {"launch": [384, 384, 1]}}}})
    tuned = launch_table.pick("test/k", "sm_90a", default)
    assert (tuned.threads_per_row, tuned.num_threads, tuned.cluster_n, tuned.vec) == (384, 384, 1, default.vec)
    assert launch_table.pick("test/k", "sm_100a", default) == default  # another arch: no entry
    assert launch_table.pick("test/k", "sm_90a", default, knob=2) == default  # a sweep knob wins
    override[("test/k", "sm_90a", 18432)] = (576, 576, 1)
    assert launch_table.pick("test/k", "sm_90a", default).threads_per_row == 576
    assert launch_table.SEEN[("test/k", "sm_90a", 18432)] == default


def test_few_rows_take_their_own_entry_else_the_keys_choice(override, monkeypatch):
    default = pick_row_launch(131072, 16)
    assert launch_table.few_rows(launch_table.FEW_ROWS) and not launch_table.few_rows(launch_table.FEW_ROWS + 1)
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {"test/k": {131072: {"launch": [1024, 1024, 4]}}}})
    launch_table.SEEN.clear()
    tuned = launch_table.pick("test/k", "sm_90a", default, few=True)  # no "/few" entry: the key's own
    assert (tuned.threads_per_row, tuned.cluster_n) == (1024, 4)
    assert list(launch_table.SEEN) == [("test/k/few", "sm_90a", 131072)]  # the search tunes the few key
    assert launch_table.SEEN[("test/k/few", "sm_90a", 131072)] == tuned  # against the key's choice
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {"test/k": {131072: {"launch": [1024, 1024, 4]}},
                                                                   "test/k/few": {131072: {"launch": [256, 256, 16]}}}})
    few = launch_table.pick("test/k", "sm_90a", default, few=True)
    assert (few.threads_per_row, few.num_threads, few.cluster_n) == (256, 256, 16)
    assert launch_table.pick("test/k", "sm_90a", default).cluster_n == 4  # more rows: the key's entry
    assert launch_table.pick("test/k", "sm_100a", default, few=True) == default


@pytest.mark.parametrize("N,bits", [(64, 16), (4096, 8), (7168, 8), (18432, 8), (131072, 16), (1000, 16)])
def test_candidates_are_valid_and_hold_the_heuristic(N, bits):
    default = pick_row_launch(N, bits)
    found = launch_table.candidates(default, max_iters=4, lanes=8, clusters=(1, 2))
    assert default in found
    for L in found:
        assert isinstance(L, RowLaunch) and L.N == N and L.vec == default.vec
        if L != default:
            assert L.iters <= 4 and L.threads_per_row % 8 == 0 and L.cluster_n in (1, 2)
    if N == 18432:  # 1152 units: the exact whole-warp tilings are offered
        assert {288, 384, 576} <= {L.threads_per_row for L in found}


def test_table_file_is_well_formed():
    for arch, key, N, e in ENTRIES:
        assert arch in ("sm_90a", "sm_100a") and key.count("/") >= 1
        tpr, nt, cl = e["launch"]
        RowLaunch(N=N, vec=1, threads_per_row=tpr, num_threads=nt, cluster_n=cl)  # raises if not a launch shape
        assert e["us"] < e["heuristic_us"], "an entry is kept only where it beat the heuristic"


def _width(key: str, N: int) -> int:
    """The row width an entry's op is called at: a shifted-rows cross-entropy key holds windows
    (the width plus a vector less one, whole vectors), whose width is the window less vec - 1."""
    if "_shifted/" in key:
        return N - (128 // int(key.rsplit("/x", 1)[1]) - 1)
    return N


def _compile(arch: str, key: str, N: int):
    """Compile the kernels ``key`` names at width N for ``arch``, with the table active: one dtype
    per key (bf16 where the key does not fix it) and the flag variants that change the kernel most."""
    few = key.endswith("/few")  # the launch for calls of launch_table.few_rows rows
    family, *rest = key.removesuffix("/few").split("/")
    op, variant = rest if len(rest) == 2 else (None, rest[0])  # the norms' keys have no op part
    x16 = {"x16": "bfloat16", "x32": "float32"}
    if family in ("rmsnorm_fwd", "layernorm_fwd"):
        from oink.kernels.rmsnorm import compiled_forward

        x, w = x16[variant[:3]], {"w0": None, "w16": "bfloat16", "w32": "float32"}[variant[3:]]
        ln = family == "layernorm_fwd"
        compiled_forward(x, N, arch, w, w if ln else None, None, None, True, layernorm=ln, store_mean=ln, few=few)
        return compiled_forward(x, N, arch, w, None, w or x, w or x, False, layernorm=ln, few=few)  # a residual
    if family in ("rmsnorm_bwd", "layernorm_bwd"):
        from oink.kernels.rmsnorm_bwd import compiled_backward

        x, ln = x16[variant], family == "layernorm_bwd"
        return compiled_backward(x, N, arch, x, x, None, ln, layernorm=ln, few=few)
    if family == "fp4":
        from oink.kernels.nvfp4 import compiled_add_rmsnorm_fp4, compiled_fp4

        mx = variant == "32"
        if op == "add_rmsnorm":
            return compiled_add_rmsnorm_fp4("bfloat16", "bfloat16", "bfloat16", N, arch, False, False, mx)
        return compiled_fp4(op, "bfloat16", N, arch, False, mx)
    if family == "fp8":
        from oink.kernels.fp8 import compiled_fp8, compiled_rmsnorm_fp8

        mode, g = ("group", 128) if variant == "group" else ("token", 0)
        if op in ("quantize", "silu_mul"):
            return compiled_fp8(op, "bfloat16", N, arch, mode, g, False, False, False)
        return compiled_rmsnorm_fp8("bfloat16", "bfloat16" if op == "add_rmsnorm" else None, "bfloat16", N, arch,
                                    mode, g, False, False, False, False)
    if family == "softmax":
        from oink.kernels.softmax import compiled_softmax

        return compiled_softmax(op, x16[variant], N, arch, few)
    if family == "cross_entropy":
        from oink.kernels.cross_entropy import compiled_cross_entropy

        mode = op.removesuffix("_shifted").removesuffix("_stream")  # forward_stream(_shifted): the forward's
        return compiled_cross_entropy(mode, x16[variant], "int64", _width(key, N), arch)
    raise AssertionError(f"{key}: add its compile call to tests/test_launch_table.py")


@pytest.mark.parametrize("arch,key,N,entry", ENTRIES, ids=IDS)
def test_entry_compiles_for_its_arch(arch, key, N, entry):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from oink.kernels.compile import CACHE

    CACHE.clear_used()
    assert callable(_compile(arch, key, N))
    shapes = CACHE.used_launches()
    assert tuple(entry["launch"]) in shapes, f"the compiled kernel did not take the table's shape: {shapes}"


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("arch,key,N,entry", [e for e in ENTRIES if e[0] == "sm_90a"],
                         ids=[i for i, e in zip(IDS, ENTRIES) if e[0] == "sm_90a"])
@pytest.mark.parametrize("rows", ["one", "odd", "most"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_entry_runs_correctly(arch, key, N, entry, rows, dtype):
    """A tuned shape is a code path of its own (for every x dtype its key serves, though tuned on one):
    its op, through the public call, against the reference; a "/few" entry at row counts that take it,
    the others at row counts that do not."""
    import re

    import torch

    width = re.search(r"/x(\d+)", key)  # keys naming x's width serve that width only (FP8's serve every dtype)
    if width and getattr(torch, dtype).itemsize * 8 != int(width.group(1)):
        pytest.skip(f"{key} serves {width.group(1)}-bit x, not {dtype}")

    from oink.kernels.compile import CACHE
    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import SPECS, build
    from pytest_oink.suites import Case

    few = key.endswith("/few")
    M = {"one": 1 if few else launch_table.FEW_ROWS + 1, "odd": 29 if few else 37,
         "most": launch_table.FEW_ROWS if few else 4099}[rows]
    assert launch_table.few_rows(M) == few
    spec, device = SPECS[entry["op"]], torch.device("cuda")
    CACHE.clear_used()
    result = gate(spec, build(entry["op"], "oink", device), Case("test", entry["op"], M, _width(key, N), dtype),
                  getattr(torch, dtype), device)
    assert result["passed"], result.get("report")
    shapes = CACHE.used_launches()
    assert tuple(entry["launch"]) in shapes, f"the op did not run the table's shape: {shapes}"


def test_search_keeps_only_a_passing_shape_that_beats_the_heuristic():
    default = pick_row_launch(18432, 8)
    a, b, c = (RowLaunch(N=18432, vec=16, threads_per_row=t, num_threads=t) for t in (288, 384, 576))
    # the fastest failed its gate: the fastest passing one is kept
    assert launch_table.choose([(default, 3.0), (a, None), (b, 2.0), (c, 2.5)], default, 0.03) == (b, 3.0, 2.0)
    # within the noise margin: the heuristic stays
    assert launch_table.choose([(default, 3.0), (b, 2.95)], default, 0.03) == (None, 3.0, 2.95)
    # the heuristic is the fastest: nothing to keep
    assert launch_table.choose([(default, 1.0), (b, 2.0)], default, 0.03) == (None, 1.0, 1.0)
    # the heuristic's own shape failed: no verdict (the tool reports it)
    assert launch_table.choose([(default, None), (b, 2.0)], default, 0.03) == (None, None, None)
