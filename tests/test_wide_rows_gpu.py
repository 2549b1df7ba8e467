"""The launch shapes the heuristics pick for wide rows (clusters, whole-warp tilings within a
cluster, capped CTAs: see pick_row_launch and tests/test_spills.py) run correctly: every row op,
through its public call, against its reference (the benchmark gate: 3 seeds, float64 reference),
at a partial CTA and a full wave of rows."""
from __future__ import annotations

import pytest

from pytest_oink.suites import Case

OPS = ("rmsnorm_forward", "rmsnorm_forward_w32", "fused_add_rmsnorm_", "layernorm", "rmsnorm_backward",
       "layernorm_backward", "softmax_forward", "softmax_backward", "softmax_fwd_bwd")
CE_OPS = ("cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd")
WIDE = (12288, 14336, 18432, 28672, 65536)
VOCABS = (128256, 151936, 201088, 256000)
CASES = [(op, N) for op in OPS for N in WIDE] + [(op, N) for op in CE_OPS for N in VOCABS]


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [37, 1000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op,N", CASES, ids=[f"{op}-{N}" for op, N in CASES])
def test_wide_row_launch_runs_correctly(op, N, dtype, M):
    import torch

    from oink.kernels.compile import CACHE
    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import SPECS, build

    device = torch.device("cuda")
    CACHE.clear_used()
    result = gate(SPECS[op], build(op, "oink", device), Case("test", op, M, N, dtype), getattr(torch, dtype), device)
    assert result["passed"], result.get("report")
    assert CACHE.used_launches(), "no row kernel ran (the call took the reference)"
