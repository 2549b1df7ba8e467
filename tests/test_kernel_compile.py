"""Tensor-free compilation of the CuTeDSL kernels for sm_90a and sm_100a (runs on CPU in CI)."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from oink.kernels.compile import CACHE, SUPPORTED_ARCHS  # noqa: E402  (after the cutlass importorskip)
from tests.helpers import set_dev, set_knob  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.row_rules import RowLaunch, pick_row_launch  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.rowsumsq import compiled_rowsumsq  # noqa: E402  (after the cutlass importorskip)

# Widths that reach every branch of pick_row_launch: 1..1024 threads per row, uneven tails
# (predicated), clusters of 2, 4 and 8 CTAs.
WIDTHS = [8, 24, 64, 1000, 4096, 16384, 65536, 131072, 262144]
DTYPES = {"float32": 32, "float16": 16, "bfloat16": 16}


def test_heuristic_reaches_every_branch():
    launches = [pick_row_launch(N, bits) for N in WIDTHS for bits in DTYPES.values()]
    assert {L.threads_per_row for L in launches} >= {1, 2, 32, 128, 512, 1024}
    assert {L.cluster_n for L in launches} >= {1, 2, 4, 8}
    assert any(not L.even_n for L in launches)
    for L in launches:
        assert L.iters * L.vec <= 64, L  # values per thread bounded (register budget)
        assert L.cols_per_cta * L.cluster_n >= L.N


def test_bad_launch_shapes_are_refused():
    with pytest.raises(ValueError):
        RowLaunch(N=64, vec=8, threads_per_row=3, num_threads=96)
    with pytest.raises(ValueError):
        RowLaunch(N=60, vec=8, threads_per_row=2, num_threads=128)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("N", WIDTHS)
def test_rowsumsq_compiles(arch, dtype, N):
    fn = compiled_rowsumsq(dtype, N, arch)
    assert callable(fn)


def test_cache_key_has_no_M():
    before = CACHE.compiles
    a = compiled_rowsumsq("bfloat16", 4096, "sm_90a")
    b = compiled_rowsumsq("bfloat16", 4096, "sm_90a")
    assert a is b
    assert CACHE.compiles - before <= 1  # at most the first call compiled (others may have run it)


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="arch"):
        compiled_rowsumsq("bfloat16", 128, "sm_80")


# ---- RMSNorm family: every flag combination x widths reaching every heuristic branch
from oink.kernels.rmsnorm import compiled_forward  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.rmsnorm_rules import ForwardKey  # noqa: E402  (after the cutlass importorskip)

NORM_WIDTHS = [64, 1000, 4096, 16384, 131072, 262144]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", [None, "same", "float32"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("store_rstd", [False, True])
def test_rmsnorm_forward_compiles(arch, dtype, w, bias, residual, store_rstd):
    wd = None if w is None else (dtype if w == "same" else w)
    for N in NORM_WIDTHS:
        fn = compiled_forward(ForwardKey(dtype, N, arch, w_dtype=wd, b_dtype=wd if bias else None,
                                         res_dtype=dtype if residual else None,
                                         res_out_dtype=dtype if residual else None, store_rstd=store_rstd))
        assert callable(fn)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_add_variant_compiles(arch, dtype):
    """The in-place fused add is the forward with residual in and out, weight of x's dtype."""
    for N in NORM_WIDTHS:
        assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype=dtype, res_dtype=dtype,
                                                    res_out_dtype=dtype)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", [None, "same", "float32"])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_forward_windows_compile(arch, dtype, w, residual):
    """Rows of odd widths through aligned windows (several rows a CTA, one, a cluster), with and without
    parameters gathered at the window's offset, bias with the weight; LayerNorm's too. Even widths,
    narrow_rows' widths, a residual, a weight wider than x and per-head parameters keep the narrow kernel
    (the same compile as without a window)."""
    from oink.kernels.rmsnorm_rules import forward_window

    wd = None if w is None else (dtype if w == "same" else w)
    for N in (7, 455, 5135, 94557, 94558):
        # odd widths only, outside narrow_rows' (4097-16384 for 16 bits)
        sixteen = dtype != "float32"
        narrow = residual or (wd == "float32" and sixteen) or N % 2 == 0 or (N == 5135 and sixteen)
        flags = dict(w_dtype=wd, b_dtype=wd, res_dtype=dtype if residual else None,
                     res_out_dtype=dtype if residual else None, store_rstd=True)
        key = ForwardKey(dtype, N, arch, **flags, window=True)
        assert (forward_window(key) is None) == narrow
        fn = compiled_forward(key)
        assert callable(fn) and (fn is compiled_forward(ForwardKey(dtype, N, arch, **flags))) == narrow
    lay = dict(w_dtype=dtype, b_dtype=dtype, layernorm=True, store_rstd=True, store_mean=True)
    for N in (7, 455, 94557):
        key = ForwardKey(dtype, N, arch, **lay, window=True)
        assert forward_window(key) is not None
        assert callable(compiled_forward(key)) and compiled_forward(key) is not compiled_forward(
            ForwardKey(dtype, N, arch, **lay))


