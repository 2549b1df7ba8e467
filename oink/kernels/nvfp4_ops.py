"""NVFP4 and MXFP4 kernels on torch tensors (CHECKS/RUNNERS for the dispatch path). Codes are written
through a 32-bit view of q; scales as raw bytes viewed as float8_e4m3fn (MXFP4: float8_e8m0fnu)
afterwards."""
from __future__ import annotations

from functools import partial

import torch

from .compile import current_stream, stream_of
from ..reference.nvfp4 import round_up
from .host import (allocator, dtype_name, in_place_reason, kernel_ready_rows, ld, prepare_rows, prepare_vector, ptr,
                   rows_view, width_reason)
from .nvfp4 import BLOCK, MX_BLOCK, compiled_add_rmsnorm_fp4, compiled_fp4


def check_quantize(t: dict, arch: str) -> str | None:
    return width_reason(t["x"].shape[-1])


def check_silu_mul(t: dict, arch: str) -> str | None:
    return width_reason(t["x"].shape[-1] // 2)


def check_add_rmsnorm(t: dict, arch: str, block: int = BLOCK) -> str | None:
    """The residual is updated in place, so its rows must already be whole scale blocks apart."""
    if t["weight"].dtype not in (t["x"].dtype, torch.float32):  # other mixes compile, untested on a GPU
        return f"weight dtype {t['weight'].dtype} with x {t['x'].dtype}: the fused FP4 kernels take x's or fp32"
    return width_reason(t["x"].shape[-1]) or in_place_reason("residual", t["residual"], block)


def _scale_shape(M: int, K: int, swizzled: bool) -> tuple[int, int]:
    """The scale buffer's shape for K scales a row: the swizzled layout pads to 128 rows, 4 columns."""
    return (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)


def _outputs(M: int, N: int, device, swizzled: bool, block: int = BLOCK):
    """q [M, N/2] uint8 and the scale bytes (swizzled padding zeroed, as the layout promises)."""
    K = N // block
    q = torch.empty((M, N // 2), device=device, dtype=torch.uint8)
    shape = _scale_shape(M, K, swizzled)
    sf = (torch.zeros if shape != (M, K) else torch.empty)(shape, device=device, dtype=torch.uint8)
    return q, sf


def _output_allocators(M: int, N: int, device, swizzled: bool, block: int = BLOCK):
    """What ``_outputs`` returns, as one function for a launch plan (cheaper allocations; a padded
    swizzled scale buffer still zeroed)."""
    K = N // block
    new_q = allocator((M, N // 2), torch.uint8, device)
    padded = _scale_shape(M, K, swizzled)
    if padded != (M, K):
        return lambda: (new_q(), torch.zeros(padded, device=device, dtype=torch.uint8))
    new_sf = allocator((M, K), torch.uint8, device)
    return lambda: (new_q(), new_sf())


def _fp4_ptrs(q, sf, global_scale):
    gs = None if global_scale is None else global_scale.reshape(1).float().contiguous()
    return (None if gs is None else gs.data_ptr(), q.data_ptr(), sf.data_ptr(), gs)


def _run_rows(mode, arch, x, N, global_scale, swizzled, mx=False):
    block = MX_BLOCK if mx else BLOCK
    x2 = prepare_rows(x, block)
    q, sf = _outputs(x2.shape[0], N, x.device, swizzled, block)
    if x2.shape[0] > 0:
        fn = compiled_fp4(mode, dtype_name(x2), N, arch, swizzled, mx)
        pgs, pq, psf, _keep = _fp4_ptrs(q, sf, global_scale)
        fn(ptr(x2), pgs, pq, psf, x2.shape[0], ld(x2), current_stream(x.device))
    return q, sf.view(torch.float8_e8m0fnu if mx else torch.float8_e4m3fn)


def run_quantize(arch, x, global_scale, swizzled=False):
    return _run_rows("quantize", arch, x, x.shape[-1], global_scale, swizzled)


def run_silu_mul(arch, x, global_scale, swizzled=False):
    return _run_rows("silu_mul", arch, x, x.shape[-1] // 2, global_scale, swizzled)


def run_mx_quantize(arch, x, swizzled=False):
    return _run_rows("quantize", arch, x, x.shape[-1], None, swizzled, mx=True)


def run_silu_mul_mx(arch, x, swizzled=False):
    return _run_rows("silu_mul", arch, x, x.shape[-1] // 2, None, swizzled, mx=True)


def run_add_rmsnorm(arch, x, residual, weight, global_scale, eps=1e-6, swizzled=False, return_y=False, mx=False):
    N = x.shape[-1]
    block = MX_BLOCK if mx else BLOCK
    x2, r2 = prepare_rows(x, block), rows_view(residual)
    w = prepare_vector(weight, block)
    M = x2.shape[0]
    q, sf = _outputs(M, N, x.device, swizzled, block)
    y = torch.empty((M, N), device=x.device, dtype=x.dtype) if return_y else None
    if M > 0:
        fn = compiled_add_rmsnorm_fp4(dtype_name(x2), dtype_name(r2), dtype_name(w), N, arch, swizzled, return_y, mx)
        pgs, pq, psf, _keep = _fp4_ptrs(q, sf, global_scale)
        fn(ptr(x2), ptr(r2), ptr(w), pgs, ptr(y), pq, psf, M, ld(x2), ld(r2), ld(y), float(eps),
           current_stream(x.device))
    sf = sf.view(torch.float8_e8m0fnu if mx else torch.float8_e4m3fn)
    return (q, sf, y.view(x.shape)) if return_y else (q, sf)


def run_add_rmsnorm_mx(arch, x, residual, weight, eps=1e-6, swizzled=False, return_y=False):
    return run_add_rmsnorm(arch, x, residual, weight, None, eps, swizzled, return_y, mx=True)


def _plan(mode: str, mx: bool = False):
    """A launch prepared once per argument layout (see dispatch.Route.plan); None where the runner
    is needed (a copy of an input, a global scale that is not one contiguous fp32)."""
    block, sf_dtype = (MX_BLOCK, torch.float8_e8m0fnu) if mx else (BLOCK, torch.float8_e4m3fn)

    def make(arch, a: dict):
        x, w, res, gs = a["x"], a.get("weight"), a.get("residual"), a.get("global_scale")
        if (x.numel() == 0 or not all(kernel_ready_rows(t, block) for t in (x, w, res))
                or (gs is not None and (gs.dtype != torch.float32 or not gs.is_contiguous()))):
            return None
        x2, swizzled = rows_view(x), a.get("swizzled", False)
        M, N = x2.shape[0], x.shape[-1] // 2 if mode == "silu_mul" else x.shape[-1]
        device, ldx = x.device, ld(x2)
        outputs, stream = _output_allocators(M, N, device, swizzled, block), stream_of(device)
        if mode != "add_rmsnorm":
            fn = compiled_fp4(mode, dtype_name(x2), N, arch, swizzled, mx)

            def run(a):
                gs = a.get("global_scale")
                q, sf = outputs()
                fn(a["x"].data_ptr(), None if gs is None else gs.data_ptr(), q.data_ptr(), sf.data_ptr(), M, ldx,
                   stream())
                return q, sf.view(sf_dtype)

            return run
        r2 = rows_view(res)
        return_y, eps = a.get("return_y", False), float(a.get("eps", 1e-6))
        fn = compiled_add_rmsnorm_fp4(dtype_name(x2), dtype_name(r2), dtype_name(w), N, arch, swizzled, return_y, mx)
        ldr, ldy = ld(r2), (N if return_y else 0)

        def run_norm(a):
            x, gs = a["x"], a.get("global_scale")
            q, sf = outputs()
            y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else None
            fn(x.data_ptr(), a["residual"].data_ptr(), a["weight"].data_ptr(), None if gs is None else gs.data_ptr(),
               None if y is None else y.data_ptr(), q.data_ptr(), sf.data_ptr(), M, ldx, ldr, ldy, eps,
               stream())
            return (q, sf.view(sf_dtype), y) if return_y else (q, sf.view(sf_dtype))

        return run_norm

    return make


PLANS = {"nvfp4_quantize": _plan("quantize"), "silu_mul_fp4quant": _plan("silu_mul"),
         "add_rmsnorm_fp4quant": _plan("add_rmsnorm"), "mxfp4_quantize": _plan("quantize", mx=True),
         "silu_mul_mxfp4quant": _plan("silu_mul", mx=True), "add_rmsnorm_mxfp4quant": _plan("add_rmsnorm", mx=True)}

CHECKS = {"nvfp4_quantize": check_quantize, "silu_mul_fp4quant": check_silu_mul,
          "add_rmsnorm_fp4quant": check_add_rmsnorm, "mxfp4_quantize": check_quantize,
          "silu_mul_mxfp4quant": check_silu_mul, "add_rmsnorm_mxfp4quant": partial(check_add_rmsnorm, block=MX_BLOCK)}
RUNNERS = {"nvfp4_quantize": run_quantize, "silu_mul_fp4quant": run_silu_mul,
           "add_rmsnorm_fp4quant": run_add_rmsnorm, "mxfp4_quantize": run_mx_quantize,
           "silu_mul_mxfp4quant": run_silu_mul_mx, "add_rmsnorm_mxfp4quant": run_add_rmsnorm_mx}
