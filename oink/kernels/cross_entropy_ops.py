"""CrossEntropy kernels on torch tensors: which inputs they take (CHECKS) and their launches, each prepared
once per argument layout (PLANS, see ``dispatch.prepare``). The reductions "mean" and "sum" are a device
sum of the kernel's per-row losses (no host round trip). A class weight scales the per-row loss and the
per-row upstream gradient by weight[target] ([M]-sized torch ops around the [M, V] kernel); with
``lse_partial`` the forward needs no pass over the logits at all: lse and the target logit are
[M]-sized torch ops."""
from __future__ import annotations

import torch

from .. import config
from .compile import stream_of
from ..reference.cross_entropy import (loss_from_lse, per_row, reduce_loss, reduction_dloss, row_weight, safe_target,
                                       z_loss_rows)
from .cross_entropy import PLAIN, CEOptions, CrossEntropyKey, compiled_cross_entropy
from .host import allocator, dense, dtype_name, ld, row_layout, vec_for, width_reason

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


def _plain_rows(t, M: int) -> bool:
    """A per-row input the kernel reads as is: contiguous fp32 [M] (else ``_row_vector``'s copy)."""
    return t.dtype == F32 and t.dim() == 1 and t.shape[0] == M and t.is_contiguous()


def _row_factor(weight, target, ignore_index):
    """weight[target] on rows not ignored, 0 on ignored ones (fp32 [M]); None without a weight."""
    return None if weight is None else row_weight(weight, *safe_target(target, ignore_index))


def _with_z_loss(out: tuple, lse, rw, tgt, ignore_index, z_loss, reduction, wanted: bool) -> tuple:
    """``out`` and, where ``wanted``, the z-loss part of the loss from the lse, reduced as the loss."""
    if not wanted:
        return out
    if rw is None:
        rw = row_weight(None, *safe_target(tgt, ignore_index))
    return out + (reduce_loss(z_loss_rows(lse, rw, tgt != ignore_index, z_loss), rw, reduction),)


