"""The launch rules on a CPU, without cutlass: every rules module (``oink/kernels/*_rules.py``, with the shared
``row_rules`` and ``launch_table``) imports where cutlass, the CUDA bindings and torch are absent, and the rules give
the launches they should. The tests below run twice: here, and in a fresh interpreter with those packages blocked
(``test_the_rules_tests_pass_without_cutlass``)."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from tests.fresh import python_without

ROOT = Path(__file__).resolve().parents[1]
RULES = sorted(f"oink.kernels.{p.stem}" for p in (ROOT / "oink" / "kernels").glob("*rules.py")) + [
    "oink.kernels.launch_table"]
KERNEL_STACK = ("cutlass", "cuda", "torch")

def _python(code: str) -> subprocess.CompletedProcess:
    # no plugin of the environment either (the plugin's stack needs torch)
    return python_without(KERNEL_STACK, code, ROOT, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def test_every_rules_module_is_found():
    assert {"oink.kernels.row_rules", "oink.kernels.rmsnorm_rules", "oink.kernels.rmsnorm_bwd_rules",
            "oink.kernels.cross_entropy_rules", "oink.kernels.softmax_rules", "oink.kernels.fp8_rules",
            "oink.kernels.nvfp4_rules", "oink.kernels.rope_rules"} <= set(RULES)


def test_the_rules_import_without_cutlass():
    out = _python(f"import importlib\nfor m in {RULES!r}:\n    importlib.import_module(m)\n"
                  "print(sorted({m.partition('.')[0] for m in sys.modules} & set(BLOCKED)))")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_the_rules_tests_pass_without_cutlass():
    out = _python(f"import pytest\nsys.exit(pytest.main([{__file__!r}, '-q', '-p', 'no:cacheprovider', "
                  "'--noconftest', '-k', 'not without_cutlass']))")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


def test_dtype_bits_match_the_cute_dtypes():
    """``row_rules.dtype_bits`` (what the rules know of a dtype) agrees with the kernels' ``compile.cute_dtype``."""
    pytest.importorskip("cutlass")
    from oink.kernels.compile import _CUTE_DTYPES, cute_dtype
    from oink.kernels.row_rules import DTYPE_BITS, dtype_bits

    assert set(DTYPE_BITS) == set(_CUTE_DTYPES)
    for name in DTYPE_BITS:
        assert dtype_bits(name) == cute_dtype(name).width == dtype_bits(f"torch.{name}")
    with pytest.raises(TypeError):
        dtype_bits("complex64")


def test_the_forwards_launch_from_its_key():
    """``forward_launch_of``: the launch-table key names the family, window and widths; the staged rule's launch
    (16-bit RMSNorm rows of 4-element accesses past 16384 columns) keeps room for its CTAs."""
    from oink.kernels.rmsnorm_rules import ForwardKey, forward_launch_of, staged_min_ctas, staged_rows

    key, launch = forward_launch_of(ForwardKey("bfloat16", 4096, "sm_90a", w_dtype="float32"))
    assert key == "rmsnorm_fwd/x16w32" and launch.N == 4096
    key, _ = forward_launch_of(ForwardKey("bfloat16", 1001, "sm_90a", w_dtype="bfloat16", layernorm=True,
                                          window=True))
    assert key == "layernorm_fwd_window/x16w16"
    staged = staged_rows(ForwardKey("bfloat16", 65540, "sm_90a", w_dtype="bfloat16"))
    assert staged is not None and staged.vec == 4 and staged.num_threads == 256
    assert staged_min_ctas(staged) == 4  # 13 accesses or fewer a thread: 4 CTAs a SM
    assert staged_rows(ForwardKey("bfloat16", 65540, "sm_90a", w_dtype="bfloat16", res_dtype="bfloat16")) is None


def test_the_split_backward_covers_a_row_in_chunks():
    from oink.kernels.rmsnorm_bwd_rules import SPLIT_ROW_GROUPS, split_groups, split_launches

    a, b = split_launches(262144, 16)
    for launch in (a, b):
        assert launch.rows_per_cta == 1 and launch.cluster_n * launch.threads_per_row * launch.iters * 8 >= 262144
    assert split_groups(1) == 1 and split_groups(10 ** 6) == SPLIT_ROW_GROUPS


