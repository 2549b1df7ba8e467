"""The correctness gate: kernel (or peer) output against the fp32 reference, with error stats.

A failure reports max abs error, relative L2 error, p99 abs error and the first mismatching
index; NaN/Inf mismatches are reported on their own, and a NaN never passes. The comparison is
``oink.measure.gate``'s (the tuner gates with it too), re-exported here with ``assert_close``.
"""
from __future__ import annotations

from oink.measure.gate import GateStats, compare  # noqa: F401  (re-exported for the plugin's modules and tests)
from oink.measure.tolerances import tolerance


def assert_close(actual, expected, *, family: str = "default", dtype=None, atol=None, rtol=None,
                 what: str = "output") -> GateStats:
    """Raise AssertionError with the stats report unless ``actual`` matches ``expected`` within
    the table's tolerance for (family, dtype) (or explicit atol/rtol)."""
    if atol is None or rtol is None:
        t_atol, t_rtol = tolerance(family, dtype if dtype is not None else actual.dtype)
        atol = t_atol if atol is None else atol
        rtol = t_rtol if rtol is None else rtol
    stats = compare(actual, expected, atol, rtol)
    if not stats.passed:
        raise AssertionError(stats.report(what))
    return stats
