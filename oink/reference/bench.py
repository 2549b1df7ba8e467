"""What an op's bench entry says (``Bench``), and the input makers several families share.

Each family module keeps its ops' entries in ``BENCH`` beside their references; ``oink.reference.BENCH``
gathers them, and ``oink.measure.gate.spec_of`` builds each op's benchmark spec from its entry (pytest_oink's
suites pick it up, the tuner gates with it). An entry is plain data and torch code: nothing here imports pytest
or pytest_oink.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Callable

import torch

EPS = 1e-6  # the entries' eps


@dataclass(frozen=True)
class Bench:
    """How the benchmark exercises an op: its inputs, the bytes it must move, how it is called, and the
    tolerance family its outputs are gated with."""
    family: str | tuple  # a tolerance family of oink/measure/tolerances.py, or one per output
    inputs: Callable  # (M, N, dtype, device, gen) -> the op's keyword arguments
    nbytes: Callable  # (M, N, elem_size) -> bytes moved
    # (o, args) -> outputs: the op called on ``o``, which is ``oink`` (the Oink call) or ``oink.reference`` (the
    # reference, which torch eager and torch.compile time too): the same names and signatures
    call: Callable
    _: KW_ONLY
    oink: Callable | None = None  # (oink, args) -> outputs, where the Oink call is not ``call``'s
    mutates: tuple = ()  # in-place ops: the arguments that are the outputs
    gate_view: str | None = None  # what the gate compares, if not the outputs: a view named in oink/measure/gate.py
    block: int = 1  # N must be a multiple of it (the FP4 blocks, FP8 groups)
    only_in: tuple = ()  # the suites that run it (empty: every suite)


def rand(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def x_weight(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen), weight=rand((N,), dtype, device, gen))


def x_residual_weight(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen), residual=rand((M, N), dtype, device, gen),
                weight=rand((N,), dtype, device, gen))
