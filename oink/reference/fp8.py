"""FP8 (float8_e4m3fn) quantization references: the spec every kernel must match.

Three scale modes, chosen by the arguments (vLLM's conventions, fp32 arithmetic):
- static (``scale`` given, a 1-element fp32 tensor never read on the host):
    q = e4m3(sat(v * float32(1 / scale)))                   scales: a [1] copy of ``scale``
- per token (``group_size=0``, no ``scale``), for each row:
    a = fmin(amax, scale_ub) if scale_ub else amax;  s = fmax(a / 448, 1 / (448 * 512))
    q = e4m3(sat(v / s))                                    scales: fp32 [M, 1]
- per group (``group_size`` G in {64, 128}), for each 1 x G group of a row:
    s = fmax(amax, 1e-10) / 448; with ``ue8m0`` s is rounded up to a power of two
    (2^ceil(log2 s), read exactly from s's bits); q = e4m3(sat(v / s))
    scales: fp32 [M, N / G]; with ``column_major_scales`` the same shape with strides (1, M)
    (the transposed layout DeepGEMM-style GEMMs read).
where amax = max |v| over the row or group, skipping NaN (as the GPU's max.f32 and CUDA's
fmaxf do); sat(t) = fmax(fmin(t, 448), -448), which also sends NaN to +448 as vLLM's clamp
does; e4m3 rounds to nearest even. An all-zero row or group gets the floor scale and zero codes.
``q`` is float8_e4m3fn in x's shape (leading dims of a scale's M flattened).

Fused ops quantize v as follows (the unrounded path differs by at most one code step):
- ``rmsnorm_fp8quant``: v = x's dtype(x_hat * weight), x_hat = x * rsqrt(mean(x^2) + eps), in fp32 as
  (x * rstd) * weight, or per token (x * weight) * rstd (its amax then rides the norm's reduction);
- ``add_rmsnorm_fp8quant``: residual <- residual's dtype(x + residual) in place, then as above
  on that stored sum (vLLM's fused_add_rms_norm semantics);
- ``silu_mul_fp8quant``: v = silu(x[..., :K]) * x[..., K:] in fp32 (not rounded).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import EPS, Bench, rand, x_residual_weight, x_weight
from .sums import row_sum

__all__ = [  # the public ops (oink.reference re-exports them)
    "fp8_quantize", "rmsnorm_fp8quant", "add_rmsnorm_fp8quant", "silu_mul_fp8quant",
]

E4M3_MAX = 448.0
MIN_TOKEN_SCALE = 1.0 / (E4M3_MAX * 512.0)
GROUP_EPS = 1e-10
GROUP_SIZES = (64, 128)


def _nan_skipping_amax(v: Tensor) -> Tensor:
    return torch.where(torch.isnan(v), torch.zeros_like(v), v.abs()).amax(-1, keepdim=True)


def _per_e4m3_max(a: Tensor) -> Tensor:
    """a / 448 rounded once (IEEE fp32 division). Not ``a / 448``: torch on CUDA multiplies by
    float32(1/448) when the divisor is a Python number, one ulp off for some a. A float64
    quotient rounded to fp32 is the correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits)."""
    return (a.double() / E4M3_MAX).float()


def _codes(t: Tensor) -> Tensor:
    """e4m3 of t after sat(): fmin/fmax ignore NaN, so NaN saturates to +448."""
    return torch.fmax(torch.fmin(t, torch.tensor(E4M3_MAX)), torch.tensor(-E4M3_MAX)).to(torch.float8_e4m3fn)


def _ue8m0(s: Tensor) -> Tensor:
    """s (positive, normal fp32) rounded up to a power of two, exactly: the exponent field plus one
    where the mantissa is not zero."""
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return ((exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)) << 23).view(torch.float32)


def empty_scales(x: Tensor, M: int, N: int, scale, group_size: int, column_major_scales: bool) -> Tensor:
    """The mode's fp32 scales, unwritten, on x's device (FakeTensors too): [1] static, [M, 1] per
    token, [M, N / G] per group, column-major allocated [N / G, M] and seen transposed."""
    if scale is not None:
        return x.new_empty((1,), dtype=torch.float32)
    if not group_size:
        return x.new_empty((M, 1), dtype=torch.float32)
    if column_major_scales:
        return x.new_empty((N // group_size, M), dtype=torch.float32).t()
    return x.new_empty((M, N // group_size), dtype=torch.float32)


def mode_of(scale, group_size: int) -> str:
    if scale is not None:
        return "static"
    return "group" if group_size else "token"


def quantize_rows(v: Tensor, scale=None, group_size: int = 0, column_major_scales: bool = False,
                  ue8m0: bool = False, scale_ub=None):
    """fp32 rows [M, N] -> (q float8_e4m3fn [M, N], scales): the three modes of the module docstring."""
    M, N = v.shape
    mode = mode_of(scale, group_size)
    if mode == "static":
        inv = torch.tensor(1.0, dtype=torch.float32, device=v.device) / scale.reshape(1).float()
        return _codes(v * inv), scale.reshape(1).float().clone()
    if mode == "token":
        a = _nan_skipping_amax(v)
        if scale_ub is not None:
            a = torch.fmin(a, scale_ub.reshape(1).float())
        s = torch.clamp_min(_per_e4m3_max(a), MIN_TOKEN_SCALE)
        return _codes(v / s), s
    G = group_size
    vg = v.reshape(M, N // G, G)
    s = _per_e4m3_max(torch.clamp_min(_nan_skipping_amax(vg), GROUP_EPS))
    if ue8m0:
        s = _ue8m0(s)
    q = _codes(vg / s).reshape(M, N)
    return q, empty_scales(v, M, N, None, G, column_major_scales).copy_(s.reshape(M, N // G))


def check_args(N: int, scale, group_size: int, column_major_scales: bool, ue8m0: bool, scale_ub,
               name: str = "x") -> None:
    """The mode's arguments agree (raises ValueError naming the argument at fault)."""
    if group_size and group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} is not 0 (per token) or one of {GROUP_SIZES}")
    if group_size and N % group_size:
        raise ValueError(f"{name}: last dim {N} is not a multiple of group_size {group_size}")
    if scale is not None and group_size:
        raise ValueError("scale: a static scale is per tensor; group_size must be 0")
    if (column_major_scales or ue8m0) and not group_size:
        raise ValueError("column_major_scales and ue8m0 apply to per-group scales (group_size > 0)")
    if scale_ub is not None and (scale is not None or group_size):
        raise ValueError("scale_ub: an upper bound applies to per-token scales only")


