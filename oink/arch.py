"""Which CuTeDSL target a device gets. No torch or cutlass import at module load."""
from __future__ import annotations

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


def arch_for_capability(major: int, minor: int = 0) -> str | None:
    """``sm_90a`` on Hopper, ``sm_100a`` on Blackwell (10.x), None elsewhere.

    ``OINK_ARCH`` overrides the choice (e.g. to compile sm_100a code on a Hopper box)."""
    from .config import get

    forced = get().arch
    if forced:
        if forced not in SUPPORTED_ARCHS:
            raise ValueError(f"OINK_ARCH={forced!r}: expected one of {SUPPORTED_ARCHS}")
        return forced
    return {9: "sm_90a", 10: "sm_100a"}.get(major)
