"""CrossEntropy kernels on torch tensors (CHECKS/RUNNERS for the dispatch path). The reductions
"mean" and "sum" are a device sum of the kernel's per-row losses (no host round trip). A class
weight scales the per-row loss and the per-row upstream gradient by weight[target] ([M]-sized
torch ops around the [M, V] kernel); with ``lse_partial`` the forward needs no pass over the
logits at all: lse and the target logit are [M]-sized torch ops."""
from __future__ import annotations

import torch

from .compile import current_stream, stream_of
from ..reference.cross_entropy import (loss_from_lse, per_row, reduce_loss, reduction_dloss, row_weight, safe_target,
                                       z_loss_rows)
from .cross_entropy import PLAIN, CEOptions, compiled_cross_entropy
from .host import allocator, dtype_name, kernel_ready_rows, ld, prepare_rows, ptr, vec_for, width_reason

INT32 = torch.iinfo(torch.int32)


def options_of(t: dict) -> CEOptions:
    """The call's options as the kernels' compile-time constants."""
    eps, z, cap = t.get("label_smoothing", 0.0), t.get("z_loss", 0.0), t.get("softcap")
    if not eps and not z and cap is None:
        return PLAIN
    return CEOptions(float(eps), float(z), None if cap is None else float(cap))


def options_reason(t: dict) -> str | None:
    """Why the options send a call to the reference, or None: label smoothing with a class weight needs
    the weighted sum of each row's logits (not in the kernels); a forward's ``target_logit`` with an
    option is read on the host, where the kernel's loss is not rebuilt."""
    if t.get("label_smoothing") and t.get("weight") is not None:
        return "label_smoothing with a class weight: reference"
    if t.get("target_logit") is not None and not options_of(t).plain:
        return "target_logit with label_smoothing, z_loss or softcap: reference"
    return None


def _check(t: dict, arch: str) -> str | None:
    why = width_reason(t["logits"].shape[-1], "V") or options_reason(t)
    if why:
        return why
    if not INT32.min <= t["ignore_index"] <= INT32.max:
        return f"ignore_index {t['ignore_index']} does not fit int32: reference"
    return None


def _check_forward(t: dict, arch: str) -> str | None:
    if t.get("lse_partial") is not None:
        return None  # no [M, V] pass: [M]-sized torch ops on the device
    return _check(t, arch)


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


def launch(mode, arch, x2, target, ignore_index, dloss=None, lse_in=None, loss=None, lse_out=None, dx=None,
           options: CEOptions = PLAIN):
    """x2: kernel-ready [M, V] logits; per-row tensors contiguous; dx may be x2 itself."""
    M, V = x2.shape
    if M == 0:
        return
    fn = compiled_cross_entropy(mode, dtype_name(x2), dtype_name(target), V, arch, lse_out is not None,
                                dx is None or ld(dx) == ld(x2), options,
                                dx is not None and dx.data_ptr() == x2.data_ptr())
    fn(ptr(x2), ptr(target, target.element_size()), ptr(dloss, 4), ptr(lse_in, 4), ptr(loss, 4), ptr(lse_out, 4),
       ptr(dx), M, ld(x2), ld(dx), int(ignore_index), current_stream(x2.device))


def _inputs(logits, target):
    x2 = prepare_rows(logits, vec_for(logits.shape[-1], logits))
    return x2, target.contiguous()


def _row_factor(weight, target, ignore_index):
    """weight[target] on rows not ignored, 0 on ignored ones (fp32 [M]); None without a weight."""
    return None if weight is None else row_weight(weight, *safe_target(target, ignore_index))


def _scaled_dloss(dloss, M, rw):
    d = _row_vector(dloss, M, torch.float32)
    return d if rw is None else d * rw


def _with_z_loss(out: tuple, lse, rw, tgt, ignore_index, z_loss, reduction, wanted: bool) -> tuple:
    """``out`` and, where ``wanted``, the z-loss part of the loss from the lse, reduced as the loss."""
    if not wanted:
        return out
    if rw is None:
        rw = row_weight(None, *safe_target(tgt, ignore_index))
    return out + (reduce_loss(z_loss_rows(lse, rw, tgt != ignore_index, z_loss), rw, reduction),)


