"""Row sums that give a row the same bits whatever batch it sits in, on any device: a fixed pairwise tree of
elementwise adds over the last dim, never a torch reduction (torch's CUDA reductions split a row by the batch's
size and by the row's alignment). The references whose GPU fallbacks are promised batch-invariant use it.

The benchmark's torch and torch.compile rows time these references as the PyTorch a user would write, with
torch's own sum (``torch_reductions``): the tree is the fallback's promise, not a cost to put on a peer."""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

_TREE = True  # a module global, not a ContextVar: torch.compile reads it as a constant (and guards on it)


def row_sum(t: Tensor) -> Tensor:
    """t summed over the last dim, kept as a dim of 1: the columns zero-padded to a power of two (adding +0
    changes no sum of squares), then the halves added until one column is left; torch's sum inside
    ``torch_reductions``."""
    return _tree(t) if _TREE else t.sum(-1, keepdim=True)


def _tree(t: Tensor) -> Tensor:
    n = t.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        t = torch.nn.functional.pad(t, (0, p - n))
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t


@contextlib.contextmanager
def torch_reductions():
    """``row_sum`` as torch's ``sum`` inside (not batch-invariant on a GPU): for the rows that time the references
    as a user's PyTorch."""
    global _TREE
    before, _TREE = _TREE, False
    try:
        yield
    finally:
        _TREE = before


def with_torch_reductions(fn):
    """``fn`` called inside ``torch_reductions``."""
    def run(*args, **kwargs):
        with torch_reductions():
            return fn(*args, **kwargs)

    return run
