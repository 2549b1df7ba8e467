"""Softmax kernels on torch tensors (CHECKS/RUNNERS for the dispatch path)."""
from __future__ import annotations

import torch

from .compile import current_stream, stream_of
from .host import dtype_name, kernel_ready_rows, ld, prepare_rows, ptr, rows_view, vec_for, width_reason
from .launch_table import few_rows
from .softmax import compiled_softmax


def _check(t: dict, arch: str) -> str | None:
    x = t.get("x", t.get("y"))
    why = width_reason(x.shape[-1])
    if why:
        return why
    other = t.get("dy")
    if other is not None and other.dtype != x.dtype:
        return "dy and x/y of different dtypes: reference"
    return None


def launch(mode, arch, a, b, out):
    """a, b, out: kernel-ready [M, N] tensors of one dtype (b unused by the forward)."""
    M, N = a.shape
    if M == 0:
        return out
    fn = compiled_softmax(mode, dtype_name(a), N, arch, few_rows(M))
    fn(ptr(a), ptr(b), ptr(out), M, ld(a), ld(b), ld(out), current_stream(a.device))
    return out


def _run(mode, arch, a, b):
    N = a.shape[-1]
    vec = vec_for(N, a)
    a2 = prepare_rows(a, vec)
    b2 = prepare_rows(b, vec) if b is not None else a2
    out = torch.empty(a2.shape, device=a.device, dtype=a.dtype)
    return launch(mode, arch, a2, b2, out).view(a.shape)


def run_forward(arch, x):
    return _run("forward", arch, x, None)


def run_backward(arch, dy, y):
    return _run("backward", arch, y, dy)


def run_fwd_bwd(arch, dy, x):
    return _run("fwd_bwd", arch, x, dy)


def _plan(mode: str, first: str, second: str | None):
    """A launch prepared once per argument layout (see dispatch.Route.plan): None where a copy is needed."""
    def make(arch, a: dict):
        x, other = a[first], (a[second] if second else None)
        N = x.shape[-1]
        vec = vec_for(N, x)
        if x.numel() == 0:
            return None
        if not (kernel_ready_rows(x, vec) and kernel_ready_rows(other, vec)):
            return None
        x2, o2 = rows_view(x), (rows_view(other) if other is not None else None)
        M, device = x2.shape[0], x.device
        fn = compiled_softmax(mode, dtype_name(x), N, arch, few_rows(M))
        stream = stream_of(device)
        lda, ldb = ld(x2), ld(o2 if o2 is not None else x2)

        def run(a):
            x = a[first]
            pa = x.data_ptr()
            out = torch.empty_like(x, memory_format=torch.contiguous_format)  # cheaper than torch.empty(shape)
            fn(pa, a[second].data_ptr() if second else pa, out.data_ptr(), M, lda, ldb, N, stream())
            return out

        return run

    return make


PLANS = {"softmax_forward": _plan("forward", "x", None), "softmax_backward": _plan("backward", "y", "dy"),
         "softmax_fwd_bwd": _plan("fwd_bwd", "x", "dy")}

CHECKS = {"softmax_forward": _check, "softmax_backward": _check, "softmax_fwd_bwd": _check}
RUNNERS = {"softmax_forward": run_forward, "softmax_backward": run_backward, "softmax_fwd_bwd": run_fwd_bwd}
