"""Linear cross-entropy: the lm-head matmul and the loss together, chunked over rows, so that the
logits [M, V] never exist whole (memory O(chunk x V), never O(M x V)).

Each chunk of rows: logits = hidden_chunk @ weight.T (+ bias), one cuBLAS matmul into a buffer
reused across chunks; Oink's fused cross-entropy forward and backward on them in place (one pass:
the loss, and the dlogits written over the logits); dhidden_chunk = dlogits @ weight;
dweight += dlogits.T @ hidden_chunk (on a second CUDA stream, beside dhidden's matmul: the two only read
the dlogits) and dbias += dlogits summed over rows. The gradients are
computed in the forward, as Liger's and Quack's are: the backward only scales them by the incoming
gradient. With ``reduction="none"`` the forward computes the loss only and the backward runs the
chunks again with the per-row gradient (per-row factors cannot be applied after the sum over rows
that dweight is).

Each chunk's cross-entropy goes through ``oink.cross_entropy_*`` and their dispatch: the kernels
on SM90/SM100, the reference elsewhere (CPU tensors, other GPUs; ``oink.explain`` says why). The
matmuls are torch's on every device.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Optional

import torch
from torch import Tensor

from . import checks as c
from . import config, ops
from .reference.cross_entropy import REDUCTIONS

log = logging.getLogger("oink.dispatch")

# One chunk's logits buffer by default: as large as the hidden states, or Liger's rows (M / ceil(V / H) rounded
# up to a power of two, so never more memory than Liger's at the same shape) where those are more, but never
# fewer than CHUNK_MIN_ROWS: each chunk reads and writes all of dweight (V x H, whatever its rows), so thin
# chunks spend their time there rather than in the matmuls (timings: docs/tuning.md). At most CHUNK_MAX_BYTES and
# a quarter of the free memory.
CHUNK_MIN_ROWS = 512
CHUNK_MAX_BYTES = 512 * 2**20
CHUNK_ROW_MULTIPLE = 128  # whole matmul tiles a chunk
OPTION_DEFAULTS = {"label_smoothing": 0.0, "z_loss": 0.0, "softcap": None}


def check_args(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
               z_loss=0.0, softcap=None, chunk_size=None, accum_dtype=None) -> None:
    """Metadata checks (they run on FakeTensors too): each error names its argument."""
    c.tensor("hidden", hidden)
    c.tensor("weight", weight, min_dim=2)
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dims [V, H], got shape {tuple(weight.shape)}")
    V, H = weight.shape
    if V == 0 or H == 0:
        raise ValueError(f"weight: expected a non-empty [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != H:
        raise ValueError(f"hidden: last dim {hidden.shape[-1]} must equal weight's H ({H}); weight is [V, H] "
                         f"= {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden: dtype {hidden.dtype} must equal weight's ({weight.dtype})")
    c.tensor("target", target, c.INDEX_DTYPES, min_dim=0)
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target: expected shape {tuple(hidden.shape[:-1])} (hidden's without its last dim), "
                         f"got {tuple(target.shape)}")
    if bias is not None:
        c.vector("bias", bias, V)
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} must equal weight's ({weight.dtype})")
    c.same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {REDUCTIONS}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing: {label_smoothing} is outside [0, 1)")
    if z_loss < 0:
        raise ValueError(f"z_loss: the coefficient of lse^2 must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap: must be > 0 (or None for no capping), got {softcap}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int (rows a chunk) or None, got {chunk_size!r}")
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"accum_dtype: expected None (weight's dtype) or torch.float32, got {accum_dtype}")


# ---------------------------------------------------------------- options and the chunk's cross-entropy
@functools.lru_cache(maxsize=None)
def _parameters(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def _accepts(fn, names) -> bool:
    return _parameters(fn).issuperset(names)


def ce_options(label_smoothing=0.0, z_loss=0.0, softcap=None) -> dict:
    """The options that differ from their defaults, to pass to the chunk's cross-entropy."""
    given = {"label_smoothing": float(label_smoothing), "z_loss": float(z_loss),
             "softcap": None if softcap is None else float(softcap)}
    return {k: v for k, v in given.items() if v != OPTION_DEFAULTS[k]}


