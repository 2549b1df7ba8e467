"""FP8 kernels on torch tensors (CHECKS/PLANS for the dispatch path). Codes are written through
a 32-bit view of q; scales are fp32 in the mode's layout (``oink.reference.fp8``)."""
from __future__ import annotations

import torch

from ..reference.fp8 import E4M3_MAX, GROUP_EPS, GROUP_SIZES, empty_scales, mode_of
from .compile import stream_of
from .fp8 import Fp8Key, RMSNormFp8Key, compiled_fp8, compiled_rmsnorm_fp8
from .fp8_rules import UNIT, fp8_launch
from .host import allocator, dense, dtype_name, in_place_reason, kernel_ready_rows, row_layout, width_reason


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


def _scalar(t):
    """A 1-element fp32 operand (static scale, upper bound) as the kernel reads it."""
    return t.reshape(1).float().contiguous()


def _plan(kind: str):
    """``kind``'s launch prepared for one argument layout (see dispatch.prepare): x copied to dense rows
    where the kernel can't read it as it is, an unaligned weight copied, a static scale or an upper bound
    passed as fp32 copies; the scales out in the mode's layout (a static scale: the input's fp32 copy);
    no launch for no rows. The residual is updated in place (``check_rmsnorm``: readable as it is)."""
    def make(arch, a: dict):
        x, w, res = a["x"], a.get("weight"), a.get("residual")
        scale, ub = a.get("scale"), a.get("scale_ub")
        g, cms, ue8m0 = a.get("group_size", 0), a.get("column_major_scales", False), a.get("ue8m0", False)
        N = x.shape[-1] // 2 if kind == "silu_mul" else x.shape[-1]
        M, lead, device = x.numel() // x.shape[-1], x.shape[:-1], x.device
        mode, static, has_ub = mode_of(scale, g), scale is not None, ub is not None
        copy_x, ldx = row_layout(x, UNIT)
        copy_w = w is not None and not kernel_ready_rows(w, UNIT)
        return_y, eps = a.get("return_y", False), float(a.get("eps", 1e-6))
        norm = kind == "add_rmsnorm"
        ldr, ldy = row_layout(res, UNIT)[1], (N if return_y else 0)
        new_q = (allocator((*lead, N), torch.float8_e4m3fn, device) if M else
                 (lambda: torch.empty((*lead, N), device=device, dtype=torch.float8_e4m3fn)))
        if M:
            stream = stream_of(device)
            if norm:
                fn = compiled_rmsnorm_fp8(RMSNormFp8Key(
                    dtype_name(x), N, arch, w_dtype=dtype_name(w), res_dtype=dtype_name(res), mode=mode, group_size=g,
                    column_major=cms, ue8m0=ue8m0, ub=has_ub, store_y=return_y))
            else:
                fn = compiled_fp8(Fp8Key(kind, dtype_name(x), N, arch, mode=mode, group_size=g, column_major=cms,
                                         ue8m0=ue8m0, ub=has_ub))

        def run(a):
            x, scale = a["x"], a.get("scale")
            q = new_q()
            s = scale.reshape(1).float().clone() if static else empty_scales(x, M, N, None, g, cms)
            y = torch.empty_like(x, memory_format=torch.contiguous_format) if return_y else None
            if M:
                sc, bound = (_scalar(scale) if static else None), (_scalar(a["scale_ub"]) if has_ub else None)
                ps, pub = (sc.data_ptr() if static else None), (bound.data_ptr() if has_ub else None)
                if copy_x:
                    x = dense(x)
                # codes through a 32-bit view of q; the scales' address only where the kernel writes them
                if norm:
                    res, w = a.get("residual"), a["weight"]
                    if copy_w:
                        w = dense(w)
                    fn(x.data_ptr(), None if res is None else res.data_ptr(), w.data_ptr(), ps, pub,
                       None if y is None else y.data_ptr(), q.data_ptr(), None if static else s.data_ptr(), M, ldx,
                       ldr, ldy, eps, stream())
                else:
                    fn(x.data_ptr(), ps, pub, q.data_ptr(), None if static else s.data_ptr(), M, ldx, stream())
            return (q, s, y) if return_y else (q, s)

        return run

    return make


# ---- vLLM's ops (oink.ops_vllm): the FP8 kernels writing vLLM's out-parameters
def scales_in_place(s, column_major: bool) -> bool:
    """Whether the kernel can write (T, G) scales straight into ``s``: its layout is the kernel's, row-major
    (t * G + g) or column-major (g * T + t); else they are written in that layout and copied (a TMA-aligned
    buffer's pad rows stay as they were)."""
    return (s.t() if column_major else s).is_contiguous()


def check_group_quant(t: dict, arch: str) -> str | None:
    if (float(t["fp8_min"]), float(t["fp8_max"]), float(t["eps"])) != (-E4M3_MAX, E4M3_MAX, GROUP_EPS):
        return "fp8_min, fp8_max and eps other than -448, 448 and 1e-10: the FP8 kernels' bounds and floor"
    if t["scale_ue8m0"]:  # the kernel floors amax, vLLM the scale: all-zero groups' scales differ (2^-42, 2^-33)
        return "UE8M0 scales: vLLM floors the scale at 1e-10 before rounding, the FP8 kernel the amax"
    if t["group_size"] not in GROUP_SIZES:
        return f"group_size {t['group_size']}: the FP8 kernels' groups are {GROUP_SIZES}"
    return _launch_reason(t["input"].shape[-1], t["group_size"], "quantize", arch)


