"""GPU clocks around each timed row (issue #34 item 4), on a CPU: NVML's answers decoded from a fake
library, a fake clock reader injected into plugin runs (pytester) for the re-timing, the JSON, CSV and
summaries, and the regression gate, which never calls a throttled row SLOWER."""
from __future__ import annotations

import csv
import ctypes
import json

import pytest

from pytest_oink import clocks, report, verdicts
from pytest_oink.clocks import Reading
from pytest_oink.state import STATE
from pytest_oink.timing import CPU_SAMPLES
from tests.helpers import BENCH, ONE_ROW, PLUGIN
from tests.helpers import _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

POWER_CAP, IDLE, APP_SETTING, HW_THERMAL = 0x4, 0x1, 0x2, 0x40


def test_causes_name_slowdowns_and_low_clocks_but_not_idle():
    assert clocks.causes(Reading(1980, 1980, 0)) == []
    assert clocks.causes(Reading(1980, 1980, POWER_CAP | HW_THERMAL)) == ["software power cap",
                                                                         "hardware thermal slowdown"]
    assert clocks.causes(Reading(1200, 1755, 0)) == ["SM clock 1200 MHz under 75% of 1755 MHz"]
    assert clocks.causes(Reading(1400, 1755, 0)) == []  # 80% of the reference: not held down
    assert clocks.causes(Reading(345, 1755, IDLE)) == []  # an idle card clocks down: no verdict on the rounds
    assert clocks.causes(Reading(1980, 1980, APP_SETTING)) == []  # a setting, not a slowdown
    assert clocks.causes(Reading(None, None, 0)) == []
    assert clocks.causes(Reading(1980, 1980, 0, others=2)) == ["shared with 2 other processes"]
    assert clocks.causes(Reading(1980, 1980, POWER_CAP, 1)) == ["software power cap", "shared with 1 other process"]


class FakeNvml:
    """The NVML calls clocks.Nvml makes, answering through the ctypes byref arguments as the library
    would; an older driver: clock-event reasons under their former name, no applications clock."""

    def __init__(self, sm=1980, max_mhz=1980, reasons=0, bus="00000000:19:00.0", pids=None):
        self.sm, self.max, self.reasons, self.bus, self.pids = sm, max_mhz, reasons, bus, pids

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, ref):
        if bus.decode() != self.bus:
            return 13  # NVML_ERROR_NOT_FOUND
        ref._obj.value = 1234
        return 0

    def nvmlDeviceGetHandleByUUID(self, uuid, ref):
        return 13

    def _clock(self, value):
        def get(handle, kind, ref):
            assert handle.value == 1234 and kind == clocks.NVML_CLOCK_SM
            if value is None:
                return 3  # NVML_ERROR_NOT_SUPPORTED
            ref._obj.value = value
            return 0
        return get

    def __getattr__(self, name):
        calls = {"nvmlDeviceGetClockInfo": self._clock(self.sm), "nvmlDeviceGetMaxClockInfo": self._clock(self.max),
                 "nvmlDeviceGetApplicationsClock": self._clock(None),
                 "nvmlDeviceGetCurrentClocksThrottleReasons": self._throttle}
        if self.pids is not None:
            calls["nvmlDeviceGetComputeRunningProcesses_v3"] = self._processes
        if name not in calls:
            raise AttributeError(name)
        return calls[name]

    def _throttle(self, handle, ref):
        ref._obj.value = self.reasons
        return 0

    def _processes(self, handle, count_ref, infos):
        """As NVML answers: the count alone (INSUFFICIENT_SIZE) where the array is missing or short."""
        count = count_ref._obj
        if infos is None or count.value < len(self.pids):
            count.value = len(self.pids)
            return clocks.NVML_SUCCESS if not self.pids else clocks.NVML_ERROR_INSUFFICIENT_SIZE
        for i, pid in enumerate(self.pids):
            infos[i].pid = pid
        count.value = len(self.pids)
        return clocks.NVML_SUCCESS


