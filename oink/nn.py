"""Differentiable functions and modules built on the custom ops (autograd registered in ops)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from . import ops as _ops  # noqa: F401  (registers torch.ops.oink.* and their autograd)
from . import validate


def rmsnorm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Differentiable RMSNorm over the last dim (kernel forward and backward where they apply)."""
    validate.rmsnorm_forward(x, weight)
    return torch.ops.oink.rmsnorm_forward(x, weight, None, None, eps, True)[0]


class RMSNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.RMSNorm``: same constructor, parameters and state_dict keys."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"x: trailing shape {tuple(x.shape[-k:])} must be {self.normalized_shape}")
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        w = self.weight.reshape(-1) if self.weight is not None else None
        if w is not None and w.dtype != x.dtype and w.dtype != torch.float32:
            w = w.to(x.dtype)
        y = rmsnorm(x.flatten(-k) if k > 1 else x, w, eps)
        return y.view(x.shape) if k > 1 else y

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
