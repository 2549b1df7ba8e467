"""The tuned launch table (oink/kernels/launch_table.json): lookups, the search's candidates, every
entry compiled for its arch on CPU, and every entry run against its op's reference on a GPU."""
from __future__ import annotations

import re

import pytest

from oink import config
from oink.kernels import launch_table
from oink.kernels.row_rules import RowLaunch, pick_row_launch

ENTRIES = [(arch, key, N, e) for arch, keys in launch_table.table().items() for key, by_n in keys.items()
           for N, e in by_n.items()]
IDS = [f"{arch}-{key}-{N}" for arch, key, N, _ in ENTRIES]


@pytest.fixture
def override():
    """The tuner's trial (``oink.tune.trial``) in effect for the test: its dicts, filled by the test."""
    from oink.tune import trial

    with trial() as t:
        yield t


def test_pick_prefers_override_then_table_then_heuristic(override, monkeypatch):
    default = pick_row_launch(18432, 8)
    assert launch_table.pick("test/none", "sm_90a", default) == default
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {"test/k": {18432: {"launch": [384, 384, 1]}}}})
    tuned = launch_table.pick("test/k", "sm_90a", default)
    assert (tuned.threads_per_row, tuned.num_threads, tuned.cluster_n, tuned.vec) == (384, 384, 1, default.vec)
    assert launch_table.pick("test/k", "sm_100a", default) == default  # another arch: no entry
    assert launch_table.pick("test/k", "sm_90a", default, knob=2) == default  # a sweep knob wins
    override.launches[("test/k", "sm_90a", 18432)] = (576, 576, 1)
    assert launch_table.pick("test/k", "sm_90a", default).threads_per_row == 576
    assert override.seen[("test/k", "sm_90a", 18432)] == default


def test_trial_ends_with_its_block():
    """The library keeps no trial: outside ``oink.tune.trial`` the table's entry (or the rule) serves again."""
    from oink.tune import trial

    default = pick_row_launch(18432, 8)
    with trial({("test/k", "sm_90a", 18432): (576, 576, 1)}) as t:
        assert launch_table.pick("test/k", "sm_90a", default).threads_per_row == 576
    assert launch_table.TRIAL is None and list(t.seen) == [("test/k", "sm_90a", 18432)]
    assert launch_table.pick("test/k", "sm_90a", default) == default


def test_few_rows_take_their_own_entry_else_the_keys_choice(override, monkeypatch):
    default = pick_row_launch(131072, 16)
    assert launch_table.few_rows(launch_table.FEW_ROWS) and not launch_table.few_rows(launch_table.FEW_ROWS + 1)
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {"test/k": {131072: {"launch": [1024, 1024, 4]}}}})
    tuned = launch_table.pick("test/k", "sm_90a", default, few=True)  # no "/few" entry: the key's own
    assert (tuned.threads_per_row, tuned.cluster_n) == (1024, 4)
    assert list(override.seen) == [("test/k/few", "sm_90a", 131072)]  # the search tunes the few key
    assert override.seen[("test/k/few", "sm_90a", 131072)] == tuned  # against the key's choice
    # a "/few" entry that splits a row otherwise is ignored (batch invariance); one packing other rows a CTA serves
    for few_launch, served in (([128, 128, 16], False), ([256, 512, 16], True)):
        monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {
            "test/k": {131072: {"launch": [256, 256, 16]}}, "test/k/few": {131072: {"launch": few_launch}}}})
        few = launch_table.pick("test/k", "sm_90a", default, few=True)
        assert (few.threads_per_row, few.num_threads, few.cluster_n) == (tuple(few_launch) if served else
                                                                          (256, 256, 16))
        assert launch_table.pick("test/k", "sm_90a", default).num_threads == 256  # more rows: the key's entry
    assert launch_table.pick("test/k", "sm_100a", default, few=True) == default