def _unsupported(options: dict, op) -> NotImplementedError:
    return NotImplementedError(
        f"linear_cross_entropy: {', '.join(sorted(options))} need oink.{op.__name__} to take "
        f"{', '.join(sorted(options))}, which it does not yet")


def inplace_backward(options: dict) -> bool:
    """Whether a chunk's dlogits can be written over its logits: the fused forward and backward in
    place (one pass), or the forward then the in-place backward (where the z-loss part is asked for)."""
    # the in-place ops are internal: ops holds their checks, with their signatures
    return _accepts(ops.cross_entropy_fwd_bwd_, options) or (
        _accepts(ops.cross_entropy_forward, options) and _accepts(ops.cross_entropy_backward_, options))


def chunk_loss_and_grad(logits: Tensor, target: Tensor, dloss: Tensor | None, ignore_index: int, options: dict,
                        z_rows: bool = False):
    """-> (loss fp32 [C], dlogits or None without ``dloss``, each row's z-loss part or None without
    ``z_rows``); dlogits may be ``logits`` itself."""
    asked = dict(options, return_z_loss=True) if z_rows else options
    if dloss is not None and not z_rows and _accepts(ops.cross_entropy_fwd_bwd_, options):
        loss, _ = torch.ops.oink.cross_entropy_fwd_bwd_(dloss, logits, target, ignore_index, **options)
        return loss, logits, None
    if dloss is None or inplace_backward(options):
        if not _accepts(ops.cross_entropy_forward, asked):
            raise _unsupported(asked, ops.cross_entropy_forward)
        out = ops.cross_entropy_forward(logits, target, ignore_index, "none", **asked)
        if dloss is not None:
            torch.ops.oink.cross_entropy_backward_(dloss, logits, target, out[1], ignore_index, **options)
        return out[0], None if dloss is None else logits, out[2] if z_rows else None
    if not _accepts(ops.cross_entropy_fwd_bwd, asked):
        raise _unsupported(asked, ops.cross_entropy_fwd_bwd)
    out = ops.cross_entropy_fwd_bwd(dloss, logits, target, ignore_index, **asked)
    return out[0], out[1], out[2] if z_rows else None


