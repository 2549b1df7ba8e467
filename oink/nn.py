"""Differentiable functions and modules built on the declared ops (their autograd is in ``oink.ops``;
``oink.layernorm`` is differentiable too)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from . import ops
from .declare import _needs_graph
from .chunked_linear_ce import linear_cross_entropy  # noqa: F401  (public: oink.linear_cross_entropy)
from .reference.cross_entropy import reduction_dloss, row_weight, safe_target


def rmsnorm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6, *, bias: Tensor | None = None,
            residual: Tensor | None = None, out_dtype: torch.dtype | None = None,
            residual_dtype: torch.dtype | None = None, prenorm: bool = False, weight_offset: float = 0.0):
    """Differentiable RMSNorm over the last dim (Quack's ``rmsnorm`` signature).

    y = x_hat * (weight + weight_offset) + bias, x_hat the norm of x, or of x + residual stored in
    ``residual_dtype``; gradients flow to x, weight, bias and residual.

    Args:
        x: [..., N] activations, fp32, fp16 or bf16.
        weight, bias: [N], or [H, D] per head for x [..., H, D]; any float dtype; None for none.
        eps: added to the mean of squares.
        residual: x's shape, any float dtype, or None.
        out_dtype: y's dtype (default x's).
        residual_dtype: the stored sum's dtype (default the residual's).
        prenorm: also return the stored sum (x itself without a residual).
        weight_offset: added to the weight (Gemma's ``1 + w``: 1.0).

    Returns:
        y, or (y, residual_out) with ``prenorm``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    store_rstd = _needs_graph((x, weight, bias, residual))  # the backward reads rstd
    y, _, res_out = ops.rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype=out_dtype,
                                        residual_dtype=residual_dtype, weight_offset=float(weight_offset))
    if prenorm:
        return y, (res_out if res_out is not None else x)
    return y


