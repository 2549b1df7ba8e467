"""Host-side helpers shared by the kernel launchers: 2-D row views, alignment checks, pointers."""
from __future__ import annotations

import torch

from .. import config
from .compile import cute_dtype, runtime_ptr
from .reduction import MAX_N


def dtype_name(t: torch.Tensor | torch.dtype | None) -> str | None:
    """'bfloat16' for a bf16 tensor or torch.bfloat16 (the compile functions' dtype keys)."""
    if t is None:
        return None
    return str(t if isinstance(t, torch.dtype) else t.dtype).removeprefix("torch.")


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """t as [M, N] without a copy (leading dims flattened), or None if its strides don't allow it."""
    N = t.shape[-1]
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, N)
    except RuntimeError:
        return None


def vec_for(N: int, t: torch.Tensor) -> int:
    """Elements per 128-bit access for t's dtype that also divide N."""
    from math import gcd

    return gcd(N, 16 // t.element_size())


def kernel_ready(t2d: torch.Tensor, vec: int) -> bool:
    """Whether a [M, N] view can be read with vec-element vector accesses: unit last stride,
    16-byte aligned base, row stride a multiple of vec."""
    if t2d.shape[0] > 1 and t2d.stride(0) % vec:
        return False
    if t2d.shape[-1] > 1 and t2d.stride(-1) != 1:
        return False
    return t2d.data_ptr() % 16 == 0


def kernel_ready_rows(t: torch.Tensor | None, vec: int) -> bool:
    """Whether t (an activation [..., N] or a parameter [N]) is readable by a kernel as is, with
    no copy; an absent t is."""
    if t is None:
        return True
    v = rows_view(t)
    return v is not None and kernel_ready(v, vec)


def prepare_rows(t: torch.Tensor | None, vec: int) -> torch.Tensor | None:
    """An activation [..., N] (a 1-D one is a single row) as a kernel-ready [M, N] tensor,
    copying only when its layout demands."""
    if t is None:
        return None
    v = rows_view(t)
    if v is None or not kernel_ready(v, vec):
        # clone, not contiguous(): a contiguous view at an odd offset must move to aligned memory
        v = t.reshape(-1, t.shape[-1]).clone(memory_format=torch.contiguous_format)
    return v


def prepare_vector(t: torch.Tensor | None, vec: int) -> torch.Tensor | None:
    """A per-column parameter [N] (weight, bias) as a kernel-ready 1-D tensor."""
    if t is None:
        return None
    if kernel_ready_rows(t, vec):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def allocator(shape, dtype, device):
    """A function returning a fresh dense tensor of ``shape`` (numel > 0) for the launch plans:
    ``torch.empty_like`` of a one-element template broadcast to the shape, about 1.6x cheaper on the
    host than ``torch.empty(shape, device=..., dtype=...)`` (argument parsing). The template holds
    one element."""
    template = torch.empty((1,) * len(shape), device=device, dtype=dtype).expand(shape)
    empty_like, dense = torch.empty_like, torch.contiguous_format
    return lambda: empty_like(template, memory_format=dense)


def width_reason(N: int, name: str = "N") -> str | None:
    """Why rows this wide go to the reference, or None if the row kernels take them."""
    return f"{name}={N} > {MAX_N}: wider rows use the reference" if N > MAX_N else None


def in_place_reason(name: str, t: torch.Tensor, vec: int) -> str | None:
    """Why an in-place operand can't be used as is (a copy would break in place), or None."""
    if not kernel_ready_rows(t, vec):
        return f"{name} is not 16-byte aligned with unit last stride and aligned rows (in place: no copy possible)"
    return None


def ptr(t: torch.Tensor | None, align: int = 16):
    """t's address as the compiled functions take it. The caller keeps t alive until the launch
    is enqueued: never pass a temporary made inside the argument list."""
    if t is None:
        return None
    if config.CONFIG.tvm_ffi:  # the address is all TVM-FFI takes
        return t.data_ptr()
    return runtime_ptr(cute_dtype(dtype_name(t)), t.data_ptr(), align)


def ld(t: torch.Tensor | None) -> int:
    return 0 if t is None else (t.stride(0) if t.shape[0] > 1 else t.shape[-1])