def test_forward_loads_parameters_late_where_registers_limit_it():
    """``late_params``: the LayerNorm forward from 12288 columns (rows of narrow accesses past 4096 columns and
    20 values a thread), a wider weight in CTAs of 1024 threads; never for a plain RMSNorm, and never by the row
    count (it takes none: batch invariance)."""
    from oink.kernels.row_rules import RowLaunch
    from oink.kernels.rmsnorm_rules import late_params

    def launch(N, threads=512):
        return RowLaunch(N=N, vec=math.gcd(N, 8), threads_per_row=threads, num_threads=threads)

    assert late_params(launch(16384), True, False)
    assert not late_params(launch(8192), True, False)
    assert late_params(launch(5124, 256), True, False, narrow=True)  # 24 values a thread
    assert not late_params(launch(4100, 256), True, False, narrow=True)  # 20
    assert not late_params(launch(4094, 128), True, False, narrow=True)  # past 20, not past 4096 columns
    assert not late_params(launch(5124, 256), False, False, narrow=True)
    assert late_params(launch(16384, 1024), False, True)
    assert not late_params(launch(18432, 576), False, True)
    assert not late_params(launch(262144), False, True)
    assert not late_params(launch(16384, 1024), False, False)


def test_a_residual_is_never_staged(monkeypatch):
    """``stage_rows``: a tile with a residual is never staged, whatever the table or the ``fwd_stage`` setting asks
    (staged with its fp32 residual, the forward gave other bits at identical calls on an H100); without one, the
    table's choice or the setting."""
    from oink import config
    from oink.kernels.row_rules import RowLaunch
    from oink.kernels.rmsnorm_rules import stage_rows

    launch = RowLaunch(N=131072, vec=8, threads_per_row=128, num_threads=128, cluster_n=8)
    assert stage_rows(launch, 16, 0, True) and not stage_rows(launch, 16, 0, False)
    assert not stage_rows(launch, 16, 32, True) and not stage_rows(launch, 16, 16, True)
    with config.override(fwd_stage=True):
        assert not stage_rows(launch, 16, 32, False) and stage_rows(launch, 16, 0, False)


def test_direct_sums_only_for_one_cta_of_one_row():
    from oink.kernels.rmsnorm_bwd_rules import direct_sums
    from oink.kernels.row_rules import RowLaunch

    one = RowLaunch(N=4096, vec=8, threads_per_row=256, num_threads=256)
    two_rows = RowLaunch(N=512, vec=8, threads_per_row=64, num_threads=128)
    assert direct_sums(one, 1, 1) and direct_sums(one, 1, 1000)  # one CTA walks every row
    assert direct_sums(RowLaunch(N=131072, vec=8, threads_per_row=512, num_threads=512, cluster_n=16), 1, 1)
    assert not direct_sums(one, 2, 2)  # two CTAs: two partial rows to add
    assert direct_sums(two_rows, 1, 1) and not direct_sums(two_rows, 1, 2)  # two rows a CTA: only for one row
    assert not direct_sums(one, 1, 1, heads=2)


# searched winners on the H100 (launch_table.json before the rules) that the wide-row rule gives unaided
SEARCHED = [(18432, 8, 16, (192, 192, 4)), (131072, 8, 16, (128, 128, 16)), (262144, 8, 16, (256, 256, 16))]


@pytest.mark.parametrize("N,vec,cluster,shape", SEARCHED)
def test_the_wide_row_rule_finds_the_searched_winners(N, vec, cluster, shape):
    from oink.kernels.row_rules import cluster_rows

    L = cluster_rows(N, vec, cluster)
    assert (L.threads_per_row, L.num_threads, L.cluster_n) == shape


