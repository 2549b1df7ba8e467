"""Softmax over the last dim: fp32 arithmetic, outputs in the input's dtype."""
from __future__ import annotations

import torch
from torch import Tensor

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