def softmax(x: Tensor) -> Tensor:
    """Differentiable softmax over the last dim (``oink.softmax_forward`` with its backward).

    Args:
        x: [..., N], fp32, fp16 or bf16.

    Returns:
        softmax(x) in x's dtype.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    return ops.softmax_forward(x)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, inplace_backward, weight, lse_partial, label_smoothing,
                z_loss, softcap, return_z_loss):
        out = ops.cross_entropy_forward(logits, target, ignore_index, reduction, weight=weight, lse_partial=lse_partial,
                                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                        return_z_loss=return_z_loss)
        ctx.ignore_index, ctx.reduction, ctx.inplace = ignore_index, reduction, inplace_backward
        ctx.options = dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
        ctx.save_for_backward(logits, target, out[1], weight)
        if return_z_loss:  # logged, not differentiated (the loss holds it)
            ctx.mark_non_differentiable(out[2])
            return out[0], out[2]
        return out[0]

    @staticmethod
    def backward(ctx, dloss, *_dz_loss):
        logits, target, lse, weight = ctx.saved_tensors
        if ctx.reduction == "mean":  # a device division: no host read of the count
            dloss = reduction_dloss(dloss, row_weight(weight, *safe_target(target, ctx.ignore_index)), "mean")
        # Under torch.compile the in-place write would mutate a graph input that may be a leaf
        # requiring grad (AOTAutograd refuses): compiled graphs take the out-of-place backward.
        if ctx.inplace and not torch.compiler.is_compiling():
            torch.ops.oink.cross_entropy_backward_(dloss, logits, target, lse, ctx.ignore_index, weight,
                                                   **ctx.options)
            dlogits = logits
        else:
            dlogits = ops.cross_entropy_backward(dloss, logits, target, lse, ctx.ignore_index, weight=weight,
                                                 **ctx.options)
        return (dlogits,) + (None,) * 10


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  inplace_backward: bool = False, *, weight: Tensor | None = None,
                  lse_partial: Tensor | None = None, label_smoothing: float = 0.0, z_loss: float = 0.0,
                  softcap: float | None = None, return_z_loss: bool = False):
    """Differentiable cross-entropy of logits [M, V] against int targets [M]; fp32 loss.

    Args:
        logits: [M, V] fp32, fp16 or bf16.
        target: [M] int32 or int64 class indices, or ``ignore_index``.
        ignore_index: rows with this target count for nothing.
        reduction: "mean" (over rows not ignored, weighted by ``weight``[target] where given; 0 when
            none counts), "sum" or "none".
        inplace_backward: write dlogits over the logits in the backward (saves an [M, V] buffer, as
            Quack's option does): the logits' values are gone after ``backward()``. Under
            torch.compile the backward is out of place (the values are the same).
        weight: per-class weights [V] (torch's rule for "mean").
        lse_partial: [M, K] per-shard logsumexps of a vocab-parallel model, combined into the row's
            lse (logits are then only read at the target and in the backward).
        label_smoothing: eps in [0, 1): (1 - eps) * nll + eps * mean_j(-log p_j), torch's rule.
        z_loss: coefficient z >= 0 of z * lse^2 added to each row's loss.
        softcap: c > 0: logits -> c * tanh(logits / c) before the softmax (Gemma-2); None for none.
        return_z_loss: also return the z-loss part of the loss (reduced alike, not differentiated).

    Returns:
        The loss (0-d, or [M] for "none"), or (loss, z_loss) with ``return_z_loss``.

    Raises:
        ValueError: a shape, reduction or option out of range, naming the argument.
        TypeError: a dtype not supported.
    """
    ops.cross_entropy_forward.op.check(logits, target, ignore_index, reduction, weight=weight, lse_partial=lse_partial,
                                       label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return _CrossEntropy.apply(logits, target, ignore_index, reduction, inplace_backward, weight, lse_partial,
                               label_smoothing, z_loss, softcap, return_z_loss)


class CrossEntropyLoss(torch.nn.Module):
    """``torch.nn.CrossEntropyLoss`` for logits [..., V] (class dim last) and targets [...], on
    ``oink.cross_entropy``; ``weight`` is a buffer, as torch's.

    Args:
        weight, ignore_index, reduction, label_smoothing: torch's.
        z_loss, softcap, return_z_loss, inplace_backward: ``oink.cross_entropy``'s.
    """

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, z_loss: float = 0.0, softcap: float | None = None,
                 return_z_loss: bool = False, inplace_backward: bool = False):
        super().__init__()
        from .checks import ce_options
        from .reference.cross_entropy import REDUCTIONS

        ce_options(label_smoothing, z_loss, softcap)
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: {reduction!r} is not one of {REDUCTIONS}")
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.return_z_loss = z_loss, softcap, return_z_loss
        self.inplace_backward = inplace_backward

    def forward(self, logits: Tensor, target: Tensor):
        rows = logits.reshape(-1, logits.shape[-1])
        out = cross_entropy(rows, target.reshape(-1), self.ignore_index, self.reduction, self.inplace_backward,
                            weight=self.weight, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                            softcap=self.softcap, return_z_loss=self.return_z_loss)
        if self.reduction == "none":  # per-row results back in the target's shape
            out = tuple(t.view(target.shape) for t in out) if self.return_z_loss else out.view(target.shape)
        return out

    def extra_repr(self) -> str:
        opts = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        opts += [f"{n}={getattr(self, n)}" for n in ("label_smoothing", "z_loss", "softcap") if getattr(self, n)]
        return ", ".join(opts)


def _flat_weight(w: Tensor | None) -> Tensor | None:
    """A (possibly multi-dim) parameter as the kernels' [N] vector (any float dtype)."""
    return None if w is None else w.reshape(-1)


class _LastDimsNorm(torch.nn.Module):
    """What RMSNorm and LayerNorm share: ``normalized_shape`` (an int or a tuple) over the last
    dims, flattened into one row dim for the kernels, and torch's repr."""

    def __init__(self, normalized_shape, eps, elementwise_affine: bool):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine

    def _rows(self, x: Tensor, norm) -> Tensor:
        """``norm`` over x's normalized dims seen as one: x flattened to [..., N] and back."""
        k = len(self.normalized_shape)
        if tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(f"x: trailing shape {tuple(x.shape[-k:])} must be {self.normalized_shape}")
        if k == 1:
            return norm(x)
        return norm(x.flatten(-k)).view(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_LastDimsNorm):
    """Drop-in for ``torch.nn.RMSNorm``: same constructor, parameters and state_dict keys.

    Args:
        normalized_shape: the trailing dims normalised over (an int or a tuple).
        eps: added to the mean of squares; None: ``torch.finfo(x.dtype).eps``, as torch.
        elementwise_affine: learn a weight of ``normalized_shape`` (ones at first).
        device, dtype: the weight's.

    Raises:
        ValueError: (in ``forward``) x's trailing dims are not ``normalized_shape``.
    """

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return self._rows(x, lambda x2: rmsnorm(x2, _flat_weight(self.weight), eps))


class LayerNorm(_LastDimsNorm):
    """Drop-in for ``torch.nn.LayerNorm``: same constructor, parameters and state_dict keys.

    Without affine parameters the kernels get a ones weight (a buffer outside the state_dict).

    Args:
        normalized_shape: the trailing dims normalised over (an int or a tuple).
        eps: added to the variance.
        elementwise_affine: learn a weight (ones at first) and, with ``bias``, a bias (zeros).
        bias: learn a bias (with ``elementwise_affine``).
        device, dtype: the parameters'.

    Raises:
        ValueError: (in ``forward``) x's trailing dims are not ``normalized_shape``.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine)
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            self.bias = (torch.nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
                         if bias else None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            self.register_buffer("_ones", torch.ones(self.normalized_shape, device=device, dtype=dtype),
                                 persistent=False)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        w = _flat_weight(self.weight if self.weight is not None else self._ones)
        b = _flat_weight(self.bias)

        return self._rows(x, lambda x2: ops.layernorm(x2, w, b, self.eps))


class LinearCrossEntropy(torch.nn.Linear):
    """The lm head and its loss in one: ``torch.nn.Linear``'s constructor, parameters and state_dict
    keys (weight [V, H], optional bias), and ``forward(hidden, target)`` -> the loss of
    ``oink.linear_cross_entropy`` (chunked: the [M, V] logits never exist whole), or (loss, z_loss)
    with ``return_z_loss``; the other arguments are its."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, ignore_index: int = -100,
                 reduction: str = "mean", *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 softcap: float | None = None, chunk_size: int | None = None, accum_dtype: torch.dtype | None = None,
                 return_z_loss: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap
        self.chunk_size, self.accum_dtype, self.return_z_loss = chunk_size, accum_dtype, return_z_loss

    def forward(self, hidden: Tensor, target: Tensor):
        return linear_cross_entropy(hidden, self.weight, target, self.bias, self.ignore_index, self.reduction,
                                    label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                    chunk_size=self.chunk_size, accum_dtype=self.accum_dtype,
                                    return_z_loss=self.return_z_loss)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"chunk_size={self.chunk_size}")
