"""Oink: CuTeDSL kernels for the memory-bound ops of LLM training and inference.

``import oink`` is cheap: torch, the custom ops and the kernels load on first use of a public
op (``oink.rmsnorm_forward`` ...), so the vLLM plugin hook ``oink.register`` can decide whether
to register anything at all.
"""
from __future__ import annotations

import os

__version__ = "0.1.0"

_API = (
    "rmsnorm_forward", "fused_add_rmsnorm_", "rmsnorm_backward", "layernorm", "layernorm_backward",
    "softmax_forward", "softmax_backward", "softmax_fwd_bwd",
    "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd",
    "nvfp4_quantize", "nvfp4_dequantize", "add_rmsnorm_fp4quant", "silu_mul_fp4quant",
    "mxfp4_quantize", "mxfp4_dequantize", "add_rmsnorm_mxfp4quant", "silu_mul_mxfp4quant", "explain",
)
_NN = ("rmsnorm", "RMSNorm", "LayerNorm", "softmax", "cross_entropy")
__all__ = [*_API, *_NN, "reference", "register"]

_registered = False


def register(force: bool = False) -> bool:
    """vLLM general-plugin hook: registers ``torch.ops.oink.rmsnorm`` and
    ``torch.ops.oink.fused_add_rms_norm`` (and the other ops) when ``VLLM_USE_OINK_RMSNORM`` is
    truthy (1/true/yes/on) or ``force`` is set. Idempotent; never imports vllm.
    Returns whether the ops are registered."""
    global _registered
    if _registered:
        return True
    from .config import truthy

    if not force and not truthy(os.environ.get("VLLM_USE_OINK_RMSNORM")):
        return False
    from . import ops  # noqa: F401  (registration happens at import)

    _registered = True
    return True


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in _NN:
        from . import nn

        return getattr(nn, name)
    if name == "reference":
        import importlib

        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'oink' has no attribute {name!r}")
