"""NVFP4 and MXFP4 kernels on torch tensors (CHECKS/PLANS for the dispatch path). Codes are written
through a 32-bit view of q; scales as raw bytes viewed as float8_e4m3fn (MXFP4: float8_e8m0fnu)
afterwards."""
from __future__ import annotations

from functools import partial

import torch

from .compile import stream_of
from ..reference.nvfp4 import round_up
from .host import allocator, dense, dtype_name, in_place_reason, kernel_ready_rows, row_layout, width_reason
from .nvfp4 import AddRMSNormFp4Key, Fp4Key, compiled_add_rmsnorm_fp4, compiled_fp4
from .nvfp4_rules import BLOCK, MX_BLOCK


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


def _plan(mode: str, mx: bool = False):
    """``mode``'s launch prepared for one argument layout (see dispatch.prepare): x copied to dense rows
    where the kernel can't read it as it is, an unaligned weight copied, a global scale that is not one
    contiguous fp32 passed as such a copy; no launch for no rows. The residual is updated in place
    (``check_add_rmsnorm``: readable as it is)."""
    block, sf_dtype = (MX_BLOCK, torch.float8_e8m0fnu) if mx else (BLOCK, torch.float8_e4m3fn)

    def make(arch, a: dict):
        x, w, res, gs = a["x"], a.get("weight"), a.get("residual"), a.get("global_scale")
        swizzled, norm = a.get("swizzled", False), mode == "add_rmsnorm"
        N = x.shape[-1] // 2 if mode == "silu_mul" else x.shape[-1]
        M, device = x.numel() // x.shape[-1], x.device
        copy_x, ldx = row_layout(x, block)
        copy_w = w is not None and not kernel_ready_rows(w, block)
        copy_gs = gs is not None and (gs.dtype != torch.float32 or not gs.is_contiguous())
        return_y, eps = a.get("return_y", False), float(a.get("eps", 1e-6))
        ldr, ldy = row_layout(res, block)[1], (N if return_y else 0)
        if not M:
            outputs = partial(_outputs, M, N, device, swizzled, block)
        else:
            outputs, stream = _output_allocators(M, N, device, swizzled, block), stream_of(device)
            if norm:
                fn = compiled_add_rmsnorm_fp4(AddRMSNormFp4Key(
                    dtype_name(x), N, arch, res_dtype=dtype_name(res), w_dtype=dtype_name(w), swizzled=swizzled,
                    store_y=return_y, mx=mx))
            else:
                fn = compiled_fp4(Fp4Key(mode, dtype_name(x), N, arch, swizzled=swizzled, mx=mx))

        def run(a):
            x, gs = a["x"], a.get("global_scale")
            q, sf = outputs()  # codes written through a 32-bit view of q, scales as raw bytes
            y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else None
            if M:
                if copy_x:
                    x = dense(x)
                if copy_gs:
                    gs = gs.reshape(1).float().contiguous()
                pgs = None if gs is None else gs.data_ptr()
                if norm:
                    w = a["weight"]
                    if copy_w:
                        w = dense(w)
                    fn(x.data_ptr(), a["residual"].data_ptr(), w.data_ptr(), pgs, None if y is None else y.data_ptr(),
                       q.data_ptr(), sf.data_ptr(), M, ldx, ldr, ldy, eps, stream())
                else:
                    fn(x.data_ptr(), pgs, q.data_ptr(), sf.data_ptr(), M, ldx, stream())
            return (q, sf.view(sf_dtype), y) if return_y else (q, sf.view(sf_dtype))

        return run

    return make


PLANS = {"nvfp4_quantize": _plan("quantize"), "silu_mul_fp4quant": _plan("silu_mul"),
         "add_rmsnorm_fp4quant": _plan("add_rmsnorm"), "mxfp4_quantize": _plan("quantize", mx=True),
         "silu_mul_mxfp4quant": _plan("silu_mul", mx=True), "add_rmsnorm_mxfp4quant": _plan("add_rmsnorm", mx=True)}

CHECKS = {"nvfp4_quantize": check_quantize, "silu_mul_fp4quant": check_silu_mul,
          "add_rmsnorm_fp4quant": check_add_rmsnorm, "mxfp4_quantize": check_quantize,
          "silu_mul_mxfp4quant": check_silu_mul, "add_rmsnorm_mxfp4quant": partial(check_add_rmsnorm, block=MX_BLOCK)}
