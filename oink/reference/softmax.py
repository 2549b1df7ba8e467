"""Softmax over the last dim: fp32 arithmetic, outputs in the input's dtype."""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import Bench, rand, x_weight

__all__ = ["softmax_forward", "softmax_backward", "softmax_fwd_bwd"]  # the public ops (oink.reference re-exports them)


def softmax_forward(x: Tensor) -> Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def softmax_backward(dy: Tensor, y: Tensor) -> Tensor:
    """dx = y * (dy - sum(dy * y))."""
    yf, gf = y.float(), dy.float()
    return (yf * (gf - (gf * yf).sum(-1, keepdim=True))).to(y.dtype)


def softmax_fwd_bwd(dy: Tensor, x: Tensor) -> Tensor:
    """Backward of softmax(x) without materialising y in x's dtype (y stays fp32)."""
    yf, gf = torch.softmax(x.float(), dim=-1), dy.float()
    return (yf * (gf - (gf * yf).sum(-1, keepdim=True))).to(x.dtype)


# ---- bench entries (``.bench``: pytest_oink builds each op's benchmark spec from its own) ----
def _backward_inputs(M, N, dtype, device, gen):
    y = softmax_forward(rand((M, N), dtype, device, gen, 3.0))
    return dict(dy=rand((M, N), dtype, device, gen), y=y)


def _fwd_bwd_inputs(M, N, dtype, device, gen):
    return dict(dy=rand((M, N), dtype, device, gen), x=rand((M, N), dtype, device, gen, 3.0))


BENCH = {
    "softmax_forward": Bench("softmax", x_weight, lambda M, N, e: 2 * M * N * e,
                             lambda o, a: (o.softmax_forward(a["x"]),)),
    "softmax_backward": Bench("norm_backward", _backward_inputs, lambda M, N, e: 3 * M * N * e,
                              lambda o, a: (o.softmax_backward(a["dy"], a["y"]),)),
    # fused: read x and dy, write dx (y never touches memory)
    "softmax_fwd_bwd": Bench("norm_backward", _fwd_bwd_inputs, lambda M, N, e: 3 * M * N * e,
                             lambda o, a: (o.softmax_fwd_bwd(a["dy"], a["x"]),)),
}