def fp8_quantize(x: Tensor, scale: Tensor | None = None, group_size: int = 0, *, column_major_scales: bool = False,
                 ue8m0: bool = False, scale_ub: Tensor | None = None):
    check_args(x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]).float(), scale, group_size, column_major_scales, ue8m0,
                         scale_ub)
    return q.reshape(x.shape), s


def _normed(h: Tensor, weight: Tensor, eps: float, dtype, per_token: bool) -> Tensor:
    """x's dtype(h * rstd * weight), rstd = rsqrt(mean(h^2) + eps), back in fp32: [M, N]; ``per_token``
    (h * weight) * rstd, as the kernels take it (their amax is then max |h * weight| times rstd, exactly), else
    (h * rstd) * weight."""
    hf = h.reshape(-1, h.shape[-1]).float()
    rstd = torch.rsqrt(row_sum(hf.square()) / hf.shape[-1] + eps)  # a fixed tree: batch-invariant
    v = (hf * weight.float()) * rstd if per_token else (hf * rstd) * weight.float()
    return v.to(dtype).float()


def rmsnorm_fp8quant(x: Tensor, weight: Tensor, eps: float = 1e-6, scale: Tensor | None = None,
                     group_size: int = 0, *, column_major_scales: bool = False, ue8m0: bool = False,
                     scale_ub: Tensor | None = None, return_y: bool = False):
    check_args(x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)
    v = _normed(x, weight, eps, x.dtype, scale is None and not group_size)
    q, s = quantize_rows(v, scale, group_size, column_major_scales, ue8m0, scale_ub)
    q = q.reshape(x.shape)
    return (q, s, v.to(x.dtype).reshape(x.shape)) if return_y else (q, s)


def add_rmsnorm_fp8quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                         scale: Tensor | None = None, group_size: int = 0, *, column_major_scales: bool = False,
                         ue8m0: bool = False, scale_ub: Tensor | None = None, return_y: bool = False):
    check_args(x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)
    r = (x.float() + residual.float()).to(residual.dtype)
    v = _normed(r, weight, eps, x.dtype, scale is None and not group_size)
    q, s = quantize_rows(v, scale, group_size, column_major_scales, ue8m0, scale_ub)
    q = q.reshape(x.shape)
    residual.copy_(r)  # last: nothing written if anything before it raised
    return (q, s, v.to(x.dtype).reshape(x.shape)) if return_y else (q, s)


