"""No launch the heuristics pick spills registers, at the sweep's widths up to 65536 (vocabularies
for cross-entropy), for sm_90a and sm_100a: read from the cubins' notes on the CPU. A spilling
launch ran at 0.06-0.35 of the copy ceiling on H100 (bench/RESULTS.md). A launch-table entry may
spill a little: the search measured it faster. Past 65536 the norm backward's one kernel takes a
cluster of 16 on SM90 up to 131072 columns; wider rows (SM100: past 65536) take its split kernels."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from oink.arch import SUPPORTED_ARCHS  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.profile import ROW_FAMILIES, cubin_resources, launch_resources  # noqa: E402  (after the cutlass importorskip)
from pytest_oink.suites import SWEEP_VOCABS  # noqa: E402  (after the cutlass importorskip)
from tests.helpers import set_knob  # noqa: E402  (after the cutlass importorskip)

WIDE = (12288, 14336, 18432, 28672, 65536)  # where the old heuristics spilled
# Known limit: a cluster of 8 CTAs of 256 threads leaves 8 fp32 units a LayerNorm backward thread.
# (The cross-entropy forward's wide rows, which spilled in registers, now stream: none spills.)
LIMITS = {("layernorm_bwd", "float32", 65536), ("layernorm_bwd", "float32", 131072)}


def _resources(family: str, dtype: str, N: int, arch: str) -> tuple:
    """``launch_resources``, and whether a launch used is the launch table's entry for a key this
    compile looked up: the search measured it faster than the heuristic's on a GPU (gated), small
    spill included (28672 with an fp32 weight: 16 bytes)."""
    from oink.kernels.launch_table import table
    from oink.tune import trial

    with trial() as looked_up:  # the keys this compile looks up
        launches, res = launch_resources(family, dtype, N, arch)
    entries = table().get(arch, {})
    tuned = {tuple(entries[key][n]["launch"]) for key, a, n in looked_up.seen
             if a == arch and n in entries.get(key, {})}
    return launches, res, any(tuple(L) in tuned for L in launches)


@pytest.fixture
def keep_cubin(monkeypatch):
    set_knob(monkeypatch, "OINK_KEEP_CUBIN", "1")


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", list(ROW_FAMILIES))
def test_chosen_launch_does_not_spill(keep_cubin, family, dtype, arch):
    widths = [N for N in (SWEEP_VOCABS if family.startswith("ce_") else WIDE) if (family, dtype, N) not in LIMITS]
    found = {N: _resources(family, dtype, N, arch) for N in widths}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"] and not r[2]}
    assert not spilled, f"{family} {dtype} {arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 for r in found.values())  # the notes were read


# widths between the suites' and the table's (none is an entry's or a suite's): the wide-row rule's launches
RULE_WIDTHS = (17408, 24576, 40960, 53248, 98304, 147456, 180224, 229376)
RULE_FAMILIES = ("rmsnorm_fwd", "rmsnorm_fwd_w32", "rmsnorm_fwd_res", "layernorm_fwd", "softmax_fwd", "softmax_bwd",
                 "softmax_fwd_bwd")
# Known limit, as before the rule: SM100's portable cluster of 8 leaves an fp32 RMSNorm thread of a 1024-thread
# CTA 7 units at 229376 (16 bytes spilled; no SM100 card to measure a wider-thread alternative on)
RULE_LIMITS = {(f, "float32", "sm_100a", 229376) for f in ("rmsnorm_fwd", "rmsnorm_fwd_w32", "rmsnorm_fwd_res")}


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", RULE_FAMILIES)
def test_wide_row_rule_does_not_spill(keep_cubin, family, dtype, arch):
    """The launch ``row_rules.cluster_rows`` gives at widths nobody searched compiles, takes the rule's
    cluster (no table entry applies on the CPU) and keeps its values in registers."""
    found = {N: _resources(family, dtype, N, arch) for N in RULE_WIDTHS}
    spilled = {N: r[:2] for N, r in found.items()
               if r[1]["frame_bytes"] and (family, dtype, arch, N) not in RULE_LIMITS}
    assert not spilled, f"{family} {dtype} {arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 and not r[2] for r in found.values())
    assert any(L[2] > 1 for r in found.values() for L in r[0]), "no launch took a cluster"


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("family", ("rmsnorm_fwd", "rmsnorm_fwd_res", "layernorm_fwd", "softmax_fwd"))
def test_narrow_access_rows_do_not_spill(keep_cubin, family, arch):
    """16-bit rows whose width is not a multiple of 8 (``row_rules.narrow_rows``: 32 one-element accesses a
    thread at 8077; the norm forwards' rows of 2-element accesses from 1025 columns, and past 16384 in CTAs of
    256 threads of up to 17 accesses, ``row_rules.narrow_cluster_rows``) keep their values in registers."""
    widths = (4097, 4619, 4750, 8077, 12290, 16383)
    if family != "softmax_fwd":
        widths += (1030, 3078, 33794, 67810, 131750)
    found = {N: _resources(family, "bfloat16", N, arch) for N in widths}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"{family} {arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 for r in found.values())


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_staged_rule_does_not_spill(keep_cubin, arch):
    """RMSNorm's 16-bit rows of 4- and 2-element accesses past 16384 columns (``rmsnorm_rules.staged_rows``: 8-32
    accesses a thread) take the staged rule's launch, staged (but rows of 2-element accesses the rule would
    spread over CTAs of 1024 threads: sm_100a's cluster of 8 past 131072 columns), keep their values in
    registers, and where the rule caps them (``staged_min_ctas``) fit that many CTAs a SM."""
    from oink.kernels.compile import CACHE
    from oink.kernels.rmsnorm_rules import ForwardKey, forward_launch_of, ran_staged, staged_min_ctas, staged_rows

    found, capped = {}, 0
    for N in (16388, 40964, 73124, 171988, 200004, 262140, 16386, 33794, 67810, 88002, 120002, 139266, 180226, 262142):
        CACHE.clear_used()
        key = ForwardKey("bfloat16", N, arch, w_dtype="bfloat16", out_dtype="bfloat16")
        found[N] = _resources("rmsnorm_fwd", "bfloat16", N, arch) + (ran_staged(CACHE.used),)
        launch, rule = forward_launch_of(key)[1], staged_rows(key)
        assert found[N][3] == (rule is not None) and (rule is None or launch == rule), (N, launch, found[N])
        assert rule is not None or (N % 4 == 2 and arch != "sm_90a" and launch.num_threads == 1024), (N, launch)
        ctas = staged_min_ctas(launch) if rule else 0
        capped += ctas > 0
        assert not ctas or found[N][1]["registers"] <= 65536 // (ctas * launch.num_threads), (N, launch, found[N])
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"{arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 for r in found.values()), found
    assert all(1 < L[2] <= 16 for r in found.values() for L in r[0]), found
    assert capped >= 6, "the rule capped too few launches to be tested"


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_forward_register_cap(keep_cubin, arch, monkeypatch):
    """``fwd_ctas`` (a sweep's dial) caps the norm forward's registers so that many CTAs fit a SM, over the staged
    rule's own cap: RMSNorm's rows of 2-element accesses staged, weight late (67810: 256 threads of 17 accesses),
    at most 64 registers as the rule has it (4 CTAs), at most 51 at 5 CTAs a SM, no spill on sm_90a."""
    from oink.kernels.profile import compiled_resources
    from oink.kernels.rmsnorm import compiled_forward
    from oink.kernels.rmsnorm_rules import ForwardKey
    from tests.helpers import set_dev

    key = ForwardKey("bfloat16", 67810, arch, w_dtype="bfloat16", out_dtype="bfloat16")
    found = {}
    for ctas in (None, 5):
        set_dev(monkeypatch, fwd_stage=True, fwd_late=True, fwd_ctas=ctas)
        found[ctas] = compiled_resources(compiled_forward(key))
    assert 65536 // (4 * 256) >= found[None]["registers"] > 65536 // (5 * 256) >= found[5]["registers"], found
    assert arch != "sm_90a" or not found[5]["frame_bytes"], found


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("family", ("rmsnorm_bwd", "layernorm_bwd", "rmsnorm_fwd_w32"))
def test_rows_counted_in_values_do_not_spill(keep_cubin, family, arch):
    """16-bit rows off 16-byte boundaries whose budget counts values (the norm backward: up to 26 one-element
    accesses a LayerNorm thread; the forward with an fp32 weight: up to 24) keep them in registers, from rows
    of several a CTA to clusters."""
    widths = (7, 447, 763, 2109, 2538, 6571, 10378, 11646, 15001, 30001, 65535)
    found = {N: _resources(family, "bfloat16", N, arch) for N in widths}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"{family} {arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 for r in found.values())


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rmsnorm_backward_pairs_of_narrow_rows_do_not_spill(keep_cubin, dtype, arch):
    """RMSNorm backward rows of 2-element accesses past 4096 columns, two rows of 128 threads a CTA
    (``rmsnorm_bwd_rules.NARROW_PAIR_VALUES``), keep their values in registers; with a dresidual they keep the
    cluster."""
    from oink.kernels.profile import compiled_resources
    from oink.kernels.rmsnorm_bwd import compiled_backward
    from oink.kernels.rmsnorm_bwd_rules import NARROW_PAIR_VALUES, BackwardKey, backward_launch

    widths = (4098, 4702, 128 * NARROW_PAIR_VALUES - 2)
    assert {(L.threads_per_row, L.num_threads, L.cluster_n) for L in (backward_launch(N, 16, arch) for N in widths)} \
        == {(128, 256, 1)}
    assert all(backward_launch(N, 16, arch, dres=True).cluster_n > 1 for N in widths)
    for N in widths:
        for dres in (None, dtype, "float32"):
            res = compiled_resources(compiled_backward(BackwardKey(dtype, N, arch, dout_dtype=dtype, w_dtype=dtype,
                                                                   dres_dtype=dres)))
            assert res["registers"] > 0 and not res["frame_bytes"], (N, dres, res)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_layernorm_narrow_rows_take_256_threads_without_spilling(keep_cubin, arch):
    """LayerNorm's 16-bit rows counted in values past 8192 columns (1- to 4-element accesses) take one CTA of 256
    threads up to ``rmsnorm_rules.LAYERNORM_NARROW_MAX_VALUES`` (56) values a thread (14330: 28 accesses of 2 elements;
    9045: 36 of one), else 512 (15100: 60; 16382: 64)."""
    found = {N: _resources("layernorm_fwd", "bfloat16", N, arch) for N in (8196, 9045, 13004, 14330, 15100, 16382)}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"layernorm_fwd {arch} spills at (launch, resources) {spilled}"
    threads = {N: {L[1] for L in r[0]} for N, r in found.items()}
    assert threads == {8196: {256}, 9045: {256}, 13004: {256}, 14330: {256}, 15100: {512}, 16382: {512}}, threads


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layernorm_fewest_warps_do_not_spill(keep_cubin, dtype, arch):
    """LayerNorm rows no whole-warp tiling covers, over the fewest whole warps (``row_rules.fewest_warps``)."""
    found = {N: _resources("layernorm_fwd", dtype, N, arch) for N in (1064, 2120, 4240, 9000, 15000)}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"layernorm_fwd {dtype} {arch} spills at (launch, resources) {spilled}"
    assert any(L[0] % 64 for r in found.values() for L in r[0]), "no launch took a whole-warp count"


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layernorm", [False, True], ids=["rmsnorm", "layernorm"])
def test_wide_backward_one_kernel_does_not_spill(keep_cubin, layernorm, dtype, arch):
    """The one-kernel norm backward between 65536 columns and the split (SM90's cluster of 16; known
    limit: LayerNorm fp32 at 131072, 96 bytes, 0.95 of the copy ceiling at 2048 rows on H100)."""
    from oink.kernels.rmsnorm_bwd_rules import split_rows

    family = "layernorm_bwd" if layernorm else "rmsnorm_bwd"
    bits = 16 if dtype == "bfloat16" else 32
    widths = [N for N in (73728, 90112, 114688, 131072) if not split_rows(N, bits, arch, layernorm)]
    assert len(widths) == (4 if arch == "sm_90a" else 0), widths  # SM100: the split takes them all
    found = {N: _resources(family, dtype, N, arch) for N in widths if (family, dtype, N) not in LIMITS}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"] and not r[2]}
    assert not spilled, f"{family} {dtype} {arch} spills at (launch, resources) {spilled}"


# rows off 16-byte boundaries the forwards read through aligned windows: odd widths from several rows a CTA to
# clusters of 16 (RMSNorm outside narrow_rows' 4097-16384), and the softmax's 4-byte accesses (16 bits)
WINDOW_WIDTHS = (7, 455, 2979, 17409, 45347, 98305, 180225)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op", ["rmsnorm", "layernorm", "softmax"])
def test_window_launches_do_not_spill(keep_cubin, op, dtype, arch):
    """The window launches (an aligned row's of the window's width) keep their values in registers; RMSNorm's
    window stops at MAX_N (262143 columns' window of 262152 took sm_100a an access a thread more, which
    spilled), LayerNorm's at LAYERNORM_WINDOW_MAX_N."""
    from oink.kernels.profile import compiled_resources
    from oink.kernels.rmsnorm import compiled_forward
    from oink.kernels.rmsnorm_rules import ForwardKey, forward_window
    from oink.kernels.softmax import compiled_softmax
    from oink.kernels.softmax_rules import SoftmaxKey, softmax_window

    # the widest windows; RMSNorm's 16-bit only (fp32 rows past 229376 on sm_100a spill aligned too: RULE_LIMITS)
    sixteen = dtype == "bfloat16"
    widths = list(WINDOW_WIDTHS)
    if op == "softmax":
        widths += [262143] + ([25630, 94558] if sixteen else [])
    elif sixteen:
        widths.append(262137)
    if op == "layernorm":  # its windows stop at LAYERNORM_WINDOW_MAX_N
        widths = [N for N in widths if N < 131072]
    found = {}
    for N in widths:
        if op != "softmax":  # LayerNorm with a bias and both statistics
            stats = dict(b_dtype=dtype, layernorm=True, store_mean=True) if op == "layernorm" else {}
            key = ForwardKey(dtype, N, arch, w_dtype=dtype, store_rstd=True, window=True, **stats)
            assert forward_window(key), N
            found[N] = compiled_resources(compiled_forward(key))
        else:
            key = SoftmaxKey("forward", dtype, N, arch, window=True)
            assert softmax_window(key), N
            found[N] = compiled_resources(compiled_softmax(key))
    spilled = {N: r for N, r in found.items() if r["frame_bytes"]}
    assert not spilled, f"{op} {dtype} {arch} windows spill: {spilled}"
    if op != "softmax":
        assert forward_window(ForwardKey(dtype, 262143, arch, w_dtype=dtype, window=True)) is None
        assert forward_window(ForwardKey(dtype, 131075, arch, w_dtype=dtype, layernorm=True, window=True)) is None
    assert all(r["registers"] > 0 for r in found.values())


@pytest.mark.parametrize("family", ["softmax_bwd", "softmax_fwd_bwd"])
def test_softmax_backward_modes_take_the_wide_cluster(keep_cubin, family):
    """fp32 rows of 256000 leave a thread 16 units over SM90's portable cluster of 8 (712 bytes
    spilled); the heuristic takes a cluster of 16 there, which does not spill (no table entry at 256000)."""
    launches, res, tuned = _resources(family, "float32", 256000, "sm_90a")
    assert not tuned and [L[2] for L in launches] == [16], launches
    assert res["registers"] > 0 and res["frame_bytes"] == 0, res


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("layernorm", [False, True], ids=["rmsnorm", "layernorm"])
def test_split_backward_does_not_spill(keep_cubin, layernorm, dtype, arch):
    """The kernels the norm backward of rows too wide for one cluster takes (``rmsnorm_bwd_rules.split_rows``),
    at the split's narrowest width (SM100's; SM90's is past 131072), an uneven one and the widest."""
    from oink.kernels.profile import compiled_resources
    from oink.kernels.rmsnorm_bwd import compiled_split_backward
    from oink.kernels.rmsnorm_bwd_rules import BackwardKey

    for N in (73728, 151936, 262144):
        fn_a, fn_b, _ = compiled_split_backward(BackwardKey(dtype, N, arch, w_dtype=dtype, dout_dtype=dtype,
                                                            has_db=layernorm, layernorm=layernorm))
        for name, fn in (("A", fn_a), ("B", fn_b)):
            res = compiled_resources(fn)
            assert res["registers"] > 0 and res["frame_bytes"] == 0, f"kernel {name} at {N}: {res}"


def test_a_spilling_launch_is_seen(keep_cubin):
    """The check can fail: 8 units a thread of bf16 LayerNorm at 1024 threads (the old heuristic's
    65536) has 64 registers a thread and spills."""
    from oink.kernels.profile import compiled_resources
    from oink.kernels.row_rules import RowLaunch
    from oink.kernels.rmsnorm import compiled_forward
    from oink.kernels.rmsnorm_rules import ForwardKey
    from oink.tune import trial

    with trial({("layernorm_fwd/x16w16", "sm_90a", 65536): (1024, 1024, 1)}):
        res = compiled_resources(compiled_forward(ForwardKey("bfloat16", 65536, "sm_90a", w_dtype="bfloat16",
                                                             b_dtype="bfloat16", layernorm=True)))
    assert res["registers"] <= 64 and res["frame_bytes"] > 0, res
    assert RowLaunch(N=65536, vec=8, threads_per_row=1024, num_threads=1024).iters == 8


def test_cubin_notes_refuse_what_is_not_a_cubin():
    with pytest.raises(ValueError, match="ELF"):
        cubin_resources(b"not an elf file at all")


# the streamed rows at widths the forward streams by default (odd: shifted windows, one CTA of 128 threads and of
# 256; aligned: clusters of 2 and 4), each option of the forward that keeps the +inf limit, and the fused mode forced
# to stream (aligned, odd)
STREAM_CASES = [("forward", 19298, 0), ("forward", 49207, 0), ("forward", 129280, 0), ("forward", 256000, 0),
                ("forward", 19298, 3), ("forward", 49207, 1), ("forward", 129280, 2), ("forward", 256000, 3),
                ("fwd_bwd", 129280, 0), ("fwd_bwd", 50257, 0)]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cross_entropy_streamed_rows_do_not_spill(keep_cubin, monkeypatch, dtype, arch):
    """The streamed rows' kernels (tiles folded with no +inf branch; a thread whose max is +inf reads its tiles
    again to count them) keep their values in registers."""
    from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy
    from oink.kernels.cross_entropy_rules import CEOptions, stream_rows
    from oink.kernels.row_rules import shifted_window
    from oink.kernels.profile import compiled_resources
    from tests.helpers import set_dev

    sets = [CEOptions(), CEOptions(0.1), CEOptions(0.0, 1e-4), CEOptions(0.1, 1e-4)]
    bits = 16 if dtype == "bfloat16" else 32
    spilled = {}
    for mode, N, o in STREAM_CASES:
        set_dev(monkeypatch, ce_stream=True if mode != "forward" else None)
        assert stream_rows(shifted_window(N, bits) or N, bits, mode)
        key = CrossEntropyKey(mode, dtype, "int64", N, arch, options=sets[o])
        res = compiled_resources(compiled_cross_entropy(key))
        assert res["registers"] > 0
        if res["frame_bytes"]:
            spilled[(mode, N, sets[o])] = res
    assert not spilled, f"{dtype} {arch}: {spilled}"


# the fused cross-entropy's rule for full-width 16-bit rows of 8192 columns or more (``cross_entropy_launch``):
# widths no suite or search names, the widest a 128-thread CTA at 8 accesses in a cluster of 16 (or 8) holds
CE_FUSED_WIDTHS = (8192, 12800, 40960, 98304, 180224, 262144)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_cross_entropy_fused_rule_does_not_spill(keep_cubin, arch):
    found = {N: _resources("ce_fwd_bwd", "bfloat16", N, arch) for N in CE_FUSED_WIDTHS}
    spilled = {N: r[:2] for N, r in found.items() if r[1]["frame_bytes"]}
    assert not spilled, f"ce_fwd_bwd bfloat16 {arch} spills at (launch, resources) {spilled}"
    assert all(r[1]["registers"] > 0 for r in found.values())


# the backward's rule (``cluster_rows``, retiled by ``least_padding``) at the fused rule's widths and where it
# retiles; and the options' dlogits kernels, which take the same rules (``option_launch``): the softcap's held
# form, the capped loop (label smoothing with a softcap, or a softcap past SOFTCAP_LEAN_MAX) and the z-loss
CE_BACKWARD_WIDTHS = CE_FUSED_WIDTHS + (50304, 100000, 201088)
CE_WIDE_OPTIONS = ((0.0, 0.0, 30.0), (0.1, 1e-4, 30.0), (0.0, 0.0, 50.0), (0.1, 1e-4, None))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_cross_entropy_wide_dlogits_rules_do_not_spill(keep_cubin, arch):
    from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy
    from oink.kernels.cross_entropy_rules import CEOptions
    from oink.kernels.profile import compiled_resources

    cases = [("backward", N, CEOptions()) for N in CE_BACKWARD_WIDTHS]
    cases += [(mode, N, CEOptions(*o)) for mode in ("fwd_bwd", "backward") for N in (8192, 50304, 180224, 262144)
              for o in CE_WIDE_OPTIONS]
    spilled = {}
    for mode, N, options in cases:
        res = compiled_resources(compiled_cross_entropy(CrossEntropyKey(mode, "bfloat16", "int64", N, arch,
                                                                        options=options)))
        assert res["registers"] > 0
        if res["frame_bytes"]:
            spilled[(mode, N, options)] = res
    assert not spilled, f"cross-entropy dlogits rows, {arch}, spill: {spilled}"


FP8_RULE_WIDTHS = (17408, 18432, 24576, 36864, 65536)  # past 16384: the rule splits a row over a cluster


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("mode,group", [("static", 0), ("token", 0), ("group", 128)])
def test_fp8_rule_splits_wide_rows_and_does_not_spill(keep_cubin, mode, group, arch):
    """``fp8_rules.fp8_rule``: a row wider than 512 whole-warp threads at two accesses takes a cluster of CTAs
    of at most 512 threads and two accesses (a CTA of 576 threads of ~64 registers left a SM one CTA),
    and the fused RMSNorm kernels it gives keep their values in registers, with a SM holding two CTAs."""
    from oink.kernels.fp8 import RMSNormFp8Key, compiled_rmsnorm_fp8
    from oink.kernels.fp8_rules import CTA_THREADS, UNIT, fp8_launch
    from oink.kernels.profile import compiled_resources

    for N in FP8_RULE_WIDTHS:
        L = fp8_launch(N, arch, "rmsnorm", group, op="rmsnorm")
        assert L.cluster_n > 1 and L.threads_per_row <= CTA_THREADS, (N, L)
        assert L.threads_per_row * L.cluster_n * 2 * UNIT >= N, (N, L)  # two accesses a thread hold the row
        fn = compiled_rmsnorm_fp8(RMSNormFp8Key("bfloat16", N, arch, w_dtype="bfloat16", mode=mode, group_size=group))
        res = compiled_resources(fn)
        assert res["registers"] > 0 and not res["frame_bytes"], (N, L, res)
        assert 2 * L.num_threads * res["registers"] <= 65536, (N, L, res)


# 16-bit backward rows where a thread holds 64 values (the options' cap) or 48-56 (the plain kernel's): the
# rule's 128- to 256-thread CTAs on sm_90a
CE_CAPPED_WIDTHS = (8192, 14000, 28000, 32000, 65536, 110000, 128256, 140000, 190000, 200000, 210000, 256000, 262144)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_cross_entropy_backward_keeps_its_ctas_a_sm(keep_cubin, arch):
    """``backward_min_ctas``: the options' backward (softcap, label smoothing, z-loss, all three) holds no more
    registers than leave a SM the plain backward's CTAs at its launch, the plain one no more than 80 at 48-56
    values a thread, and neither spills (uncapped: the softcap's 88 registers to the plain 79, 2 CTAs of 256 a
    SM where the plain kernel has 3; the plain one 96-128 at 7 accesses)."""
    from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy
    from oink.kernels.cross_entropy_rules import CEOptions
    from oink.kernels.compile import CACHE
    from oink.kernels.profile import compiled_resources

    def ctas(options, N):
        CACHE.clear_used()
        res = compiled_resources(compiled_cross_entropy(CrossEntropyKey("backward", "bfloat16", "int64", N, arch,
                                                                        options=options)))
        ((tpr, threads, cluster),) = CACHE.used_launches()
        assert res["registers"] > 0 and not res["frame_bytes"], (N, options, res)
        values = -(-N // (8 * tpr * cluster)) * 8
        if options.plain and 48 <= values <= 56 and threads % 64 == 0:
            assert res["registers"] <= 80, (N, res)
        return 65536 // (threads * -(-res["registers"] // 8) * 8)

    options = (CEOptions(softcap=30.0), CEOptions(label_smoothing=0.1), CEOptions(z_loss=1e-4),
               CEOptions(0.1, 1e-4, 30.0))
    fewer = {}
    for N in CE_CAPPED_WIDTHS:
        plain = ctas(CEOptions(), N)
        fewer.update({(N, o): (c, plain) for o in options if (c := ctas(o, N)) < plain})
    assert not fewer, f"{arch}: (options' CTAs a SM, plain's) {fewer}"


def test_backward_min_ctas_caps_only_where_ptxas_took_more():
    from oink.kernels.cross_entropy_rules import backward_min_ctas
    from oink.kernels.row_rules import RowLaunch

    wide = RowLaunch(N=256000, vec=8, threads_per_row=256, num_threads=256, cluster_n=16)  # 8 accesses, 64 values
    assert backward_min_ctas(wide, 16, plain=False) == 3  # 80 registers a thread
    assert backward_min_ctas(wide, 16, plain=True) == 0  # (capped, the plain kernel spilled)
    assert backward_min_ctas(wide, 32, plain=False) == 0
    seven = RowLaunch(N=200000, vec=8, threads_per_row=224, num_threads=224, cluster_n=16)  # 56 values
    assert backward_min_ctas(seven, 16, plain=True) == 3 and backward_min_ctas(seven, 16, plain=False) == 0
    five_warps = RowLaunch(N=140000, vec=8, threads_per_row=160, num_threads=160, cluster_n=16)  # 56 values
    assert backward_min_ctas(five_warps, 16, plain=True) == 0  # (5 CTAs leave 81 registers: 8 bytes spilled)
    fewer = RowLaunch(N=151936, vec=8, threads_per_row=256, num_threads=256, cluster_n=16)  # 40 values
    assert backward_min_ctas(fewer, 16, plain=True) == backward_min_ctas(fewer, 16, plain=False) == 0
