"""The correctness gate: kernel (or peer) output against the fp32 reference, with error stats.

A failure reports max abs error, relative L2 error, p99 abs error and the first mismatching
index; NaN/Inf mismatches are reported on their own, and a NaN never passes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .tolerances import tolerance


@dataclass
class GateStats:
    max_abs: float
    rel_l2: float
    p99_abs: float
    first_mismatch: tuple | None
    nonfinite_mismatches: int
    mismatches: int
    numel: int
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.mismatches == 0 and self.nonfinite_mismatches == 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["first_mismatch"] = list(self.first_mismatch) if self.first_mismatch is not None else None
        d["passed"] = self.passed
        return d

    def report(self, what: str = "output") -> str:
        lines = [f"{what}: {self.mismatches} of {self.numel} elements outside atol={self.atol:g}, rtol={self.rtol:g}"]
        if self.nonfinite_mismatches:
            lines.append(f"  NaN/Inf mismatches: {self.nonfinite_mismatches}")
        lines.append(f"  max abs err {self.max_abs:.4g}; rel L2 err {self.rel_l2:.4g}; p99 abs err {self.p99_abs:.4g}")
        if self.first_mismatch is not None:
            lines.append(f"  first mismatch at index {self.first_mismatch}")
        return "\n".join(lines)


def compare(actual, expected, atol: float, rtol: float) -> GateStats:
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    fin_a, fin_e = torch.isfinite(a), torch.isfinite(e)
    # an infinity passes only against the same infinity; a NaN never passes
    nonfinite_bad = (~fin_a | ~fin_e) & ~(a == e)
    both = fin_a & fin_e
    diff = torch.where(both, (a - e).abs(), torch.zeros_like(a))
    bad = (both & (diff > atol + rtol * e.abs())) | nonfinite_bad
    n = a.numel()
    idx = None
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    denom = float(torch.linalg.vector_norm(torch.where(both, e, torch.zeros_like(e))))
    num = float(torch.linalg.vector_norm(diff))
    p99 = float(torch.quantile(diff.reshape(-1)[: 2**24].float(), 0.99)) if n else 0.0
    return GateStats(
        max_abs=float(diff.max()) if n else 0.0,
        rel_l2=num / denom if denom > 0 else num,
        p99_abs=p99,
        first_mismatch=idx,
        nonfinite_mismatches=int(nonfinite_bad.sum()),
        mismatches=int(bad.sum()),
        numel=n,
        atol=atol,
        rtol=rtol,
    )


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
