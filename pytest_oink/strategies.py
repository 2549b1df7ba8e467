"""Hypothesis strategies for shapes, dtypes, layouts and magnitudes, and the settings profiles.

Shapes are bucketed: N comes from a short list per op (each N is a compile of a kernel), M is
free (M never recompiles). Profiles: ``oink-ci`` (few examples, derandomized: stable on CI) and
``oink-gpu`` (more examples, no deadline: first calls compile kernels)."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

N_BUCKETS = {
    "rmsnorm": (8, 64, 1000, 4096, 7168, 16384),
    "layernorm": (8, 64, 1000, 4096),
    "softmax": (8, 64, 1000, 4096),
    "cross_entropy": (8, 1000, 32000),
    "nvfp4": (16, 64, 1024, 4096),
    "fp8": (128, 1024, 4096, 7168),
}
DTYPE_NAMES = ("float32", "float16", "bfloat16")
LAYOUTS = ("contiguous", "padded_rows", "offset_view")


def register_profiles() -> None:
    settings.register_profile("oink-ci", max_examples=15, derandomize=True, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("oink-gpu", max_examples=200, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])


def dtypes():
    return st.sampled_from(DTYPE_NAMES)


def shapes(family: str, max_m: int = 300):
    return st.tuples(st.integers(0, max_m), st.sampled_from(N_BUCKETS[family]))


def layouts():
    return st.sampled_from(LAYOUTS)


@dataclass(frozen=True)
class Magnitude:
    """How large ``make_tensor``'s values are: unit Gaussians times ``scale``, each row times
    10^u for u uniform in [-row_decades, row_decades]; the factors stay within [1e-4, 1e4] and
    values within the dtype's finite range (fp16's max is 65504: a 1e4 factor comes near it). ``peak`` (0: unset)
    then rescales the whole tensor so that its largest |value| is that fraction of the dtype's largest finite one
    (``near_overflow``)."""
    scale: float = 1.0
    row_decades: float = 0.0
    peak: float = 0.0


def magnitudes():
    """Overall scales 1e-4 .. 1e4 (a power of ten), with rows spread over up to 2 decades each way."""
    return st.builds(Magnitude, scale=st.integers(-4, 4).map(lambda k: 10.0**k),
                     row_decades=st.sampled_from((0.0, 1.0, 2.0)))


def near_overflow():
    """Tensors whose largest |value| is 0.25, 0.5 or 0.9 of the dtype's largest finite one, rows spread over up to
    2 decades below it. For fp16 (up to ~5.9e4) every square of such a value overflows fp16, and a row's sum of
    them overflows too unless accumulated wider: what a naive implementation gets wrong and fp32 math does not."""
    return st.builds(Magnitude, row_decades=st.sampled_from((0.0, 1.0, 2.0)),
                     peak=st.sampled_from((0.25, 0.5, 0.9)))


def make_tensor(M: int, N: int, dtype, layout: str, device="cpu", seed: int = 0, magnitude: Magnitude | None = None):
    """A random [M, N] tensor laid out as asked: dense, rows padded (stride(0) > N), or a view
    whose storage starts at an element offset (misaligned base for vector loads). Unit Gaussians
    unless a ``magnitude`` is given."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    pad = 8 if layout == "padded_rows" else 0
    off = 1 if layout == "offset_view" else 0
    base = torch.randn(M * (N + pad) + off, generator=g, device=device)
    if magnitude is not None:
        rows = base[off:].view(M, N + pad)
        u = torch.rand(M, 1, generator=g, device=device) * 2 - 1
        factor = (magnitude.scale * 10.0 ** (u * magnitude.row_decades)).clamp(1e-4, 1e4)
        rows.mul_(factor)
        big = torch.finfo(dtype).max
        if magnitude.peak and rows.numel() and rows[:, :N].abs().max() > 0:
            rows.mul_(magnitude.peak * big / rows[:, :N].abs().max())  # the visible values' largest at the peak
        base.clamp_(-big, big)
    return base.to(dtype)[off:].view(M, N + pad)[:, :N]
