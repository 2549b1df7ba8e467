"""The GPU clocks read through NVML (issue #34 item 4) on a real card: the handle found from torch's
PCI bus id is this GPU, a busy card's SM clock and reasons read sensibly, and a benchmark row of a
plugin run carries them in its JSON."""
from __future__ import annotations

import json

import pytest
import torch

from pytest_oink import clocks
from tests.helpers import oink_on_pythonpath

pytestmark = [pytest.mark.gpu]


def test_nvml_reads_this_gpus_clocks_while_it_is_busy():
    device = torch.device("cuda", torch.cuda.current_device())
    clocks.install_reader(None)  # NVML, not a test's injected reader
    read, why = clocks.reader(device)
    assert read is not None, why
    nvml = clocks.Nvml.load()
    assert nvml.name(nvml.handle(*clocks._bus_id(device))) == torch.cuda.get_device_name(device)
    a = torch.randn(8192, 8192, device=device)
    readings = []
    for _ in range(20):  # matmuls queued ahead of each reading: the card is busy while it is read
        for _ in range(8):
            a @ a
        readings.append(read())
    torch.cuda.synchronize()
    busy = [r for r in readings if not r.reasons & clocks.IDLE]
    assert busy, readings
    for r in busy:
        assert 200 <= r.sm_mhz <= 4000 and 500 <= r.reference_mhz <= 4000, r
    print("busy readings (SM MHz, reference MHz, causes):",
          [(r.sm_mhz, r.reference_mhz, clocks.causes(r)) for r in busy])


def test_a_gpu_row_carries_its_clocks(pytester, monkeypatch, tmp_path):
    oink_on_pythonpath(monkeypatch)
    res = pytester.runpytest_subprocess("-p", "pytest_oink.plugin", "-p", "no:cacheprovider", "--oink-suite=smoke",
                                        "--oink-ops=rmsnorm_forward", "--oink-providers=torch,torch.compile",
                                        "--oink-configs=4096x4096", f"--oink-json={tmp_path / 'o.json'}")
    assert res.ret == 0, res.stdout.str()[-3000:]
    for bench in json.loads((tmp_path / "o.json").read_text())["benchmarks"]:
        info = bench["extra_info"]
        assert len(info["clocks"]["sm_mhz"]) >= 2 and info["clocks"]["reference_mhz"] >= 500, info["clocks"]
        assert isinstance(info["throttled"], bool)
    res.stdout.fnmatch_lines(["*clocks: * of 2 rows throttled*"])