def run_forward(arch, logits, target, ignore_index=-100, reduction="none", weight=None, lse_partial=None,
                target_logit=None, label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    if lse_partial is not None:
        loss, lse, rw = per_row(logits, target, ignore_index, weight, lse_partial, target_logit, label_smoothing,
                                z_loss, softcap)
        return _with_z_loss((reduce_loss(loss, rw, reduction), lse), lse, rw, target, ignore_index, z_loss,
                            reduction, return_z_loss)
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    loss = torch.empty(M, device=logits.device, dtype=torch.float32)
    lse = torch.empty(M, device=logits.device, dtype=torch.float32)
    opts = options_of(dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap))
    launch("forward", arch, x2, tgt, ignore_index, loss=loss, lse_out=lse, options=opts)
    if target_logit is None and weight is None and reduction == "none" and not return_z_loss:
        return loss, lse  # the kernel's loss is final (0 on ignored rows): no per-row torch ops
    valid, safe = safe_target(tgt, ignore_index)
    if target_logit is not None:  # the target's logit comes from elsewhere
        loss = loss_from_lse(lse, target_logit, valid, safe)
    rw = row_weight(weight, valid, safe)
    if weight is not None:
        loss = loss * rw
    out = (reduce_loss(loss, rw, reduction), lse)  # the reference's reduction, on device
    return _with_z_loss(out, lse, rw, tgt, ignore_index, z_loss, reduction, return_z_loss)


def run_backward(arch, dloss, logits, target, lse, ignore_index=-100, weight=None, label_smoothing=0.0, z_loss=0.0,
                 softcap=None):
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    dx = torch.empty_like(x2)
    launch("backward", arch, x2, tgt, ignore_index, dloss=_scaled_dloss(dloss, M, _row_factor(weight, tgt, ignore_index)),
           lse_in=_row_vector(lse, M, torch.float32), dx=dx,
           options=options_of(dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)))
    return dx


def run_backward_(arch, dloss, logits, target, lse, ignore_index=-100, weight=None, label_smoothing=0.0, z_loss=0.0,
                  softcap=None):
    """dlogits written over the logits (each element read before it is written, by one thread)."""
    M = logits.shape[0]
    tgt = target.contiguous()
    launch("backward", arch, logits, tgt, ignore_index, dloss=_scaled_dloss(dloss, M, _row_factor(weight, tgt, ignore_index)),
           lse_in=_row_vector(lse, M, torch.float32), dx=logits,
           options=options_of(dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)))


def run_fwd_bwd(arch, dloss, logits, target, ignore_index=-100, weight=None, return_lse=False, reduction="none",
                label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    x2, tgt = _inputs(logits, target)
    M = x2.shape[0]
    loss = torch.empty(M, device=logits.device, dtype=torch.float32)
    lse = torch.empty(M, device=logits.device, dtype=torch.float32) if return_lse or return_z_loss else None
    dx = torch.empty_like(x2)
    rw = _row_factor(weight, tgt, ignore_index)
    if reduction == "mean":  # the mean's divisor, on device
        rw_all = rw if rw is not None else row_weight(None, *safe_target(tgt, ignore_index))
        dloss = reduction_dloss(dloss.float(), rw_all, reduction)
    launch("fwd_bwd", arch, x2, tgt, ignore_index, dloss=_scaled_dloss(dloss, M, rw), loss=loss, lse_out=lse, dx=dx,
           options=options_of(dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)))
    if rw is not None:
        loss = loss * rw
    if reduction != "none":
        rw_all = rw if rw is not None else row_weight(None, *safe_target(tgt, ignore_index))
        loss = reduce_loss(loss, rw_all, reduction)
    out = (loss, dx) + ((lse,) if return_lse else ())
    return _with_z_loss(out, lse, rw, tgt, ignore_index, z_loss, reduction, return_z_loss)


