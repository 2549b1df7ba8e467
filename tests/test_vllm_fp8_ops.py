"""vLLM's fused RMSNorm + FP8 ops as torch.ops.oink.* (oink/ops_vllm.py), against vLLM's own tests.

Ports (fp8 cases, cut to run on 2 CPU cores, vLLM's skips kept as filters): test_fused_quant_layernorm.py
(dynamic per-token and per-block), test_per_token_group_quant.py and test_block_fp8.py's group quant, and
the 255-vs-300-row batch-invariance checks; their references built as vLLM's tests build them, apart from
oink/reference/vllm_fp8.py, with vLLM's tolerances. Then stricter checks: the kernels' arithmetic bit for
bit, scale layouts, UE8M0, NaN, 0 tokens, opcheck, torch.compile, argument errors. CPU always, CUDA marked gpu.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import oink.ops  # noqa: F401  (registers torch.ops.oink.*)
from oink.reference.sums import row_sum

FP8 = torch.float8_e4m3fn
QMAX = 448.0
EPS = 1e-6
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
OPS = torch.ops.oink
NAMES = ("rms_norm_static_fp8_quant", "fused_add_rms_norm_static_fp8_quant", "rms_norm_dynamic_per_token_quant",
         "rms_norm_per_block_quant", "per_token_group_fp8_quant")


# ---------------------------------------------------------------- vLLM's references (as its tests build them)
def rms_norm_native(x, weight, eps, residual=None):
    """vLLM's RMSNorm.forward_native: fp32 sum, residual = sum.to(T), (x * rsqrt(var + eps)).to(T) * weight."""
    orig = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)
        residual = x.to(orig)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(orig) * weight, residual


def _per_qmax(a):
    """a / 448 as vLLM's quant kernels (the test's reference on CUDA) divide: IEEE fp32. A Python divisor
    would not do: torch on CUDA multiplies by float32(1 / 448), one ulp off, and flips codes at ties."""
    return a / torch.full_like(a, QMAX)


def ref_dynamic_per_token_quant(x, scale_ub=None):
    """vLLM's quant_utils.ref_dynamic_per_token_quant, fp8 (its division as ops.scaled_fp8_quant's)."""
    x_token_max = x.abs().max(dim=-1).values.to(torch.float32)
    if scale_ub is not None:
        x_token_max = x_token_max.clamp(max=scale_ub)
    scales = _per_qmax(x_token_max)[:, None]
    scales = torch.max(scales, torch.tensor(1.0, device=x.device) / (QMAX * 512.0))
    return (x.to(torch.float32) / scales).clamp(-QMAX, QMAX).to(FP8), scales