def liger_chunk_rows(M: int, H: int, V: int) -> int:
    """Liger's chunk rows: M / ceil(V / H), rounded up to a power of two."""
    rows = -(-M // max(1, -(-V // H)))
    return 1 << max(0, rows - 1).bit_length()


def default_chunk_rows(M: int, H: int, V: int, elem_size: int, buffers: int, device: torch.device) -> int:
    """Rows a chunk: its ``buffers`` [rows, V] buffers within the hidden states' size M x H or Liger's
    chunk (``liger_chunk_rows``) of V-wide rows, whichever is larger, CHUNK_MIN_ROWS at least; then
    within CHUNK_MAX_BYTES and a quarter of the memory free now (the allocator's cached blocks
    included), whole CHUNK_ROW_MULTIPLE tiles (one tile at least), and never more than M."""
    row_bytes = max(1, V * elem_size * buffers)
    rows = max(CHUNK_MIN_ROWS, max(M * H, liger_chunk_rows(M, H, V) * V) * elem_size // row_bytes)
    cap = CHUNK_MAX_BYTES
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():  # no driver queries in a capture
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        cap = min(cap, free // 4)
    rows = min(rows, cap // row_bytes) // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE
    return max(1, min(M, max(CHUNK_ROW_MULTIPLE, rows)))


# ---------------------------------------------------------------- the chunked loop
def _accumulate_dweight(dw: Tensor, dlogits: Tensor, h: Tensor, first: bool) -> None:
    """dw (+)= dlogits.T @ h: the matmul's fp32 accumulator rounded once a chunk into dw's dtype
    (fp32 with ``accum_dtype``: on CUDA cuBLAS writes fp32 from 16-bit operands; elsewhere fp32
    operands)."""
    a = dlogits.t()
    if dw.dtype == a.dtype:
        if first:
            torch.mm(a, h, out=dw)
        else:
            torch.addmm(dw, a, h, out=dw)
    elif dw.is_cuda:
        torch.addmm(dw, a, h, beta=0 if first else 1, out_dtype=torch.float32, out=dw)
    else:
        dw.addmm_(a.float(), h.float(), beta=0 if first else 1)


def _side_stream(device: torch.device):
    """A stream for dweight's matmul beside dhidden's (both read the chunk's dlogits: dhidden's output is
    [chunk, H] over a V-long sum, too few tiles to fill the GPU alone), or None: not CUDA, or turned off."""
    if device.type != "cuda" or config.get().lce_overlap is False:
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


_streams: dict = {}


def fwd_bwd(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, dloss: Tensor | None,
            ignore_index: int = -100, options: dict | None = None, chunk_size: int | None = None,
            need_dhidden: bool = True, need_dweight: bool = True, need_dbias: bool = True,
            accum_dtype: torch.dtype | None = None, return_z_loss: bool = False):
    """The chunked loop on hidden [M, H], weight [V, H], target [M]: -> (loss fp32 [M], dhidden |
    None, dweight | None, dbias | None, z-loss part fp32 [M] | None). ``dloss``: None for the loss
    alone, else the gradient of each row's loss (a scalar or [M], fp32). Gradients in their
    parameters' dtypes; dbias summed in fp32, dweight in ``accum_dtype`` (default the weight's) then
    cast."""
    options = options or {}
    M, H = hidden.shape
    V = weight.shape[0]
    device = hidden.device
    grads = dloss is not None and (need_dhidden or need_dweight or need_dbias)
    dloss = dloss if grads else None
    buffers = 1 if not grads or inplace_backward(options) else 2
    C = chunk_size or default_chunk_rows(M, H, V, hidden.element_size(), buffers, device)
    C = min(C, max(M, 1))
    if M:
        c.target_values(weight.t(), target, ignore_index)  # [H, V]: the check reads V from the last dim
    loss = torch.empty(M, device=device, dtype=torch.float32)
    z_rows = torch.empty(M, device=device, dtype=torch.float32) if return_z_loss else None
    dh = torch.empty_like(hidden, memory_format=torch.contiguous_format) if grads and need_dhidden else None
    dw = db = None
    if grads and need_dweight:
        dw = torch.empty(V, H, device=device, dtype=accum_dtype or weight.dtype)
    if grads and need_dbias:
        db = torch.zeros(V, device=device, dtype=torch.float32)
    buf = torch.empty(C, V, device=device, dtype=hidden.dtype) if M else None
    wt = weight.t()
    per_row = dloss is not None and dloss.dim() == 1
    side = _side_stream(device) if dw is not None and (dh is not None or db is not None) else None
    main = torch.cuda.current_stream(device) if side is not None else None
    log.debug("linear_cross_entropy: %d rows in chunks of %d, vocabulary %d (%s)", M, C, V,
              "loss and gradients" if grads else "loss only")
    for i, start in enumerate(range(0, M, C)):
        end = min(start + C, M)
        h = hidden[start:end]
        logits = buf[: end - start]
        if side is not None and i:  # the buffer is free once the chunk before's dweight has read it (a wait
            main.wait_stream(side)  # before the side stream's first use would join no capture: an error in one)
        if bias is not None:
            torch.addmm(bias, h, wt, out=logits)
        else:
            torch.mm(h, wt, out=logits)
        d = dloss[start:end] if per_row else dloss
        loss_c, dlogits, z_c = chunk_loss_and_grad(logits, target[start:end], d, ignore_index, options,
                                                   return_z_loss)
        loss[start:end] = loss_c
        if z_rows is not None:
            z_rows[start:end] = z_c
        if dlogits is None:
            continue
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                _accumulate_dweight(dw, dlogits, h, first=i == 0)
        elif dw is not None:
            _accumulate_dweight(dw, dlogits, h, first=i == 0)
        if dh is not None:
            torch.mm(dlogits, weight, out=dh[start:end])
        if db is not None:
            db += dlogits.sum(0, dtype=torch.float32)
        del dlogits
    if side is not None:  # dweight, the buffer and hidden's chunks are the caller's stream's again
        main.wait_stream(side)
    if dw is not None and M == 0:
        dw.zero_()
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype if bias is not None else weight.dtype)
    return loss, dh, dw, db, z_rows


def reduce(loss_rows: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(total.dtype)
    return torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))  # nothing counted: 0


def row_scale(target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """d(reduced loss) / d(row loss) for "mean" and "sum": a device scalar (no host read of the count)."""
    if reduction == "sum":
        return torch.ones((), device=target.device, dtype=torch.float32)
    count = (target != ignore_index).sum().float()
    return torch.where(count > 0, 1.0 / count.clamp_min(1), torch.zeros_like(count))


# ---------------------------------------------------------------- the custom op (torch.compile sees one node)
@torch.library.custom_op("oink::linear_cross_entropy_fwd_bwd", mutates_args=())
def _op(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor], dloss: Optional[Tensor],
        ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, softcap: Optional[float],
        chunk_size: Optional[int], need_dhidden: bool, need_dweight: bool, need_dbias: bool,
        accum_dtype: Optional[torch.dtype], return_z_loss: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (loss reduced, dhidden, dweight, dbias, z-loss part reduced), gradients and z-loss empty
    where not asked for. Without ``dloss`` and with a "mean" or "sum" reduction the gradients are of
    the reduced loss."""
    options = ce_options(label_smoothing, z_loss, softcap)
    grads = need_dhidden or need_dweight or need_dbias
    if dloss is None and grads and reduction != "none":
        dloss = row_scale(target, ignore_index, reduction)
    loss, dh, dw, db, z = fwd_bwd(hidden, weight, target, bias, dloss if grads else None, ignore_index, options,
                                  chunk_size, need_dhidden, need_dweight, need_dbias, accum_dtype, return_z_loss)
    empty = hidden.new_empty(0)
    return (reduce(loss, target, ignore_index, reduction), empty if dh is None else dh,
            empty.clone() if dw is None else dw, empty.clone() if db is None else db,
            loss.new_empty(0) if z is None else reduce(z, target, ignore_index, reduction))


@_op.register_fake
def _(hidden, weight, target, bias, dloss, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_size,
      need_dhidden, need_dweight, need_dbias, accum_dtype, return_z_loss):
    M = hidden.shape[0]
    loss = hidden.new_empty((M,) if reduction == "none" else (), dtype=torch.float32)
    z = torch.empty_like(loss) if return_z_loss else loss.new_empty(0)
    dh = torch.empty_like(hidden) if need_dhidden else hidden.new_empty(0)
    dw = torch.empty_like(weight) if need_dweight else hidden.new_empty(0)
    db = weight.new_empty(weight.shape[0], dtype=bias.dtype if bias is not None else weight.dtype) \
        if need_dbias else hidden.new_empty(0)
    return loss, dh, dw, db, z


# ---------------------------------------------------------------- autograd
class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the loss and (for "mean" and "sum") every gradient asked for; backward: those
    gradients times the incoming one. "none": the backward runs the chunks with the per-row
    gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                chunk_size, accum_dtype, return_z_loss, need_dhidden, need_dweight, need_dbias):
        eager = reduction != "none"
        loss, dh, dw, db, z = torch.ops.oink.linear_cross_entropy_fwd_bwd(
            hidden, weight, target, bias, None, ignore_index, reduction, label_smoothing, z_loss, softcap,
            chunk_size, need_dhidden and eager, need_dweight and eager, need_dbias and eager, accum_dtype,
            return_z_loss)
        ctx.eager = eager
        ctx.need = (need_dhidden, need_dweight, need_dbias)
        ctx.args = (ignore_index, label_smoothing, z_loss, softcap, chunk_size, accum_dtype)
        ctx.scaled = False
        if eager:
            ctx.save_for_backward(dh, dw, db)
        else:
            ctx.save_for_backward(hidden, weight, target, bias)
        if return_z_loss:  # logged, not differentiated (the loss holds it)
            ctx.mark_non_differentiable(z)
            return loss, z
        return loss

    @staticmethod
    def backward(ctx, dloss, *_dz_loss):
        need_dh, need_dw, need_db = ctx.need
        if not ctx.eager:
            hidden, weight, target, bias = ctx.saved_tensors
            ignore_index, ls, z, softcap, chunk_size, accum_dtype = ctx.args
            _, dh, dw, db, _ = torch.ops.oink.linear_cross_entropy_fwd_bwd(
                hidden, weight, target, bias, dloss.float().contiguous(), ignore_index, "none", ls, z, softcap,
                chunk_size, need_dh, need_dw, need_db, accum_dtype, False)
        elif torch.compiler.is_compiling():
            dh, dw, db = (t * dloss.to(t.dtype) for t in ctx.saved_tensors)
        else:  # scaled in place: the forward's buffers are ours, and a second backward would scale twice
            if ctx.scaled:
                raise RuntimeError("linear_cross_entropy: backward ran twice through one forward; its "
                                   "gradients are computed in the forward and scaled in place once")
            ctx.scaled = True
            dh, dw, db = ctx.saved_tensors
            grads = [t for t in (dh, dw, db) if t.numel()]
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                for t in grads:  # no host read in a capture: the scalar stays on the device
                    t.mul_(dloss.to(t.dtype))
            else:
                # read on the host (one sync, as Liger's): loss.backward()'s 1 skips the pass over dweight, and a
                # host scalar takes the vectorized kernel (a 0-d device operand takes the strided one)
                g = dloss.item()
                if g != 1.0:
                    for t in grads:
                        t.mul_(g)
        return (dh if need_dh else None, dw if need_dw else None, None, db if need_db else None,
                None, None, None, None, None, None, None, None, None, None, None)


def _needs_grad(t) -> bool:
    return t is not None and t.requires_grad and torch.is_grad_enabled()


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         ignore_index: int = -100, reduction: str = "mean", *, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: float | None = None, chunk_size: int | None = None,
                         accum_dtype: torch.dtype | None = None, return_z_loss: bool = False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against int targets, without the [M, V] logits:
    chunks of rows, memory O(chunk x V) (see ``oink.chunked_linear_ce``).

    Args:
        hidden: [..., H] fp32, fp16 or bf16 (M rows in all).
        weight: [V, H], hidden's dtype (the lm head, ``torch.nn.Linear``'s layout).
        target: [...] (hidden's leading dims) int32 or int64 class indices, or ``ignore_index``.
        bias: [V] in weight's dtype, or None.
        ignore_index: rows with this target count for nothing (loss and gradients 0).
        reduction: "mean" (over rows not ignored; 0 when none counts), "sum" or "none" (per row).
        label_smoothing: eps in [0, 1), torch's rule.
        z_loss: coefficient z >= 0 of z * lse^2 added to each row.
        softcap: c > 0: logits -> c * tanh(logits / c) before the softmax (Gemma-2); None for none.
        chunk_size: rows a chunk; default from H, V and the free memory (``default_chunk_rows``).
        accum_dtype: torch.float32 sums dweight over chunks in fp32 (V x H x 4 bytes more); None sums
            in the weight's dtype (cuBLAS accumulates each chunk's product in fp32, rounded once a chunk).
        return_z_loss: also return the z-loss part of the loss, reduced as the loss is (for logging:
            not differentiated; the loss holds it).

    Returns:
        The fp32 loss, or (loss, z_loss) with ``return_z_loss``: 0-d, or target's shape for "none".
        Differentiable in hidden, weight and bias: for "mean" and "sum" the gradients are computed in
        the forward and the backward scales them (in place: a second backward through the same
        forward raises); "none" computes them in the backward from the per-row gradient. On CPU
        tensors (and GPUs the kernels don't serve) each chunk's cross-entropy is the reference's.

    Raises:
        ValueError: a shape, reduction, option or chunk size out of range, naming the argument; a
            target outside [0, V) that is not ``ignore_index``.
        TypeError: a dtype not supported, or hidden, weight and bias of different dtypes.
    """
    check_args(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap, chunk_size,
               accum_dtype)
    H = weight.shape[1]
    h2, t1 = hidden.reshape(-1, H), target.reshape(-1)
    need = (_needs_grad(hidden), _needs_grad(weight), _needs_grad(bias))
    cap = softcap if softcap is None else float(softcap)
    ret_z = bool(return_z_loss)
    if any(need):
        out = _LinearCrossEntropy.apply(h2, weight, t1, bias, ignore_index, reduction, float(label_smoothing),
                                        float(z_loss), cap, chunk_size, accum_dtype, ret_z, *need)
        loss, z = out if ret_z else (out, None)
    else:
        loss, *_, z = torch.ops.oink.linear_cross_entropy_fwd_bwd(
            h2, weight, t1, bias, None, ignore_index, reduction, float(label_smoothing), float(z_loss), cap,
            chunk_size, False, False, False, accum_dtype, ret_z)
    if reduction == "none":  # per-row results in the target's shape
        loss, z = loss.reshape(target.shape), z.reshape(target.shape) if ret_z else z
    return (loss, z) if ret_z else loss