def plan_group_quant(arch, a: dict):
    """vLLM's group quant through the group kernel: codes straight into output_q where it is 16-byte aligned (else
    through a copy), scales straight into output_s where its layout is the kernel's (row-major, or column-major
    with strides (1, T)), else into the kernel's layout and copied (TMA-aligned columns: their pad rows untouched)."""
    x, out_q, out_s, g = a["input"], a["output_q"], a["output_s"], a["group_size"]
    N = x.shape[-1]
    M = x.numel() // N
    col = out_s.dim() == 2 and out_s.stride(0) < out_s.stride(1)
    direct_s = scales_in_place(out_s, col)
    direct_q = out_q.data_ptr() % 16 == 0
    copy_x, ldx = row_layout(x, UNIT)
    if not M:
        return lambda a: None
    fn = compiled_fp8(Fp8Key("quantize", dtype_name(x), N, arch, mode="group", group_size=g, column_major=col,
                             ue8m0=False, ub=False))
    stream = stream_of(x.device)

    def run(a):
        x, q, s = a["input"], a["output_q"], a["output_s"]
        if copy_x:
            x = dense(x)
        codes = q if direct_q else torch.empty_like(q)
        scales = s if direct_s else empty_scales(x, M, N, None, g, col)
        fn(x.data_ptr(), None, None, codes.data_ptr(), scales.data_ptr(), M, ldx, stream())
        if not direct_q:
            q.copy_(codes)
        if not direct_s:
            s.copy_(scales)

    return run


# the four fused RMSNorm + FP8 ops: the fused kernel with vLLM's values (``RMSNormFp8``'s ``twice``)
VLLM_NORM_MODES = {"rms_norm_static_fp8_quant": "static", "fused_add_rms_norm_static_fp8_quant": "static",
                   "rms_norm_dynamic_per_token_quant": "token", "rms_norm_per_block_quant": "block"}


def _check_vllm_norm(name: str):
    """The check of vLLM's norm + FP8 op ``name``: the FP8 norm kernels' widths (and groups), a residual readable
    in place."""
    block = VLLM_NORM_MODES[name] == "block"

    def check(t: dict, arch: str) -> str | None:
        op = "rmsnorm" if t.get("residual") is None else "add_rmsnorm"
        why = _launch_reason(t["input"].shape[-1], t["group_size"] if block else 0, "add_rmsnorm", arch, op)
        if why is None and t.get("residual") is not None:  # updated in place: no copy possible
            why = in_place_reason("residual", t["residual"], UNIT)
        return why

    return check


def _plan_vllm_norm(name: str):
    """vLLM's norm + FP8 op ``name`` through the fused kernel: codes straight into ``result`` where it is 16-byte
    aligned (else through a copy), scales straight into ``scale`` where its layout is the kernel's (per token:
    contiguous; per block: row-major, or transposed with strides (1, T)), else written in the kernel's layout and
    copied (TMA-aligned columns: their pad rows untouched); the static scale and the bound read where they are."""
    mode = VLLM_NORM_MODES[name]

    def make(arch, a: dict):
        x, w, res, out, scale = a["input"], a["weight"], a.get("residual"), a["result"], a["scale"]
        N = x.shape[-1]
        M = x.numel() // N
        if not M:
            return lambda a: None
        g = a["group_size"] if mode == "block" else 0
        col = mode == "block" and bool(a["is_scale_transposed"])
        ub = a.get("scale_ub") is not None
        copy_x, ldx = row_layout(x, UNIT)
        copy_w = not kernel_ready_rows(w, UNIT)
        ldr = row_layout(res, UNIT)[1]
        direct_q = out.data_ptr() % 16 == 0
        direct_s = mode == "static" or scales_in_place(scale, col)
        fn = compiled_rmsnorm_fp8(RMSNormFp8Key(
            dtype_name(x), N, arch, w_dtype=dtype_name(w), res_dtype=dtype_name(res), mode=mode, group_size=g,
            column_major=col, ue8m0=bool(a.get("scale_ue8m0", False)), ub=ub, twice=True,
            raw_sum=mode != "static"))
        stream = stream_of(x.device)

        def run(a):
            x, w, res, out, scale, bound = a["input"], a["weight"], a.get("residual"), a["result"], a["scale"], \
                a.get("scale_ub")
            if copy_x:
                x = dense(x)
            if copy_w:
                w = dense(w)
            codes = out if direct_q else torch.empty_like(out)
            scales = scale
            if not direct_s:
                scales = (x.new_empty((M,), dtype=torch.float32) if mode == "token" else
                          empty_scales(x, M, N, None, g, col))
            fn(x.data_ptr(), None if res is None else res.data_ptr(), w.data_ptr(),
               scale.data_ptr() if mode == "static" else None, bound.data_ptr() if ub else None, None,
               codes.data_ptr(), None if mode == "static" else scales.data_ptr(), M, ldx, ldr, 0,
               float(a["epsilon"]), stream())
            if not direct_q:
                out.copy_(codes)
            if not direct_s:
                scale.copy_(scales.reshape(scale.shape))

        return run

    return make


PLANS = {"fp8_quantize": _plan("quantize"), "silu_mul_fp8quant": _plan("silu_mul"),
         "rmsnorm_fp8quant": _plan("add_rmsnorm"), "add_rmsnorm_fp8quant": _plan("add_rmsnorm"),
         "per_token_group_fp8_quant": plan_group_quant, **{name: _plan_vllm_norm(name) for name in VLLM_NORM_MODES}}

CHECKS = {"fp8_quantize": check_quantize, "silu_mul_fp8quant": check_silu_mul, "rmsnorm_fp8quant": check_rmsnorm,
          "add_rmsnorm_fp8quant": check_rmsnorm, "per_token_group_fp8_quant": check_group_quant,
          **{name: _check_vllm_norm(name) for name in VLLM_NORM_MODES}}
