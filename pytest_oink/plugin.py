"""The module pytest loads (entry point ``pytest11``). Import-light: no torch here."""
from __future__ import annotations

import pytest

from . import markers


def pytest_addoption(parser):
    group = parser.getgroup("oink", "Oink kernels: correctness gates and benchmarks")
    group.addoption("--oink-suite", default=None,
                    help="run the benchmark suite NAME (benchmarks are not run without it)")


def pytest_configure(config):
    for line in markers.MARKERS:
        config.addinivalue_line("markers", line)


def pytest_runtest_setup(item):
    reason = markers.skip_reason(item)
    if reason:
        pytest.skip(reason)
