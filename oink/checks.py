"""Input checks the op declarations (``oink.ops``) are made of: the public API, the custom ops
and their fake kernels run them.

Only metadata is inspected (dtype, shape, device, strides), so the same checks run on
FakeTensors under torch.compile. Errors name the offending argument.
"""
from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t, dtypes=FLOAT_DTYPES, min_dim: int = 1) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (expected one of {allowed})")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dim(s), got shape {tuple(t.shape)}")
    return t


def optional(name: str, t, dtypes=FLOAT_DTYPES, min_dim: int = 1):
    return None if t is None else tensor(name, t, dtypes, min_dim)


def rows_input(name: str, x) -> Tensor:
    """An [..., N] activation with N >= 1."""
    tensor(name, x)
    if x.shape[-1] == 0:
        raise ValueError(f"{name}: the last dim must be at least 1, got shape {tuple(x.shape)}")
    return x


def same_device(**tensors) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    n0, t0 = items[0]
    for n, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(f"{n} is on {t.device} but {n0} is on {t0.device}")


def same_shape(name: str, t, ref_name: str, ref) -> None:
    if t is not None and tuple(t.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: shape {tuple(t.shape)} must equal {ref_name}'s {tuple(ref.shape)}")


def fused_add_inputs(x, residual, weight) -> None:
    """A fused add + RMSNorm's inputs: x [..., N] rows, a residual of x's shape, a weight [N], one device."""
    rows_input("x", x)
    tensor("residual", residual)
    same_shape("residual", residual, "x", x)
    tensor("weight", weight)
    vector("weight", weight, x.shape[-1])
    same_device(x=x, residual=residual, weight=weight)


def vector(name: str, t, N: int) -> None:
    """A per-column parameter (weight, bias): shape (N,), any float dtype (x's or another)."""
    if t is None:
        return
    tensor(name, t)
    if tuple(t.shape) != (N,):
        raise ValueError(f"{name}: expected shape ({N},), got {tuple(t.shape)}")


def norm_param(name: str, t, x) -> None:
    """A norm's weight or bias: shape (N,), or (H, D) per head for x [..., H, D]; any float dtype."""
    if t is None:
        return
    tensor(name, t)
    if t.dim() == 2 and x.dim() >= 2 and tuple(t.shape) == tuple(x.shape[-2:]):
        return
    if tuple(t.shape) != (x.shape[-1],):
        heads = f" or {tuple(x.shape[-2:])} (per head)" if x.dim() >= 2 else ""
        raise ValueError(f"{name}: expected shape ({x.shape[-1]},){heads}, got {tuple(t.shape)}")


def no_internal_overlap(name: str, t) -> None:
    """An argument written in place: no two of its elements may share memory (a broadcast view, stride
    0 over a dim of size > 1; torch's copy_ refuses the same, but only once something is written)."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: written in place, but elements share memory (stride {tuple(t.stride())} "
                         f"for shape {tuple(t.shape)}); pass a tensor that owns each element, e.g. .contiguous()")


def writable(name: str, t, grad: bool) -> bool:
    """An argument written in place, checked on every call before anything is written (the grad and
    inference modes are not part of the cached layout checks): refused where torch refuses an in-place
    write, with its words, so an op that refuses leaves every input as it was. ``grad``: grad mode is
    on. -> whether autograd tracks the write (grad mode on, not an inference tensor): its version is
    then bumped, as the op's ADInplaceOrView would."""
    if t.is_inference():
        if not torch.is_inference_mode_enabled():
            raise RuntimeError(f"{name}: Inplace update to inference tensor outside InferenceMode is not allowed "
                               "(clone it first, or call inside torch.inference_mode())")
        return False
    if grad and t.requires_grad:
        if t.is_leaf:
            raise RuntimeError(f"{name}: a leaf Variable that requires grad is being used in an in-place operation.")
        base = t._base
        if base is not None and base.is_leaf:  # torch refuses a view of such a leaf too
            raise RuntimeError(f"{name}: a view of a leaf Variable that requires grad is being used in an "
                               "in-place operation.")
    return grad


def dtype_arg(name: str, d) -> None:
    """An optional output dtype argument: None or a float dtype the kernels store."""
    if d is not None and d not in FLOAT_DTYPES:
        allowed = ", ".join(str(f).removeprefix("torch.") for f in FLOAT_DTYPES)
        raise TypeError(f"{name}: {d} is not supported (expected None or one of {allowed})")


def row_stat(name: str, t, M_shape) -> None:
    """A per-row fp32 statistic (rstd, mean, lse)."""
    tensor(name, t, (torch.float32,), min_dim=0)
    if t.numel() != _numel(M_shape):
        raise ValueError(f"{name}: expected {_numel(M_shape)} elements (one per row), got shape {tuple(t.shape)}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def global_scale(name: str, t, device) -> None:
    tensor(name, t, (torch.float32,), min_dim=0)
    if t.numel() != 1:
        raise ValueError(f"{name}: expected a 1-element float32 tensor, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def multiple_of_16(name: str, n: int) -> None:
    if n % 16:
        raise ValueError(f"{name}: last dim {n} must be a multiple of 16 for NVFP4 blocks")


def multiple_of_32(name: str, n: int) -> None:
    if n % 32:
        raise ValueError(f"{name}: last dim {n} must be a multiple of 32 for MXFP4 blocks")



def _number(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(v).__name__}")
    return float(v)


def ce_options(label_smoothing, z_loss, softcap) -> None:
    """Cross-entropy's options: label_smoothing in [0, 1), z_loss >= 0 and finite, softcap None or > 0."""
    eps = _number("label_smoothing", label_smoothing)
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"label_smoothing: expected a value in [0, 1), got {label_smoothing}")
    z = _number("z_loss", z_loss)
    if not 0.0 <= z < float("inf"):
        raise ValueError(f"z_loss: expected a finite coefficient >= 0, got {z_loss}")
    if softcap is not None:
        cap = _number("softcap", softcap)
        if not 0.0 < cap < float("inf"):
            raise ValueError(f"softcap: expected a finite value > 0 (None for no capping), got {softcap}")


def target_values(logits, target, ignore_index) -> None:
    """Value check (reads the data, so not for fake tensors): targets in [0, V) or ignored.
    It costs one host sync, which CUDA-graph capture forbids: while the stream is capturing it
    is skipped, and the kernels answer such a row with a NaN loss and NaN dlogits instead."""
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    V = logits.shape[-1]
    if target.numel() == 0:
        return
    # three small kernels and one read back (this check is most of an eager call's host time)
    lo, hi = torch.aminmax(torch.where(target == ignore_index, 0, target))
    lo, hi = torch.stack((lo, hi)).tolist()
    if lo < 0 or hi >= V:
        bad = ((target < 0) | (target >= V)) & (target != ignore_index)
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"target[{i}] = {int(target[i])} is outside [0, {V}) and is not ignore_index ({ignore_index})")
