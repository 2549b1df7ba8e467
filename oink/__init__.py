"""Oink: CuTeDSL kernels for the memory-bound ops of LLM training and inference.

``import oink`` is cheap: torch, the custom ops and the kernels load on first use of a public
op (``oink.rmsnorm_forward`` ...), so the vLLM plugin hook ``oink.register`` can decide whether
to register anything at all.
"""
from __future__ import annotations

import os

__version__ = "0.1.0"

_NN = ("rmsnorm", "RMSNorm", "LayerNorm", "softmax", "cross_entropy", "linear_cross_entropy", "LinearCrossEntropy",
       "CrossEntropyLoss")

_registered = False

# vLLM's switches: VLLM_USE_OINK_OPS (vLLM >= 0.33 routes RMSNorm to torch.ops.oink.* under it)
# and VLLM_USE_OINK_RMSNORM (the earlier name)
VLLM_SWITCHES = ("VLLM_USE_OINK_OPS", "VLLM_USE_OINK_RMSNORM")


def register(force: bool = False) -> bool:
    """vLLM general-plugin hook: registers ``torch.ops.oink.*`` when vLLM's switch is on.

    Registers ``torch.ops.oink.rmsnorm`` and ``torch.ops.oink.fused_add_rms_norm``, vLLM's fused
    RMSNorm + FP8 ops under vLLM's names and schemas (``rms_norm_static_fp8_quant``,
    ``fused_add_rms_norm_static_fp8_quant``, ``rms_norm_dynamic_per_token_quant``,
    ``rms_norm_per_block_quant``, ``per_token_group_fp8_quant``; see docs/vllm-ops.md), vLLM's
    ``fused_qk_norm_rope``, and the other
    ops when ``VLLM_USE_OINK_OPS`` or ``VLLM_USE_OINK_RMSNORM`` is truthy (1/true/yes/on).
    Idempotent; never imports vllm. vLLM calls it unguarded at start-up, so it never raises: a
    failure is logged as a warning (logger ``oink``) and vLLM runs on with its own kernels.

    Args:
        force: register whatever the environment says.

    Returns:
        Whether the ops are registered.
    """
    global _registered
    if _registered:
        return True
    try:
        from .config import truthy

        if not force and not any(truthy(os.environ.get(v)) for v in VLLM_SWITCHES):
            return False
        from . import ops  # noqa: F401  (registration happens at import)
    except Exception as e:  # noqa: BLE001  (anything, so that vLLM starts: said in the warning)
        import logging

        logging.getLogger("oink").warning("oink.register: torch.ops.oink.* not registered (%s: %s); vLLM "
                                          "keeps its own kernels", type(e).__name__, e, exc_info=True)
        return False
    _registered = True
    return True


def __getattr__(name: str):
    import importlib.util

    if name in _NN:
        value = getattr(importlib.import_module(".nn", __name__), name)
        globals()[name] = value  # found once: later lookups skip this function
        return value
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    if name.startswith("_") and name != "__all__" or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # a submodule not yet imported (``from . import checks``): the import system loads it next
        raise AttributeError(f"module 'oink' has no attribute {name!r}")
    ops = importlib.import_module(".ops", __name__)  # the declarations: each public op, by its name
    declared = ops.PUBLIC
    if name == "__all__":
        return [*declared, "explain", "batch_invariant", *_NN, "reference", "register"]
    if name in ("explain", "batch_invariant"):
        globals()[name] = getattr(ops, name)
        return globals()[name]
    if name in declared:
        globals()[name] = getattr(ops, name)
        return globals()[name]
    raise AttributeError(f"module 'oink' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__getattr__("__all__")))
