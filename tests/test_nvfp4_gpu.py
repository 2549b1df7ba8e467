"""NVFP4 kernels on the GPU. ``nvfp4_quantize``: bit-exact against the reference (codes and
scale bytes, both layouts, swizzled padding included). The fused ops compute v in fp32 in
another order than the reference (reduction order, exp rounding), so against the reference
evaluated in float64 then rounded to fp32 they give: scales exact but for ~1 block in a million
(one E4M3 step, see gpu_helpers.scales_exact), >= 99.9% of codes exact, every other code one E2M1 step
away with the same sign. The MXFP4 variants the same, counting a power-of-two scale step as one
step and checking codes where the scales agree."""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from oink.reference.nvfp4 import _mx_quantize_rows, _quantize_rows, unswizzle
from tests.gpu_helpers import DTYPES, kernel, scales_exact

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

MS = (1, 3, 128, 4097)
NS = (16, 64, 1008, 2048, 7168, 14336)
DISTRIBUTIONS = ("normal", "uniform", "heavy", "ties", "saturate", "subnormal", "zeros", "nan")


def _values(kind, M, N, g):
    """fp32 data of one kind, with its global scale."""
    dev = "cuda"
    if kind == "normal":
        return torch.randn(M, N, device=dev, generator=g), 448 * 6 / 4.0
    if kind == "uniform":
        return torch.rand(M, N, device=dev, generator=g) * 2 - 1, 448 * 6 / 1.0
    if kind == "heavy":  # Student-t-like: a few huge values per row
        heavy = torch.randn(M, N, device=dev, generator=g) / torch.rand(M, N, device=dev, generator=g).clamp_min(1e-3)
        return heavy, 50.0
    if kind == "ties":  # global scale 1 and block amax 6: sf = 1, s = 1, so v * s hits every tie exactly
        ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                             -0.0], device=dev)
        perm = torch.argsort(torch.rand(M, N // 16, 16, device=dev, generator=g), -1)
        return ties[perm].reshape(M, N), 1.0
    if kind == "saturate":  # gs * amax / 6 far above 448: scales saturate
        return torch.randn(M, N, device=dev, generator=g) * 100, 1e4
    if kind == "subnormal":  # E4M3 subnormal scales, some rounding to 0
        return torch.randn(M, N, device=dev, generator=g) * 1e-3, 1.0
    if kind == "zeros":  # every other block all zero
        v = torch.randn(M, N, device=dev, generator=g).view(M, N // 16, 16)
        v[:, ::2] = 0
        return v.reshape(M, N), 448 * 6 / 4.0
    v = torch.randn(M, N, device=dev, generator=g)  # NaN policy: amax skips NaN, NaN codes 0 with sign
    v.view(-1)[torch.randperm(M * N, device=dev, generator=g)[: max(1, M * N // 50)]] = float("nan")
    v.view(-1)[:1] = -float("nan")
    return v, 448 * 6 / 4.0


def _bytes(sf):
    return sf.view(torch.uint8)


def _poison_allocator(nbytes=1 << 26):
    """Fill memory the caching allocator will hand out next with 0xFF (the kernels allocate
    their outputs themselves): a byte a kernel forgets to write then shows up as 0xFF."""
    junk = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    del junk


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", NS)
@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_quantize_bit_exact(kind, dtype, N, M, swizzled, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    v, gs = _values(kind, M, N, g)
    x = v.to(dtype)
    gs_t = torch.tensor([gs], device="cuda", dtype=torch.float32)
    _poison_allocator()
    q, sf = kernel("nvfp4_quantize", x=x, global_scale=gs_t, swizzled=swizzled)
    eq, esf = R.nvfp4_quantize(x, gs_t, swizzled)
    assert torch.equal(_bytes(sf), _bytes(esf)), \
        f"scales differ at {(_bytes(sf) != _bytes(esf)).nonzero()[:5].tolist()}"
    assert torch.equal(q, eq), f"codes differ at {(q != eq).nonzero()[:5].tolist()}"


def test_quantize_writes_every_byte_and_routes(seed):
    """Every output byte written (allocator poisoned first; swizzled padding zeroed)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, 5, 1008, device="cuda", generator=g).bfloat16()
    gs = torch.tensor([448 * 6 / 4.0], device="cuda")
    assert "kernel" in oink.explain("nvfp4_quantize", x, gs, True)
    _poison_allocator()
    q, sf = oink.nvfp4_quantize(x, gs, swizzled=True)
    eq, esf = R.nvfp4_quantize(x, gs, swizzled=True)
    assert q.shape == (15, 504) and sf.shape == (128, 64)
    assert torch.equal(q, eq) and torch.equal(_bytes(sf), _bytes(esf))
    padded = torch.randn(64, 2048 + 16, device="cuda", generator=g)[:, :2048]  # padded rows: no copy
    assert torch.equal(oink.nvfp4_quantize(padded, gs)[0], R.nvfp4_quantize(padded, gs)[0])


def _codes_within_one_step(q, eq, what):
    """>= 99.9% of codes exact; the rest one magnitude step away with the same sign."""
    codes = torch.stack([q & 0xF, q >> 4], -1).reshape(-1).int()
    want = torch.stack([eq & 0xF, eq >> 4], -1).reshape(-1).int()
    diff = codes != want
    frac = diff.float().mean().item()
    assert frac <= 1e-3, f"{what}: {frac:.2e} of codes differ"
    if diff.any():
        a, b = codes[diff], want[diff]
        same_sign = (a & 8) == (b & 8)
        step = ((a & 7) - (b & 7)).abs()
        zero_sign_flip = ((a & 7) == 0) & ((b & 7) == 0)  # -0 vs +0 at the rounding edge
        assert bool(((same_sign & (step == 1)) | zero_sign_flip).all()), f"{what}: a code is more than one step off"


def _fused_codes_close(q, sf, eq, esf, swizzled, what):
    """_codes_within_one_step over the blocks whose scales agree. An MXFP4 block whose power-of-two
    scale moved (an fp32 amax on the other side of a power of two; scales_exact bounds how many)
    has every code moved with it, so it is left out; an NVFP4 block's codes move by one step at most."""
    if sf.dtype == torch.float8_e8m0fnu:
        M, K = q.shape[0], q.shape[1] * 2 // 32
        a, b = ((unswizzle(s, M, K) if swizzled else s).view(torch.uint8) for s in (sf, esf))
        keep = (a == b).repeat_interleave(16, dim=1)  # 16 code bytes a block of 32
        q, eq = q[keep], eq[keep]
    _codes_within_one_step(q, eq, what)


def _fp64_then_fp32_quantize(v64, gs, swizzled):
    """NVFP4 (a global scale) or, with gs None, MXFP4 of v evaluated in fp64, rounded to fp32."""
    return _quantize_rows(v64.float(), gs, swizzled) if gs is not None else _mx_quantize_rows(v64.float(), swizzled)


FORMATS = ("nvfp4", "mxfp4")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", (64, 2048, 7168, 14336))
@pytest.mark.parametrize("M", (1, 128, 4097))
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_silu_mul_fp4quant(fmt, dtype, N, M, swizzled, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, 2 * N, device="cuda", generator=g) * 2).to(dtype)
    gs = torch.tensor([448 * 6 / 8.0], device="cuda") if fmt == "nvfp4" else None
    op, args = ("silu_mul_fp4quant", (x, gs, swizzled)) if gs is not None else ("silu_mul_mxfp4quant", (x, swizzled))
    assert "kernel" in oink.explain(op, *args)
    q, sf = getattr(oink, op)(*args)
    x64 = x.double()
    v64 = torch.nn.functional.silu(x64[:, :N]) * x64[:, N:]
    eq, esf = _fp64_then_fp32_quantize(v64, gs, swizzled)
    scales_exact(sf, esf)
    _fused_codes_close(q, sf, eq, esf, swizzled, "silu_mul codes")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_fp32", [False, True], ids=["w_same", "w_fp32"])
@pytest.mark.parametrize("N", (64, 2048, 7168, 14336))
@pytest.mark.parametrize("M", (1, 128, 4097))
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_add_rmsnorm_fp4quant(fmt, dtype, w_fp32, N, M, swizzled, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    res = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    w = torch.randn(N, device="cuda", generator=g).to(torch.float32 if w_fp32 else dtype)
    gs = torch.tensor([448 * 6 / 6.0], device="cuda") if fmt == "nvfp4" else None
    res_ref = res.clone()
    if gs is not None:
        op, extra = "add_rmsnorm_fp4quant", (gs,)
    else:
        op, extra = "add_rmsnorm_mxfp4quant", ()
    eq_y = getattr(R, op)(x, res_ref, w, *extra, 1e-6, swizzled, return_y=True)[2]
    assert "kernel" in oink.explain(op, x, res, w, *extra, 1e-6, swizzled, True)
    _poison_allocator()
    q, sf, y = getattr(oink, op)(x, res, w, *extra, 1e-6, swizzled, return_y=True)
    assert torch.equal(res, res_ref), "residual in place must match the reference exactly"
    r64 = res_ref.double()
    v64 = r64 * torch.rsqrt(r64.square().mean(-1, keepdim=True) + 1e-6) * w.double()
    eq, esf = _fp64_then_fp32_quantize(v64, gs, swizzled)
    scales_exact(sf, esf)
    _fused_codes_close(q, sf, eq, esf, swizzled, "add_rmsnorm codes")
    atol = {torch.float32: 1e-4}.get(dtype, 2e-2)
    torch.testing.assert_close(y.float(), eq_y.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("swizzled", [False, True])
def test_dequantize_round_trip_bound(swizzled, seed):
    """|v - dequant(quant(v))| <= amax/6 * (1 + 2^-3) per block: half the top E2M1 gap (1.0) in
    units of the block scale, plus the scale's own rounding (E4M3: 3 mantissa bits)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(4097, 7168, device="cuda", generator=g)
    gs = torch.tensor([448 * 6 / x.abs().max().item()], device="cuda")
    q, sf = oink.nvfp4_quantize(x, gs, swizzled)
    back = oink.nvfp4_dequantize(q, sf, gs, swizzled)
    amax = x.view(4097, -1, 16).abs().amax(-1, keepdim=True)
    err = (back.view(4097, -1, 16) - x.view(4097, -1, 16)).abs()
    assert bool((err <= amax / 6 * (1 + 2**-3) + 1e-6).all()), float((err / amax).max())
    if swizzled:
        assert sf.shape == (4224, 448) and torch.equal(unswizzle(sf, 4097, 448).view(torch.uint8),
                                                      R.nvfp4_quantize(x, gs)[1].view(torch.uint8))


def test_large_rows_and_graph_capture(seed):
    """A 2^31-byte-crossing input (> 2^30 elements) and capture in a CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    M, N = 65536 + 3, 16384 + 16  # ~1.07e9 elements of bf16
    x = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    gs = torch.tensor([448 * 6 / 5.0], device="cuda")
    q, sf = oink.nvfp4_quantize(x, gs)
    tail = slice(M - 5, M)
    eq, esf = R.nvfp4_quantize(x[tail], gs)
    assert torch.equal(q[tail], eq) and torch.equal(_bytes(sf[tail]), _bytes(esf))
    del x, q, sf
    small = torch.randn(256, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    oink.nvfp4_quantize(small, gs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qg, sfg = oink.nvfp4_quantize(small, gs)
    small.copy_(torch.randn(256, 4096, device="cuda", generator=g))
    graph.replay()
    eq, esf = R.nvfp4_quantize(small, gs)
    assert torch.equal(qg, eq) and torch.equal(_bytes(sfg), _bytes(esf))


@pytest.mark.parametrize("kind", DISTRIBUTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", (32, 1056, 7168, 14336))
@pytest.mark.parametrize("M", (1, 3, 4097))
@pytest.mark.parametrize("swizzled", [False, True], ids=["rowmajor", "swizzled"])
def test_mxfp4_quantize_bit_exact(kind, dtype, N, M, swizzled, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    v, _ = _values(kind, M, N, g)
    x = (v * 37.0 if kind == "ties" else v).to(dtype)  # ties: scale the block so 2^-shared is not 1
    _poison_allocator()
    q, sf = kernel("mxfp4_quantize", x=x, swizzled=swizzled)
    eq, esf = R.mxfp4_quantize(x, swizzled)
    assert torch.equal(_bytes(sf), _bytes(esf)), \
        f"scales differ at {(_bytes(sf) != _bytes(esf)).nonzero()[:5].tolist()}"
    assert torch.equal(q, eq), f"codes differ at {(q != eq).nonzero()[:5].tolist()}"


def test_mxfp4_public_api_routes_to_kernel(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, 9, 4096, device="cuda", generator=g).bfloat16()
    assert "kernel" in oink.explain("mxfp4_quantize", x, False)
    q, sf = oink.mxfp4_quantize(x)
    assert sf.dtype == torch.float8_e8m0fnu and q.shape == (18, 2048) and sf.shape == (18, 128)
    back = oink.mxfp4_dequantize(q, sf)
    amax = x.float().view(18, -1, 32).abs().amax(-1, keepdim=True)
    err = (back.view(18, -1, 32) - x.float().view(18, -1, 32)).abs()
    assert bool((err <= amax / 4 + 1e-30).all())  # half a top step (1 of the 4..6 gap) at scale <= amax/4
