"""The "Your own kernel" example of docs/plugin.md, run as written (CPU in CI, the GPU where there is one)."""
import pytest
import torch

from pytest_oink import OpSpec

SCALED_SILU = OpSpec(
    family="softmax",  # the tolerance family (pytest_oink/tolerances.py)
    make_inputs=lambda M, N, dtype, device, gen: {"x": torch.randn(M, N, generator=gen, device=device).to(dtype)},
    reference=lambda a: (torch.nn.functional.silu(a["x"].float()).to(a["x"].dtype) * 2,),
    nbytes=lambda M, N, e: 2 * M * N * e,  # read x, write y
)


@pytest.mark.parametrize("M,N", [(4, 128), (64, 1024)])
def test_scaled_silu(oink_measure, M, N):
    row = oink_measure(SCALED_SILU, lambda a: (torch.nn.functional.silu(a["x"]) * 2,), M, N, name="scaled_silu")
    assert row.status == "ok" and row.median_s > 0


def test_scaled_silu_is_batch_invariant(oink_batch_invariance):
    oink_batch_invariance(SCALED_SILU, lambda a: (torch.nn.functional.silu(a["x"]) * 2,), 1024)
