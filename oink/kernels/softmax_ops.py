"""Softmax kernels on torch tensors (CHECKS/PLANS for the dispatch path)."""
from __future__ import annotations

import torch

from .compile import stream_of
from .host import dense, dtype_name, row_layout, vec_for, width_reason, window_key
from .launch_table import few_rows
from .softmax import compiled_softmax
from .softmax_rules import SoftmaxKey, softmax_window

DENSE = torch.contiguous_format


def _check(t: dict, arch: str) -> str | None:
    x = t.get("x", t.get("y"))
    why = width_reason(x.shape[-1])
    if why:
        return why
    other = t.get("dy")
    if other is not None and other.dtype != x.dtype:
        return "dy and x/y of different dtypes: reference"
    return None


def _plan(mode: str, first: str, second: str | None):
    """``mode``'s launch prepared for one argument layout (see dispatch.prepare): ``first`` (x or y)
    and ``second`` (dy, or None) read as they are where the kernel can, else copied to dense rows each
    call; the output dense rows of x's shape."""
    def make(arch, a: dict):
        x, other = a[first], (a[second] if second else None)
        N = x.shape[-1]
        M, vec = x.numel() // N, vec_for(N, x)
        if M == 0:
            return lambda a: torch.empty_like(a[first], memory_format=DENSE)
        (copy_x, lda), (copy_o, ldb) = row_layout(x, vec), row_layout(other, vec)
        if not second:
            ldb = lda
        key = SoftmaxKey(mode, dtype_name(x), N, arch, few=few_rows(M))
        if lda == N:  # rows off 16-byte boundaries through aligned windows: the output's rows at x's offsets
            key = window_key(key, softmax_window)
        fn = compiled_softmax(key)
        stream = stream_of(x.device)

        def run(a):
            x = a[first]
            out = torch.empty_like(x, memory_format=DENSE)  # cheaper than torch.empty(shape)
            if copy_x:
                x = dense(x)
            o = a[second] if second else x
            if copy_o:
                o = dense(o)
            fn(x.data_ptr(), o.data_ptr(), out.data_ptr(), M, lda, ldb, N, stream())
            return out

        return run

    return make


PLANS = {"softmax_forward": _plan("forward", "x", None), "softmax_backward": _plan("backward", "y", "dy"),
         "softmax_fwd_bwd": _plan("fwd_bwd", "x", "dy")}

CHECKS = {"softmax_forward": _check, "softmax_backward": _check, "softmax_fwd_bwd": _check}
