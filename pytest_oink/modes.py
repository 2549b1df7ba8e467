"""Timing modes (``--oink-timing``, issue #34 item 5): what a row's time means. Rows of different
modes never compare (the regression gate lists them as not compared)."""
from __future__ import annotations

MODES = {
    "cold": "CUDA-graph replays, input sets cycled past 3x L2 (the kernel from HBM)",
    "hot": "CUDA-graph replays on one input set (L2-warm where it fits)",
    "eager": "wall time per eager call, host cost included (calls back to back, synchronized per sample)",
}
DEFAULT = "cold"
CPU_NOTE = "on a CPU every mode is timed by the host timer (perf_counter per call)"


def parse(text) -> str:
    mode = str(text or DEFAULT).strip()
    if mode not in MODES:
        raise ValueError(f"--oink-timing={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def for_suite(mode: str, suite: str) -> str:
    """The mode a suite's rows are timed in: a host-timed suite (launch) is eager calls whatever is asked."""
    from .suites import HOST_TIMED

    return "eager" if suite in HOST_TIMED else mode


def of_method(method: str | None) -> str | None:
    """The mode of a row recorded before rows named one: eager calls for the launch suite, cold
    graph replays otherwise (the only way rows were timed then); None where nothing says."""
    if not method:
        return None
    return "eager" if method == "eager-calls" else DEFAULT


CPU_TIMING = "the host timer on a CPU (perf_counter per call): reference timings, no kernel ran"


def describe(modes, devices) -> str:
    """'cold (CUDA-graph replays, ...)' for a set of rows' modes, with the CPU note where any row ran there;
    rows all timed on a CPU: the host timer, the mode asked named (its GPU meaning does not apply)."""
    if devices and all(d == "cpu" for d in devices):
        return f"{CPU_TIMING} (--oink-timing={', '.join(sorted(modes))} asked: a CPU times every mode alike)"
    text = "; ".join(f"{m} ({MODES.get(m, '?')})" for m in sorted(modes))
    return text + (f"; {CPU_NOTE}" if any(d == "cpu" for d in devices) else "")
