"""Host-side helpers shared by the kernel launches: 2-D row views, alignment checks, copies, outputs,
and how many CTAs the GPU holds at once."""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import config
from .compile import driver_checked
from .row_rules import MAX_N


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


def row_layout(t: torch.Tensor | None, vec: int) -> tuple[bool, int]:
    """How a kernel reads an activation [..., N] of t's layout (None: absent): (copied to dense rows
    first, because it can't be read as it is; the row stride it is launched with)."""
    if t is None:
        return False, 0
    v = rows_view(t)
    if v is None or not kernel_ready(v, vec):
        return True, t.shape[-1]
    return False, ld(v)


def dense(t: torch.Tensor) -> torch.Tensor:
    """t copied to dense rows in fresh (16-byte aligned) memory: clone, not contiguous(), since a
    contiguous view at an odd offset must move."""
    return t.clone(memory_format=torch.contiguous_format)


def prepare_vector(t: torch.Tensor | None, vec: int) -> torch.Tensor | None:
    """A per-column parameter [N] (weight, bias) as a kernel-ready 1-D tensor."""
    if t is None:
        return None
    if kernel_ready_rows(t, vec):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def allocator(shape, dtype, device):
    """A function returning a fresh dense tensor of ``shape`` (numel > 0) for the launch plans:
    ``torch.empty_like`` of a one-element template broadcast to the shape, cheaper on the host than
    ``torch.empty(shape, device=..., dtype=...)`` (less argument parsing). The template holds
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


def ld(t: torch.Tensor | None) -> int:
    return 0 if t is None else (t.stride(0) if t.shape[0] > 1 else t.shape[-1])


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    """SMs of a CUDA device (its index, or the current device's)."""
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def window_key(key, window_of):
    """``key`` asking for aligned windows (its ``window`` field) where the ``windows`` setting is on and the family's
    rule ``window_of`` gives the asking key one; else ``key``. Off by default: a window's threads split a row by the
    row's offset from a 16-byte boundary, which depends on its index in the batch, so a row's bits would depend on
    where it sits (batch invariance). Nothing here depends on the row count, for the same reason."""
    asked = dataclasses.replace(key, window=True)
    return asked if config.get().windows and window_of(asked) else key


# An empty kernel; with a SM's whole shared memory its occupancy is one CTA a SM. PTX for sm_90, the
# first arch with clusters, which the driver compiles for any later one.
_PROBE_PTX = b".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry oink_probe()\n{\n ret;\n}\n"


@functools.lru_cache(maxsize=None)
def resident_clusters(index: int, cluster_n: int) -> int:
    """Clusters of ``cluster_n`` CTAs that device ``index`` runs at once with one CTA a SM. A cluster's
    CTAs share a GPC, so where a GPC's SMs are not a multiple of ``cluster_n`` this is fewer than
    SMs / cluster_n (a persistent grid sized by the division runs its last clusters alone, a second wave,
    after the others; docs/tuning.md). The driver's answer (cuOccupancyMaxActiveClusters over an empty probe
    kernel), or that division where it has none."""
    sms = sm_count(index)
    if cluster_n <= 1:
        return sms
    try:
        return min(sms // cluster_n, _max_active_clusters(index, cluster_n)) or sms // cluster_n
    except Exception:  # an old driver or a GPU without clusters: the division, as before
        return sms // cluster_n


def _max_active_clusters(index: int, cluster_n: int) -> int:
    from cuda.bindings import driver as drv

    dev = driver_checked(drv.cuDeviceGet(index))
    ctx = driver_checked(drv.cuDevicePrimaryCtxRetain(dev))
    driver_checked(drv.cuCtxPushCurrent(ctx))
    try:
        module = driver_checked(drv.cuModuleLoadData(_PROBE_PTX))
        try:
            fn = driver_checked(drv.cuModuleGetFunction(module, b"oink_probe"))
            A = drv.CUfunction_attribute
            smem = driver_checked(drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev))
            driver_checked(drv.cuFuncSetAttribute(fn, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            driver_checked(drv.cuFuncSetAttribute(fn, A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1))
            cfg = drv.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = cluster_n, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = 128, 1, 1
            cfg.sharedMemBytes = smem
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster_n, 1, 1
            cfg.numAttrs, cfg.attrs = 1, [attr]
            return int(driver_checked(drv.cuOccupancyMaxActiveClusters(fn, cfg)))
        finally:
            drv.cuModuleUnload(module)
    finally:
        drv.cuCtxPopCurrent()
        drv.cuDevicePrimaryCtxRelease(dev)