def test_row_loads_go_unbranched_where_the_grid_holds_the_rows():
    """``rows_in_grid``: a kernel traced for sm_90a (``compile_kernel`` sets the arch) with one row a CTA loads
    its row without the ``row < M`` branch (the grid holds exactly M CTAs); several rows a CTA, sm_100a and an
    untraced kernel keep it. RMSNorm only where a thread holds 16-bit values of x, no residual and no wider
    parameter (the others spilled)."""
    import cutlass

    from oink.kernels.reduction import RowKernelBase
    from oink.kernels.rmsnorm import RMSNormForward

    one = RowLaunch(N=4096, vec=8, threads_per_row=128, num_threads=128)
    several = RowLaunch(N=512, vec=8, threads_per_row=16, num_threads=128)
    for launch, arch, expected in ((one, "sm_90a", True), (one, "sm_100a", False), (one, None, False),
                                   (several, "sm_90a", False)):
        k = RowKernelBase(launch)
        if arch:
            k.arch = arch
        assert k.rows_in_grid == expected, (launch, arch)
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    for w, res, x, expected in ((bf16, None, bf16, True), (None, None, bf16, True), (f32, None, bf16, False),
                                (bf16, bf16, bf16, False), (f32, None, f32, False)):
        k = RMSNormForward(one, x, w, None, res, x, res, store_rstd=True)
        k.arch = "sm_90a"
        assert k.unbranched == expected, (w, res, x)


def test_layernorm_takes_one_round_where_its_fallback_is_uniform():
    """``pivoted``: LayerNorm's one-round moments for 16-bit x where the threads of a barrier or shuffle take the
    fallback round alike (one row a CTA or cluster, or rows inside warps, which vote); several rows over several
    warps a CTA, fp32 x, RMSNorm, and narrow-access rows read again after the round (late parameters, staged)
    keep two rounds. The compiled kernels of both forms are checked against the references on the GPU."""
    import cutlass

    from oink.kernels.rmsnorm import RMSNormForward

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    one = RowLaunch(N=4096, vec=8, threads_per_row=128, num_threads=128)
    cluster = RowLaunch(N=65536, vec=8, threads_per_row=256, num_threads=256, cluster_n=8)
    in_warps = RowLaunch(N=512, vec=8, threads_per_row=16, num_threads=128)
    over_warps = RowLaunch(N=2048, vec=8, threads_per_row=64, num_threads=128)
    narrow = RowLaunch(N=21316, vec=4, threads_per_row=128, num_threads=128, cluster_n=8)
    cases = [(one, bf16, True, False, True), (cluster, bf16, True, True, True), (in_warps, bf16, True, False, True),
             (over_warps, bf16, True, False, False), (one, f32, True, False, False), (one, bf16, False, False, False),
             (narrow, bf16, True, False, True), (narrow, bf16, True, True, False)]
    for launch, x, layernorm, late, expected in cases:
        k = RMSNormForward(launch, x, x, x if layernorm else None, None, x, None, True, layernorm, late_params=late)
        assert k.pivoted == expected, (launch, x, layernorm, late)


def test_rmsnorm_width_limit():
    with pytest.raises(ValueError, match="262144"):
        compiled_forward(ForwardKey("bfloat16", 262144 * 2, "sm_90a"))


from oink.kernels.partial_sum import compiled_partial_sum, quads_per_cta  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.rmsnorm_bwd import compiled_backward  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.rmsnorm_bwd_rules import BackwardKey  # noqa: E402  (after the cutlass importorskip)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kinds", [1, 2])
def test_partial_sum_compiles(arch, dtype, kinds):
    # 1001: the partial rows are padded to a multiple of 4; 368, 1200, 2342: CTAs of 1, 2 and 4 column quads
    for N in (*NORM_WIDTHS, 1001, 368, 1200, 2342):
        assert callable(compiled_partial_sum(N, kinds, dtype, arch))