@pytest.mark.parametrize("cluster", [8, 16])
@pytest.mark.parametrize("vec", [1, 4, 8])
def test_the_wide_row_rule_between_measured_widths(vec, cluster):
    """At every width (odd ones too): a valid launch within the cluster limit and 1024 threads; a CTA's
    share tiled exactly wherever a whole-warp tiling of at most 8 accesses exists; at most 8 accesses a
    thread unless even 1024 threads of the widest cluster need more."""
    import math

    from oink.kernels.row_rules import CLUSTER_ROWS_MIN_N, cluster_rows

    for N in sorted({int(2 ** (14 + 4 * i / 97)) // vec * vec for i in range(98)}):
        if N <= CLUSTER_ROWS_MIN_N:
            continue
        L = cluster_rows(N, vec, cluster)
        assert L.cluster_n <= cluster and L.num_threads <= 1024 and L.rows_per_cta == 1
        assert L.iters <= 8 or (L.threads_per_row == 1024 and L.cluster_n == cluster), L
        share = N // vec / L.cluster_n
        exact = share == int(share) and any(
            share % it == 0 and (share // it) % 32 == 0 and share // it <= 1024 for it in range(1, 9))
        assert L.even_n or not exact, L
        assert math.ceil(N / vec / (L.threads_per_row * L.cluster_n)) == L.iters


def test_narrow_access_rows_count_values_a_thread():
    """A 16-bit row whose width is not a multiple of 8 takes as many values a thread as an aligned row of
    the same width (more, narrower accesses), within ``NARROW_ROWS_N`` only; aligned rows, fp32 and rows
    outside it keep the family's launch."""
    from oink.kernels.row_rules import NARROW_ROWS_N, narrow_rows

    for N in (4097, 4619, 4750, 8077, 9116, 16383):
        L = narrow_rows(N, 16)
        assert L.vec < 8 and L.cluster_n == 1 and 16 < L.iters * L.vec <= 32  # values a thread: 2-4 aligned units
    assert narrow_rows(8077, 16).threads_per_row == 256  # 32 one-element accesses, not 1024 threads over 2 CTAs
    assert narrow_rows(8192, 16) is None and narrow_rows(8077, 32) is None
    assert narrow_rows(NARROW_ROWS_N[0], 16) is None and narrow_rows(NARROW_ROWS_N[1] + 1, 16) is None


def test_short_and_even_narrow_rows_count_values_in_the_norm_forwards():
    """With ``short`` (the norm forwards), rows of 2-element accesses count values a thread at any width up to
    16384, rows of 4 up to ``NARROW_SHORT_N`` columns (a row of up to 32 values a thread then fits a warp);
    odd widths (1-element accesses, read through windows) and rows of 4 between it and 4096 do not."""
    from oink.kernels.row_rules import NARROW_SHORT_N, narrow_rows

    for N in (6, 210, 746, 1018, 1030, 2050, 3078, 4094):
        L = narrow_rows(N, 16, 4, NARROW_SHORT_N)
        assert L.vec == 2 and L.cluster_n == 1 and L.iters * L.vec <= 32, L
        assert N < 1024 or 16 < L.iters * L.vec, L
        assert narrow_rows(N, 16) is None  # without it, the range starts past 4096
    for N in (300, 644, 1020):
        L = narrow_rows(N, 16, 4, NARROW_SHORT_N)
        assert L.vec == 4 and L.threads_per_row <= 32 and 16 < L.iters * L.vec <= 32, L
        assert narrow_rows(N, 16) is None
    assert narrow_rows(1027, 16, 4, NARROW_SHORT_N) is None  # odd: the windows' widths
    assert narrow_rows(1028, 16, 4, NARROW_SHORT_N) is None and narrow_rows(2052, 16, 4, NARROW_SHORT_N) is None
    assert narrow_rows(NARROW_SHORT_N, 16, 4, NARROW_SHORT_N) is None  # aligned


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_wide_narrow_access_rows_take_small_ctas_holding_more_values(arch):
    """Past ``CLUSTER_ROWS_MIN_N``, a 16-bit row of 2-element accesses takes CTAs of 256 threads
    holding up to ``NARROW_CLUSTER_VALUES`` values a thread (one padded access more) where a cluster holds
    it so, fewer threads a row than an access count gives; LayerNorm never clusters 16 CTAs of more
    than 256 threads; aligned rows, odd widths, rows of 4-element accesses, a wider weight and a residual
    keep ``cluster_rows``' launch."""
    from oink.kernels.row_rules import (CLUSTER_ROWS_MIN_N, MAX_CLUSTER, NARROW_CLUSTER_VALUES, WIDE_CLUSTER,
                                        cluster_rows, narrow_cluster_rows)
    from oink.kernels.rmsnorm_rules import forward_launch

    widest = WIDE_CLUSTER.get(arch, MAX_CLUSTER)
    for N in (16386, 20482, 33794, 49474, 67810, 98306, 131750):
        L = narrow_cluster_rows(N, 16, widest)
        assert L.vec == 2 and L.cluster_n <= widest
        assert L.num_threads == 256 or L.cluster_n == widest, L
        assert L.iters * L.vec <= NARROW_CLUSTER_VALUES + L.vec, L
        assert forward_launch(N, 16, arch) == L
        old = cluster_rows(N, L.vec, widest)
        assert L.threads_per_row * L.cluster_n <= old.threads_per_row * old.cluster_n and L.iters >= old.iters
    assert forward_launch(67810, 16, arch).num_threads == 256  # 1024 x 8 counted in accesses
    for N in (180226, 262142):  # a cluster of 16 would take 512-thread CTAs: LayerNorm keeps its cluster of 8
        ln = forward_launch(N, 16, arch, layernorm=True)
        assert ln.cluster_n <= MAX_CLUSTER or ln.num_threads <= 256
    for N, bits in ((65536, 16), (CLUSTER_ROWS_MIN_N + 1, 16), (67810, 32), (CLUSTER_ROWS_MIN_N - 2, 16),
                    (90116, 16)):
        assert narrow_cluster_rows(N, bits, widest) is None
    assert forward_launch(67810, 16, arch, w_bits=32) == cluster_rows(67810, 2, widest)
    assert forward_launch(67810, 16, arch, residual=True) == cluster_rows(67810, 2, widest)  # the fused add's
    assert forward_launch(1030, 16, arch, residual=True) != forward_launch(1030, 16, arch)


def test_backward_depth_one_where_several_rows_leave_an_access_idle():
    """RMSNorm's CTAs of several rows whose last access is partly idle take depth 1; even rows, one row a CTA
    and LayerNorm keep the family's depth; ``bwd_depth`` still wins."""
    from oink import config
    from oink.kernels.rmsnorm_bwd_rules import TUNING, backward_depth, backward_launch

    several = [backward_launch(N, 16, "sm_90a") for N in (368, 578, 904)]
    assert all(L.rows_per_cta > 1 and not L.even_n and backward_depth(L, False) == 1 for L in several)
    for N in (512, 1024, 1256, 8192):
        assert backward_depth(backward_launch(N, 16, "sm_90a"), False) == TUNING["rmsnorm"][2]
    assert backward_depth(several[0], True) == TUNING["layernorm"][2]
    with config.override(bwd_depth=2):
        assert backward_depth(several[0], False) == 2


def test_backward_pairs_of_narrow_rows_replace_a_cluster():
    """RMSNorm backward rows of 2-element accesses that the values' budget would split over a cluster take two
    rows of 128 threads a CTA up to ``NARROW_PAIR_VALUES`` values a thread; wider ones, LayerNorm, rows with a
    dresidual, fp32 and rows of 4-element accesses keep the rule before."""
    from oink.kernels.rmsnorm_bwd_rules import NARROW_PAIR_VALUES, backward_launch, split_rows, thread_values

    top = 128 * NARROW_PAIR_VALUES
    for arch in ("sm_90a", "sm_100a"):
        for N in (4098, 4702, top - 2):
            L = backward_launch(N, 16, arch)
            assert (L.threads_per_row, L.num_threads, L.cluster_n) == (128, 256, 1), (N, L)
            assert thread_values(L) <= NARROW_PAIR_VALUES
            assert not split_rows(N, 16, arch, False)  # the split kernels took these rows at 10x the time
        assert backward_launch(4094, 16, arch).cluster_n == 1 and backward_launch(4094, 16, arch).num_threads == 256
        for other in (backward_launch(top + 2, 16, arch), backward_launch(4702, 16, arch, layernorm=True),
                      backward_launch(4702, 16, arch, dres=True), backward_launch(4100, 16, arch)):
            assert other.threads_per_row != 128, other
        assert backward_launch(4702, 32, arch).threads_per_row == 512


def test_softmax_rules():
    """``softmax_launch``: the backward modes hold two rows' values, so their CTAs stop at 512 threads; a forward row
    past ``CLUSTER_ROWS_MIN_N`` spreads over a cluster; the fused mode always merges max and sum online, the forward
    only over clusters of 16. ``softmax_window``: forwards asked to, of accesses of at most 4 bytes, through windows
    holding the row wherever it starts in a 16-byte block."""
    from oink.kernels.row_rules import CLUSTER_ROWS_MIN_N
    from oink.kernels.softmax_rules import MODES, SoftmaxKey, online_reduction, softmax_launch, softmax_window

    for arch in ("sm_90a", "sm_100a"):
        for N in (1000, 4096, 65536, 262144):
            for bits in (16, 32):
                for mode in MODES[1:]:
                    L = softmax_launch(N, bits, arch, mode)
                    assert L.num_threads <= 512 and L.threads_per_row * L.iters * L.vec * L.cluster_n >= N, L
                    assert online_reduction(L, "fwd_bwd") or mode == "backward"
        wide = softmax_launch(2 * CLUSTER_ROWS_MIN_N, 16, arch)
        assert wide.cluster_n > 1 and online_reduction(wide, "forward") == (wide.cluster_n >= 16)
    for N, bits, windowed in ((1001, 16, True), (1002, 16, True), (1004, 16, False), (1001, 32, True),
                              (1002, 32, False)):
        dtype = {16: "bfloat16", 32: "float32"}[bits]
        width = softmax_window(SoftmaxKey("forward", dtype, N, "sm_90a", window=True))
        assert (width is not None) == windowed, (N, bits)
        assert width is None or (width >= N + 128 // bits - 1 and width * bits % 128 == 0)
        assert softmax_window(SoftmaxKey("forward", dtype, N, "sm_90a")) is None
        assert softmax_window(SoftmaxKey("backward", dtype, N, "sm_90a", window=True)) is None


def test_fp8_rules():
    """``whole_warp_launch``: the least padding over whole warps (its documented rows); ``fp8_launch``: a group stays
    on a warp's aligned lanes, rows past ``CTA_THREADS`` whole-warp threads spread over a cluster of CTAs of at most
    that many threads at two accesses (rows past whole warps at 4 accesses take the FP4 tiling), and a group no
    launch keeps aligned is refused."""
    import pytest as _pytest

    from oink.kernels.fp8_rules import CTA_THREADS, UNIT, fp8_launch, whole_warp_launch

    for N, tpr, iters in ((2560, 160, 1), (4992, 160, 2), (11008, 352, 2)):
        L = whole_warp_launch(N, UNIT)
        assert (L.threads_per_row, -(-N // UNIT // L.threads_per_row)) == (tpr, iters) and L.num_threads >= 128
    for arch in ("sm_90a", "sm_100a"):
        for N in (2048, 7168, 16384, 57344, 131072):
            for group in (0, 64, 128):
                L = fp8_launch(N, arch, "add_rmsnorm", group, op="rmsnorm")
                assert L.vec == UNIT and L.threads_per_row * L.iters * UNIT * L.cluster_n >= N
                assert not group or L.threads_per_row % (group // UNIT) == 0, (N, group, L)
                if L.cluster_n > 1 and whole_warp_launch(N, UNIT) is not None:  # the rule's rows, not the FP4 tiling's
                    assert L.threads_per_row <= CTA_THREADS and L.iters <= 2, (N, L)
        with _pytest.raises(ValueError, match="aligned lanes"):
            fp8_launch(2560, arch, "quantize", 1024)


def test_fp4_rule():
    """``fp4_launch``: a unit is one scale block; a thread takes the fewest units (1, 2, 4) that keep its row within
    the kernel's ``MAX_THREADS_PER_ROW``; the ``fp4_upt`` setting forces the count."""
    from oink import config
    from oink.kernels.nvfp4_rules import BLOCK, MAX_THREADS_PER_ROW, MX_BLOCK, fp4_launch

    for block in (BLOCK, MX_BLOCK):
        for kind, most in MAX_THREADS_PER_ROW.items():
            for N in (1024, 7168, 16384, 32768):
                L = fp4_launch(N, "sm_90a", kind, block)
                assert L.vec == block, L
                units = N // block
                assert L.iters in (1, 2, 4) and (L.iters == 4 or units <= L.iters * most), (kind, N, L)
                assert L.iters == 1 or units > L.iters // 2 * most, (kind, N, L)
    with config.override(fp4_upt=2):
        assert fp4_launch(1024, "sm_90a").iters == 2


def test_rope_rules():
    """``head_lanes``: one 16-byte load a lane (the ``rope_lanes`` setting forces a count); ``rotary_reason``: a
    rotary width whose lanes' values don't rotate together goes to the reference, with the reason."""
    from oink import config
    from oink.kernels.rope_rules import WARP, head_lanes, rotary_reason

    assert [head_lanes(D, bits) for D, bits in ((64, 16), (128, 16), (256, 16), (128, 32), (256, 32))] == \
        [8, 16, 32, 32, 32]
    with config.override(rope_lanes=WARP):
        assert head_lanes(128, 16) == WARP
    assert rotary_reason(128, 128, True, 16) is None and rotary_reason(128, 64, False, 16) is None
    assert "NeoX" in rotary_reason(128, 60, True, 16) and "multiple" in rotary_reason(128, 4, False, 16)