def test_grid_belongs_to_its_entrys_launch(override, monkeypatch):
    grid = launch_table.grid
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {
        "test/k": {65536: {"launch": [256, 256, 8], "grid": 2048}, 28672: {"launch": [128, 128, 8]}},
        "test/k/few": {28672: {"launch": [256, 256, 16], "grid": 4096}}}})
    assert grid("test/k", "sm_90a", 65536) == 2048
    assert grid("test/k", "sm_90a", 28672) is None  # an entry without one: the family's default
    assert grid("test/k", "sm_100a", 65536) is None and grid("test/none", "sm_90a", 65536) is None
    assert grid("test/k", "sm_90a", 65536, knob=2) is None  # a knob that makes pick ignore the table
    assert grid("test/k", "sm_90a", 65536, few=True) == 2048  # no "/few" entry: the key's
    assert grid("test/k", "sm_90a", 28672, few=True) == 4096
    override.launches[("test/k", "sm_90a", 65536)] = (512, 512, 4)  # a trial of another launch: not its grid
    assert grid("test/k", "sm_90a", 65536) is None
    override.grids[("test/k", "sm_90a", 65536)] = 1024
    assert grid("test/k", "sm_90a", 65536) == 1024
    override.grids[("test/k", "sm_90a", 65536)] = 0  # a trial of the default
    assert grid("test/k", "sm_90a", 65536) is None


def test_stage_belongs_to_its_entrys_launch(override, monkeypatch):
    """An entry's "stage" (rows staged in shared memory, parameters loaded early or late) goes with its
    launch, as "grid" does: not for a trial of another shape or under a knob; a trial may set it (False:
    not staged); "/few" looks at its own entry first."""
    staged = launch_table.staged
    monkeypatch.setattr(launch_table, "table", lambda: {"sm_90a": {
        "test/k": {262144: {"launch": [512, 512, 8], "stage": "early"}, 131072: {"launch": [128, 128, 16]}},
        "test/k/few": {131072: {"launch": [256, 256, 16], "stage": "late"}}}})
    assert staged("test/k", "sm_90a", 262144) == "early" and staged("test/k", "sm_90a", 131072) is None
    assert staged("test/k", "sm_100a", 262144) is None and staged("test/none", "sm_90a", 262144) is None
    assert staged("test/k", "sm_90a", 262144, knob=4) is None
    assert staged("test/k", "sm_90a", 262144, few=True) == "early"  # no "/few" entry: the key's
    assert staged("test/k", "sm_90a", 131072, few=True) == "late"
    override.launches[("test/k", "sm_90a", 262144)] = (256, 256, 8)  # a trial of another launch: not its stage
    assert staged("test/k", "sm_90a", 262144) is None
    override.stages[("test/k", "sm_90a", 262144)] = "late"
    assert staged("test/k", "sm_90a", 262144) == "late"
    override.stages[("test/k", "sm_90a", 262144)] = False
    assert staged("test/k", "sm_90a", 262144) is None


