"""Tensor-free compilation of the CuTeDSL kernels for sm_90a and sm_100a (runs on CPU in CI)."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")

from oink.kernels.compile import CACHE, SUPPORTED_ARCHS  # noqa: E402
from oink.kernels.reduction import RowLaunch, pick_row_launch  # noqa: E402
from oink.kernels.rowsumsq import compiled_rowsumsq  # noqa: E402

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
