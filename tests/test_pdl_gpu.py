"""Programmatic dependent launch (on by default, OINK_PDL=0 off): in a chain of Oink kernels each
reads what the one before it wrote, and with PDL each may be launched before that one has ended.
The chain gives bitwise the results it gives with PDL off, eagerly and replayed from a CUDA graph,
and its last step agrees with the reference on the chain's own input. A kernel that read before the
kernel ahead ended would see the allocator's stale memory, not its input."""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from tests.gpu_helpers import close_family
from tests.helpers import set_knob

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]


def _inputs(M, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16)
    b = (0.1 * torch.randn(N, device="cuda", generator=g)).to(torch.bfloat16)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    return x, res, w, b, target


def _chain(x, res, w, b, target):
    """Oink kernels back to back, each on the previous one's output (no torch kernel between)."""
    y, res = x.clone(), res.clone()
    for _ in range(4):
        y = oink.rmsnorm_forward(y, w)[0]
        y = oink.layernorm(y, w, b)
        oink.fused_add_rmsnorm_(y, res, w)
    p = oink.softmax_forward(y)
    loss, lse = oink.cross_entropy_forward(y, target)
    return y, res, p, loss, lse


@pytest.mark.parametrize("M,N", [(64, 4096), (4099, 4096), (37, 32000)])
def test_chain_is_bitwise_the_same_with_and_without_pdl(monkeypatch, M, N, seed):
    args = _inputs(M, N, seed)
    with_pdl = _chain(*args)
    set_knob(monkeypatch, "OINK_PDL", "0")
    without = _chain(*args)
    set_knob(monkeypatch, "OINK_PDL", "1")
    for a, b, name in zip(with_pdl, without, ("y", "residual", "softmax", "loss", "lse")):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), f"{name}: differs with PDL"
    # the last step against the reference, on the input the chain gave it
    y = with_pdl[0]
    close_family(with_pdl[2], R.softmax_forward(y), "softmax", torch.bfloat16, "softmax")
    close_family(with_pdl[3], R.cross_entropy_forward(y, args[4])[0], "cross_entropy_loss", torch.float32, "loss")


def test_chain_replays_from_a_cuda_graph(seed):
    args = _inputs(256, 4096, seed)
    eager = _chain(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(*args)
    for _ in range(3):
        for t in captured:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for a, b, name in zip(captured, eager, ("y", "residual", "softmax", "loss", "lse")):
            assert torch.equal(a, b), f"{name}: the graph's replay differs from the eager chain"
