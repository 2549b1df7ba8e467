"""GPU clocks around each timed row (issue #34 item 4): the SM clock, the clock-event ("throttle")
reasons and the compute processes on the GPU, read through NVML by ctypes on libnvidia-ml.so.1 (no
dependency; where the library is absent the feature is off and the session says so once). A row timed
while the GPU was held down (power cap, thermal or hardware slowdown, or an SM clock under
MIN_CLOCK_FRACTION of its applications clock, else its max clock) or shared (another process computing
on it: ``own_pid`` names this session's workers) is re-timed once, then marked ``throttled``: the
regression gate never calls such a row SLOWER, since its time measures the card's state, not the code.

Tests inject a reader (``install_reader``) instead of NVML."""
from __future__ import annotations

import ctypes
import os
from typing import Callable, NamedTuple

# NVML's clock-event reason bits (nvmlClocksEventReason*, formerly nvmlClocksThrottleReason*)
REASONS = {
    0x1: "idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake slowdown",
    0x100: "display clock setting",
}
IDLE = 0x1
THROTTLING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80  # power, thermal and hardware slowdowns: the card's state, not the code
# nvbench's rule: samples taken below 75% of the default clock are not the kernel's time
MIN_CLOCK_FRACTION = 0.75
NVML_CLOCK_SM = 1
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_SIZE = 7


class Reading(NamedTuple):
    sm_mhz: int | None  # the SM clock now
    reference_mhz: int | None  # what the SM clock is held against: the applications clock, else the max
    reasons: int  # REASONS bits set now
    others: int = 0  # compute processes on the GPU other than this session's (0 where NVML does not say)


def causes(reading: Reading) -> list[str]:
    """Why a reading says the GPU was held down or shared ([] where it was neither): the throttling
    reasons set, an SM clock under MIN_CLOCK_FRACTION of its reference (not while idle: an idle GPU
    clocks down, which says nothing of the rounds timed), and other processes computing on it."""
    out = [name for bit, name in REASONS.items() if bit & THROTTLING & reading.reasons]
    sm, ref = reading.sm_mhz, reading.reference_mhz
    if not reading.reasons & IDLE and sm and ref and sm < MIN_CLOCK_FRACTION * ref:
        out.append(f"SM clock {sm} MHz under {MIN_CLOCK_FRACTION:.0%} of {ref} MHz")
    if reading.others:
        out.append(f"shared with {reading.others} other process{'es' if reading.others > 1 else ''}")
    return out


class _ProcessInfo(ctypes.Structure):
    """nvmlProcessInfo_t as the _v2 and _v3 process queries fill it."""
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


_OWN_PIDS: set[int] = set()  # this session's other processes on the GPU (an --oink-against worker, its session)


def own_pid(pid: int) -> None:
    """Count process ``pid`` as this session's: its work on the GPU does not make a row shared."""
    _OWN_PIDS.add(pid)


def others(pids: list[int] | None) -> int:
    """How many of the processes NVML lists on the GPU are not this session's. NVML may name them in
    another PID namespace (a container) than ours: where it names none of ours, this session's own
    count is taken off instead."""
    if not pids:
        return 0
    own = _OWN_PIDS | {os.getpid()}
    mine = sum(1 for p in pids if p in own)
    return len(pids) - mine if mine else max(0, len(pids) - len(own))


class Nvml:
    """The few NVML calls the clocks need, by ctypes. ``lib`` is the loaded library (tests pass a fake)."""

    def __init__(self, lib):
        self.lib = lib
        # nvmlDeviceGetCurrentClocksEventReasons from driver 535 on; the older name before
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            self._reasons = getattr(lib, name, None)
            if self._reasons is not None:
                break
        # the compute processes (v2 and v3 fill the same record; the first version a shorter one, not read)
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2"):
            self._processes = getattr(lib, name, None)
            if self._processes is not None:
                break

    @classmethod
    def load(cls) -> Nvml:
        """NVML initialized; OSError naming why not (no library, init failed)."""
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
        rc = init()
        if rc != NVML_SUCCESS:
            raise OSError(f"nvmlInit returned {rc}")
        return cls(lib)

    def handle(self, bus_id: str | None = None, uuid: str | None = None):
        """The NVML handle of the GPU at PCI ``bus_id`` (as 'DDDDDDDD:BB:DD.0') or with ``uuid``
        (CUDA_VISIBLE_DEVICES renumbers devices: NVML's indices are not CUDA's); None if neither finds it."""
        handle = ctypes.c_void_p()
        if bus_id:
            fn = getattr(self.lib, "nvmlDeviceGetHandleByPciBusId_v2", None) or self.lib.nvmlDeviceGetHandleByPciBusId
            if fn(bus_id.encode(), ctypes.byref(handle)) == NVML_SUCCESS:
                return handle
        if uuid:
            text = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            if self.lib.nvmlDeviceGetHandleByUUID(text.encode(), ctypes.byref(handle)) == NVML_SUCCESS:
                return handle
        return None

    def name(self, handle) -> str:
        buf = ctypes.create_string_buffer(96)
        return buf.value.decode() if self.lib.nvmlDeviceGetName(handle, buf, 96) == NVML_SUCCESS else ""

    def _clock(self, fn, handle) -> int | None:
        value = ctypes.c_uint()
        return value.value if fn(handle, NVML_CLOCK_SM, ctypes.byref(value)) == NVML_SUCCESS and value.value else None

    def read(self, handle) -> Reading:
        sm = self._clock(self.lib.nvmlDeviceGetClockInfo, handle)
        # the applications clock where the card reports one (not every card does), else the max
        reference = (self._clock(self.lib.nvmlDeviceGetApplicationsClock, handle)
                     or self._clock(self.lib.nvmlDeviceGetMaxClockInfo, handle))
        bits = ctypes.c_ulonglong()
        ok = self._reasons is not None and self._reasons(handle, ctypes.byref(bits)) == NVML_SUCCESS
        return Reading(sm, reference, bits.value if ok else 0, others(self.processes(handle)))

    def processes(self, handle) -> list[int] | None:
        """The PIDs of the compute processes on the GPU; None where NVML does not say."""
        if self._processes is None:
            return None
        count = ctypes.c_uint(0)
        rc = self._processes(handle, ctypes.byref(count), None)
        if rc == NVML_SUCCESS:
            return []
        if rc != NVML_ERROR_INSUFFICIENT_SIZE:
            return None
        count = ctypes.c_uint(count.value + 4)  # room for processes started since
        infos = (_ProcessInfo * count.value)()
        if self._processes(handle, ctypes.byref(count), infos) != NVML_SUCCESS:
            return None
        return [infos[i].pid for i in range(count.value)]