def test_nvml_answers_are_decoded():
    nvml = clocks.Nvml(FakeNvml(sm=1100, max_mhz=1980, reasons=POWER_CAP | IDLE))
    assert nvml.handle("00000000:01:00.0", "abc") is None  # neither the bus id nor the UUID is known
    handle = nvml.handle("00000000:19:00.0", None)
    reading = nvml.read(handle)
    # no applications clock on this card: the max is the reference; the former reasons call is used
    assert reading == Reading(1100, 1980, POWER_CAP | IDLE)
    assert clocks.causes(reading) == ["software power cap"]  # idle: the low clock is no cause


def test_other_processes_on_the_gpu_make_a_reading_shared(monkeypatch):
    """NVML's compute processes, less this session's (its own PID, an --oink-against worker's); where NVML
    names PIDs of another namespace (none of ours), this session's count is taken off instead."""
    import os

    monkeypatch.setattr(clocks, "_OWN_PIDS", set())
    me = os.getpid()
    handle = ctypes.c_void_p(1234)
    assert clocks.Nvml(FakeNvml(pids=[])).read(handle).others == 0
    assert clocks.Nvml(FakeNvml(pids=[me])).read(handle).others == 0
    assert clocks.Nvml(FakeNvml(pids=[me, 777])).read(handle) == Reading(1980, 1980, 0, 1)
    clocks.own_pid(777)  # the worker: ours
    assert clocks.Nvml(FakeNvml(pids=[me, 777])).read(handle).others == 0
    assert clocks.Nvml(FakeNvml(pids=[me, 777, 778, 779])).read(handle).others == 2
    # another PID namespace: none of ours named; this session holds 2 (itself, the worker)
    assert clocks.Nvml(FakeNvml(pids=[51001, 51002])).read(handle).others == 0
    assert clocks.Nvml(FakeNvml(pids=[51001, 51002, 51003])).read(handle).others == 1
    # a driver without the v2/v3 process query: nothing said, nothing flagged
    assert clocks.Nvml(FakeNvml()).processes(handle) is None
    assert clocks.causes(clocks.Nvml(FakeNvml(pids=[me, 51003])).read(handle)) == ["shared with 1 other process"]


def test_without_nvml_the_clocks_are_off_and_say_why(monkeypatch):
    def no_library(name, *a, **kw):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    read, why = clocks._nvml_reader("cuda:0")
    assert read is None and why.startswith("clocks not read: NVML unavailable (libnvidia-ml.so.1: cannot open")

    from pytest_oink.bench_runner import _clock_watch

    class Device:
        type = "cuda"

        def __init__(self, i):
            self.i = i

        def __str__(self):
            return f"cuda:{self.i}"

    class Config:
        stash = {STATE: {}}

    monkeypatch.setattr(clocks, "_READERS", {})
    monkeypatch.setattr(clocks, "_INJECTED", None)
    monkeypatch.setattr(clocks, "_nvml_reader", lambda d: (None, f"clocks not read: none for {d}"))
    assert _clock_watch(Config, Device(0)) is None and _clock_watch(Config, Device(1)) is None
    assert Config.stash[STATE]["clock_note"] == "clocks not read: none for cuda:0"  # said once


def test_a_throttled_row_is_never_slower_nor_a_throttled_baseline_beaten():
    slower = verdicts.Verdict("SLOWER", 1.3, (1.2, 1.4))
    assert verdicts.held_down(slower, False, True) == slower
    held = verdicts.held_down(slower, True, False)
    assert held.name == "UNSURE" and "throttled" in held.describe(0.05) and "[1.20, 1.40]" in held.describe(0.05)
    faster = verdicts.Verdict("FASTER", 0.7, (0.6, 0.8))
    assert verdicts.held_down(faster, True, False) == faster
    assert verdicts.held_down(faster, False, True).name == "UNSURE"

    samples = [1e-4 * (1 + 0.001 * i) for i in range(10)]
    base = {("rmsnorm_forward", "oink", M, 4096, "bfloat16"): [report.BaselineEntry(5e-5, 0.0, "quack", "kernel",
                                                                                   tuple(x / 2 for x in samples))]
            for M in (1024, 2048)}
    rows = [report.Row("quack", "rmsnorm_forward", "oink", M, 4096, "bfloat16", "cuda:0", "ok", method="cuda-graph",
                       median_s=samples[5], samples=samples, throttled=M == 2048) for M in (1024, 2048)]
    out = report.regressions(rows, base, 0.05)
    assert [r.split(":")[0] for r in out.regressed] == ["rmsnorm_forward 1024x4096 bfloat16 oink"]
    assert out.verdicts[rows[1].key] == "UNSURE" and "throttled" in out.unsure[0]


