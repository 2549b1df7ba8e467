"""FP8 kernels on torch tensors (CHECKS/RUNNERS for the dispatch path). Codes are written through
a 32-bit view of q; scales are fp32 in the mode's layout (``oink.reference.fp8``)."""
from __future__ import annotations

import torch

from ..reference.fp8 import empty_scales, mode_of
from .compile import current_stream, stream_of
from .fp8 import UNIT, compiled_fp8, compiled_rmsnorm_fp8, fp8_launch
from .host import (allocator, dtype_name, in_place_reason, kernel_ready_rows, ld, prepare_rows, prepare_vector, ptr,
                   rows_view, width_reason)


def _launch_reason(N: int, group_size: int, kind: str, arch: str, op: str | None = None) -> str | None:
    why = width_reason(N)
    if why:
        return why
    if N % UNIT:
        return f"N={N} is not a multiple of {UNIT}: the FP8 kernels' units"
    try:
        fp8_launch(N, arch, kind, group_size, op)
    except ValueError as e:
        return str(e)
    return None


def check_quantize(t: dict, arch: str) -> str | None:
    return _launch_reason(t["x"].shape[-1], t["group_size"], "quantize", arch)


def check_silu_mul(t: dict, arch: str) -> str | None:
    return _launch_reason(t["x"].shape[-1] // 2, t["group_size"], "silu_mul", arch)


def check_rmsnorm(t: dict, arch: str) -> str | None:
    if t["weight"].dtype not in (t["x"].dtype, torch.float32):  # other mixes compile, untested on a GPU
        return f"weight dtype {t['weight'].dtype} with x {t['x'].dtype}: the fused FP8 kernels take x's or fp32"
    op = "rmsnorm" if t.get("residual") is None else "add_rmsnorm"
    why = _launch_reason(t["x"].shape[-1], t["group_size"], "add_rmsnorm", arch, op)
    if why is None and t.get("residual") is not None:  # updated in place: no copy possible
        why = in_place_reason("residual", t["residual"], UNIT)
    return why


def _scales(x, M: int, N: int, scale, group_size: int, column_major: bool):
    """The mode's scales out (a static scale is the input's fp32 copy, not the kernel's)."""
    if scale is not None:
        return scale.reshape(1).float().clone()
    return empty_scales(x, M, N, None, group_size, column_major)


def _scalar(t):
    """A 1-element fp32 operand (static scale, upper bound), kept alive by the caller."""
    return None if t is None else t.reshape(1).float().contiguous()


def _ptrs(q, s, mode, scale, scale_ub):
    sc, ub = _scalar(scale), _scalar(scale_ub)
    f32 = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return (f32(sc), f32(ub), q.data_ptr(),
            None if mode == "static" else f32(s), (sc, ub))


def _run(kind, arch, x, N, scale, group_size, column_major_scales, ue8m0, scale_ub):
    mode = mode_of(scale, group_size)
    x2 = prepare_rows(x, UNIT)
    M = x2.shape[0]
    q = torch.empty((M, N), device=x.device, dtype=torch.float8_e4m3fn)
    s = _scales(x, M, N, scale, group_size, column_major_scales)
    if M > 0:
        fn = compiled_fp8(kind, dtype_name(x2), N, arch, mode, group_size, column_major_scales, ue8m0,
                          scale_ub is not None)
        pscale, pub, pq, ps, _keep = _ptrs(q, s, mode, scale, scale_ub)
        fn(ptr(x2), pscale, pub, pq, ps, M, ld(x2), current_stream(x.device))
    return q.view(*x.shape[:-1], N), s


def run_quantize(arch, x, scale=None, group_size=0, column_major_scales=False, ue8m0=False, scale_ub=None):
    return _run("quantize", arch, x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


def run_silu_mul(arch, x, scale=None, group_size=0, column_major_scales=False, ue8m0=False, scale_ub=None):
    return _run("silu_mul", arch, x, x.shape[-1] // 2, scale, group_size, column_major_scales, ue8m0, scale_ub)


def run_add_rmsnorm(arch, x, residual, weight, eps=1e-6, scale=None, group_size=0, column_major_scales=False,
                    ue8m0=False, scale_ub=None, return_y=False):
    N = x.shape[-1]
    mode = mode_of(scale, group_size)
    x2 = prepare_rows(x, UNIT)
    r2 = rows_view(residual) if residual is not None else None
    w = prepare_vector(weight, UNIT)
    M = x2.shape[0]
    q = torch.empty((M, N), device=x.device, dtype=torch.float8_e4m3fn)
    s = _scales(x, M, N, scale, group_size, column_major_scales)
    y = torch.empty((M, N), device=x.device, dtype=x.dtype) if return_y else None
    if M > 0:
        fn = compiled_rmsnorm_fp8(dtype_name(x2), dtype_name(r2), dtype_name(w), N, arch, mode, group_size,
                                  column_major_scales, ue8m0, scale_ub is not None, return_y)
        pscale, pub, pq, ps, _keep = _ptrs(q, s, mode, scale, scale_ub)
        fn(ptr(x2), ptr(r2), ptr(w), pscale, pub, ptr(y), pq, ps, M, ld(x2), ld(r2), ld(y), float(eps),
           current_stream(x.device))
    q = q.view(x.shape)
    return (q, s, y.view(x.shape)) if return_y else (q, s)


def run_rmsnorm(arch, x, weight, eps=1e-6, scale=None, group_size=0, column_major_scales=False, ue8m0=False,
                scale_ub=None, return_y=False):
    return run_add_rmsnorm(arch, x, None, weight, eps, scale, group_size, column_major_scales, ue8m0, scale_ub,
                           return_y)


def _plan(kind: str):
    """A launch prepared once per argument layout (see dispatch.Route.plan) for the dynamic scale
    modes; None where the runner is needed (a static scale or an upper bound, a copy of an input)."""
    def make(arch, a: dict):
        x, w, res = a["x"], a.get("weight"), a.get("residual")
        if (x.numel() == 0 or a.get("scale") is not None
                or a.get("scale_ub") is not None or not all(kernel_ready_rows(t, UNIT) for t in (x, w, res))):
            return None
        x2 = rows_view(x)
        M, N = x2.shape[0], x.shape[-1] // 2 if kind == "silu_mul" else x.shape[-1]
        g, cms, ue8m0 = a.get("group_size", 0), a.get("column_major_scales", False), a.get("ue8m0", False)
        mode, device, ldx, qshape = mode_of(None, g), x.device, ld(x2), (*x.shape[:-1], N)
        stream = stream_of(device)
        if kind != "add_rmsnorm":
            fn = compiled_fp8(kind, dtype_name(x2), N, arch, mode, g, cms, ue8m0, False)
            new_q = allocator(qshape, torch.float8_e4m3fn, device)

            def run(a):
                x = a["x"]
                q = new_q()
                s = empty_scales(x, M, N, None, g, cms)
                fn(x.data_ptr(), None, None, q.data_ptr(), s.data_ptr(), M, ldx, stream())
                return q, s

            return run
        r2 = rows_view(res) if res is not None else None
        return_y, eps = a.get("return_y", False), float(a.get("eps", 1e-6))
        fn = compiled_rmsnorm_fp8(dtype_name(x2), dtype_name(r2), dtype_name(w), N, arch, mode, g, cms, ue8m0, False,
                                  return_y)
        ldr, ldy = ld(r2), (N if return_y else 0)

        def run_norm(a):
            x, res = a["x"], a.get("residual")
            q = torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format)
            s = empty_scales(x, M, N, None, g, cms)
            y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else None
            fn(x.data_ptr(), None if res is None else res.data_ptr(), a["weight"].data_ptr(), None, None,
               None if y is None else y.data_ptr(), q.data_ptr(), s.data_ptr(), M, ldx, ldr, ldy, eps,
               stream())
            return (q, s, y) if return_y else (q, s)

        return run_norm

    return make


PLANS = {"fp8_quantize": _plan("quantize"), "silu_mul_fp8quant": _plan("silu_mul"),
         "rmsnorm_fp8quant": _plan("add_rmsnorm"), "add_rmsnorm_fp8quant": _plan("add_rmsnorm")}

CHECKS = {"fp8_quantize": check_quantize, "silu_mul_fp8quant": check_silu_mul, "rmsnorm_fp8quant": check_rmsnorm,
          "add_rmsnorm_fp8quant": check_rmsnorm}
RUNNERS = {"fp8_quantize": run_quantize, "silu_mul_fp8quant": run_silu_mul, "rmsnorm_fp8quant": run_rmsnorm,
           "add_rmsnorm_fp8quant": run_add_rmsnorm}
