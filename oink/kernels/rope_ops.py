"""The fused QK norm + rotary embedding on torch tensors (CHECKS/PLANS for the dispatch path): ``qk_norm_rope``
(q and k to new [T, H, D] tensors) and vLLM's ``fused_qk_norm_rope`` (into qkv, in place)."""
from __future__ import annotations

import torch

from .. import config
from .compile import stream_of
from .host import allocator, dtype_name, kernel_ready, kernel_ready_rows
from .rope import RopeKey, compiled_qk_norm_rope
from .rope_rules import head_lanes, rotary_reason

HALF = (torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1


def check(t: dict, arch: str) -> str | None:
    """Why a call goes to the reference, or None (the metadata checks have passed: ``oink.ops_rope``)."""
    if not config.get().rope_kernel:
        return "the kernel is compile-checked only, not yet run on a GPU (the rope_kernel development setting runs it)"
    qkv, D = t["qkv"], t["head_dim"]
    if qkv.dtype not in HALF:
        return f"qkv dtype {qkv.dtype}: the kernel takes float16 and bfloat16"
    lanes = head_lanes(D, qkv.element_size() * 8)
    E = D // lanes
    if not kernel_ready(qkv, E):
        return f"qkv's rows are not 16-byte aligned with a row stride of a multiple of {E} (a lane's values)"
    for name in ("q_weight", "k_weight"):
        if not kernel_ready_rows(t[name], E):
            return f"{name} is not contiguous and 16-byte aligned"
    if t["q_weight"].dtype != t["k_weight"].dtype:
        return "q_weight and k_weight of different dtypes"
    cache, pos = t["cos_sin_cache"], t["position_ids"]
    if not cache.is_contiguous() or cache.data_ptr() % 16:
        return "cos_sin_cache is not contiguous and 16-byte aligned"
    if pos.numel() > 1 and pos.stride(0) != 1:
        return "position_ids is strided"
    if cache.shape[0] > INT32_MAX or qkv.shape[0] * (t["num_heads_q"] + t["num_heads_k"]) > INT32_MAX:
        return "more heads or cache rows than 32-bit indices count"
    return rotary_reason(D, cache.shape[1], t["is_neox"], lanes)


def _plan(out_of_place: bool):
    """The launch for one argument layout (see dispatch.prepare): q and k to fresh tensors, or into qkv."""
    def make(arch, a: dict):
        qkv, Hq, Hk, D = a["qkv"], a["num_heads_q"], a["num_heads_k"], a["head_dim"]
        cache, pos = a["cos_sin_cache"], a["position_ids"]
        T, device = qkv.shape[0], qkv.device
        key = RopeKey(dtype_name(qkv), dtype_name(a["q_weight"]), dtype_name(cache), dtype_name(pos), D,
                      cache.shape[1], bool(a["is_neox"]), Hq, Hk, arch,
                      weight_offset=float(a.get("weight_offset", 0.0)), out_of_place=out_of_place,
                      lanes=head_lanes(D, qkv.element_size() * 8))
        new_q = allocator((T, Hq, D), qkv.dtype, device) if T else None
        new_k = allocator((T, Hk, D), qkv.dtype, device) if T else None
        fn = compiled_qk_norm_rope(key) if T else None
        stream = stream_of(device)
        ld = qkv.stride(0) if T > 1 else qkv.shape[1]
        positions = cache.shape[0]

        def run(a):
            qkv = a["qkv"]
            if out_of_place:
                if not T:
                    return qkv.new_empty((0, Hq, D)), qkv.new_empty((0, Hk, D))
                q, k = new_q(), new_k()
                out_q, out_k = q.data_ptr(), k.data_ptr()
            else:
                if not T:
                    return None
                out_q = out_k = None
            fn(qkv.data_ptr(), out_q, out_k, a["q_weight"].data_ptr(), a["k_weight"].data_ptr(),
               a["cos_sin_cache"].data_ptr(), a["position_ids"].data_ptr(), T, ld, positions, float(a["eps"]),
               stream())
            return (q, k) if out_of_place else None

        return run

    return make


PLANS = {"qk_norm_rope": _plan(True), "fused_qk_norm_rope": _plan(False)}
CHECKS = {"qk_norm_rope": check, "fused_qk_norm_rope": check}
