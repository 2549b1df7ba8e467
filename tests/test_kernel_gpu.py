"""GPU runs of the CuTeDSL kernels against float64 (skipped without a Hopper/Blackwell GPU)."""
from __future__ import annotations

import pytest
import torch

from tests.gpu_helpers import shapes_within

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N", shapes_within([1, 3, 128, 4097], [8, 64, 1000, 4096, 16384, 131072, 262144], 2**28))
@pytest.mark.parametrize("padded", [False, True])
def test_rowsumsq_matches_float64(dtype, M, N, padded, seed):
    from oink.kernels.rowsumsq import rowsumsq

    torch.manual_seed(seed)
    base = torch.randn(M, N + (16 if padded else 0), device="cuda", dtype=dtype)
    x = base[:, :N]
    out = torch.full((M,), float("nan"), device="cuda")  # poison: every row must be written
    rowsumsq(x, out=out)
    torch.cuda.synchronize()
    expect = (x.double() ** 2).sum(1)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-6)