def run_fwd_bwd_(arch, dloss, logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """(loss, lse); dlogits written over the logits in the same pass (``CrossEntropy``'s in place)."""
    M = logits.shape[0]
    loss, lse = (torch.empty(M, device=logits.device, dtype=torch.float32) for _ in range(2))
    launch("fwd_bwd", arch, logits, target.contiguous(), ignore_index, dloss=_row_vector(dloss, M, torch.float32),
           loss=loss, lse_out=lse, dx=logits,
           options=options_of(dict(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)))
    return loss, lse


def _plain_rows(t, M: int) -> bool:
    """A per-row input the kernel reads as is: contiguous fp32 [M] (else the runner copies it)."""
    return t.dtype == torch.float32 and t.dim() == 1 and t.shape[0] == M and t.is_contiguous()


def _plan(mode: str):
    """A launch prepared once per argument layout (see dispatch.Route.plan) for the plain calls: no
    class weight, ``lse_partial``, ``target_logit``, reduction, option or z-loss output; logits readable as they are;
    contiguous targets; ``dloss`` and ``lse`` contiguous fp32 [M]. None otherwise (the runner)."""
    def make(arch, a: dict):
        logits, target = a["logits"], a["target"]
        M, V = logits.shape[0], logits.shape[-1]
        # dloss (backward, fwd_bwd) and lse (backward) are required where the op has them
        if (logits.numel() == 0 or a.get("weight") is not None or a.get("lse_partial") is not None
                or a.get("target_logit") is not None or a.get("reduction", "none") != "none"
                or not options_of(a).plain or a.get("return_z_loss")
                or not kernel_ready_rows(logits, vec_for(V, logits)) or not target.is_contiguous()
                or any(n in a and not _plain_rows(a[n], M) for n in ("dloss", "lse"))):
            return None
        return_lse = mode == "forward" or a.get("return_lse", False)
        device, ldx, ignore = logits.device, ld(logits), int(a.get("ignore_index", -100))
        # dx is dense: its rows lie at the logits' offsets only where the logits' are dense too
        fn = compiled_cross_entropy(mode, dtype_name(logits), dtype_name(target), V, arch, return_lse,
                                    mode == "forward" or ldx == V)
        stream = stream_of(device)
        new_row = allocator((M,), torch.float32, device)

        def run(a):
            x, dloss = a["logits"], a.get("dloss")
            loss = new_row() if mode != "backward" else None
            lse = new_row() if return_lse else None
            dx = torch.empty_like(x, memory_format=torch.contiguous_format) if mode != "forward" else None
            lse_in = a["lse"] if mode == "backward" else None
            fn(x.data_ptr(), a["target"].data_ptr(), None if dloss is None else dloss.data_ptr(),
               None if lse_in is None else lse_in.data_ptr(), None if loss is None else loss.data_ptr(),
               None if lse is None else lse.data_ptr(), None if dx is None else dx.data_ptr(), M, ldx,
               0 if dx is None else V, ignore, stream())
            if mode == "forward":
                return loss, lse
            if mode == "backward":
                return dx
            return (loss, dx, lse) if return_lse else (loss, dx)

        return run

    return make


PLANS = {"cross_entropy_forward": _plan("forward"), "cross_entropy_backward": _plan("backward"),
         "cross_entropy_fwd_bwd": _plan("fwd_bwd")}

CHECKS = {"cross_entropy_forward": _check_forward, "cross_entropy_backward": _check,
          "cross_entropy_backward_": _check_inplace, "cross_entropy_fwd_bwd": _check,
          "cross_entropy_fwd_bwd_": _check_inplace}
RUNNERS = {"cross_entropy_forward": run_forward, "cross_entropy_backward": run_backward,
           "cross_entropy_backward_": run_backward_, "cross_entropy_fwd_bwd": run_fwd_bwd,
           "cross_entropy_fwd_bwd_": run_fwd_bwd_}
