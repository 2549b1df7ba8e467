"""Shared pieces of the test_quack_*.py ports of Quack's tests: which parametrizations run on CPU.

On a GPU every case runs. On CPU (CI: two cores, every op through its PyTorch reference) a case
runs only if it is cheap: at most ``CPU_MAX_ELEMS`` elements, and torch.compile only at a test's
smallest shape, since each CPU compile costs seconds. The other cases carry ``pytest.mark.gpu``,
which the pytest_oink plugin turns into a skip with a reason when no GPU is there.
"""
from __future__ import annotations

import math

import pytest
import torch

CPU_MAX_ELEMS = 300_000


def gpu_only_if(cond: bool, *values, id: str | None = None):
    """``pytest.param(*values)``, marked ``gpu`` when ``cond`` holds."""
    return pytest.param(*values, marks=[pytest.mark.gpu] if cond else [], id=id)


def too_big_for_cpu(*dims: int) -> bool:
    return math.prod(dims) > CPU_MAX_ELEMS


def shapes_x_compile(shapes):
    """Cases ``(*shape, use_compile)`` for every shape, eager and compiled. On CPU: eager only up
    to CPU_MAX_ELEMS elements, compiled only at the smallest shape."""
    smallest = min(shapes, key=math.prod)
    return [
        gpu_only_if(too_big_for_cpu(*shape) or (use_compile and shape != smallest), *shape, use_compile)
        for use_compile in (False, True)
        for shape in shapes
    ]


def sync() -> None:
    """``torch.cuda.synchronize()`` where there is a GPU (Quack syncs before the backward)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def maybe_compile(fn, use_compile: bool):
    return torch.compile(fn, fullgraph=True) if use_compile else fn