def test_partial_sum_spans_the_gpu():
    """The partials' sum keeps at least ``MIN_CTAS`` CTAs and a thread at most ``LOADS`` partial rows where a CTA
    of one column quad allows it: a CTA of 8 quads at 368 columns made a grid of 12 CTAs."""
    from oink.kernels.partial_sum import LOADS, MIN_CTAS, THREADS

    def fits(cols, parts, q):
        return -(-cols // q) >= MIN_CTAS and -(-parts // (THREADS // q)) <= LOADS

    seen = set()
    for cols in range(1, 4000, 7):
        for parts in (0, 1, 66, 264, 528, 2112):
            q = quads_per_cta(cols, parts)
            seen.add(q)
            assert q in (1, 2, 4, 8) and THREADS % q == 0, cols
            assert fits(cols, parts, q) or q == 1, (cols, parts, q)
            assert q == 8 or not fits(cols, parts, 2 * q), (cols, parts, q)  # the widest CTA that fits
    assert seen == {1, 2, 4, 8}
    assert quads_per_cta(1176, 528) == 2  # RMSNorm 4702's pairs: 8 quads left a thread 17 partial rows


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", [None, "same", "float32"])
@pytest.mark.parametrize("has_db", [False, True])
@pytest.mark.parametrize("dres", [False, True])
def test_rmsnorm_backward_compiles(arch, dtype, w, has_db, dres):
    wd = None if w is None else (dtype if w == "same" else w)
    for N in NORM_WIDTHS:
        fn = compiled_backward(BackwardKey(dtype, N, arch, w_dtype=wd, dout_dtype=dtype,
                                           dres_dtype=dtype if dres else None, has_db=has_db))
        assert callable(fn)


def test_forward_launch_for_a_wider_weight(monkeypatch):
    """An fp32 weight with 16-bit x: 2 units a thread where that tiles the row exactly, else the
    default; the ``fwd_upt`` setting overrides both."""
    from oink.kernels.rmsnorm_rules import forward_launch

    assert forward_launch(4096, 16, "sm_90a").threads_per_row == 128
    assert forward_launch(4096, 16, "sm_90a", 32).threads_per_row == 256
    assert forward_launch(6144, 16, "sm_90a", 32) == forward_launch(6144, 16, "sm_90a")  # 2 units: not exact
    assert forward_launch(4096, 32, "sm_90a", 32) == forward_launch(4096, 32, "sm_90a")  # same width
    set_dev(monkeypatch, fwd_upt=4)
    assert forward_launch(4096, 16, "sm_90a", 32).threads_per_row == 128


def test_narrow_rows_hold_an_aligned_threads_values(monkeypatch):
    """16-bit rows off 16-byte boundaries (vec < 8) count a thread's budget in values: the backward holds
    what 2 (RMSNorm) or 4 (LayerNorm) aligned accesses hold, in CTAs of at most 256 threads, a cluster only
    where one CTA can't; ``values=False`` and fp32 rows keep the budget in accesses; the forward with an fp32
    weight holds up to 24 values a thread before a cluster."""
    from oink.kernels.rmsnorm_rules import forward_launch
    from oink.kernels.rmsnorm_bwd_rules import NARROW_MAX_VALUES, backward_launch

    shape = lambda L: (L.threads_per_row, L.cluster_n, L.iters)  # noqa: E731  (a closure over this scope)
    assert shape(backward_launch(2109, 16, "sm_90a")) == (256, 1, 9)  # 1-element accesses: 16 a thread at most
    assert shape(backward_launch(2538, 16, "sm_90a")) == (256, 1, 5)  # 2-element: 8
    assert shape(backward_launch(11646, 16, "sm_90a")) == (256, 4, 6)
    assert shape(backward_launch(2109, 16, "sm_90a", values=False)) == (512, 4, 2)  # counted in accesses
    assert shape(backward_launch(2109, 32, "sm_90a")) == shape(backward_launch(2109, 32, "sm_90a", values=False))
    assert shape(backward_launch(6571, 16, "sm_90a", layernorm=True)) == (256, 1, 26)
    assert shape(backward_launch(30001, 16, "sm_90a", layernorm=True))[2] <= NARROW_MAX_VALUES["layernorm"]
    assert backward_launch(4096, 16, "sm_90a") == backward_launch(4096, 16, "sm_90a", values=False)  # aligned
    assert shape(forward_launch(3151, 16, "sm_90a", 32)) == (256, 1, 13)  # was 512 threads x a cluster of 2
    assert shape(forward_launch(10378, 16, "sm_90a", 32)) == (512, 1, 11)  # 22 values a thread
    assert shape(forward_launch(15001, 16, "sm_90a", 32)) == (512, 2, 15)  # 30 would be too many
    set_dev(monkeypatch, bwd_upt=2)  # a sweep's setting: accesses, as before
    assert shape(backward_launch(2109, 16, "sm_90a")) == (512, 4, 2)


def test_layernorm_forward_takes_the_fewest_whole_warps():
    """A LayerNorm row no whole-warp tiling covers exactly takes the fewest whole warps holding it in 4
    accesses a thread (4240 bf16: 160 threads, not 256 x 3), whole rows a CTA of at least 128 threads; exact
    tilings and rows of less than a warp keep theirs."""
    from oink.kernels.rmsnorm_rules import forward_launch

    shape = lambda L: (L.threads_per_row, L.num_threads, L.iters)  # noqa: E731  (a closure over this scope)
    assert shape(forward_launch(4240, 16, "sm_90a", 16, True)) == (160, 160, 4)
    assert shape(forward_launch(2120, 16, "sm_90a", 16, True)) == (96, 192, 3)
    assert shape(forward_launch(7168, 16, "sm_90a", 16, True)) == (224, 224, 4)  # exact
    assert shape(forward_launch(256, 16, "sm_90a", 16, True))[0] < 32  # a row of 32 accesses


def test_backward_launch_whole_warp_rows(monkeypatch):
    """Rows that whole warps cover exactly take that many threads (no idle last access); others
    keep the power-of-two shape."""
    from oink.kernels.rmsnorm_bwd_rules import backward_launch

    for N, tpr in ((6144, 384), (7168, 448), (8192, 512), (4096, 256)):
        L = backward_launch(N, 16, "sm_90a")
        assert (L.threads_per_row, L.num_threads, L.even_n, L.iters) == (tpr, tpr, True, 2), L
    assert backward_launch(7168, 16, "sm_90a", layernorm=True).threads_per_row == 224  # 4 accesses
    assert not backward_launch(1000, 16, "sm_90a").even_n  # 125 accesses: no whole-warp split
    with pytest.raises(ValueError, match="whole warps"):
        RowLaunch(N=6144, vec=8, threads_per_row=48, num_threads=96)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("layernorm", [False, True], ids=["rmsnorm", "layernorm"])
@pytest.mark.parametrize("N", [6144, 7168])
def test_backward_whole_warp_rows_compile(arch, layernorm, N):
    # 384 / 448 / 224 threads a row (not a power of two), the default pipeline of each family
    assert callable(compiled_backward(BackwardKey("bfloat16", N, arch, w_dtype="bfloat16", dout_dtype="bfloat16",
                                                  has_db=layernorm, layernorm=layernorm)))


def test_pdl_setting_is_part_of_the_compile_key(monkeypatch):
    """A kernel compiled with programmatic dependent launch is not served to a process that turned it
    off (OINK_PDL=0), nor the reverse: the launch and the kernel's first instructions differ."""
    key = ForwardKey("bfloat16", 4096, "sm_90a", w_dtype="bfloat16")
    with_pdl = compiled_forward(key)
    set_knob(monkeypatch, "OINK_PDL", "0")
    without = compiled_forward(key)
    assert without is not with_pdl and callable(without)
    set_knob(monkeypatch, "OINK_PDL", "1")
    assert compiled_forward(key) is with_pdl


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("setting", ["bwd_depth=1", "bwd_depth=3", "OINK_PDL=0"])
def test_backward_ab_variants_compile(arch, setting, monkeypatch):
    """The A/B settings the sweeps use still compile (RMSNorm's moved-register pipeline, a deeper
    rotation, the partials' sum without PDL)."""
    name, value = setting.split("=")
    if name.startswith("OINK_"):
        set_knob(monkeypatch, name, value)
    else:
        set_dev(monkeypatch, **{name: int(value)})
    for N in (64, 1000, 6144):  # several rows a CTA (guarded loads), a predicated tail, whole warps
        assert callable(compiled_backward(BackwardKey("bfloat16", N, arch, w_dtype="bfloat16", dout_dtype="bfloat16",
                                                      has_db=True)))
    assert callable(compiled_partial_sum(6144, 2, "bfloat16", arch))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", ["same", "float32"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("stats", [False, True])
def test_layernorm_forward_compiles(arch, dtype, w, bias, stats):
    wd = dtype if w == "same" else w
    for N in NORM_WIDTHS:
        fn = compiled_forward(ForwardKey(dtype, N, arch, w_dtype=wd, b_dtype=wd if bias else None, store_rstd=stats,
                                         layernorm=True, store_mean=stats))
        assert callable(fn)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", ["same", "float32"])
@pytest.mark.parametrize("has_db", [False, True])
def test_layernorm_backward_compiles(arch, dtype, w, has_db):
    wd = dtype if w == "same" else w
    for N in NORM_WIDTHS:
        assert callable(compiled_backward(BackwardKey(dtype, N, arch, w_dtype=wd, dout_dtype=dtype, has_db=has_db,
                                                      layernorm=True)))


from oink.kernels.softmax import compiled_softmax  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.softmax_rules import MODES, SoftmaxKey  # noqa: E402  (beside the kernels' imports)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def test_softmax_compiles(arch, dtype, mode):
    for N in NORM_WIDTHS:
        assert callable(compiled_softmax(SoftmaxKey(mode, dtype, N, arch)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_softmax_forward_windows_compile(arch, dtype):
    """Rows off 16-byte boundaries whose accesses would hold at most 4 bytes, read through aligned windows:
    several rows a CTA, one, and a cluster (the window's launch is an aligned row's of its width); aligned
    rows and rows of 8-byte accesses keep their own kernel."""
    from oink.kernels.softmax_rules import softmax_window

    bits = DTYPES[dtype]
    for N in (7, 455, 5135, 94558, 4096, 1348, 94556):
        key = SoftmaxKey("forward", dtype, N, arch, window=True)
        windowed = math.gcd(N, 128 // bits) * bits <= 32
        assert (softmax_window(key) is not None) == windowed
        if windowed:
            assert softmax_window(key) >= N + 128 // bits - 1
        fn = compiled_softmax(key)
        assert callable(fn) and (fn is compiled_softmax(SoftmaxKey("forward", dtype, N, arch))) != windowed


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("online", ["1", "0"])
def test_softmax_reduction_rounds_both_ways_compile(monkeypatch, arch, online):
    """The A/B switch's sides the defaults do not take: one round in forwards within a CTA and over a
    cluster of 8, two rounds in the fused forward+backward."""
    set_dev(monkeypatch, softmax_online=online == "1")
    for mode in ("forward", "fwd_bwd"):
        for N in (1000, 65536):
            assert callable(compiled_softmax(SoftmaxKey(mode, "bfloat16", N, arch)))


def test_softmax_merges_online_where_it_was_measured_faster():
    from oink.kernels.softmax_rules import online_reduction

    one_cta, cluster8, cluster16 = (RowLaunch(N=262144, vec=8, threads_per_row=256, num_threads=256, cluster_n=c)
                                    for c in (1, 8, 16))
    assert online_reduction(one_cta, "fwd_bwd") and online_reduction(cluster16, "fwd_bwd")
    assert online_reduction(cluster16, "forward")
    assert not online_reduction(one_cta, "forward") and not online_reduction(cluster8, "forward")


from oink.kernels.cross_entropy import MODES as CE_MODES  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy  # noqa: E402  (after the cutlass importorskip)

# vocabularies: tiny and odd (scalar loads), one warp, the forward's CTAs of 64 threads (3072; an odd
# 8322's window and 9216: 18 accesses a thread), Llama-2's 32000 (forward: 2 CTAs of 256),
# GPT-2's odd 50257 and cl100k's odd 100277 (shifted rows: an aligned window, the dlogits stored
# through it; scalar accesses where dlogits' rows lie elsewhere), Llama-3's 128256 (forward: 8 CTAs)
# and the widest
CE_WIDTHS = [7, 64, 1000, 3072, 8322, 9216, 32000, 50257, 65536, 100277, 128256, 262144]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", CE_MODES)
def test_cross_entropy_compiles(arch, dtype, mode):
    for N in CE_WIDTHS:
        assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch)))
    assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int32", 4096, arch)))
    for N in (8322, 50257, 100277):  # element accesses, not windows: the default for the reductions' odd rows
        assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch, window=False)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["backward", "fwd_bwd"])
