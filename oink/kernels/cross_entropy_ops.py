"""CrossEntropy kernels on torch tensors (CHECKS/RUNNERS for the dispatch path). The reductions
"mean" and "sum" are a device sum of the kernel's per-row losses (no host round trip)."""
from __future__ import annotations

import torch

from .compile import current_stream
from ..reference.cross_entropy import reduce_loss
from .cross_entropy import compiled_cross_entropy
from .host import dtype_name, ld, prepare_rows, ptr, vec_for, width_reason

INT32 = torch.iinfo(torch.int32)


def _check(t: dict, arch: str) -> str | None:
    why = width_reason(t["logits"].shape[-1], "V")
    if why:
        return why
    if not INT32.min <= t["ignore_index"] <= INT32.max:
        return f"ignore_index {t['ignore_index']} does not fit int32: reference"
    return None


def _check_inplace(t: dict, arch: str) -> str | None:
    why = _check(t, arch)
    if why:
        return why
    logits = t["logits"]
    if not logits.is_contiguous() or logits.data_ptr() % 16:
        return "logits not contiguous and 16-byte aligned (in place: no copy possible): reference"
    return None


def _row_vector(t: torch.Tensor, M: int, dtype) -> torch.Tensor:
    """A per-row input (target, lse, or dloss, which may be a scalar) as a contiguous [M] tensor."""
    return torch.broadcast_to(t.reshape(-1).to(dtype), (M,)).contiguous()


def launch(mode, arch, x2, target, ignore_index, dloss=None, lse_in=None, loss=None, lse_out=None, dx=None):
    """x2: kernel-ready [M, V] logits; per-row tensors contiguous; dx may be x2 itself."""
    M, V = x2.shape
    if M == 0:
        return
    fn = compiled_cross_entropy(mode, dtype_name(x2), dtype_name(target), V, arch, lse_out is not None)
    fn(ptr(x2), ptr(target, target.element_size()), ptr(dloss, 4), ptr(lse_in, 4), ptr(loss, 4), ptr(lse_out, 4),
       ptr(dx), M, ld(x2), ld(dx), int(ignore_index), current_stream(x2.device))


def _inputs(logits, target):
    x2 = prepare_rows(logits, vec_for(logits.shape[-1], logits))
    return x2, target.contiguous()


def run_forward(arch, logits, target, ignore_index=-100, reduction="none"):
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    loss = torch.empty(M, device=logits.device, dtype=torch.float32)
    lse = torch.empty(M, device=logits.device, dtype=torch.float32)
    launch("forward", arch, x2, tgt, ignore_index, loss=loss, lse_out=lse)
    return reduce_loss(loss, tgt != ignore_index, reduction), lse  # the reference's reduction, on device


def run_backward(arch, dloss, logits, target, lse, ignore_index=-100):
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    dx = torch.empty_like(x2)
    launch("backward", arch, x2, tgt, ignore_index, dloss=_row_vector(dloss, M, torch.float32),
           lse_in=_row_vector(lse, M, torch.float32), dx=dx)
    return dx


def run_backward_(arch, dloss, logits, target, lse, ignore_index=-100):
    """dlogits written over the logits (each element read before it is written, by one thread)."""
    M = logits.shape[0]
    launch("backward", arch, logits, target.contiguous(), ignore_index, dloss=_row_vector(dloss, M, torch.float32),
           lse_in=_row_vector(lse, M, torch.float32), dx=logits)


def run_fwd_bwd(arch, dloss, logits, target, ignore_index=-100):
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    loss = torch.empty(M, device=logits.device, dtype=torch.float32)
    dx = torch.empty_like(x2)
    launch("fwd_bwd", arch, x2, tgt, ignore_index, dloss=_row_vector(dloss, M, torch.float32), loss=loss, dx=dx)
    return loss, dx


CHECKS = {"cross_entropy_forward": _check, "cross_entropy_backward": _check, "cross_entropy_backward_": _check_inplace,
          "cross_entropy_fwd_bwd": _check}
RUNNERS = {"cross_entropy_forward": run_forward, "cross_entropy_backward": run_backward,
           "cross_entropy_backward_": run_backward_, "cross_entropy_fwd_bwd": run_fwd_bwd}
