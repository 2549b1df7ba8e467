"""Tensor-free compilation of the quantizing kernels (NVFP4 / MXFP4 and FP8, every scale mode and layout flag) for
sm_90a and sm_100a, and their launch rules (runs on CPU in CI); the row kernels': test_kernel_compile.py."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from oink.kernels.compile import SUPPORTED_ARCHS  # noqa: E402  (after the cutlass importorskip)

DTYPES = ("float32", "float16", "bfloat16")


# ---- FP4 (NVFP4 and MXFP4)
from oink.kernels.nvfp4 import MODES as FP4_MODES  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.nvfp4 import AddRMSNormFp4Key, Fp4Key, compiled_add_rmsnorm_fp4, compiled_fp4  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.nvfp4_rules import fp4_launch  # noqa: E402  (after the cutlass importorskip)

# one block, one warp, an odd block count (uneven rows), the study's widths, cluster widths
FP4_WIDTHS = [16, 64, 1008, 4096, 7168, 14336, 131072, 262144]  # units per thread 1, 2, 4; clusters


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", FP4_MODES)
@pytest.mark.parametrize("swizzled", [False, True])
def test_nvfp4_kernels_compile(arch, dtype, mode, swizzled):
    for N in FP4_WIDTHS:
        assert callable(compiled_fp4(Fp4Key(mode, dtype, N, arch, swizzled=swizzled)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("w", ["same", "float32"])
@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("store_y", [False, True])
def test_add_rmsnorm_fp4_compiles(arch, dtype, w, swizzled, store_y):
    wd = dtype if w == "same" else w
    for N in FP4_WIDTHS if (swizzled, store_y) == (False, False) else [1008, 7168]:
        assert callable(compiled_add_rmsnorm_fp4(AddRMSNormFp4Key(dtype, N, arch, res_dtype=dtype, w_dtype=wd,
                                                                  swizzled=swizzled, store_y=store_y)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("swizzled", [False, True])
def test_mxfp4_kernels_compile(arch, dtype, swizzled):
    for N in (32, 1056, 4096, 14336, 262144):  # units per thread 1, 2; clusters
        assert callable(compiled_fp4(Fp4Key("quantize", dtype, N, arch, swizzled=swizzled, mx=True)))
    for N in (1056, 14336, 262144):
        assert callable(compiled_fp4(Fp4Key("silu_mul", dtype, N, arch, swizzled=swizzled, mx=True)))
    for N in (1056, 7168, 262144):  # the fused RMSNorm: one unit, two, clusters
        w = "float32" if dtype == "bfloat16" else dtype
        assert callable(compiled_add_rmsnorm_fp4(AddRMSNormFp4Key(dtype, N, arch, res_dtype=dtype, w_dtype=w,
                                                                  swizzled=swizzled, store_y=N == 7168, mx=True)))


def test_nvfp4_launch_units_are_scale_blocks():
    for N in FP4_WIDTHS:
        L = fp4_launch(N, "sm_90a")
        assert L.vec == 16 and L.iters <= 4
    assert {fp4_launch(N, "sm_90a").cluster_n for N in FP4_WIDTHS} >= {1, 2, 4}
    with pytest.raises(ValueError, match="multiple of 16"):
        compiled_fp4(Fp4Key("quantize", "bfloat16", 1000, "sm_90a"))


# ---- FP8 (every scale mode and layout flag is a compile-time variant)
from oink.kernels.fp8 import Fp8Key, RMSNormFp8Key, compiled_fp8, compiled_rmsnorm_fp8  # noqa: E402  (after the cutlass importorskip)
from oink.kernels.fp8_rules import fp8_launch  # noqa: E402  (after the cutlass importorskip)

FP8_MODES = [("static", 0, False, False, False), ("token", 0, False, False, False), ("token", 0, False, False, True)]
FP8_MODES += [("group", g, cm, ue, False) for g in (64, 128) for cm in (False, True) for ue in (False, True)]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["quantize", "silu_mul"])
@pytest.mark.parametrize("mode", FP8_MODES, ids=lambda m: "-".join(map(str, m)))
def test_fp8_quantizers_compile(arch, dtype, kind, mode):
    mode_name, G, cm, ue, ub = mode
    for N in (128, 7168, 18432):  # one row a warp's worth, a predicated tail, several units a thread
        assert callable(compiled_fp8(Fp8Key(kind, dtype, N, arch, mode=mode_name, group_size=G, column_major=cm,
                                            ue8m0=ue, ub=ub)))


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("x_dtype,res_dtype,w_dtype", [("bfloat16", "bfloat16", "bfloat16"),
                                                       ("float16", "float16", "float32"),
                                                       ("float32", None, "float32"),
                                                       ("bfloat16", "float32", "float32"),
                                                       ("bfloat16", None, "bfloat16")])
@pytest.mark.parametrize("mode", FP8_MODES[:3] + [FP8_MODES[3], FP8_MODES[-1]], ids=lambda m: "-".join(map(str, m)))
@pytest.mark.parametrize("store_y", [False, True])
def test_fp8_fused_rmsnorm_compiles(arch, x_dtype, res_dtype, w_dtype, mode, store_y):
    mode_name, G, cm, ue, ub = mode
    for N in (4096, 7168, 131072):  # 131072: a cluster of CTAs a row (the per-token amax crosses CTAs)
        assert callable(compiled_rmsnorm_fp8(RMSNormFp8Key(x_dtype, N, arch, w_dtype=w_dtype, res_dtype=res_dtype,
                                                           mode=mode_name, group_size=G, column_major=cm, ue8m0=ue,
                                                           ub=ub, store_y=store_y)))


VLLM_VARIANTS = [dict(mode="static"), dict(mode="static", residual=True), dict(mode="token", ub=True),
                 dict(mode="token", residual=True, raw_sum=True),
                 dict(mode="block", group_size=128, residual=True, raw_sum=True, ub=True),
                 dict(mode="block", group_size=64, column_major=True, ue8m0=True)]


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("variant", VLLM_VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_vllm_fp8_norms_compile(arch, dtype, variant):
    """vLLM's four norm + FP8 ops' kernel (``twice``: vLLM's roundings), at a one-CTA width and a cluster's."""
    v = dict(variant)
    res = dtype if v.pop("residual", False) else None
    for N in (4096, 131072):
        assert callable(compiled_rmsnorm_fp8(RMSNormFp8Key(dtype, N, arch, w_dtype=dtype, res_dtype=res, twice=True,
                                                           **v)))


def test_fp8_groups_stay_on_aligned_lanes():
    for N in (64, 128, 1024, 7168, 18432, 131072):
        for G in (64, 128):
            if N % G == 0:
                L = fp8_launch(N, "sm_90a", "quantize", G)
                assert L.vec == 16 and L.threads_per_row % (G // 16) == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        compiled_fp8(Fp8Key("quantize", "bfloat16", 24, "sm_90a", mode="token"))


# ---- the fused QK norm + rotary embedding (every flag is a compile-time variant; T, the row stride, eps and
# the cache's length are runtime)
from oink.kernels.rope import RopeKey, compiled_qk_norm_rope  # noqa: E402  (after the importorskip)
from oink.kernels.rope_rules import head_lanes, rotary_reason  # noqa: E402  (after the importorskip)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
@pytest.mark.parametrize("D,rd", [(64, 64), (64, 16), (128, 128), (128, 32), (256, 256), (256, 96)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype,w_dtype,cache_dtype,pos_dtype", [("bfloat16", "bfloat16", "bfloat16", "int64"),
                                                                  ("float16", "float32", "float32", "int32")])
@pytest.mark.parametrize("out_of_place,offset", [(False, 0.0), (True, 1.0)])
@pytest.mark.parametrize("lanes", ["16-byte", 32])
def test_qk_norm_rope_compiles(arch, D, rd, neox, dtype, w_dtype, cache_dtype, pos_dtype, out_of_place, offset,
                               lanes):
    lanes = head_lanes(D, 16) if lanes == "16-byte" else lanes
    key = RopeKey(dtype, w_dtype, cache_dtype, pos_dtype, D, rd, neox, 40, 8, arch, weight_offset=offset,
                  out_of_place=out_of_place, lanes=lanes)
    if rotary_reason(D, rd, neox, lanes):
        with pytest.raises(ValueError, match="rotary_dim"):
            compiled_qk_norm_rope(key)
    else:
        assert callable(compiled_qk_norm_rope(key))


def test_rotary_widths_the_kernel_takes():
    assert head_lanes(128, 16) == 16 and head_lanes(64, 16) == 8 and head_lanes(256, 16) == 32
    assert rotary_reason(128, 128, True) is None and rotary_reason(128, 8, True) is None
    assert "not a multiple" in rotary_reason(128, 12, True) and rotary_reason(128, 12, False) is None
    assert "not a multiple" in rotary_reason(256, 96 + 8, True)
    assert rotary_reason(128, 64, False, 16) is None and "not a multiple" in rotary_reason(128, 68, False, 16)
