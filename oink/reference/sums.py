"""Row sums that give a row the same bits whatever batch it sits in, on any device: a fixed pairwise tree of
elementwise adds over the last dim, never a torch reduction (torch's CUDA reductions split a row by the batch's
size and by the row's alignment). The references whose GPU fallbacks are promised batch-invariant use it."""
from __future__ import annotations

import torch
from torch import Tensor


def row_sum(t: Tensor) -> Tensor:
    """t summed over the last dim, kept as a dim of 1: the columns zero-padded to a power of two (adding +0
    changes no sum of squares), then the halves added until one column is left."""
    n = t.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        t = torch.nn.functional.pad(t, (0, p - n))
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t