_INJECTED: Callable | None = None  # tests: device -> (() -> Reading) or None
_READERS: dict = {}  # device -> read() or the reason there is none, one lookup a session


def install_reader(factory: Callable | None) -> None:
    """Read clocks through ``factory(device) -> (read() -> Reading) or None`` instead of NVML, for
    every device, the CPU included (tests); None goes back to NVML."""
    global _INJECTED
    _INJECTED = factory
    _READERS.clear()


def _bus_id(device) -> tuple[str | None, str | None]:
    import torch

    p = torch.cuda.get_device_properties(device)
    bus = None
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    uuid = getattr(p, "uuid", None)
    return bus, str(uuid) if uuid else None


def reader(device) -> tuple[Callable | None, str | None]:
    """(read, None) for a device whose clocks can be read, else (None, why not). GPU rows only,
    unless a reader is injected."""
    key = str(device)
    if key not in _READERS:
        if _INJECTED is not None:
            read = _INJECTED(device)
            _READERS[key] = (read, None if read else "the injected reader has none for this device")
        elif getattr(device, "type", "cpu") != "cuda":
            _READERS[key] = (None, "not a GPU")
        else:
            _READERS[key] = _nvml_reader(device)
    return _READERS[key]


def _nvml_reader(device):
    try:
        nvml = Nvml.load()
    except (OSError, AttributeError) as e:
        return None, f"clocks not read: NVML unavailable ({e})"
    handle = nvml.handle(*_bus_id(device))
    if handle is None:
        return None, f"clocks not read: NVML finds no GPU matching {device}'s PCI bus id or UUID"
    return (lambda: nvml.read(handle)), None


class Watch:
    """A row's clock readings, before and after each round of its timing (``wrap`` a round's
    timer), and whether the rounds it kept ran held down."""

    def __init__(self, read: Callable[[], Reading]):
        self.read, self.rounds, self.dropped = read, [], 0

    def wrap(self, time_once):
        if time_once is None:
            return None

        def timed():
            before = self.read()
            samples = time_once()
            self.rounds.append((before, self.read()))
            return samples
        return timed

    def last_causes(self) -> list[str]:
        return sorted({c for reading in self.rounds[-1] for c in causes(reading)}) if self.rounds else []

    def drop_last(self) -> None:
        """The last round's samples were thrown away (re-timed): its readings no longer describe the row."""
        self.dropped = len(self.rounds)

    def kept(self) -> list[Reading]:
        return [reading for pair in self.rounds[self.dropped:] for reading in pair]

    def record(self, retimed: bool) -> tuple[dict, bool]:
        """(the row's ``clocks``, whether it is throttled) from the rounds kept."""
        kept = self.kept()
        found = sorted({c for reading in kept for c in causes(reading)})
        reasons = sorted({name for reading in kept for bit, name in REASONS.items() if bit & reading.reasons})
        refs = [r.reference_mhz for r in kept if r.reference_mhz]
        clocks = {"sm_mhz": [r.sm_mhz for r in kept], "reference_mhz": max(refs) if refs else None,
                  "reasons": reasons, "throttled_by": found, "retimed": retimed}
        return clocks, bool(found)



def summary(rows) -> str | None:
    """'2 of 40 rows timed while the GPU was held down ...' for the summaries; None where no row's
    clocks were read."""
    from .suites import row_title

    watched = [r for r in rows if r.clocks or r.throttled]
    if not watched:
        return None
    held = [r for r in watched if r.throttled]
    retimed = sum(1 for r in watched if r.clocks.get("retimed"))
    text = (f"{len(held)} of {len(watched)} rows throttled (timed while the GPU was held down or shared, after one "
            f"re-timing: the regression gate never calls them SLOWER); {retimed} re-timed once for it")
    if held:
        named = [f"{row_title(r)} ({', '.join(r.clocks.get('throttled_by') or ['throttled'])})" for r in held[:10]]
        text += ": " + "; ".join(named) + (f"; and {len(held) - 10} more" if len(held) > 10 else "")
    return text
