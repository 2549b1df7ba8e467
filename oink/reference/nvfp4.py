"""NVFP4 quantization references (bit-exact semantics every kernel must match).

Per 16-element block of a row, in fp32 arithmetic:
  amax = max|v| over the block (NaN elements are ignored, as the GPU's max.f32 ignores them)
  sf   = float8_e4m3fn(min(global_scale * (amax * float32(1/6)), 448))  round to nearest even
  s    = global_scale / float32(sf)
  q    = e2m1(v * s): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, round to nearest, ties to even,
         saturating at 6; the sign bit is x's sign bit (so -0.0 and small negatives give 0x8,
         a NaN gives magnitude 0 with its own sign bit); where sf is 0 every code is 0x0.
Two codes a byte, element 2j in the low nibble. ``q`` is uint8 [M, N/2] (leading dims
flattened into M); ``sf`` is float8_e4m3fn [M, N/16], or with ``swizzled=True`` FlashInfer's
128x4 layout of shape [round_up(M, 128), round_up(N/16, 4)] whose padding is zero and whose
element (m, k) lives at flat offset ``swizzled_offset(m, k, padded_cols)``.

MXFP4 (OCP MX): blocks of 32, no global scale, a power-of-two scale stored as UE8M0:
  e      = floor(log2(amax)), read exactly from amax's fp32 exponent field (a zero or subnormal
           amax reads as -127, an infinite one as 128)
  shared = clamp(e - 2, -127, 127)     (2 = the exponent of E2M1's largest value, 6 = 1.5 * 2^2)
  sf     = shared + 127 as a byte (float8_e8m0fnu), 0..254 (never 0xFF, the NaN code)
  q      = e2m1(v * 2^-shared) as above (v * 2^-shared < 8: at most 6 after saturation); where
           amax is 0 every code is 0x0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import EPS, Bench, rand, x_residual_weight
from .sums import row_sum

__all__ = [  # the public ops (oink.reference re-exports them)
    "nvfp4_quantize", "nvfp4_dequantize", "add_rmsnorm_fp4quant", "silu_mul_fp4quant",
    "mxfp4_quantize", "mxfp4_dequantize", "add_rmsnorm_mxfp4quant", "silu_mul_mxfp4quant",
]

BLOCK = 16
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest-even thresholds between consecutive E2M1 magnitudes. At a tie the even
# code wins: ties at 0.25, 1.25, 2.5 and 5 round down (strict >), at 0.75, 1.75, 3.5 up (>=).
_THRESHOLDS_DOWN = (0.25, 1.25, 2.5, 5.0)
_THRESHOLDS_UP = (0.75, 1.75, 3.5)
_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # float32(1/6)


def round_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def swizzled_offset(m, k, padded_cols: int):
    """Flat offset of scale (row m, scale column k) in the 128x4 layout: 128-row x 4-col tiles
    of 512 bytes, tiles row-major, inside a tile [m % 32][(m % 128) // 32][k % 4]."""
    tile = (m // 128) * (padded_cols // 4) + k // 4
    return tile * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + (k % 4)


def _swizzle(sf: Tensor) -> Tensor:
    """Scales (one byte each, any 8-bit dtype) into the 128x4 layout, same dtype."""
    M, K = sf.shape
    Mp, Kp = round_up(M, 128), round_up(K, 4)
    out = torch.zeros(Mp * Kp, dtype=torch.uint8, device=sf.device)
    m = torch.arange(M, device=sf.device).unsqueeze(1)
    k = torch.arange(K, device=sf.device).unsqueeze(0)
    out[swizzled_offset(m, k, Kp).reshape(-1)] = sf.view(torch.uint8).reshape(-1)
    return out.view(sf.dtype).reshape(Mp, Kp)


def unswizzle(sf: Tensor, M: int, K: int) -> Tensor:
    """Row-major [M, K] scales from the 128x4 layout (same dtype)."""
    Kp = sf.shape[-1]
    m = torch.arange(M, device=sf.device).unsqueeze(1)
    k = torch.arange(K, device=sf.device).unsqueeze(0)
    flat = sf.reshape(-1).view(torch.uint8)
    return flat[swizzled_offset(m, k, Kp)].view(sf.dtype)


def e2m1_codes(v: Tensor) -> Tensor:
    """4-bit codes (uint8) of fp32 values, round to nearest even, saturating at 6."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t in _THRESHOLDS_DOWN:
        mag += (a > t).to(torch.uint8)
    for t in _THRESHOLDS_UP:
        mag += (a >= t).to(torch.uint8)
    sign = (v.view(torch.int32) < 0).to(torch.uint8) << 3
    return mag | sign


def _pack(codes: Tensor) -> Tensor:
    """[M, N] 4-bit codes -> [M, N/2] bytes, element 2j in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _quantize_rows(v: Tensor, global_scale: Tensor, swizzled: bool):
    """v: fp32 [M, N] -> (q uint8 [M, N/2], sf e4m3)."""
    M, N = v.shape
    gs = global_scale.reshape(()).float()
    blocks = v.reshape(M, N // BLOCK, BLOCK)
    a = blocks.abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(-1)
    sf_f32 = torch.clamp(gs * (amax * _ONE_SIXTH), max=E4M3_MAX)
    sf = sf_f32.to(torch.float8_e4m3fn)
    sf_back = sf.float()
    s = gs / sf_back
    codes = e2m1_codes(blocks * s.unsqueeze(-1))
    codes = torch.where((sf_back == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    return _pack(codes.reshape(M, N)), (_swizzle(sf) if swizzled else sf)


def _check_n(N: int, name: str = "x") -> None:
    if N % BLOCK:
        raise ValueError(f"{name}: last dim {N} must be a multiple of {BLOCK} for NVFP4")


def nvfp4_quantize(x: Tensor, global_scale: Tensor, swizzled: bool = False):
    _check_n(x.shape[-1])
    return _quantize_rows(x.reshape(-1, x.shape[-1]).float(), global_scale, swizzled)


def nvfp4_dequantize(q: Tensor, sf: Tensor, global_scale: Tensor, swizzled: bool = False) -> Tensor:
    """fp32 [M, N]: e2m1(code) * float(sf) / global_scale."""
    vals, sf_rm = _decode(q, sf, swizzled, BLOCK)
    M, K = sf_rm.shape
    return (vals * sf_rm.float().unsqueeze(-1) / global_scale.reshape(()).float()).reshape(M, K * BLOCK)


def _decode(q: Tensor, sf: Tensor, swizzled: bool, block: int):
    """(E2M1 values [M, K, block] of the codes, row-major scales [M, K])."""
    M, N = q.shape[0], q.shape[1] * 2
    K = N // block
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=q.device)
    codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(M, N).long()
    return table[codes].reshape(M, K, block), (unswizzle(sf, M, K) if swizzled else sf)


def _add_rmsnorm_values(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    """-> (r = round(x + residual) for the caller to store in place once all else is computed,
    v = r * rstd(r) * weight, fp32 [M, N])."""
    r = (x.float() + residual.float()).to(residual.dtype)
    rf = r.reshape(-1, r.shape[-1]).float()
    rstd = torch.rsqrt(row_sum(rf.square()) / rf.shape[-1] + eps)  # a fixed tree: batch-invariant
    return r, rf * rstd * weight.float()


def _silu_mul_values(x: Tensor, block: int) -> Tensor:
    """x [..., 2K] -> v = silu(x[..., :K]) * x[..., K:], fp32 [M, K]."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1]} must be even (gate and up halves)")
    K = x.shape[-1] // 2
    if K % block:
        raise ValueError(f"x (each half): last dim {K} must be a multiple of {block}")
    xf = x.reshape(-1, 2 * K).float()
    return torch.nn.functional.silu(xf[:, :K]) * xf[:, K:]


def add_rmsnorm_fp4quant(x: Tensor, residual: Tensor, weight: Tensor, global_scale: Tensor,
                         eps: float = 1e-6, swizzled: bool = False, return_y: bool = False):
    """residual <- round(x + residual) in place; v = r * rstd(r) * weight in fp32, quantized.
    -> (q, sf) or (q, sf, y) with y = v in x's dtype when ``return_y``."""
    _check_n(x.shape[-1])
    r, v = _add_rmsnorm_values(x, residual, weight, eps)
    q, sf = _quantize_rows(v, global_scale, swizzled)
    residual.copy_(r)  # last: nothing written if anything before it raised
    return (q, sf, v.to(x.dtype).reshape(x.shape)) if return_y else (q, sf)


def silu_mul_fp4quant(x: Tensor, global_scale: Tensor, swizzled: bool = False):
    """x [..., 2K]: v = silu(x[..., :K]) * x[..., K:] in fp32, quantized."""
    return _quantize_rows(_silu_mul_values(x, BLOCK), global_scale, swizzled)


MX_BLOCK = 32


def _mx_quantize_rows(v: Tensor, swizzled: bool):
    """v: fp32 [M, N] -> (q uint8 [M, N/2], sf float8_e8m0fnu)."""
    M, N = v.shape
    blocks = v.reshape(M, N // MX_BLOCK, MX_BLOCK)
    a = blocks.abs()
    amax = torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    shared = torch.clamp(e - 2, -127, 127)
    scale = torch.ldexp(torch.ones_like(amax), -shared)  # 2^-shared: a normal fp32 for every shared
    codes = e2m1_codes(blocks * scale.unsqueeze(-1))
    codes = torch.where((amax == 0).unsqueeze(-1), torch.zeros_like(codes), codes)
    sf = (shared + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return _pack(codes.reshape(M, N)), (_swizzle(sf) if swizzled else sf)


def _check_mx(N: int) -> None:
    if N % MX_BLOCK:
        raise ValueError(f"x: last dim {N} must be a multiple of {MX_BLOCK} for MXFP4")


def mxfp4_quantize(x: Tensor, swizzled: bool = False):
    """-> (q uint8 [M, N/2], sf float8_e8m0fnu [M, N/32] or 128x4-swizzled); see the module doc."""
    _check_mx(x.shape[-1])
    return _mx_quantize_rows(x.reshape(-1, x.shape[-1]).float(), swizzled)


def add_rmsnorm_mxfp4quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                           swizzled: bool = False, return_y: bool = False):
    """``add_rmsnorm_fp4quant`` with the MXFP4 quantizer (no global scale)."""
    _check_mx(x.shape[-1])
    r, v = _add_rmsnorm_values(x, residual, weight, eps)
    q, sf = _mx_quantize_rows(v, swizzled)
    residual.copy_(r)  # last: nothing written if anything before it raised
    return (q, sf, v.to(x.dtype).reshape(x.shape)) if return_y else (q, sf)


def silu_mul_mxfp4quant(x: Tensor, swizzled: bool = False):
    """``silu_mul_fp4quant`` with the MXFP4 quantizer (no global scale)."""
    return _mx_quantize_rows(_silu_mul_values(x, MX_BLOCK), swizzled)


def mxfp4_dequantize(q: Tensor, sf: Tensor, swizzled: bool = False) -> Tensor:
    """fp32 [M, N]: e2m1(code) * 2^(sf - 127)."""
    vals, sf_rm = _decode(q, sf, swizzled, MX_BLOCK)
    scale = torch.ldexp(torch.ones(sf_rm.shape, device=q.device), sf_rm.view(torch.uint8).int() - 127)
    return (vals * scale.unsqueeze(-1)).reshape(q.shape[0], q.shape[1] * 2)


# ---- bench entries (``.bench``: pytest_oink builds each op's benchmark spec from its own) ----
# FP4 ops have no peer kernel in the quack and dsv3 suites (Quack's, DeepSeek's shapes for the norms,
# softmax and cross-entropy): their numbers at scale are the nvfp4 suite's
FP4_SUITES = ("nvfp4", "sweep", "smoke", "launch", "random", "invariance")
MX_FUSED_GATE = ("mxfp4_block_ratio", "nvfp4_code_step")  # (code ratios, scale bytes)


def _fp4_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen), global_scale=torch.tensor([448 * 6 / 5.0], device=device))


def _mx_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, N), dtype, device, gen))


def _silu_fp4_inputs(M, N, dtype, device, gen):
    a = _fp4_inputs(M, 2 * N, dtype, device, gen)  # N is the quantized width K: x is [M, 2K]
    a["x"] = a["x"] * 2
    return a


def _silu_mx_inputs(M, N, dtype, device, gen):
    return dict(x=rand((M, 2 * N), dtype, device, gen) * 2)


def _add_rms_fp4_inputs(M, N, dtype, device, gen):
    return dict(x_residual_weight(M, N, dtype, device, gen), global_scale=torch.tensor([448.0], device=device))


def _fp4(family, inputs, nbytes, call, block, view="fp4_code_steps"):
    return Bench(family, inputs, nbytes, call, gate_view=view, block=block, only_in=FP4_SUITES)


BENCH = {
    # read x; write codes (half a byte an element) and one scale byte per 16. Gated to one step
    # like the fused ops: torch.compile of the reference is not bit-exact (the kernel is: tests)
    "nvfp4_quantize": _fp4("nvfp4_code_step", _fp4_inputs, lambda M, N, e: M * N * e + M * N // 2 + M * N // 16,
                           lambda o, a: o.nvfp4_quantize(a["x"], a["global_scale"]), 16),
    # read x; write codes and one UE8M0 scale byte per 32
    "mxfp4_quantize": _fp4("nvfp4_code_step", _mx_inputs, lambda M, N, e: M * N * e + M * N // 2 + M * N // 32,
                           lambda o, a: o.mxfp4_quantize(a["x"]), 32),
    # read x and residual, write residual (in place), codes and scales; read the weight
    "add_rmsnorm_fp4quant": _fp4("nvfp4_code_step", _add_rms_fp4_inputs,
                                 lambda M, N, e: 3 * M * N * e + M * N // 2 + M * N // 16 + N * e,
                                 lambda o, a: o.add_rmsnorm_fp4quant(a["x"], a["residual"], a["weight"],
                                                                     a["global_scale"], EPS), 16),
    # read x [M, 2N]; write codes and scales of the N-wide product
    "silu_mul_fp4quant": _fp4("nvfp4_code_step", _silu_fp4_inputs,
                              lambda M, N, e: 2 * M * N * e + M * N // 2 + M * N // 16,
                              lambda o, a: o.silu_mul_fp4quant(a["x"], a["global_scale"]), 16),
    # the MXFP4 fused variants: the same bytes with one scale byte per 32
    "add_rmsnorm_mxfp4quant": _fp4(MX_FUSED_GATE, x_residual_weight,
                                   lambda M, N, e: 3 * M * N * e + M * N // 2 + M * N // 32 + N * e,
                                   lambda o, a: o.add_rmsnorm_mxfp4quant(a["x"], a["residual"], a["weight"], EPS), 32,
                                   view="mx_block_ratios"),
    "silu_mul_mxfp4quant": _fp4(MX_FUSED_GATE, _silu_mx_inputs,
                                lambda M, N, e: 2 * M * N * e + M * N // 2 + M * N // 32,
                                lambda o, a: o.silu_mul_mxfp4quant(a["x"]), 32, view="mx_block_ratios"),
}