def _conftest(script: str) -> str:
    """A plugin run's clocks, injected: 'always' held down by the power cap, 'first' in the first round
    only (its 2 readings), 'never' not at all."""
    return f'''
from pytest_oink import clocks

reads = {{"n": 0}}


def read():
    reads["n"] += 1
    held = {script!r} == "always" or ({script!r} == "first" and reads["n"] <= 2)
    return clocks.Reading(900 if held else 1980, 1980, 0x4 if held else 0)


clocks.install_reader(lambda device: read)
'''


def test_a_throttled_row_is_retimed_once_then_marked(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    pytester.makeconftest(_conftest("always"))
    out = [f"--oink-json={tmp_path / 'o.json'}", f"--oink-csv={tmp_path / 'r.csv'}",
           f"--oink-summary={tmp_path / 's.md'}"]
    res = pytester.runpytest_subprocess(*ONE_ROW, *out, *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    bench, = json.loads((tmp_path / "o.json").read_text())["benchmarks"]
    info = bench["extra_info"]
    assert info["throttled"] is True and len(info["samples"]) == CPU_SAMPLES  # the first round's samples dropped
    assert info["clocks"] == {"sm_mhz": [900, 900], "reference_mhz": 1980, "reasons": ["software power cap"],
                              "throttled_by": ["SM clock 900 MHz under 75% of 1980 MHz", "software power cap"],
                              "retimed": True}
    row, = csv.DictReader(open(tmp_path / "r.csv"))
    assert (row["throttled"], row["sm_mhz_min"]) == ("1", "900")
    assert "Clocks: 1 of 1 rows throttled (timed while the GPU was held down" in (tmp_path / "s.md").read_text()
    res.stdout.fnmatch_lines(["*clocks: 1 of 1 rows throttled*; 1 re-timed once for it: softmax_forward 4x128 "
                              "bfloat16 torch (SM clock 900 MHz under 75% of 1980 MHz, software power cap)"])


def test_a_row_held_down_in_its_first_round_only_is_retimed_and_kept(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    pytester.makeconftest(_conftest("first"))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-json={tmp_path / 'o.json'}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-2000:]
    info = json.loads((tmp_path / "o.json").read_text())["benchmarks"][0]["extra_info"]
    assert info["throttled"] is False and len(info["samples"]) == CPU_SAMPLES
    assert info["clocks"]["sm_mhz"] == [1980, 1980] and info["clocks"]["retimed"] is True
    res.stdout.fnmatch_lines(["*clocks: 0 of 1 rows throttled*; 1 re-timed once for it"])


def test_the_gate_reads_a_throttled_slower_row_as_unsure(pytester, tmp_path):
    pytester.makepyfile(BENCH)
    base = tmp_path / "fast.json"  # a baseline 10^6 x faster: the row is SLOWER unless throttled
    base.write_text(json.dumps({"rows": [{"suite": "smoke", "op": "softmax_forward", "provider": "torch", "M": 4,
                                          "N": 128, "dtype": "bfloat16", "method": "cpu-one-thread",
                                          "median_s": 1e-12, "samples": [1e-12 * (1 + i / 100) for i in range(6)]}]}))
    pytester.makeconftest(_conftest("always"))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={base}", *PLUGIN)
    assert res.ret == 0, res.stdout.str()[-3000:]
    assert "SLOWER beyond" not in res.stdout.str()
    res.stdout.fnmatch_lines(["*softmax_forward 4x128 bfloat16 torch: UNSURE, x* (throttled: timed while the GPU "
                              "was held down, would read SLOWER)*",
                              "UNSURE after re-timing (passes*): softmax_forward 4x128 bfloat16 torch: UNSURE*"])
    pytester.makeconftest(_conftest("never"))
    res = pytester.runpytest_subprocess(*ONE_ROW, f"--oink-baseline={base}", *PLUGIN)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    res.stdout.fnmatch_lines(["SLOWER beyond 5% (fails the session): softmax_forward 4x128 bfloat16 torch: SLOWER*"])