def native_per_token_group_quant_fp8(x, group_size, eps=1e-10, ue8m0=False, kernel_division=False):
    """test_block_fp8's native reference (with the Triton fallback's UE8M0 rounding): row-major scales;
    ``kernel_division``: a / 448 as the kernels divide (test_fused_quant_layernorm's reference is one)."""
    x_ = x.reshape(x.numel() // group_size, group_size)
    amax = x_.abs().max(dim=-1, keepdim=True)[0].clamp(min=eps).to(torch.float32)
    x_s = _per_qmax(amax) if kernel_division else amax / QMAX
    if ue8m0:
        x_s = torch.exp2(torch.ceil(torch.log2(x_s.abs().clamp(min=1e-10))))
    x_q = (x_ / x_s).clamp(min=-QMAX, max=QMAX).to(FP8)
    return x_q.reshape(x.shape), x_s.reshape(x.shape[:-1] + (x.shape[-1] // group_size,))


# ---------------------------------------------------------------- vLLM's python wrappers (_custom_ops, fp8_utils)
def per_token(x, weight, eps, scale_ub=None, residual=None):
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty((x.numel() // x.shape[-1], 1), dtype=torch.float32, device=x.device)
    OPS.rms_norm_dynamic_per_token_quant(out, x, weight, scales, eps, scale_ub, residual)
    return out, scales


def tma_scales(m, sf_k, device, fill=float("nan")):
    """empty_strided((m, sf_k), (1, round_up(m, 4))) of vLLM's wrappers, its storage filled so that
    a written pad row shows."""
    tma_m = (m + 3) // 4 * 4
    base = torch.full((max(tma_m * sf_k, 1),), fill, dtype=torch.float32, device=device)
    return base.as_strided((m, sf_k), (1, tma_m)), base


def per_block(x, weight, eps, group_size, scale_ub=None, residual=None, is_scale_transposed=False, tma_alignment=0):
    H = x.shape[-1]
    T, G = x.numel() // H, H // group_size
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    if is_scale_transposed and tma_alignment:
        scales = tma_scales(x.shape[-2], G, x.device)[0]
    elif is_scale_transposed:
        scales = torch.empty((G, T), dtype=torch.float32, device=x.device).transpose(0, 1)
    else:
        scales = torch.empty((T, G), dtype=torch.float32, device=x.device)
    OPS.rms_norm_per_block_quant(out, x, weight, scales, eps, scale_ub, residual, group_size, is_scale_transposed)
    return out, scales


def per_token_group_quant_fp8(x, group_size, column_major_scales=False, tma_aligned_scales=False, use_ue8m0=False):
    """fp8_utils.per_token_group_quant_fp8's allocation, then the op (x 2-D)."""
    m, G = x.shape[-2], x.shape[-1] // group_size
    x_q = torch.empty(x.shape, dtype=FP8, device=x.device)
    if column_major_scales and tma_aligned_scales:
        x_s = tma_scales(m, G, x.device)[0]
    elif column_major_scales:
        x_s = torch.empty((G, m), dtype=torch.float32, device=x.device).permute(-1, -2)
    else:
        x_s = torch.empty((m, G), dtype=torch.float32, device=x.device)
    OPS.per_token_group_fp8_quant(x, x_q, x_s, group_size, 1e-10, -QMAX, QMAX, use_ue8m0, column_major_scales,
                                tma_aligned_scales)
    return x_q, x_s


# ---------------------------------------------------------------- port: test_fused_quant_layernorm.py (fp8)
TOKENS_HIDDEN = [(1, h) for h in (1, 64, 128, 1024, 1025, 5120, 5137)] + [(67, h) for h in (1, 64, 1024, 1027, 5137)]
GROUP_TMA = [(g, t) for g in (None, [1, 64], [1, 128]) for t in (0, 4)]  # vLLM's {(None, 0)} U this


def _fused_quant_cases():
    for (T, H), res, ub, (gs, tma), dtype, strided in itertools.product(
            TOKENS_HIDDEN, (False, True), (True, False), GROUP_TMA, (torch.bfloat16, torch.float32), (False, True)):
        if gs is not None and (H % gs[1] or ub):
            continue  # vLLM's skips: H a multiple of the group; no scale_ub with groups
        if tma and (gs is None or (H // gs[1]) % 4 == 0):
            continue  # TMA alignment for group fp8 only, and only where it pads
        yield pytest.param(T, H, res, ub, gs, tma, dtype, strided,
                           id=f"{T}x{H}-res{int(res)}-ub{int(ub)}-g{gs and gs[1]}-tma{tma}-{str(dtype)[6:]}"
                              f"-s{int(strided)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,H,add_residual,has_scale_ub,group_size,tma_alignment,dtype,strided_input",
                         list(_fused_quant_cases()))
def test_rms_norm(device, T, H, add_residual, has_scale_ub, group_size, tma_alignment, dtype, strided_input):
    torch.manual_seed(0)
    weight = torch.empty(H, dtype=dtype).normal_(mean=1.0, std=0.1).to(device)
    scale = 1 / H
    last_dim = 2 * H if strided_input else H
    x = (torch.randn(T, last_dim, dtype=dtype) * scale).to(device)[:, :H]
    residual = (torch.randn_like(x) * scale).contiguous() if add_residual else None
    scale_ub = None
    if has_scale_ub:
        rms_x, _ = rms_norm_native(x, weight, EPS, None if residual is None else residual.clone())
        scale_ub = torch.mean(rms_x).to(dtype=torch.float32)

    ref, ref_residual = rms_norm_native(x, weight, EPS, None if residual is None else residual.clone())
    if group_size is None:
        ref_out, ref_scales = ref_dynamic_per_token_quant(ref, scale_ub)
    else:
        ref_out, ref_scales = native_per_token_group_quant_fp8(ref, group_size[1], kernel_division=True)

    ops_residual = None if residual is None else residual.clone()
    if group_size is None:
        ops_out, ops_scales = per_token(x, weight, EPS, scale_ub, ops_residual)
    else:
        ops_out, ops_scales = per_block(x, weight, EPS, group_size[1], scale_ub, ops_residual, True, tma_alignment)
        ops_scales = ops_scales.contiguous()

    assert ops_out.dtype == FP8 and ops_out.is_contiguous()
    assert torch.allclose(ref_scales, ops_scales)
    a, b = ref_out.to(torch.float32), ops_out.to(torch.float32)
    ok = torch.allclose(a, b, atol=1e-6)
    if not ok:  # vLLM's fallback: the dequantized values
        reps = 1 if group_size is None else group_size[1]
        a_deq, b_deq = a * ref_scales.repeat_interleave(reps, dim=1), b * ops_scales.repeat_interleave(reps, dim=1)
        ok = torch.allclose(a_deq, b_deq, rtol=5e-2, atol=5e-2)
    assert ok
    if add_residual:
        assert torch.allclose(ref_residual, ops_residual)


# ---------------------------------------------------------------- port: test_per_token_group_quant.py
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(31, 128), (32, 128), (63, 256), (64, 256), (16, 512)])
@pytest.mark.parametrize("column_major,tma_aligned", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("scale_ue8m0", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
def test_per_token_group_quant_fp8(device, shape, column_major, tma_aligned, scale_ue8m0, group_size):
    torch.manual_seed(0)
    x = (torch.randn(shape, dtype=torch.bfloat16) * 8).to(device)
    out_q, scale = per_token_group_quant_fp8(x, group_size, column_major, tma_aligned, scale_ue8m0)
    ref_q, ref_s = native_per_token_group_quant_fp8(x, group_size, ue8m0=scale_ue8m0)
    assert torch.allclose(out_q.float(), ref_q.float(), atol=0.15, rtol=0.15)
    assert torch.allclose(scale, ref_s, atol=0.01, rtol=0.01)


# ---------------------------------------------- port: test_block_fp8.py::test_per_token_group_quant_fp8
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [7, 67])
@pytest.mark.parametrize("d", [512, 5120])
@pytest.mark.parametrize("group_size", [64, 128, 512])
@pytest.mark.parametrize("column_major,tma_aligned", [(False, False), (True, False), (True, True)])
def test_block_fp8_per_token_group_quant(device, num_tokens, d, group_size, column_major, tma_aligned):
    torch.manual_seed(0)
    x = torch.rand(num_tokens, d, dtype=torch.bfloat16).to(device)
    ref_out, ref_scale = native_per_token_group_quant_fp8(x, group_size)
    out, scale = per_token_group_quant_fp8(x, group_size, column_major, tma_aligned)
    assert torch.allclose(out.float(), ref_out.float(), rtol=0.15)
    assert torch.allclose(scale, ref_scale)
    if column_major:
        assert scale.stride()[-2] == 1
        if tma_aligned:
            assert scale.stride()[-1] == (num_tokens + 3) // 4 * 4


# ---------------------------------------------------------------- port: batch invariance (255 vs 300 rows)
def _rows_bit_identical(small, large):
    if small.dtype == FP8:
        assert torch.equal(small.view(torch.uint8), large[: small.shape[0]].view(torch.uint8))
    else:
        torch.testing.assert_close(small, large[: small.shape[0]], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H", [512, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("add_residual", [False, True])
def test_rms_norm_static_fp8_quant_batch_invariant(device, H, dtype, seed, add_residual):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, H, dtype=dtype, generator=g).to(device)
    res = torch.randn(300, H, dtype=dtype, generator=g).to(device)
    w = torch.randn(H, dtype=dtype, generator=g).to(device)
    scale = torch.tensor(1.0, device=device)

    def run(n):
        out = torch.empty(n, H, dtype=FP8, device=device)
        if add_residual:
            OPS.fused_add_rms_norm_static_fp8_quant(out, x[:n].clone(), res[:n].clone(), w, scale, 1e-6)
        else:
            OPS.rms_norm_static_fp8_quant(out, x[:n].clone(), w, scale, 1e-6)
        return out

    _rows_bit_identical(run(255), run(300))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H", [512, 4096])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_per_block_quant_batch_invariant(device, H, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, H, dtype=dtype, generator=g).to(device)
    w = torch.randn(H, dtype=dtype, generator=g).to(device)
    small, large = (per_block(x[:n].clone(), w, 1e-6, 128) for n in (255, 300))
    _rows_bit_identical(small[0], large[0])
    _rows_bit_identical(small[1], large[1])


# ---------------------------------------------------------------- the reference's arithmetic, bit for bit
@pytest.fixture
def reference_path(monkeypatch):
    """The reference on every device: these tests pin vLLM's arithmetic in torch's ops; on a GPU the kernels
    (their own reduction order, a fast rsqrt) are checked against it below (``test_norm_kernels_*``)."""
    from oink import config

    monkeypatch.setenv("OINK_FORCE_REFERENCE", "1")
    config.reload()
    yield
    monkeypatch.undo()
    config.reload()


def _to(v, dtype):
    return v.to(dtype).float()


def kernel_norm(h, w, eps, dtype):
    """vLLM's kernels' norm value: to_T(to_T(h * rstd) * w), rstd = rsqrt(sum(h^2) / H + eps), the sum in the
    reference's fixed tree (``row_sum``: its order is no one kernel's; these tests pin the roundings around it)."""
    rstd = torch.rsqrt(row_sum(h.square()) / h.shape[-1] + eps)
    return _to(_to(h * rstd, dtype) * w.float(), dtype)


def sat(t):
    return torch.fmax(torch.fmin(t, torch.tensor(QMAX)), torch.tensor(-QMAX)).to(FP8)


def _data(T, H, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731  (a closure over this scope)
    return mk(T, 2 * H)[:, :H], mk(T, H), (1 + 0.3 * torch.randn(H, generator=g)).to(dtype).to(device)


def _equal(a, b):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_static_exact(device, dtype, fused):
    T, H = 64, 1024
    x, r, w = _data(T, H, dtype, device)
    x0, scale = x.clone(), torch.tensor([0.013], device=device)
    out = torch.empty(T, H, dtype=FP8, device=device)
    res = r.clone()
    if fused:
        OPS.fused_add_rms_norm_static_fp8_quant(out, x, res, w, scale, EPS)
        h = _to(x.float() + r.float(), dtype)  # the sum rounded to T before the norm
        assert torch.equal(res, h.to(dtype)) and torch.equal(x, x0)  # input not written
    else:
        OPS.rms_norm_static_fp8_quant(out, x, w, scale, EPS)
        h = x.float()
    n = kernel_norm(h, w, EPS, dtype)
    _equal(out, sat(n * (torch.tensor(1.0, device=device) / scale)))  # times 1/scale
    if dtype != torch.float32:  # rounding once (Oink's FP8 norms) would differ somewhere
        once = sat(_to(kernel_norm(h, w.float(), EPS, torch.float32), dtype) * (1 / scale))
        assert not torch.equal(out.view(torch.uint8), once.view(torch.uint8))


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("group_size", [0, 64, 128])
@pytest.mark.parametrize("ub", [None, 2.5])
def test_dynamic_and_per_block_exact(device, dtype, with_residual, group_size, ub):
    T, H = 40, 512
    x, r, w = _data(T, H, dtype, device, seed=1)
    res = r.clone() if with_residual else None
    scale_ub = None if ub is None else torch.tensor(ub, device=device)
    h = x.float() + (r.float() if with_residual else 0)  # fp32, not rounded
    n = kernel_norm(h, w, EPS, dtype)
    gs = group_size or H
    ng = n.reshape(T, H // gs, gs)
    a = ng.abs().amax(-1, keepdim=True)
    if ub is not None:
        a = torch.fmin(a, scale_ub)
    s = torch.clamp_min(_per_qmax(a), 1 / (QMAX * 512))
    if group_size:
        out, scales = per_block(x, w, EPS, group_size, scale_ub, res)
    else:
        out, scales = per_token(x, w, EPS, scale_ub, res)
    _equal(out, sat(ng / s).reshape(T, H))  # a true division by s
    assert torch.equal(scales, s.reshape(scales.shape))
    if with_residual:
        assert torch.equal(res, h.to(dtype))


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ue8m0", [False, True])
def test_group_quant_exact(device, dtype, ue8m0):
    T, H, gs = 33, 512, 128
    x = (torch.randn(T, H) * 5).to(dtype).to(device)
    x[3, :gs] = 0  # an all-zero group: s = eps / fp8_max (2^-33 with UE8M0)
    x[5, 7] = float("nan")  # skipped by amax, coded +fp8_max
    q, s = per_token_group_quant_fp8(x, gs, use_ue8m0=ue8m0)
    xg = x.float().reshape(T, H // gs, gs)
    a = torch.fmax(torch.where(xg.isnan(), 0, xg.abs()).amax(-1, keepdim=True), torch.tensor(1e-10))
    want = _per_qmax(a)
    if ue8m0:
        want = torch.exp2(torch.ceil(torch.log2(want.double().clamp_min(1e-10)))).float()
    assert torch.equal(s, want.reshape(T, -1))
    _equal(q, sat(xg / want).reshape(T, H))
    assert s[3, 0].item() == (2.0 ** -33 if ue8m0 else _per_qmax(torch.tensor(1e-10)).item())
    assert q[5, 7].float().item() == QMAX


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
def test_ue8m0_rounds_up_and_fp8_bounds_come_from_the_arguments(device):
    x = torch.full((2, 128), 672.0, device=device)  # s = 1.5 -> 2: codes 336, rounded to e4m3's 320
    q, s = torch.empty(2, 128, dtype=FP8, device=device), torch.empty(2, 1, device=device)
    OPS.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -QMAX, QMAX, True)
    assert (s == 2.0).all() and (q.float() == 320.0).all()
    OPS.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -224.0, 224.0, False)  # ROCm fnuz's bounds
    assert (s == 3.0).all() and (q.float() == 224.0).all()


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
def test_per_block_ue8m0_flag(device):
    x, _, w = _data(8, 256, torch.bfloat16, device)
    x[2] = 0  # the per-block floor 1/(448*512) rounds up to 2^-17
    plain = per_block(x, w, EPS, 64)[1]
    out, s = torch.empty(8, 256, dtype=FP8, device=device), torch.empty(8, 4, device=device)
    OPS.rms_norm_per_block_quant(out, x, w, s, EPS, None, None, 64, False, True)
    assert torch.equal(s, torch.exp2(torch.ceil(torch.log2(plain))))
    assert (s[2] == 2.0 ** -17).all() and (out[2].float() == 0).all()


@pytest.mark.usefixtures("reference_path")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 5, 8])
@pytest.mark.parametrize("op", ["per_block", "group"])
def test_tma_scales_keep_pad_rows(device, T, op):
    G, gs = 3, 64
    x, _, w = _data(T, G * gs, torch.bfloat16, device)
    x = x.contiguous()
    s, base = tma_scales(T, G, device)
    q = torch.empty(T, G * gs, dtype=FP8, device=device)
    if op == "per_block":
        OPS.rms_norm_per_block_quant(q, x, w, s, EPS, None, None, gs, True)
        want = per_block(x, w, EPS, gs)[1]
    else:
        OPS.per_token_group_fp8_quant(x, q, s, gs, 1e-10, -QMAX, QMAX, False, True, True)
        want = per_token_group_quant_fp8(x, gs)[1]
    assert torch.equal(s, want)
    tma_m = base.numel() // G
    pads = base.view(G, tma_m)[:, T:]
    assert pads.isnan().all()  # rows T..round_up(T, 4)-1 never written


@pytest.mark.parametrize("device", DEVICES)
def test_static_nan_saturates(device):
    x, _, w = _data(4, 64, torch.bfloat16, device)
    x[1, 3] = float("nan")
    out = torch.empty(4, 64, dtype=FP8, device=device)
    OPS.rms_norm_static_fp8_quant(out, x, w, torch.tensor([0.1], device=device), EPS)
    assert (out[1].float() == QMAX).all() and not out.float().isnan().any()


# ---------------------------------------------------------------- 0 tokens, 3-D inputs
def _calls(T, H=256, device="cpu", dtype=torch.bfloat16):
    x, r, w = _data(T, H, dtype, device)
    q = torch.empty(T, H, dtype=FP8, device=device)
    one = torch.tensor([0.05], device=device)
    st = torch.empty(4, T, device=device).t()
    return [
        (OPS.rms_norm_static_fp8_quant, (q, x, w, one, EPS)),
        (OPS.fused_add_rms_norm_static_fp8_quant, (q.clone(), x, r.clone(), w, one, EPS)),
        (OPS.rms_norm_dynamic_per_token_quant, (q.clone(), x, w, torch.empty(T, 1, device=device), EPS,
                                                torch.tensor(3.0, device=device), r.clone())),
        (OPS.rms_norm_dynamic_per_token_quant, (q.clone(), x, w, torch.empty(T, 1, device=device), EPS, None, None)),
        (OPS.rms_norm_per_block_quant, (q.clone(), x, w, st, EPS, None, r.clone(), 64, True)),
        (OPS.rms_norm_per_block_quant, (q.clone(), x, w, torch.empty(T, 2, device=device), EPS, None, None, 128,
                                        False, True)),
        (OPS.per_token_group_fp8_quant, (x.contiguous(), q.clone(), torch.empty(T, 2, device=device), 128, 1e-10,
                                         -QMAX, QMAX, False)),
        (OPS.per_token_group_fp8_quant, (x.contiguous(), q.clone(), torch.empty(4, T, device=device).t(), 64, 1e-10,
                                         -QMAX, QMAX, True, True, False)),
    ]


@pytest.mark.parametrize("i", range(8))
def test_zero_tokens(i):
    op, args = _calls(0)[i]
    op(*args)


@pytest.mark.parametrize("device", DEVICES)
def test_3d_input_flattens_to_tokens(device):
    x, r, w = _data(6, 128, torch.float16, device)
    out3, s3 = per_token(x.reshape(2, 3, 128), w, EPS, None, r.clone().reshape(2, 3, 128))
    out2, s2 = per_token(x, w, EPS, None, r.clone())
    _equal(out3.reshape(6, 128), out2)
    assert torch.equal(s3, s2)


# ---------------------------------------------------------------- opcheck, torch.compile
SAMPLES = _calls(5)


@pytest.mark.parametrize("op,args", SAMPLES, ids=[f"{s[0]._qualified_op_name}-{i}" for i, s in enumerate(SAMPLES)])
def test_opcheck(op, args):
    # CPU float8 lacks the arithmetic opcheck's schema test compares inputs with (as tests/test_custom_ops.py)
    torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration",
                                                "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("op,args", SAMPLES, ids=[f"{s[0]._qualified_op_name}-{i}" for i, s in enumerate(SAMPLES)])
def test_writes_exactly_the_declared_arguments(op, args):
    """What opcheck's schema test checks (it can't run with CPU float8): the op writes each argument its
    schema marks written, and no other."""
    def raw(t):
        return t.view(torch.uint8) if t.dtype == FP8 else t

    def same(x, y):  # NaN equal to NaN
        return bool(((x == y) | (x != x) & (y != y)).all())

    specs = op.default._schema.arguments
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for a, spec in zip(args, specs):
        if isinstance(a, torch.Tensor) and spec.name != "residual" and spec.alias_info is not None:
            raw(a).fill_(0x7F if a.dtype == FP8 else float("nan"))  # outputs start as NaN
    before = [raw(a).clone() if isinstance(a, torch.Tensor) else None for a in args]
    op(*args)
    for a, b, spec in zip(args, before, specs):
        if b is not None:
            written = spec.alias_info is not None and spec.alias_info.is_write
            assert same(raw(a), b) != written, spec.name


def test_every_op_is_sampled():
    assert {s[0]._qualified_op_name.split("::")[1] for s in SAMPLES} == set(NAMES)


def _all_ops(x, r, w, scale, ub):
    T, H = x.shape
    q1, q2, q3, q4, q5 = (torch.empty(T, H, dtype=FP8, device=x.device) for _ in range(5))
    r1, r2, r3 = r.clone(), r.clone(), r.clone()
    s3, s4 = torch.empty(T, 1, device=x.device), torch.empty(H // 128, T, device=x.device).t()
    s5 = torch.empty(T, H // 64, device=x.device)
    OPS.rms_norm_static_fp8_quant(q1, x, w, scale, EPS)
    OPS.fused_add_rms_norm_static_fp8_quant(q2, x, r1, w, scale, EPS)
    OPS.rms_norm_dynamic_per_token_quant(q3, x, w, s3, EPS, ub, r2)
    OPS.rms_norm_per_block_quant(q4, x, w, s4, EPS, None, r3, 128, True)
    OPS.per_token_group_fp8_quant(x, q5, s5, 64, 1e-10, -QMAX, QMAX, True)
    return [t.view(torch.uint8) if t.dtype == FP8 else t for t in (q1, q2, q3, q4, q5, r1, r2, r3, s3, s4, s5)]


def test_torch_compile_fullgraph():
    import torch._dynamo.testing

    torch._dynamo.reset()
    x, r, w = _data(6, 256, torch.bfloat16, "cpu")
    args = (x.contiguous(), r, w, torch.tensor([0.05]), torch.tensor(2.0))
    counts = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_all_ops, fullgraph=True, backend=counts)
    for a, b in zip(compiled(*args), _all_ops(*args)):
        assert torch.equal(a, b)
    assert counts.frame_count == 1


# ---------------------------------------------------------------- bad inputs: clear errors naming the argument
def _bad(change):
    x, r, w = _data(4, 256, torch.bfloat16, "cpu")
    a = dict(result=torch.empty(4, 256, dtype=FP8), input=x, weight=w, scale=torch.empty(4, 4), epsilon=EPS,
             scale_ub=None, residual=r.clone(), group_size=64, is_scale_transposed=False)
    a.update(change)
    return a


BAD_BLOCK = {
    "result dtype": (dict(result=torch.empty(4, 256, dtype=torch.int8)), TypeError, "result"),
    "result not contiguous": (dict(result=torch.empty(256, 4, dtype=FP8).t()), ValueError, "result"),
    "H % group_size": (dict(input=torch.randn(4, 200, dtype=torch.bfloat16), result=torch.empty(4, 200, dtype=FP8),
                            weight=torch.randn(200, dtype=torch.bfloat16), residual=torch.randn(4, 200).bfloat16()),
                       ValueError, "group_size"),
    "group_size 32": (dict(group_size=32, scale=torch.empty(4, 8)), ValueError, "group_size"),
    "scale numel": (dict(scale=torch.empty(4, 3)), ValueError, "scale"),
    "scale 1-D": (dict(scale=torch.empty(16)), ValueError, "scale"),
    "strided scale not transposed": (dict(scale=torch.empty(4, 4).t()), ValueError, "is_scale_transposed"),
    "transposed scale row-major": (dict(scale=torch.empty(4, 4), is_scale_transposed=True), ValueError, "scale"),
    "scale dtype": (dict(scale=torch.empty(4, 4, dtype=torch.float16)), TypeError, "scale"),
    "residual shape": (dict(residual=torch.randn(4, 128, dtype=torch.bfloat16)), ValueError, "residual"),
    "residual dtype": (dict(residual=torch.randn(4, 256)), TypeError, "residual"),
    "residual not contiguous": (dict(residual=torch.randn(256, 4, dtype=torch.bfloat16).t()), ValueError, "residual"),
    "weight shape": (dict(weight=torch.randn(128, dtype=torch.bfloat16)), ValueError, "weight"),
    "weight dtype": (dict(weight=torch.randn(256)), TypeError, "weight"),
    "scale_ub numel": (dict(scale_ub=torch.ones(2)), ValueError, "scale_ub"),
    "input int": (dict(input=torch.ones(4, 256, dtype=torch.int32)), TypeError, "input"),
}


@pytest.mark.parametrize("case", BAD_BLOCK)
def test_per_block_bad_inputs(case):
    change, exc, name = BAD_BLOCK[case]
    a = _bad(change)
    before = a["residual"].clone()
    with pytest.raises(exc, match=name):
        OPS.rms_norm_per_block_quant(*a.values())
    assert torch.equal(a["residual"], before)  # refused before anything was written


@pytest.mark.parametrize("case,exc,name", [
    (dict(result=torch.empty(4, 256, dtype=torch.float8_e5m2)), TypeError, "result"),
    (dict(scale=torch.empty(3, 1)), ValueError, "scale"),
    (dict(residual=torch.randn(3, 256, dtype=torch.bfloat16)), ValueError, "residual"),
])
def test_per_token_bad_inputs(case, exc, name):
    a = _bad({"scale": torch.empty(4, 1), **case})
    del a["group_size"], a["is_scale_transposed"]
    with pytest.raises(exc, match=name):
        OPS.rms_norm_dynamic_per_token_quant(*a.values())


STATIC_BAD = [
    (dict(result=torch.empty(4, 256, dtype=torch.bfloat16)), TypeError, "result"),
    (dict(result=torch.empty(256, 4, dtype=FP8).t()), ValueError, "result"),
    (dict(scale=torch.ones(2)), ValueError, "scale"),
    (dict(scale=torch.ones(1, dtype=torch.float64)), TypeError, "scale"),
    (dict(residual=torch.randn(4, 255, dtype=torch.bfloat16)), ValueError, "residual"),
]


@pytest.mark.parametrize("op,case,exc,name", [(op, *c) for op in ("static", "fused") for c in STATIC_BAD
                                              if op == "fused" or "residual" not in c[0]])
def test_static_bad_inputs(op, case, exc, name):
    a = _bad({"scale": torch.ones(1), **case})
    if op == "static":
        args = (a["result"], a["input"], a["weight"], a["scale"], EPS)
        fn = OPS.rms_norm_static_fp8_quant
    else:
        args = (a["result"], a["input"], a["residual"], a["weight"], a["scale"], EPS)
        fn = OPS.fused_add_rms_norm_static_fp8_quant
    with pytest.raises(exc, match=name):
        fn(*args)


@pytest.mark.parametrize("case,exc,name", [
    (dict(output_q=torch.empty(4, 256, dtype=torch.bfloat16)), TypeError, "output_q"),
    (dict(output_q=torch.empty(256, 4, dtype=FP8).t()), ValueError, "output_q"),
    (dict(group_size=100), ValueError, "group_size"),
    (dict(group_size=0), TypeError, "group_size"),
    (dict(output_s=torch.empty(4, 3)), ValueError, "output_s"),
    (dict(output_s=torch.empty(8)), ValueError, "output_s"),
    (dict(output_s=torch.empty(4, 4, dtype=torch.float16)), TypeError, "output_s"),
    (dict(output_s=torch.empty(4, 1).expand(4, 4)), ValueError, "output_s"),
    (dict(output_s=torch.empty(16).as_strided((4, 4), (1, 2))), ValueError, "output_s"),  # stride(1) < T
])
def test_group_quant_bad_inputs(case, exc, name):
    a = dict(input=torch.randn(4, 256), output_q=torch.empty(4, 256, dtype=FP8), output_s=torch.empty(4, 4),
             group_size=64, eps=1e-10, fp8_min=-QMAX, fp8_max=QMAX, scale_ue8m0=False)
    a.update(case)
    with pytest.raises(exc, match=name):
        OPS.per_token_group_fp8_quant(*a.values())


@pytest.mark.gpu
def test_mismatched_devices():
    a = _bad(dict(scale=torch.empty(4, 4, device="cuda")))
    with pytest.raises(ValueError, match="scale"):
        OPS.rms_norm_per_block_quant(*a.values())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "column", "tma"])
@pytest.mark.parametrize("T,H,gs", [(7, 512, 128), (256, 7168, 128), (33, 4096, 64)])
def test_group_quant_kernel_is_the_reference_bit_for_bit(layout, T, H, gs):
    """On a GPU ``per_token_group_fp8_quant`` runs Oink's FP8 group kernel, writing vLLM's out-parameters in each
    scale layout: codes and scales bit for bit the reference's, a TMA-aligned buffer's pad rows untouched."""
    from oink import dispatch
    from oink.reference import vllm_fp8

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 8
    G, S = H // gs, -(-T // 4) * 4

    def outputs():
        q = torch.full((T, H), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)  # NaN codes
        s = {"row": lambda: torch.empty(T, G, device="cuda"), "column": lambda: torch.empty(G, T, device="cuda").t(),
             "tma": lambda: tma_scales(T, G, "cuda")[0]}[layout]()  # its storage holds the pad rows
        s.as_strided((s.untyped_storage().nbytes() // 4,), (1,)).fill_(float("nan"))
        return q, s

    args = (1e-10, -448.0, 448.0, False, False, False)
    q, s = outputs()
    route = dispatch.route("per_token_group_fp8_quant", dict(input=x, output_q=q, output_s=s, group_size=gs,
                                                             eps=1e-10, fp8_min=-448.0, fp8_max=448.0,
                                                             scale_ue8m0=False))
    assert route.backend == "kernel", route
    torch.ops.oink.per_token_group_fp8_quant(x, q, s, gs, *args)
    q_ref, s_ref = outputs()
    vllm_fp8.per_token_group_fp8_quant(x, q_ref, s_ref, gs, *args)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref) and not s.isnan().any()
    if layout == "tma" and S > T:  # the pad rows of the buffer stay as they were
        pad = s.as_strided((G, S - T), (S, 1), storage_offset=T)
        assert pad.isnan().all()


# ---------------------------------------------------------------- the kernels on a GPU against the reference
def _norm_call(op, x, w, res, T, H, scale_layout, g):
    """Fresh (poisoned) out-parameters for ``op`` and the call's arguments -> (args, the written tensors)."""
    out = torch.full((T, H), 0x7F, dtype=torch.uint8, device="cuda").view(FP8)  # NaN codes
    r = None if res is None else res.clone()
    if op.endswith("static_fp8_quant"):
        scale = torch.tensor([0.011], device="cuda")
        args = (out, x, r, w, scale, EPS) if op.startswith("fused") else (out, x, w, scale, EPS)
        return args, [out] + ([r] if r is not None else [])
    G = H // g if g else 1
    s = {"token": lambda: torch.empty(T, 1, device="cuda"), "row": lambda: torch.empty(T, G, device="cuda"),
         "column": lambda: torch.empty(G, T, device="cuda").t(),
         "tma": lambda: tma_scales(T, G, "cuda")[0]}[scale_layout]()  # its storage holds the pad rows
    s.as_strided((s.untyped_storage().nbytes() // 4,), (1,)).fill_(float("nan"))
    ub = torch.tensor(2.5, device="cuda")
    if g:
        args = (out, x, w, s, EPS, None, r, g, scale_layout != "row", False)
    else:
        args = (out, x, w, s, EPS, ub, r)
    return args, [out, s] + ([r] if r is not None else [])


NORM_KERNEL_CASES = [("rms_norm_static_fp8_quant", None, 0, False),
                     ("fused_add_rms_norm_static_fp8_quant", None, 0, True)]
NORM_KERNEL_CASES += [(op, layout, g, residual) for op, layout, g in (
    ("rms_norm_dynamic_per_token_quant", "token", 0), ("rms_norm_per_block_quant", "row", 128),
    ("rms_norm_per_block_quant", "column", 64), ("rms_norm_per_block_quant", "tma", 128)) for residual in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("op,scale_layout,g,residual", NORM_KERNEL_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("T,H", [(1, 2048), (7, 4096), (257, 7168), (64, 18432), (3, 131072)])
def test_norm_kernels_within_a_step(op, scale_layout, g, residual, dtype, T, H):
    """On a GPU the four norm ops run the fused FP8 kernel in vLLM's order: codes within one e4m3 step of the
    reference (>= 99.9% exact; the kernel's rsqrt and reduction order are its own), scales equal but for 1e-3 of them
    (one ulp of T: an amax value rounded the other way), the residual
    bit for bit, nothing left unwritten (NaN-poisoned), a TMA buffer's pad rows untouched; a row batch-invariant."""
    from oink import dispatch
    from oink.reference import vllm_fp8
    from tests.gpu_helpers import fp8_steps

    gen = torch.Generator(device="cuda").manual_seed(T * 7 + H)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 3).to(dtype)
    w = (1 + 0.3 * torch.randn(H, device="cuda", generator=gen)).to(dtype)
    res = (torch.randn(T, H, device="cuda", generator=gen) * 3).to(dtype) if residual else None
    args, got = _norm_call(op, x, w, res, T, H, scale_layout, g)
    names = [a.name for a in getattr(OPS, op).default._schema.arguments]
    route = dispatch.route(op, dict(zip(names, args)))
    assert route.backend == "kernel", route
    getattr(OPS, op)(*args)
    ref_args, want = _norm_call(op, x, w, res, T, H, scale_layout, g)
    getattr(vllm_fp8, op)(*ref_args)
    steps = fp8_steps(got[0], want[0])
    assert steps.max().item() <= 1 and (steps == 0).float().mean().item() >= 0.999, f"{int((steps > 0).sum())} moved"
    if scale_layout is not None:
        s, s_ref = got[1], want[1]
        if scale_layout == "tma" and T % 4:
            S = -(-T // 4) * 4
            pad = s.as_strided((H // g, S - T), (S, 1), storage_offset=T)
            assert pad.isnan().all()
        # a group's amax is one of its rounded values, so where the kernel's rsqrt (its own, a few fp32 ulps off)
        # moves that value's first rounding, the scale moves by one ulp of T: allowed for 1e-3 of the scales
        ulp = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
        rel = (s - s_ref).abs() / s_ref
        assert not rel.isnan().any() and rel.max().item() <= ulp
        assert int((rel > 1e-6).sum()) <= max(1, s.numel() // 1000), f"{int((rel > 1e-6).sum())} scales moved"
    if res is not None:
        assert torch.equal(got[-1], want[-1])
    if T > 1:  # the first row alone: the same bits
        one, one_got = _norm_call(op, x[:1], w, None if res is None else res[:1], 1, H, scale_layout, g)
        getattr(OPS, op)(*one)
        assert torch.equal(one_got[0].view(torch.uint8), got[0][:1].view(torch.uint8))
