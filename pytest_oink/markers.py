"""Markers and the one place where they turn into skips.

``@pytest.mark.gpu``: needs a CUDA GPU. ``@pytest.mark.sm(90)``: needs compute capability
>= 9.0; ``@pytest.mark.sm(90, exact=True)``: exactly 9.x (arch-specific "a" features).
``@pytest.mark.peer("quack")``: needs that peer package importable.
``OINK_FAKE_SM=100`` pretends the GPU has that capability, so the skip logic is testable on CPU.
"""
from __future__ import annotations

import functools
import importlib.util
import os

MARKERS = (
    "gpu: needs a CUDA GPU (skipped with a reason without one)",
    "sm(major, exact=False): needs compute capability >= major*10 (or exactly that major with exact=True)",
    "peer(name): needs the peer package (quack, liger, flashinfer, triton) installed",
)

PEER_MODULES = {"quack": "quack", "liger": "liger_kernel", "flashinfer": "flashinfer", "triton": "triton"}


@functools.lru_cache(maxsize=None)
def device_capability() -> int | None:
    """Capability as an int (90 for 9.0), OINK_FAKE_SM if set, None without a GPU."""
    fake = os.environ.get("OINK_FAKE_SM")
    if fake:
        return int(fake)
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def skip_reason(item) -> str | None:
    """Why ``item`` can't run here, or None."""
    needs_gpu = item.get_closest_marker("gpu") is not None
    sm = item.get_closest_marker("sm")
    if needs_gpu or sm is not None:
        cap = device_capability()
        if cap is None:
            return "needs a CUDA GPU; none is available"
        if sm is not None:
            want = int(sm.args[0])
            want = want * 10 if want < 20 else want  # accept sm(9) and sm(90)
            if sm.kwargs.get("exact"):
                if cap // 10 != want // 10:
                    return f"needs exactly sm_{want // 10}x; this GPU is sm_{cap}"
            elif cap < want:
                return f"needs sm_{want} or newer; this GPU is sm_{cap}"
    for mark in item.iter_markers("peer"):
        name = mark.args[0]
        module = PEER_MODULES.get(name, name)
        if importlib.util.find_spec(module) is None:
            return f"peer {name!r} not installed (pip install {module.replace('_', '-')})"
    return None
