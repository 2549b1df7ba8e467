"""The one table of tolerances: (op family, output dtype name) -> (atol, rtol).

Kernel-vs-reference gates (the plugin's and the tuner's) and reference-vs-float64 tests all read it
(``pytest_oink.tolerances`` re-exports it). Values are set by the rounding of the output dtype (one ulp
of bf16 is 2^-8 relative) plus fp32 reduction-order noise.
"""
from __future__ import annotations

_BY_DTYPE = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}

# Families whose outputs pass through an extra rounded intermediate get looser bounds.
_OVERRIDES = {
    # gradients sum over the row; a bf16 output of a difference of two O(1) terms
    ("norm_backward", "bfloat16"): (3e-2, 3e-2),
    ("norm_backward", "float16"): (4e-3, 4e-3),
    ("norm_backward", "float32"): (1e-4, 1e-4),
    # weight gradients sum over M rows in fp32
    ("weight_grad", "float32"): (1e-3, 1e-4),
    ("weight_grad", "float16"): (1e-2, 4e-3),
    ("weight_grad", "bfloat16"): (5e-2, 3e-2),
    ("cross_entropy_loss", "float32"): (1e-4, 1e-5),
    # a softcap on 16-bit logits takes tanh.approx (relative error 2^-11): each capped logit within
    # c 2^-11 of the exact one, the loss and lse within twice that; sized for softcaps up to 30
    ("cross_entropy_capped_loss", "float32"): (3e-2, 1e-5),
    # fused NVFP4 codes as signed E2M1 indices: within one rounding step of the reference
    ("nvfp4_code_step", "float32"): (1.0, 0.0),
    # fused MXFP4: codes over their block's largest (4 or 6); one step of an element and of its
    # block's largest at once (4/4 against 3/6) moves that by 1/2
    ("mxfp4_block_ratio", "float32"): (0.5, 0.0),
    # FP8 codes as signed e4m3 ordinals: fused ops within one step of the reference
    ("fp8_code_step", "float32"): (1.0, 0.0),
    # FP8 scales: a fused op's amax may come from values one bf16 ulp away (2^-8 relative)
    ("fp8_scale", "float32"): (0.0, 1e-2),
    # linear cross-entropy (training suite): the loss from 16-bit logits (each rounded once; capped
    # eagerly in bf16 by torch's eager peer), the gradients as their shapes (over their root mean
    # square: elements far above it round at their own magnitude) and their root mean squares
    ("linear_ce_loss", "float32"): (1e-3, 2e-3),
    ("linear_ce_grad", "bfloat16"): (0.125, 0.25),
    ("linear_ce_grad", "float16"): (0.03, 0.06),
    ("linear_ce_grad", "float32"): (1e-3, 1e-2),
    ("linear_ce_scale", "float32"): (0.0, 1.5e-2),
}


# every family the table knows: the plain ones take the dtype's bounds, the others their overrides
FAMILIES = ("default", "rmsnorm", "layernorm", "softmax", "rope", *dict.fromkeys(f for f, _ in _OVERRIDES))


def tolerance(family: str, dtype) -> tuple[float, float]:
    """(atol, rtol) for an output of ``dtype`` from an op of ``family``; exact for integer and
    byte outputs (quantized codes, scales)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _BY_DTYPE:
        return (0.0, 0.0)
    return _OVERRIDES.get((family, name), _BY_DTYPE[name])
