"""Pure-PyTorch references for every Oink op: the correctness oracle and the fallback.

Same signatures as the public ``oink.<op>`` functions, fp32 arithmetic, outputs in the
input's dtype unless a docstring says otherwise. No validation here: the public API does it.
``cross_entropy_backward_`` (in place) backs ``oink.cross_entropy(..., inplace_backward=True)``.
"""
from .cross_entropy import cross_entropy_backward_  # noqa: F401  (internal: not a public op)
from .cross_entropy import cross_entropy_backward, cross_entropy_forward, cross_entropy_fwd_bwd
from .norms import fused_add_rmsnorm_, layernorm, layernorm_backward, rmsnorm_backward, rmsnorm_forward
from .nvfp4 import (add_rmsnorm_fp4quant, add_rmsnorm_mxfp4quant, mxfp4_dequantize, mxfp4_quantize,
                    nvfp4_dequantize, nvfp4_quantize, silu_mul_fp4quant, silu_mul_mxfp4quant)
from .softmax import softmax_backward, softmax_forward, softmax_fwd_bwd

__all__ = [
    "rmsnorm_forward", "fused_add_rmsnorm_", "rmsnorm_backward", "layernorm", "layernorm_backward",
    "softmax_forward", "softmax_backward", "softmax_fwd_bwd",
    "cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd",
    "nvfp4_quantize", "nvfp4_dequantize", "add_rmsnorm_fp4quant", "silu_mul_fp4quant",
    "mxfp4_quantize", "mxfp4_dequantize", "add_rmsnorm_mxfp4quant", "silu_mul_mxfp4quant",
]