def test_cross_entropy_in_place_compiles(arch, dtype, mode):
    """dlogits over the logits (the rows' barrier before the stores, the fused mode's loss from the
    target's thread): one row a CTA, several, a cluster, a shifted window, with options; no spill."""
    from oink.kernels.cross_entropy_rules import CEOptions
    from oink.kernels.profile import compiled_resources
    from tests.helpers import set_knob

    with pytest.MonkeyPatch.context() as mp:
        set_knob(mp, "OINK_KEEP_CUBIN", "1")
        for N, o in [(1000, None), (32000, None), (50257, None), (128256, None), (262144, None),
                     (128256, CEOptions(0.1, 1e-4, 30.0)), (50257, CEOptions(0.0, 0.0, 30.0))]:
            fn = compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch, options=o or CEOptions(),
                                                        inplace=True))
            assert compiled_resources(fn)["frame_bytes"] == 0, (N, o)
    with pytest.raises(ValueError, match="in place"):
        from oink.kernels.cross_entropy import CrossEntropy
        from oink.kernels.cross_entropy_rules import cross_entropy_launch
        from oink.kernels.compile import cute_dtype

        CrossEntropy(cross_entropy_launch(4096, 16, arch), cute_dtype(dtype), cute_dtype("int64"), "forward",
                     inplace=True)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", CE_MODES)