def _sharded_forward(logits, target, ignore_index=-100, reduction="none", weight=None, lse_partial=None,
                     target_logit=None, label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    """The forward with ``lse_partial``: no pass over the logits, [M]-sized torch ops on the device."""
    loss, lse, rw = per_row(logits, target, ignore_index, weight, lse_partial, target_logit, label_smoothing, z_loss,
                            softcap)
    return _with_z_loss((reduce_loss(loss, rw, reduction), lse), lse, rw, target, ignore_index, z_loss, reduction,
                        return_z_loss)


def _skip(*args) -> None:
    """The launch of no rows: none."""


# ---- launches, each prepared once per argument layout (see dispatch.prepare) ---------------------
DENSE = torch.contiguous_format
F32 = torch.float32


def _window(mode: str, dx_at_x: bool) -> bool:
    """Whether rows off 16-byte boundaries are read through aligned windows: the backward's wherever dlogits lie at
    the logits' offsets (no sum over a row); the forward's and the fused mode's too unless the ``windows`` setting
    is False, which reads them by element: a window splits a row's sum by the row's address, so by its index in the
    batch (batch invariance); the element path has not run on a GPU yet, so windows stay the rule."""
    if mode == "backward":
        return dx_at_x
    return config.get().windows is not False and (mode == "forward" or dx_at_x)


class _Layout:
    """What a launch of ``mode`` reads of the call's layout, decided once: the compiled function (``_skip`` for
    no rows), the logits' row stride and dlogits' (``dx``: the logits themselves ``inplace``), which inputs
    are copied each call (logits the kernel can't read as they are, a target not contiguous), and the
    scalars and flags (ignore_index, class weight, reduction, z-loss) the host's part around it reads."""

    def __init__(self, mode: str, arch: str, a: dict, inplace: bool, store_lse: bool):
        logits, target = a["logits"], a["target"]
        self.M, V = logits.shape
        self.ignore = int(a.get("ignore_index", -100))
        self.weighted = a.get("weight") is not None
        self.reduction = a.get("reduction", "none")
        self.z_loss, self.return_z = float(a.get("z_loss", 0.0)), bool(a.get("return_z_loss", False))
        if inplace:  # dlogits over the logits: no copy possible (the op's check: contiguous, aligned)
            self.copy_x, self.ldx = False, ld(logits)
        else:
            self.copy_x, self.ldx = row_layout(logits, vec_for(V, logits))
        # dlogits are dense unless in place: rows at the logits' offsets only where the logits' are dense too
        self.ldd = 0 if mode == "forward" else self.ldx if inplace else V
        self.copy_t = not target.is_contiguous()
        self.fn = _skip if self.M == 0 else compiled_cross_entropy(CrossEntropyKey(
            mode, dtype_name(logits), dtype_name(target), V, arch, store_lse=store_lse,
            window=_window(mode, self.ldd == self.ldx), options=options_of(a), inplace=inplace))
        self.stream = stream_of(logits.device)
        self.new_row = allocator((self.M,), F32, logits.device)


def plan_forward(arch, a: dict):
    """The forward prepared for ``a``'s layout: logits copied to dense rows where the kernel can't read them
    as they are; the kernel's loss final (0 on ignored rows) unless a ``target_logit``, class weight,
    reduction or z-loss output asks for [M]-sized torch ops after it; with ``lse_partial`` no kernel."""
    if a.get("lse_partial") is not None:
        return lambda a: _sharded_forward(**a)
    L = _Layout("forward", arch, a, False, True)
    fn, stream, new_row, copy_x, copy_t = L.fn, L.stream, L.new_row, L.copy_x, L.copy_t
    M, ldx, ignore = L.M, L.ldx, L.ignore
    final = a.get("target_logit") is None and not L.weighted and L.reduction == "none" and not L.return_z

    def run(a):
        x, t = a["logits"], a["target"]
        if copy_x:
            x = dense(x)
        if copy_t:
            t = t.contiguous()
        loss, lse = new_row(), new_row()
        fn(x.data_ptr(), t.data_ptr(), None, None, loss.data_ptr(), lse.data_ptr(), None, M, ldx, 0, ignore, stream())
        if final:
            return loss, lse
        valid, safe = safe_target(t, ignore)
        if a.get("target_logit") is not None:  # the target's logit comes from elsewhere
            loss = loss_from_lse(lse, a["target_logit"], valid, safe)
        weight = a.get("weight")
        rw = row_weight(weight, valid, safe)
        if weight is not None:
            loss = loss * rw
        out = (reduce_loss(loss, rw, L.reduction), lse)  # the reference's reduction, on device
        return _with_z_loss(out, lse, rw, t, ignore, L.z_loss, L.reduction, L.return_z)

    return run


def _plan_backward(inplace: bool):
    """The backward prepared for one call's layout: logits copied to dense rows where the kernel can't read
    them as they are (never ``inplace``: dlogits then go over the logits); dloss (times weight[target] with
    a class weight) and lse passed as contiguous fp32 [M], copied where they are not."""
    def make(arch, a: dict):
        L = _Layout("backward", arch, a, inplace, False)
        fn, stream, copy_x, copy_t = L.fn, L.stream, L.copy_x, L.copy_t
        M, ldx, ldd, ignore, weighted = L.M, L.ldx, L.ldd, L.ignore, L.weighted
        copy_dloss = weighted or not _plain_rows(a["dloss"], M)
        copy_lse = not _plain_rows(a["lse"], M)

        def run(a):
            x, t, dloss, lse = a["logits"], a["target"], a["dloss"], a["lse"]
            if copy_x:
                x = dense(x)
            if copy_t:
                t = t.contiguous()
            if copy_dloss:
                dloss = _row_vector(dloss, M, F32)
                if weighted:
                    dloss = dloss * _row_factor(a["weight"], t, ignore)
            if copy_lse:
                lse = _row_vector(lse, M, F32)
            dx = x if inplace else torch.empty_like(x, memory_format=DENSE)
            fn(x.data_ptr(), t.data_ptr(), dloss.data_ptr(), lse.data_ptr(), None, None, dx.data_ptr(), M, ldx, ldd,
               ignore, stream())
            return None if inplace else dx

        return run

    return make


def _plan_fwd_bwd(inplace: bool):
    """The forward and backward in one pass prepared for one call's layout: logits and dloss as the
    backward's, "mean"'s divisor applied to dloss first (on the device); loss weighted, reduced and the
    z-loss output added after the kernel. ``inplace``: dlogits over the logits, -> (loss, lse) per row."""
    def make(arch, a: dict):
        return_lse = inplace or a.get("return_lse", False)
        store_lse = return_lse or bool(a.get("return_z_loss", False))
        L = _Layout("fwd_bwd", arch, a, inplace, store_lse)
        fn, stream, new_row, copy_x, copy_t = L.fn, L.stream, L.new_row, L.copy_x, L.copy_t
        M, ldx, ldd, ignore, weighted, reduction = L.M, L.ldx, L.ldd, L.ignore, L.weighted, L.reduction
        copy_dloss = weighted or reduction == "mean" or not _plain_rows(a["dloss"], M)
        final = not weighted and reduction == "none" and not L.return_z

        def run(a):
            x, t, dloss = a["logits"], a["target"], a["dloss"]
            if copy_x:
                x = dense(x)
            if copy_t:
                t = t.contiguous()
            rw = None
            if copy_dloss:
                rw = _row_factor(a["weight"], t, ignore) if weighted else None
                if reduction == "mean":  # the mean's divisor, on device
                    rw_all = rw if rw is not None else row_weight(None, *safe_target(t, ignore))
                    dloss = reduction_dloss(dloss.float(), rw_all, reduction)
                dloss = _row_vector(dloss, M, F32)
                if rw is not None:
                    dloss = dloss * rw
            loss = new_row()
            lse = new_row() if store_lse else None
            dx = x if inplace else torch.empty_like(x, memory_format=DENSE)
            fn(x.data_ptr(), t.data_ptr(), dloss.data_ptr(), None, loss.data_ptr(),
               None if lse is None else lse.data_ptr(), dx.data_ptr(), M, ldx, ldd, ignore, stream())
            if inplace:
                return loss, lse
            if final:
                return (loss, dx, lse) if return_lse else (loss, dx)
            if rw is not None:
                loss = loss * rw
            if reduction != "none":
                rw_all = rw if rw is not None else row_weight(None, *safe_target(t, ignore))
                loss = reduce_loss(loss, rw_all, reduction)
            out = (loss, dx) + ((lse,) if return_lse else ())
            return _with_z_loss(out, lse, rw, t, ignore, L.z_loss, reduction, L.return_z)

        return run

    return make


PLANS = {"cross_entropy_forward": plan_forward, "cross_entropy_backward": _plan_backward(False),
         "cross_entropy_backward_": _plan_backward(True), "cross_entropy_fwd_bwd": _plan_fwd_bwd(False),
         "cross_entropy_fwd_bwd_": _plan_fwd_bwd(True)}

CHECKS = {"cross_entropy_forward": _check_forward, "cross_entropy_backward": _check,
          "cross_entropy_backward_": _check_inplace, "cross_entropy_fwd_bwd": _check,
          "cross_entropy_fwd_bwd_": _check_inplace}
