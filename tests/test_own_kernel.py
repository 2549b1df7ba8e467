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


def test_docs_say_how_to_write_gate_time_and_compare_a_kernel():
    """docs/plugin.md's "Your own kernel" names what a user must know without reading the source: the
    fixture's arguments, every tolerance family, nbytes' element size, and comparing with a peer."""
    import inspect
    from pathlib import Path

    from oink.measure.tolerances import FAMILIES

    text = (Path(__file__).resolve().parents[1] / "docs" / "plugin.md").read_text()
    section = text.split("## Your own kernel")[1].split("\n## ")[0]
    for family in FAMILIES:
        assert f"`{family}`" in section, family
    assert "oink/measure/tolerances.py" in section and "nbytes(M, N, e)" in section
    from pytest_oink import plugin

    measure = inspect.getsource(plugin.oink_measure)
    assert 'dtype: str = "bfloat16", name: str = "custom", provider: str = "mine"' in measure  # as the docs say
    assert 'oink_measure(spec, fn, M, N, dtype="bfloat16", name="custom", provider="mine")' in section
    assert "To compare your kernel with a peer" in section and "--oink-gate-providers" in section