def test_backward_grid_takes_the_knob_then_the_table_then_the_default(override, monkeypatch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from oink.kernels.rmsnorm_bwd_rules import TUNING, backward_launch, backward_tpsm, persistent_ctas

    def table():
        return {"sm_90a": {"rmsnorm_bwd/x16": {65536: {"launch": [256, 256, 8], "grid": 2048}}}}

    table.cache_clear = lambda: None  # config.reload() clears the real one's cache
    monkeypatch.setattr(launch_table, "table", table)
    config.reload()
    assert backward_tpsm(65536, 16, "sm_90a") == 2048
    assert backward_tpsm(65536, 16, "sm_90a", True) == TUNING["layernorm"][1]  # LayerNorm's key has none
    assert backward_tpsm(65536, 16, "sm_100a") == TUNING["rmsnorm"][1]
    launch = backward_launch(65536, 16, "sm_90a")
    assert (launch.num_threads, launch.cluster_n) == (256, 8)
    assert persistent_ctas(launch, 16, 2048) == 16 * 8  # 8 CTAs of 256 a SM, in 16 clusters of 8 at once
    assert persistent_ctas(launch, 16, 128) == 16  # at least one a SM
    from tests.helpers import set_dev

    set_dev(monkeypatch, bwd_tpsm=1024)
    assert backward_tpsm(65536, 16, "sm_90a") == 1024
    set_dev(monkeypatch, bwd_tpsm=None, bwd_upt=4)  # the heuristic's launch: not the entry's grid
    assert backward_tpsm(65536, 16, "sm_90a") == TUNING["rmsnorm"][1]


def test_resident_clusters_asks_the_driver_and_falls_back_to_the_division(monkeypatch):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from oink.kernels import host

    asked = []

    def driver(index, cluster_n):
        asked.append(cluster_n)
        if cluster_n == 16:
            raise RuntimeError("CUDA driver error")
        return {4: 30, 8: 15}.get(cluster_n, 0)

    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    monkeypatch.setattr(host, "_max_active_clusters", driver)
    host.resident_clusters.cache_clear()
    try:
        assert host.resident_clusters(0, 1) == 132 and asked == []  # no cluster: every SM, no query
        assert (host.resident_clusters(0, 4), host.resident_clusters(0, 8)) == (30, 15)  # a GPC holds a cluster
        assert host.resident_clusters(0, 16) == 132 // 16  # the driver could not answer
        assert host.resident_clusters(0, 2) == 66  # nor here (0): the division
    finally:
        host.resident_clusters.cache_clear()


def _tune_script():
    from oink import tune

    return tune


def test_shape_search_keeps_a_grid_only_with_its_launch():
    """oink.tune's shape verdict: an old entry's grid stays where the key's launch is
    unchanged (re-found, or the heuristic's shape the entry was kept for), and goes with a new launch."""
    pytest.importorskip("torch")
    tune = _tune_script()
    heuristic = RowLaunch(N=12288, vec=8, threads_per_row=256, num_threads=256, cluster_n=2)
    found = RowLaunch(N=12288, vec=8, threads_per_row=384, num_threads=384, cluster_n=2)
    other = RowLaunch(N=12288, vec=8, threads_per_row=192, num_threads=192, cluster_n=4)
    grid = {"grid": 512, "grid_rows": [4096], "grid_us": [235.0, 222.0]}

    def verdict(old, best):
        entries = {"12288": dict(old)} if old else {}
        said = tune.record_shape(entries, 12288, "layernorm_backward", [4096], "bfloat16", "card", heuristic, best,
                                 150e-6, 114e-6)
        return entries.get("12288"), said

    found, other = (found, False), (other, False)  # (launch, staged) as the search tries them
    same, said = verdict({"launch": [384, 384, 2], **grid}, found)
    assert same["launch"] == [384, 384, 2] and same["us"] == 114.0 and {k: same[k] for k in grid} == grid
    assert said == "tuned [384, 384, 2], its grid 512 kept"
    moved, said = verdict({"launch": [384, 384, 2], **grid}, other)
    assert moved["launch"] == [192, 192, 4] and "grid" not in moved and said == "tuned [192, 192, 4]"
    for_grid = {"launch": [256, 256, 2], "heuristic": [256, 256, 2], "us": 150.0, **grid}
    assert verdict(for_grid, None) == (for_grid, "heuristic kept, its grid 512 kept")
    assert verdict({"launch": [384, 384, 2], **grid}, None) == (None, "heuristic kept")
    assert verdict(None, found)[0]["launch"] == [384, 384, 2] and "grid" not in verdict(None, found)[0]
    staged, said = verdict(None, (found[0], "late"))  # rows staged, parameters loaded after the reduction
    assert staged["stage"] == "late" and said == "tuned [384, 384, 2], staged (late parameters)"
    assert "stage" not in verdict(None, found)[0]


def test_ops_sharing_a_key_search_it_once(capsys):
    """oink.tune: rmsnorm_forward and fused_add_rmsnorm_ share rmsnorm_fwd's keys; the
    second op named does not search a key the first searched (its verdict would replace the entry)."""
    pytest.importorskip("torch")
    tune = _tune_script()
    searched, key = {}, ("rmsnorm_fwd/x16w16", "sm_90a", 131072)
    assert tune.first_search(searched, key, "rmsnorm_forward")
    assert tune.first_search(searched, key, "rmsnorm_forward")  # the same op's own keys, again
    assert not tune.first_search(searched, key, "fused_add_rmsnorm_")
    assert "searched with rmsnorm_forward in this run" in capsys.readouterr().out
    assert tune.first_search(searched, ("rmsnorm_fwd/x16w16", "sm_90a", 262144), "fused_add_rmsnorm_")


def test_search_keeps_a_grid_only_where_it_beats_the_default(monkeypatch):
    """oink.tune's grid step on canned timings: kept in the entry where it won by more
    than --min-gain, an old one dropped where none did, an entry made at the heuristic's shape."""
    import argparse

    pytest.importorskip("torch")
    tune = _tune_script()
    times = {0: 1.0e-3, 1024: 0.9e-3, 2048: 0.8e-3, 4096: None}  # None: failed its gate

    def try_shape(*args):  # as the real one: (passed, seconds per row count, why)
        t = times[args[-1]]
        return (False, [], "gate failed") if t is None else (True, [t, t], "")

    monkeypatch.setattr(tune, "try_shape", try_shape)
    a = argparse.Namespace(min_gain=0.03, dtype="bfloat16")
    key, shape = ("rmsnorm_bwd/x16", "sm_90a", 65536), (256, 256, 8)

    def search(entries, searched=None):
        tune.search_grid(a, [1024, 2048, 4096], None, entries, None, None, "rmsnorm_backward", 65536, [4096],
                         None, None, key, shape, searched, "card")
        return entries

    made = search({}, (1.0e-3, 1.0e-3))["65536"]  # the shape search kept the heuristic's shape
    assert (made["launch"], made["heuristic"], made["heuristic_us"], made["grid"], made["grid_us"]) == (
        [256, 256, 8], [256, 256, 8], 1000.0, 2048, [1000.0, 800.0])
    times[2048] = 0.99e-3
    kept = search({"65536": {"launch": [256, 256, 8], "us": 700.0}})["65536"]
    assert (kept["grid"], kept["grid_us"], kept["us"]) == (1024, [1000.0, 900.0], 700.0)  # "us": the shape search's
    times[1024] = 0.98e-3  # within the margin: the default, and an old grid is dropped
    dropped = search({"65536": {"launch": [256, 256, 8], "grid": 1024, "grid_rows": [4096], "grid_us": [1.0, 0.9],
                                "us": 700.0}})["65536"]
    assert dropped == {"launch": [256, 256, 8], "us": 700.0}
    assert search({}) == {}


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
        lo, hi = e["n"]  # a range of widths around the one measured, on the card measured
        assert lo <= N <= hi and e["card"] and e["iters"] >= 1
        tpr, nt, cl = e["launch"]
        RowLaunch(N=N, vec=1, threads_per_row=tpr, num_threads=nt, cluster_n=cl)  # raises if not a launch shape
        if e["launch"] != e["heuristic"] or e.get("stage"):
            assert e["us"] < e["heuristic_us"], "an entry is kept only where it beat the heuristic"
        else:
            assert "grid" in e, "an entry at the heuristic's shape is kept only for its grid"
        if "stage" in e:  # rows staged in shared memory, parameters loaded early or late: the norm forward's
            assert e["stage"] in launch_table.STAGINGS and key.startswith(launch_table.STAGEABLE)
        if "grid" in e:  # a persistent grid's size, in threads a SM: kept where it beat the default's
            assert key.startswith(launch_table.PERSISTENT) and e["grid"] >= nt
            assert e["grid_us"][1] < e["grid_us"][0] and e["grid_rows"]


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
        from oink.kernels.rmsnorm_rules import ForwardKey

        x, w = x16[variant[:3]], {"w0": None, "w16": "bfloat16", "w32": "float32"}[variant[3:]]
        ln = family == "layernorm_fwd"
        compiled_forward(ForwardKey(x, N, arch, w_dtype=w, b_dtype=w if ln else None, store_rstd=True, layernorm=ln,
                                    store_mean=ln, few=few))
        return compiled_forward(ForwardKey(x, N, arch, w_dtype=w, res_dtype=w or x, res_out_dtype=w or x,
                                           layernorm=ln, few=few))  # a residual
    if family in ("rmsnorm_bwd", "layernorm_bwd"):
        from oink.kernels.rmsnorm_bwd import compiled_backward
        from oink.kernels.rmsnorm_bwd_rules import BackwardKey

        x, ln = x16[variant], family == "layernorm_bwd"
        return compiled_backward(BackwardKey(x, N, arch, w_dtype=x, dout_dtype=x, has_db=ln, layernorm=ln, few=few))
    if family == "fp4":
        from oink.kernels.nvfp4 import AddRMSNormFp4Key, Fp4Key, compiled_add_rmsnorm_fp4, compiled_fp4

        mx = variant == "32"
        if op == "add_rmsnorm":
            return compiled_add_rmsnorm_fp4(AddRMSNormFp4Key("bfloat16", N, arch, res_dtype="bfloat16",
                                                             w_dtype="bfloat16", mx=mx))
        return compiled_fp4(Fp4Key(op, "bfloat16", N, arch, mx=mx))
    if family == "fp8":
        from oink.kernels.fp8 import Fp8Key, RMSNormFp8Key, compiled_fp8, compiled_rmsnorm_fp8

        mode, g = ("group", 128) if variant == "group" else ("token", 0)
        if op in ("quantize", "silu_mul"):
            return compiled_fp8(Fp8Key(op, "bfloat16", N, arch, mode=mode, group_size=g))
        return compiled_rmsnorm_fp8(RMSNormFp8Key("bfloat16", N, arch, w_dtype="bfloat16",
                                                  res_dtype="bfloat16" if op == "add_rmsnorm" else None, mode=mode,
                                                  group_size=g))
    if family == "softmax":
        from oink.kernels.softmax import compiled_softmax
        from oink.kernels.softmax_rules import SoftmaxKey

        return compiled_softmax(SoftmaxKey(op, x16[variant], N, arch, few=few))
    if family == "cross_entropy":
        from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy

        mode = op.removesuffix("_shifted").removesuffix("_stream")  # forward_stream(_shifted): the forward's
        return compiled_cross_entropy(CrossEntropyKey(mode, x16[variant], "int64", _width(key, N), arch))
    raise AssertionError(f"{key}: add its compile call to tests/test_launch_table.py")


@pytest.fixture
def card():
    """Launches chosen for a card (the dispatch sets the GPU's); back to none (the rules) after."""
    yield launch_table.use_card
    launch_table.use_card(None)


@pytest.mark.parametrize("arch,key,N,entry", ENTRIES, ids=IDS)
def test_entry_compiles_for_its_arch(arch, key, N, entry, card):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    from oink.kernels.compile import CACHE

    from oink.kernels.rmsnorm_rules import ran_staged

    card(entry.get("card"))
    CACHE.clear_used()
    assert callable(_compile(arch, key, N))
    shapes = CACHE.used_launches()
    assert tuple(entry["launch"]) in shapes, f"the compiled kernel did not take the table's shape: {shapes}"
    assert ran_staged(CACHE.used) == bool(entry.get("stage")), "the kernel did not stage as the entry says"


def _served_dtypes(key: str) -> list[str]:
    """The x dtypes an entry's key serves: those of the width it names (``/x16``, ``/x32``), else all three (FP8's)."""
    width = re.search(r"/x(\d+)", key)
    return [d for d in ("bfloat16", "float16", "float32") if not width or DTYPE_BITS[d] == int(width.group(1))]


DTYPE_BITS = {"bfloat16": 16, "float16": 16, "float32": 32}
RUNS = [pytest.param(*e, d, id=f"{i}-{d}") for i, e in zip(IDS, ENTRIES) if e[0] == "sm_90a"
        for d in _served_dtypes(e[1])]


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("arch,key,N,entry,dtype", RUNS)
@pytest.mark.parametrize("rows", ["one", "odd", "most"])
def test_entry_runs_correctly(arch, key, N, entry, dtype, rows):
    """A tuned shape is a code path of its own (for every x dtype its key serves, though tuned on one):
    its op, through the public call, against the reference; a "/few" entry at row counts that take it,
    the others at row counts that do not. Every card's entries run on the GPU at hand (their launches chosen as
    on their card): correctness does not depend on the card an entry was tuned for."""
    import torch

    before = launch_table.CARD or torch.cuda.get_device_name()  # (what the dispatch chooses for this GPU)
    launch_table.use_card(entry.get("card", before))
    try:
        _run_entry(key, N, entry, dtype, rows, torch)
    finally:
        launch_table.use_card(before)


def _run_entry(key, N, entry, dtype, rows, torch):
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


def _tables(monkeypatch, tables: dict) -> None:
    def table():
        return tables

    table.cache_clear = lambda: None  # config.reload() (a change of card) clears the real one's cache
    monkeypatch.setattr(launch_table, "table", table)


def test_an_entry_serves_a_range_of_widths_on_its_card(override, monkeypatch, card):
    """No lookup by exact width alone: an entry serves the widths within ``RANGE`` of its own (or its
    "n"), on its card only (none: any card), the nearest measured width first."""
    _tables(monkeypatch, {"sm_90a": {"test/k": {
        18432: {"launch": [192, 192, 4], "iters": 3, "card": "H100"},
        20480: {"launch": [128, 128, 4], "iters": 5, "card": "H100", "n": [19968, 20480]},
        65536: {"launch": [64, 128, 16], "iters": 8}}}})
    at = lambda N: launch_table.entry("test/k", "sm_90a", N)  # noqa: E731  (a closure over this scope)
    assert at(18432) is None  # the CPU, no card: entries for a card do not apply
    card("H100")
    assert at(18432)[0] == at(17408)[0] == at(19584)[0] == 18432
    assert at(19968)[0] == 20480 and at(20481) is None and at(17279) is None
    assert at(65536 + 4096)[0] == 65536  # an entry without a card serves any
    card("H200")
    assert at(18432) is None and at(65536)[0] == 65536


def test_an_entry_scales_to_the_widths_it_serves(override, monkeypatch, card):
    """Away from its own width an entry keeps its cluster and rows a CTA and tiles the row's share exactly
    with the accesses a thread nearest its own; where no tiling is exact, the rule's launch."""
    _tables(monkeypatch, {"sm_90a": {"test/k": {18432: {"launch": [192, 192, 4], "iters": 3},
                                                131072: {"launch": [128, 128, 16], "iters": 8}}}})
    rule = lambda N: pick_row_launch(N, 16)  # noqa: E731  (a closure over this scope)
    assert launch_table.pick("test/k", "sm_90a", rule(18432)).threads_per_row == 192  # as measured
    near = launch_table.pick("test/k", "sm_90a", rule(19456))  # 2432 units over 4 CTAs: 608 = 32 x 19
    assert (near.cluster_n, near.rows_per_cta, near.even_n) == (4, 1, True) and near.iters in (1, 2, 19)
    near = launch_table.pick("test/k", "sm_90a", rule(18944))  # 2368 units: 592 a CTA, 37 x 16
    assert near == rule(18944)  # no whole-warp tiling of 592: the rule's
    near = launch_table.pick("test/k", "sm_90a", rule(135168))  # 16896 units: 1056 = 96 x 11 or 352 x 3 a CTA
    assert (near.threads_per_row, near.cluster_n, near.iters, near.even_n) == (96, 16, 11, True)
    _tables(monkeypatch, {"sm_90a": {"test/k": {262144: {"launch": [512, 512, 8], "stage": "early", "grid": 1024}}}})
    assert launch_table.staged("test/k", "sm_90a", 262144) == "early"
    assert launch_table.grid("test/k", "sm_90a", 262144) == 1024
    # an entry's staging and grid were tuned with its launch as measured, not as scaled to another width
    assert launch_table.staged("test/k", "sm_90a", 258048) is None
    assert launch_table.grid("test/k", "sm_90a", 258048) is None


def test_the_users_overlay_is_read_over_the_shipped_table(tmp_path, monkeypatch):
    """``python -m oink.tune`` writes beside the kernel cache; the library reads it over the shipped
    table (an overlay entry replaces the one measured at the same width), and a damaged one is ignored."""
    import json

    from tests.helpers import set_knob

    set_knob(monkeypatch, "OINK_CACHE_DIR", str(tmp_path))
    assert launch_table.overlay_path() == tmp_path / "launch_table.json"
    shipped = launch_table.table()
    key, (at, e) = next((k, next(iter(v.items()))) for k, v in shipped["sm_90a"].items())
    mine = {**e, "launch": [32, 128, 1]}
    overlay = {"tables": {"sm_90a": {key: {str(at): mine}, "test/mine": {"4096": mine}}}}
    launch_table.overlay_path().write_text(json.dumps(overlay))
    config.reload()
    merged = launch_table.table()
    assert merged["sm_90a"][key][at]["launch"] == [32, 128, 1] and merged["sm_90a"]["test/mine"][4096] == mine
    assert len(merged["sm_90a"][key]) == len(shipped["sm_90a"][key])
    launch_table.overlay_path().write_text("{not json")
    config.reload()
    assert launch_table.table() == shipped
    set_knob(monkeypatch, "OINK_CACHE_DIR", "0")
    assert launch_table.overlay_path() is None and launch_table.table() == shipped


def test_the_table_has_fewer_entries_than_before_the_rules():
    assert len(ENTRIES) < 90  # the exact-width table of the nineteenth session had 90


@pytest.mark.parametrize("mode", ["backward", "fwd_bwd"])
def test_softmax_backward_wide_rows_take_small_ctas(mode):
    """Full-width 16-bit rows of the backward modes from ``BWD_WIDE_MIN_N`` take 128-thread CTAs over a cluster on
    sm_90a while a CTA's share stays within ``BWD_WIDE_MAX_UNITS``; fp32, unaligned and sm_100a rows keep the
    general rule."""
    from oink.kernels.softmax_rules import BWD_WIDE_MAX_UNITS, BWD_WIDE_MIN_N, softmax_launch

    for N in (BWD_WIDE_MIN_N, 57344, 131072):
        L = softmax_launch(N, 16, "sm_90a", mode)
        assert (L.num_threads, L.cluster_n > 1) == (128, True), L
    wide = softmax_launch(180224, 16, "sm_90a", mode)
    assert wide.cluster_n == 16 and wide.num_threads * wide.iters <= BWD_WIDE_MAX_UNITS
    assert softmax_launch(262144, 16, "sm_90a", mode).num_threads == 512  # its share past the bound
    for args in ((57344, 32, "sm_90a"), (57345, 16, "sm_90a"), (57344, 16, "sm_100a"), (8192, 16, "sm_90a")):
        assert softmax_launch(*args, mode).num_threads > 128, args
