"""Public profiling hook (used by the pytest plugin's ``--oink-profile``): which compiled kernels a
piece of code used, and their resources (registers, spills, shared memory, occupancy).

    oink.profiling.start()
    run_something()
    oink.profiling.report()  # {} when no CuTeDSL kernel ran (the reference path)

Resources are read from the cubins, so kernels must be compiled with ``OINK_KEEP_CUBIN=1``, on a GPU.
"""
from __future__ import annotations


def start() -> None:
    """Forget the kernels used so far: ``report()`` covers what runs from now on."""
    from .kernels.compile import CACHE

    CACHE.clear_used()


def report(device_index: int = 0) -> dict:
    """Resources of the kernels used since ``start()``: the worst case over them, and each one."""
    from .kernels.profile import recent_kernel_profile

    return recent_kernel_profile(device_index)