def test_cross_entropy_streamed_rows_compile(monkeypatch, arch, dtype, mode):
    """Streamed rows forced at every width (one pass, several, a partial last one, clusters; odd
    widths through aligned windows, or element accesses where dlogits' rows lie elsewhere), and the
    register-held forward at widths that stream by default (the A/B switch's other side)."""
    from oink.kernels import cross_entropy_rules as rules

    set_dev(monkeypatch, ce_stream=True)
    for N in [7, 1000, 32000, 50257, 200008, 262144]:
        assert rules.stream_rows(N, 16, mode)
        assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch)))
    assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", 50257, arch, window=False)))
    if mode == "forward":
        set_dev(monkeypatch, ce_stream=False)
        for N in [65536, 262144]:
            assert not rules.stream_rows(N, 16, mode)
            assert callable(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch)))


def test_cross_entropy_streams_wide_rows(monkeypatch):
    from oink.kernels import cross_entropy as ce
    from oink.kernels import cross_entropy_rules as rules

    set_dev(monkeypatch, ce_stream=None)
    # 16-bit rows past 64 threads x 18 accesses stream, fp32 rows past 4096 accesses
    assert not rules.stream_rows(9216, 16) and rules.stream_rows(9224, 16) and rules.stream_rows(32000, 16)
    assert not rules.stream_rows(16384, 32) and rules.stream_rows(16388, 32)
    assert not rules.stream_rows(128256, 16, "backward") and not rules.stream_rows(128256, 16, "fwd_bwd")
    assert [rules.stream_launch(N, 16).cluster_n for N in (32000, 128256, 256000)] == [1, 2, 4]
    assert [rules.stream_launch(N, 16).threads_per_row for N in (9224, 32768, 32776, 128256)] == [128, 128, 256, 256]
    # held forward rows of 257-1152 accesses: one CTA of 64 threads, aligned or a shifted window
    for N in (2056, 2512, 4008, 9216):
        for shifted in (False, True):
            L = rules.cross_entropy_launch(N, 16, "sm_90a", "forward", shifted)
            assert (L.threads_per_row, L.num_threads, L.cluster_n) == (64, 64, 1), (N, L)
    assert rules.cross_entropy_launch(2048, 16, "sm_90a").num_threads == 128  # 4 accesses a thread: 2 rows a CTA
    assert rules.cross_entropy_launch(4008, 16, "sm_90a", "backward").threads_per_row != 64
    two_rows = RowLaunch(N=4096, vec=8, threads_per_row=128, num_threads=256)
    with pytest.raises(ValueError, match="streamed row"):
        ce.CrossEntropy(two_rows, None, None, "forward", stream=True)


