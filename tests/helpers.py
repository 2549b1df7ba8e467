"""Shared test helpers: fresh random data and float64 comparisons, knobs, and the plugin runs' environment."""
from __future__ import annotations

import pytest
import torch

from pytest_oink.tolerances import tolerance

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def randn(gen, *shape, dtype=torch.float32, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def assert_close_to(actual, expected64, family, dtype=None):
    """actual (any dtype) vs a float64 expectation within the table's tolerance for ``dtype``."""
    dtype = dtype or actual.dtype
    atol, rtol = tolerance(family, dtype)
    assert not torch.isnan(actual).any(), "NaN in output"
    torch.testing.assert_close(actual.double(), expected64.double(), atol=atol, rtol=rtol)


def set_knob(monkeypatch, name: str, value: str | None) -> None:
    """Set (None: delete) an OINK_* environment knob and reload oink.config, which reads them once;
    the root conftest reloads it again after the test, once monkeypatch has restored the env."""
    from oink import config

    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    config.reload()


def set_dev(monkeypatch, **settings) -> None:
    """Development settings of oink.config (``config.DEV_DEFAULTS``' names: the A/B switches that force a
    rule's side, the sweeps' launch dials) for this test; monkeypatch puts the previous ones back and
    the root conftest reloads the config after the test."""
    from oink import config

    monkeypatch.setattr(config, "DEV", {**config.DEV, **config.dev_settings(**settings)})
    config.reload()


@pytest.fixture(autouse=True)
def _plugin_runs_see_no_gpu(monkeypatch):
    """These tests check the plugin's CPU behaviour (timing rounds, gating CPU rows, the smoke
    suite) in subprocess runs, also on a machine with GPUs: those stay hidden from the runs (the
    GPU behaviour is what the benchmark suites exercise there). Under pytest-xdist the runs must
    not inherit the worker's identity either: pytest-benchmark would disable itself."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("OINK_FAKE_SM", raising=False)
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)


# plugin runs (pytester): load the plugin, a bench file of one benchmark test, one gated CPU row
PLUGIN = ("-p", "pytest_oink.plugin", "-p", "no:cacheprovider")
BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''
ONE_ROW = ("--oink-suite=smoke", "--oink-ops=softmax_forward", "--oink-providers=torch", "--oink-configs=4x128",
           "--oink-gate-cpu", "--oink-gate-providers=torch")


def oink_on_pythonpath(monkeypatch) -> None:
    """Plugin runs from a directory that is not this repository find Oink as an installed package
    would be found: its parent directory ahead of PYTHONPATH (kept: CuTeDSL's own entries may be there)."""
    import os
    from pathlib import Path

    import pytest_oink

    root = str(Path(pytest_oink.__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))

