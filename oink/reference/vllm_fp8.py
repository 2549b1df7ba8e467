"""vLLM's fused RMSNorm + FP8 ops, in vLLM's arithmetic order (fp32, float8_e4m3fn codes, qmax 448).

They back ``torch.ops.oink.<name>`` (``oink.ops_vllm``), which take vLLM's ``torch.ops._C.<name>``
schemas: every one writes its out-parameters in place and returns None. T is the input's dtype;
``to_T`` rounds an fp32 value to it (nothing for fp32). Per row of H values:

- norm value, every op: ``n = to_T(to_T(h * rstd) * w)``, rstd = rsqrt(sum(h^2) / H + eps), h in fp32.
  Rounded twice as vLLM's kernels (and ``RMSNorm.forward_native``) do; Oink's own FP8 norms round once.
- ``rms_norm_static_fp8_quant``: h = input; result = e4m3(sat(n * (1 / scale))).
- ``fused_add_rms_norm_static_fp8_quant``: h = to_T(input + residual) (the sum rounded first),
  residual <- h; result as static. ``input`` is not written.
- ``rms_norm_dynamic_per_token_quant``: h = input + residual in fp32 (not rounded), residual <- to_T(h);
  s = fmax(fmin(amax|n|, scale_ub) / 448, 1 / (448 * 512)), scale[t] = s, result = e4m3(sat(n / s)).
- ``rms_norm_per_block_quant``: as per token, with one s per group of ``group_size`` columns
  (``scale_ue8m0``: s rounded up to a power of two, as ``per_token_group_fp8_quant`` rounds it).
- ``per_token_group_fp8_quant`` (no norm): per group, a = fmax(eps, amax|x|), s = a / fp8_max
  (``scale_ue8m0``: 2^ceil(log2(fmax(s, 1e-10)))), q = e4m3(clamp(x / s, fp8_min, fp8_max)).

Divisions are IEEE fp32 (``/ 448`` correctly rounded, as the CUDA kernels' float division is); sat and
clamp send NaN to the upper bound (fmin/fmax ignore NaN), and amax skips NaN. Scales are written through
the given tensor's strides, (T, G) logical: transposed or TMA-padded layouts (address g * stride(1) + t)
get only their T rows written, pad rows stay as they were.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .fp8 import MIN_TOKEN_SCALE, _codes, _nan_skipping_amax, _per_e4m3_max, _ue8m0
from .sums import row_sum

__all__ = [  # vLLM's names (torch.ops.oink.<name>); not public oink.<name> functions
    "rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant",
    "rms_norm_per_block_quant", "per_token_group_fp8_quant",
]

UE8M0_FLOOR = 1e-10  # vLLM's fmaxf(|s|, 1e-10f) before the power-of-two rounding


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _to(v: Tensor, dtype) -> Tensor:
    """fp32 ``v`` rounded to ``dtype`` and read back in fp32 (a no-op for fp32)."""
    return v.to(dtype).float()


def _normed(h: Tensor, weight: Tensor, eps: float, dtype) -> Tensor:
    """n = to_T(to_T(h * rstd) * w) in fp32, h fp32 rows [M, H]."""
    rstd = torch.rsqrt(row_sum(h.square()) / h.shape[-1] + eps)  # a fixed tree: batch-invariant
    return _to(_to(h * rstd, dtype) * weight.float(), dtype)


def _static_codes(n: Tensor, scale: Tensor) -> Tensor:
    # vLLM multiplies by the inverse scale, computed once in fp32 (not n / scale)
    inv = torch.ones((), dtype=torch.float32, device=n.device) / scale.reshape(()).float()
    return _codes(n * inv)


def _token_scale(amax: Tensor, scale_ub: Tensor | None) -> Tensor:
    if scale_ub is not None:
        amax = torch.fmin(amax, scale_ub.reshape(()).float())
    return torch.clamp_min(_per_e4m3_max(amax), MIN_TOKEN_SCALE)


def _pow2(s: Tensor) -> Tensor:
    return _ue8m0(torch.clamp_min(s, UE8M0_FLOOR))


def rms_norm_static_fp8_quant(result: Tensor, input: Tensor, weight: Tensor, scale: Tensor,
                              epsilon: float) -> None:
    n = _normed(_rows(input).float(), weight, epsilon, input.dtype)
    result.copy_(_static_codes(n, scale).reshape(result.shape))


def fused_add_rms_norm_static_fp8_quant(result: Tensor, input: Tensor, residual: Tensor, weight: Tensor,
                                        scale: Tensor, epsilon: float) -> None:
    z = _to(_rows(input).float() + _rows(residual).float(), input.dtype)  # the sum rounded to T first
    q = _static_codes(_normed(z, weight, epsilon, input.dtype), scale)
    result.copy_(q.reshape(result.shape))
    residual.copy_(z.reshape(residual.shape))


def _sum(input: Tensor, residual: Tensor | None) -> Tensor:
    h = _rows(input).float()
    return h if residual is None else h + _rows(residual).float()  # fp32, not rounded


def rms_norm_dynamic_per_token_quant(result: Tensor, input: Tensor, weight: Tensor, scale: Tensor,
                                     epsilon: float, scale_ub: Tensor | None = None,
                                     residual: Tensor | None = None) -> None:
    h = _sum(input, residual)
    n = _normed(h, weight, epsilon, input.dtype)
    s = _token_scale(_nan_skipping_amax(n), scale_ub)
    q = _codes(n / s)  # a true division, not n * (1 / s)
    result.copy_(q.reshape(result.shape))
    scale.copy_(s.reshape(scale.shape))
    if residual is not None:
        residual.copy_(h.reshape(residual.shape))


def rms_norm_per_block_quant(result: Tensor, input: Tensor, weight: Tensor, scale: Tensor, epsilon: float,
                             scale_ub: Tensor | None = None, residual: Tensor | None = None,
                             group_size: int = 128, is_scale_transposed: bool = False,
                             scale_ue8m0: bool = False) -> None:
    h = _sum(input, residual)
    M, H = h.shape
    n = _normed(h, weight, epsilon, input.dtype).reshape(M, H // group_size, group_size)
    s = _token_scale(_nan_skipping_amax(n), scale_ub)
    if scale_ue8m0:
        s = _pow2(s)
    result.copy_(_codes(n / s).reshape(result.shape))
    # (T, G) logical: the given strides place it (row-major, transposed, or TMA-padded with pad rows kept)
    scale.copy_(s.reshape(scale.shape))
    if residual is not None:
        residual.copy_(h.reshape(residual.shape))


def per_token_group_fp8_quant(input: Tensor, output_q: Tensor, output_s: Tensor, group_size: int, eps: float,
                              fp8_min: float, fp8_max: float, scale_ue8m0: bool,
                              dummy_is_scale_transposed: bool = False, dummy_is_tma_aligned: bool = False) -> None:
    x = _rows(input).float()
    M, H = x.shape
    xg = x.reshape(M, H // group_size, group_size)
    # the kernel's float arguments: fp32
    lo, hi, eps32 = (torch.tensor(v, dtype=torch.float32, device=x.device) for v in (fp8_min, fp8_max, eps))
    amax = torch.fmax(_nan_skipping_amax(xg), eps32)  # the reduction is seeded with eps
    s = (amax.double() / hi.double()).float()  # correctly rounded fp32 a / fp8_max
    if scale_ue8m0:
        s = _pow2(s)
    q = torch.fmax(torch.fmin(xg / s, hi), lo).to(torch.float8_e4m3fn)  # fmin/fmax: NaN -> fp8_max
    output_q.copy_(q.reshape(output_q.shape))
    output_s.copy_(s.reshape(output_s.shape))
