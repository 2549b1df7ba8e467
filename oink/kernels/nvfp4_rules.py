"""The FP4 quantizers' launch rule (no cutlass here): ``fp4_launch``, a thread's unit one scale block. The kernels
are ``nvfp4``'s; a launch-table entry overrides the rule where ``compiled_fp4`` asks."""
from __future__ import annotations

from .. import config
from .row_rules import RowLaunch, pick_row_launch

BLOCK = 16  # NVFP4
MX_BLOCK = 32  # MXFP4


# Most threads a row gets, per kernel: a unit is one scale block, and a thread takes the fewest
# units (1, 2, 4) that keep its row within this. Chosen by timing the nvfp4 suite at 1, 2 and 4
# units a thread: the plain quantizers ran slower with 512- or 1024-thread rows (N = 7168, 14336),
# the fused RMSNorm (one row reduction) faster with 512.
# The ``fp4_upt`` development setting (oink.config) overrides the units per thread, for sweeps.
MAX_THREADS_PER_ROW = {"quantize": 256, "silu_mul": 256, "add_rmsnorm": 512}


def fp4_launch(N: int, arch: str, kind: str = "quantize", block: int = BLOCK) -> RowLaunch:
    """Launch heuristic for the FP4 kernels (the one place it is chosen): one unit is one scale
    block (``widest_bits = 128 / block`` makes pick_row_launch's vector one block long)."""
    upt = 1
    while upt < 4 and N // block > upt * MAX_THREADS_PER_ROW[kind]:
        upt *= 2
    upt = config.get().fp4_upt or upt
    return pick_row_launch(N, 128 // block, units_per_thread=upt, max_units_per_thread=max(upt, 4))