def test_cross_entropy_launch_covers_clusters():
    from oink.kernels.cross_entropy_rules import cross_entropy_launch

    assert {cross_entropy_launch(N, 16, "sm_90a").cluster_n for N in CE_WIDTHS} >= {1, 2, 4, 8}
    assert cross_entropy_launch(262144, 32, "sm_90a").cluster_n == 8


def test_host_row_layout_and_vectors():
    """Activations are read as [M, N] rows (a 1-D input is one row, leading dims flattened); only layouts
    the 128-bit loads can't read are copied (``dense``), into aligned memory."""
    import torch

    from oink.kernels.host import dense, prepare_vector, row_layout

    assert row_layout(torch.randn(64), 8) == (False, 64)
    assert row_layout(torch.randn(3, 5, 64), 8) == (False, 64)  # a view, no copy
    assert row_layout(torch.randn(4, 72)[:, :64], 8) == (False, 72)  # padded rows: no copy
    odd = torch.randn(4 * 64 + 1)[1:].view(4, 64)  # 4-byte offset: misaligned for 16-byte loads
    assert row_layout(odd, 8) == (True, 64)
    fixed = dense(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)
    strided = torch.randn(4, 128)[:, ::2]
    assert row_layout(strided, 8) == (True, 64)
    assert dense(strided).is_contiguous() and torch.equal(dense(strided), strided)
    w = torch.randn(64)
    assert prepare_vector(w, 8) is w and prepare_vector(None, 8) is None
    w_odd = torch.randn(65)[1:]
    assert prepare_vector(w_odd, 8).data_ptr() % 16 == 0 and torch.equal(prepare_vector(w_odd, 8), w_odd)