def silu_mul_fp8quant(x: Tensor, scale: Tensor | None = None, group_size: int = 0, *,
                      column_major_scales: bool = False, ue8m0: bool = False, scale_ub: Tensor | None = None):
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1]} must be even (gate and up halves)")
    K = x.shape[-1] // 2
    check_args(K, scale, group_size, column_major_scales, ue8m0, scale_ub, "x (each half)")
    xf = x.reshape(-1, 2 * K).float()
    q, s = quantize_rows(torch.nn.functional.silu(xf[:, :K]) * xf[:, K:], scale, group_size, column_major_scales,
                         ue8m0, scale_ub)
    return q.reshape(*x.shape[:-1], K), s


# ---- bench entries (``.bench``: pytest_oink builds each op's benchmark spec from its own) ----
# (e4m3 codes, fp32 scales): the fp8 suite's ops
FP8_SUITES = ("fp8", "smoke", "launch", "random", "invariance")


def _x_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen) * 3)


def _silu_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, 2 * N), dtype, device, gen) * 2)  # N is the quantized width K


# The static entries' scale (a calibrated per-tensor scale, as vLLM's and FlashInfer's static FP8 take one):
# rmsnorm(x) * weight of the entries' normal inputs (x and weight) reaches about 18 at the suite's sizes, codes
# of about 350 at this scale: they span e4m3's range without saturating
STATIC_SCALE = 0.05
STATIC_SUITES = ("fp8", "random", "invariance")  # the static entries' suites: fp8 (FlashInfer's peers), random


def _with_static_scale(inputs):
    """The entry's inputs plus ``scale``: a 1-element fp32 tensor on the device (the same every seed)."""
    def make(M, N, dtype, device, gen):
        return dict(inputs(M, N, dtype, device, gen),
                    scale=torch.full((1,), STATIC_SCALE, dtype=torch.float32, device=device))

    return make


def _fp8(inputs, nbytes, call, block=1, only_in=FP8_SUITES):
    return Bench(("fp8_code_step", "fp8_scale"), inputs, nbytes, call, gate_view="fp8_code_steps", block=block,
                 only_in=only_in)


BENCH = {
    # per token: read x; write codes and one fp32 scale a row
    "fp8_quantize": _fp8(_x_inputs, lambda M, N, e: M * N * e + M * N + 4 * M, lambda o, a: o.fp8_quantize(a["x"])),
    # per 1 x 128 group (DeepSeek-V3's activations): one fp32 scale a group
    "fp8_quantize_group": _fp8(_x_inputs, lambda M, N, e: M * N * e + M * N + M * N // 32,
                               lambda o, a: o.fp8_quantize(a["x"], group_size=128), 128),
    # read x and weight; write codes and per-row scales
    "rmsnorm_fp8quant": _fp8(x_weight, lambda M, N, e: M * N * e + M * N + 4 * M + N * e,
                             lambda o, a: o.rmsnorm_fp8quant(a["x"], a["weight"], EPS)),
    # read x and residual, write residual (in place), codes and 1 x 128 group scales; read the weight
    "add_rmsnorm_fp8quant": _fp8(x_residual_weight, lambda M, N, e: 3 * M * N * e + M * N + M * N // 32 + N * e,
                                 lambda o, a: o.add_rmsnorm_fp8quant(a["x"], a["residual"], a["weight"], EPS,
                                                                     group_size=128), 128),
    # read x [M, 2N]; write codes and 1 x 128 group scales of the N-wide product
    "silu_mul_fp8quant": _fp8(_silu_inputs, lambda M, N, e: 2 * M * N * e + M * N + M * N // 32,
                              lambda o, a: o.silu_mul_fp8quant(a["x"], group_size=128), 128),
    # the fused norms with a static scale (the mode FlashInfer's rmsnorm_quant and fused_add_rmsnorm_quant
    # have): read x (and residual, written back) and weight, write the codes
    "rmsnorm_fp8quant_static": _fp8(_with_static_scale(x_weight), lambda M, N, e: M * N * e + M * N + N * e,
                                    lambda o, a: o.rmsnorm_fp8quant(a["x"], a["weight"], EPS, scale=a["scale"]),
                                    only_in=STATIC_SUITES),
    "add_rmsnorm_fp8quant_static": _fp8(_with_static_scale(x_residual_weight),
                                        lambda M, N, e: 3 * M * N * e + M * N + N * e,
                                        lambda o, a: o.add_rmsnorm_fp8quant(a["x"], a["residual"], a["weight"], EPS,
                                                                            scale=a["scale"]),
                                        only_in=STATIC_SUITES),
}
