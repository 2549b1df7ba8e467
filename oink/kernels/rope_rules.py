"""The QK norm + rotary embedding kernel's rules (no cutlass here): the lanes a head takes (``head_lanes``) and the
rotary widths a lane's values allow (``rotary_reason``). The kernel is ``rope.QKNormRope``."""
from __future__ import annotations

from .. import config

WARP = 32


def head_lanes(head_dim: int, bits: int) -> int:
    """Lanes a head: one 16-byte load each (a 128-wide 16-bit head: 16 lanes, two heads a warp), so that a lane's
    values are one full-width access; the ``rope_lanes`` development setting forces 32 (or another count)."""
    return config.get().rope_lanes or max(1, min(WARP, head_dim * bits // 128))


def rotary_reason(head_dim: int, rotary_dim: int, neox: bool, lanes: int = WARP) -> str | None:
    """Why a rotary width goes to the reference, or None: a lane's E = head_dim / lanes values rotate together
    (NeoX: half of rotary_dim whole lanes, a lane's partner one lane; GPT-J: rotary_dim whole lanes)."""
    E = head_dim // lanes
    if neox and (rotary_dim // 2) % E:
        return f"rotary_dim {rotary_dim}: half of it is not a multiple of a lane's {E} values (NeoX pairs lanes)"
    if not neox and rotary_dim % E:
        return f"rotary_dim {rotary_dim}: not a multiple of a lane's {E} values"
    return None