# Quack's arguments (#16): Gemma's weight offset, an output dtype other than x's, an fp32
# residual stream with 16-bit activations, and weights of any float dtype (bf16 with fp16 or fp32 x).
@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("x,w", [("float16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float16"),
                                 ("bfloat16", "float32")])
def test_rmsnorm_mixed_weight_dtypes_compile(arch, x, w):
    for N in (769, 4096):
        assert callable(compiled_forward(ForwardKey(x, N, arch, w_dtype=w, b_dtype=w, store_rstd=True)))
        assert callable(compiled_backward(BackwardKey(x, N, arch, w_dtype=w, dout_dtype=x, has_db=True)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("N", [1000, 4096, 131072])
def test_rmsnorm_quack_arguments_compile(arch, dtype, N):
    # weight offset, forward and backward (dx reads w + offset)
    assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype="float32", store_rstd=True,
                                                weight_offset=1.0)))
    assert callable(compiled_backward(BackwardKey(dtype, N, arch, w_dtype="float32", dout_dtype=dtype,
                                                  weight_offset=1.0)))
    # fp32 residual stream (residual in, sum out) with 16-bit x and output; fp32 output of bf16 x
    assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype="float32", res_dtype="float32",
                                                res_out_dtype="float32", store_rstd=True)))
    assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype="float32", res_dtype=dtype,
                                                res_out_dtype="float32", store_rstd=True)))
    assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype="bfloat16", out_dtype="float32")))
    # the backward of an fp32 residual stream: x (the stored sum) fp32, dout 16-bit, dresidual fp32
    assert callable(compiled_backward(BackwardKey("float32", N, arch, w_dtype="bfloat16", dout_dtype=dtype,
                                                  dres_dtype="float32")))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_layernorm_ragged_widths_compile(arch):
    # ragged widths take the padding-lane mask in the variance (N not a multiple of the row tile)
    for dtype in DTYPES:
        for N in (769, 1128, 4097):
            assert callable(compiled_forward(ForwardKey(dtype, N, arch, w_dtype="float32", b_dtype="float32",
                                                        store_rstd=True, layernorm=True, store_mean=True)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("D,heads", [(64, 4), (128, 8), (128, 32), (256, 40)])
def test_per_head_norm_compiles(arch, D, heads):
    # QK-norm: weight/bias [H, D], row r of x [..., H, D] takes head r % H
    from oink.kernels.rmsnorm_bwd_rules import backward_launch, head_launch

    assert callable(compiled_forward(ForwardKey("bfloat16", D, arch, w_dtype="float32", b_dtype="float32",
                                                store_rstd=True, heads=heads)))
    L = head_launch(backward_launch(D, 16, arch), heads)
    assert L is not None and L.rows_per_cta % heads == 0
    assert callable(compiled_backward(BackwardKey("bfloat16", D, arch, w_dtype="float32", dout_dtype="bfloat16",
                                                  has_db=True, heads=heads)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("late", ["0", "1"])
def test_forward_parameter_load_variants_compile(arch, late, monkeypatch):
    """Both placements of the forward's weight and bias loads, forced (``fwd_late``), for LayerNorm,
    RMSNorm with a residual and a wider weight, and per-head parameters, at even and uneven widths."""
    set_dev(monkeypatch, fwd_late=late == "1")
    for N in (1000, 16384, 131072):
        assert callable(compiled_forward(ForwardKey("bfloat16", N, arch, w_dtype="bfloat16", b_dtype="bfloat16",
                                                    store_rstd=True, layernorm=True, store_mean=True)))
        assert callable(compiled_forward(ForwardKey("float16", N, arch, w_dtype="float32", res_dtype="float16",
                                                    res_out_dtype="float32")))
    assert callable(compiled_forward(ForwardKey("bfloat16", 128, arch, w_dtype="bfloat16", heads=4)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_forward_stages_rows_where_the_tile_fits(arch, monkeypatch):
    """``fwd_stage=True`` stages the forward's rows in shared memory (RMSNorm, a wider weight, LayerNorm with its
    statistics) wherever the tile fits STAGE_MAX_BYTES, padded (1000, 67810) or not (the cases
    tests/test_wide_rows_gpu.py runs on a GPU), and never otherwise; a residual never (``stage_rows``); False
    never."""
    from oink.kernels.profile import ROW_FAMILIES
    from oink.kernels.rmsnorm_rules import STAGE_MAX_BYTES, ran_staged

    set_dev(monkeypatch, fwd_stage=True)
    for family in ("rmsnorm_fwd", "rmsnorm_fwd_w32", "rmsnorm_fwd_res", "layernorm_fwd"):
        for dtype, N in (("bfloat16", 4096), ("bfloat16", 262144), ("float32", 262144), ("bfloat16", 1000),
                         ("bfloat16", 67810)):
            CACHE.clear_used()
            assert callable(ROW_FAMILIES[family](dtype, N, arch))
            (tpr, nt, cluster_n), = CACHE.used_launches()
            tile_bytes = nt // tpr * N // cluster_n * (2 if dtype == "bfloat16" else 4) * (
                2 if family == "rmsnorm_fwd_res" else 1)  # x, and the residual of its dtype
            fits = tile_bytes <= STAGE_MAX_BYTES and family != "rmsnorm_fwd_res"
            assert ran_staged(CACHE.used) == fits, (family, dtype, N, CACHE.used_launches())
    set_dev(monkeypatch, fwd_stage=False)
    CACHE.clear_used()
    ROW_FAMILIES["layernorm_fwd"]("bfloat16", 4096, arch)
    assert not ran_staged(CACHE.used)


from oink.kernels.rmsnorm_bwd import compiled_split_backward  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.rmsnorm_bwd_rules import split_rows  # noqa: E402  (after the cutlass importorskip)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_one_row_backward_storing_dweight_compiles(arch):
    """The backward that stores dweight / dbias in the weight's dtype (one row, ``direct_sums``): RMSNorm
    with a bf16, an fp32 or no weight and a bias, LayerNorm, per-row and clustered widths."""
    for N in (4096, 131072):
        for w in ("bfloat16", "float32", None):
            assert callable(compiled_backward(BackwardKey("bfloat16", N, arch, w_dtype=w, dout_dtype="bfloat16",
                                                          dres_dtype="bfloat16", has_db=True, few=True, direct=True)))
        assert callable(compiled_backward(BackwardKey("float32", N, arch, w_dtype="float32", dout_dtype="float32",
                                                      has_db=True, layernorm=True, few=True, direct=True)))


def test_split_backward_takes_rows_too_wide_for_one_kernel(monkeypatch):
    """The split where a thread of the largest cluster the arch takes would hold too much of a row:
    SM90's cluster of 16 holds 131072 columns (bf16 and fp32), SM100's portable 8 only 65536."""
    from oink.kernels.rmsnorm_bwd_rules import _fitted_launch

    for bits in (16, 32):
        for layernorm in (False, True):
            for N in (8192, 65536, 73728, 98304, 131072):
                assert not split_rows(N, bits, "sm_90a", layernorm), (N, bits, layernorm)
                heuristic = _fitted_launch(N, bits, "sm_90a", layernorm)[0]  # not the table's
                portable = _fitted_launch(N, bits, "sm_100a", layernorm)[0]
                assert heuristic.cluster_n == (16 if N > 65536 else portable.cluster_n)
            for N in (131072 + 64, 151936, 262144):
                assert split_rows(N, bits, "sm_90a", layernorm), (N, bits, layernorm)
            assert not split_rows(65536, bits, "sm_100a", layernorm)
            assert split_rows(73728, bits, "sm_100a", layernorm)
    set_dev(monkeypatch, bwd_split=False)
    assert not split_rows(262144, 16, "sm_90a", False)
    set_dev(monkeypatch, bwd_split=True)
    assert split_rows(4096, 16, "sm_90a", False)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layernorm", [False, True])
def test_split_backward_compiles(arch, dtype, layernorm):
    """Both split kernels, at the widths that take them (200000: a partial last chunk), with the
    weight of x's dtype and no dbias, or an fp32 weight with dbias (RMSNorm: and dresidual_out)."""
    for N in (131072, 200000, 262144):
        for w, has_db, dres in ((dtype, False, None), ("float32", True, None if layernorm else dtype)):
            fn_a, fn_b, chunks = compiled_split_backward(BackwardKey(dtype, N, arch, w_dtype=w, dout_dtype=dtype,
                                                                     dres_dtype=dres, has_db=has_db,
                                                                     layernorm=layernorm))
            assert callable(fn_a) and callable(fn_b) and chunks > 1
        if not layernorm:
            assert callable(compiled_split_backward(BackwardKey(dtype, N, arch, dout_dtype=dtype))[1])
