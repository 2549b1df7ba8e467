"""The NVFP4 reference agrees bit for bit with an independent scalar implementation of the
semantics (tables of every E4M3 and E2M1 value, nearest-with-ties-to-even by search, numpy
float32 arithmetic), on random data and on the edge cases the spec names."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oink import reference as R
from oink.reference.nvfp4 import round_up, swizzled_offset

F32 = np.float32


def _e4m3_table():
    vals = []
    for code in range(0x7F):  # positive codes; 0x7F is NaN
        e, m = code >> 3, code & 7
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append((v, code))
    return vals


E4M3 = _e4m3_table()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(value: float, table):
    """(value, code) nearest to value; on a tie the even code."""
    best = min(table, key=lambda vc: (abs(vc[0] - value), vc[1] & 1))
    return best


def ind_e4m3(v: np.float32) -> float:
    v = float(v)
    if v >= 448.0:
        return 448.0
    return nearest_even(v, E4M3)[0]


def ind_e2m1_code(v: np.float32, negative: bool) -> int:
    a = abs(float(v))
    mag = 7 if (a > 6.0 or math.isinf(a)) else (0 if math.isnan(a) else nearest_even(a, list(zip(E2M1, range(8))))[1])
    return mag | (8 if negative else 0)


def independent_quantize(x: torch.Tensor, gs: float):
    xs = x.reshape(-1, x.shape[-1]).float().numpy()
    M, N = xs.shape
    q = np.zeros((M, N // 2), np.uint8)
    sf = np.zeros((M, N // 16), np.float32)
    g = F32(gs)
    for m in range(M):
        for k in range(N // 16):
            blk = xs[m, 16 * k:16 * k + 16]
            finite_abs = [abs(float(v)) for v in blk if not math.isnan(v)]
            amax = F32(max(finite_abs) if finite_abs else 0.0)
            s_scale = F32(ind_e4m3(g * (amax * F32(1.0 / 6.0))))
            sf[m, k] = s_scale
            codes = []
            for v in blk:
                if s_scale == 0:
                    codes.append(0)
                else:
                    s = F32(g / s_scale)
                    codes.append(ind_e2m1_code(F32(F32(v) * s), bool(np.signbit(v))))
            for j in range(8):
                q[m, 8 * k + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return torch.from_numpy(q), torch.from_numpy(sf)


def check(x, gs, swizzled):
    q, sf = R.nvfp4_quantize(x, torch.tensor([gs]), swizzled=swizzled)
    iq, isf = independent_quantize(x, gs)
    assert torch.equal(q, iq), f"codes differ at {(q != iq).nonzero()[:5].tolist()}"
    M, K = isf.shape
    if swizzled:
        assert sf.shape == (round_up(M, 128), round_up(K, 4))
        flat = sf.reshape(-1).view(torch.uint8)
        m = torch.arange(M).unsqueeze(1)
        k = torch.arange(K).unsqueeze(0)
        got = flat[swizzled_offset(m, k, sf.shape[1])].view(torch.float8_e4m3fn).float()
        assert torch.equal(got, isf)
        mask = torch.ones(flat.numel(), dtype=torch.bool)
        mask[swizzled_offset(m, k, sf.shape[1]).reshape(-1)] = False
        assert (flat[mask] == 0).all(), "swizzle padding must be zero"
    else:
        assert sf.dtype == torch.float8_e4m3fn and sf.shape == (M, K)
        assert torch.equal(sf.float(), isf)


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("swizzled", [False, True])
@pytest.mark.parametrize("dist", ["normal", "uniform", "heavy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random(gen, swizzled, dist, dtype):
    shape = (37, 64)
    if dist == "normal":
        x = torch.randn(shape, generator=gen) * 3
    elif dist == "uniform":
        x = torch.rand(shape, generator=gen) * 20 - 10
    else:  # Cauchy: heavy tails, wide amax spread between blocks
        x = torch.tan(math.pi * (torch.rand(shape, generator=gen) - 0.5))
    check(x.to(dtype), 448 * 6 / float(x.abs().max()), swizzled)


@pytest.mark.parametrize("swizzled", [False, True])
def test_ties_saturation_zero_and_subnormal_scales(gen, swizzled):
    ties = torch.tensor([6, -3, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, .1, -.1, 4, 1.5, -6, .5])
    rows = [
        ties,                                        # gs=1: sf = 1, every E2M1 tie exercised
        torch.zeros(16),                             # all-zero block: sf 0, codes 0
        -torch.zeros(16),                            # negative zeros in a zero block: still 0x0
        torch.randn(16, generator=gen) * 1e6,        # sf saturates at 448
        torch.randn(16, generator=gen) * 1e-3,       # E4M3-subnormal scales
        torch.randn(16, generator=gen) * 1e-9,       # scale rounds to 0: codes 0
        torch.full((16,), float("inf")) * torch.sign(torch.randn(16, generator=gen)),
    ]
    check(torch.stack(rows[:6]).reshape(3, 32), 1.0, swizzled)
    check(torch.stack(rows[:6]).reshape(3, 32), 3.0, swizzled)
    check(torch.cat([rows[6], rows[0]]).reshape(1, 32), 1.0, swizzled)


def test_hand_case_codes():
    ties = torch.tensor([[6, -3, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -0.0, .1, -.1, 4, 1.5, -6, .5]])
    q, sf = R.nvfp4_quantize(ties, torch.tensor([1.0]))
    assert sf.float().item() == 1.0
    assert q.tolist() == [[0xD7, 0x20, 0x42, 0x64, 0x86, 0x80, 0x36, 0x1F]]


def test_nan_policy():
    """NaN is ignored by amax and encodes as magnitude 0 with its sign bit."""
    x = torch.tensor([[float("nan"), 6.0] + [1.0] * 14])
    q, sf = R.nvfp4_quantize(x, torch.tensor([1.0]))
    assert sf.float().item() == 1.0
    assert q[0, 0].item() & 0xF in (0x0, 0x8) and q[0, 0].item() >> 4 == 7
    check(x, 1.0, False)


def test_dequantize_round_trip(gen):
    x = torch.randn(130, 48, generator=gen) * 5
    gs = torch.tensor([448 * 6 / float(x.abs().max())])
    for swizzled in (False, True):
        q, sf = R.nvfp4_quantize(x, gs, swizzled)
        d = R.nvfp4_dequantize(q, sf, gs, swizzled)
        amax = x.reshape(130, 3, 16).abs().amax(-1, keepdim=True)
        err = (d.reshape(130, 3, 16) - x.reshape(130, 3, 16)).abs()
        # half an E2M1 step is at most 1/6 of the block's range; E4M3 rounding of the scale adds <= 1/16
        assert (err <= amax * (1 / 6 + 1 / 16) + 1e-6).all()


@pytest.mark.parametrize("swizzled", [False, True])
def test_add_rmsnorm_fp4quant_matches_composition(gen, swizzled):
    x, res = torch.randn(20, 64, generator=gen).bfloat16(), torch.randn(20, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    gs = torch.tensor([100.0])
    r_expect = (x.float() + res.float()).bfloat16()
    res2 = res.clone()
    q, sf, y = R.add_rmsnorm_fp4quant(x, res2, w, gs, 1e-6, swizzled, return_y=True)
    assert torch.equal(res2, r_expect)
    rf = r_expect.double()
    v = (rf / torch.sqrt((rf * rf).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
    iq, isf = independent_quantize(v, 100.0)
    sf_rm = R.nvfp4.unswizzle(sf, 20, 4) if swizzled else sf
    assert torch.equal(sf_rm.float(), isf)
    codes_equal = ((q & 0xF) == (iq & 0xF)).float().mean() * 0.5 + ((q >> 4) == (iq >> 4)).float().mean() * 0.5
    assert codes_equal >= 0.999
    torch.testing.assert_close(y.double(), v.double(), atol=3e-2, rtol=1.6e-2)


def test_silu_mul_fp4quant(gen):
    x = torch.randn(9, 2 * 48, generator=gen)
    gs = torch.tensor([50.0])
    q, sf = R.silu_mul_fp4quant(x, gs)
    v = (torch.nn.functional.silu(x[:, :48].double()) * x[:, 48:].double()).float()
    iq, isf = independent_quantize(v, 50.0)
    assert torch.equal(sf.float(), isf)
    assert (q == iq).float().mean() >= 0.99


def independent_mx_quantize(x: torch.Tensor):
    """MXFP4 by the OCP rule, scalar: shared = clamp(floor(log2(amax)) - 2, -127, 127)."""
    xs = x.reshape(-1, x.shape[-1]).float().numpy()
    M, N = xs.shape
    q = np.zeros((M, N // 2), np.uint8)
    sf = np.zeros((M, N // 32), np.uint8)
    for m in range(M):
        for k in range(N // 32):
            blk = xs[m, 32 * k:32 * k + 32]
            finite_abs = [abs(float(v)) for v in blk if not math.isnan(v)]
            amax = max(finite_abs) if finite_abs else 0.0
            if amax == 0:
                e = -127
            elif math.isinf(amax):
                e = 128
            else:
                e = max(math.frexp(amax)[1] - 1, -127)  # floor(log2(amax)); subnormals read as -127
            shared = min(max(e - 2, -127), 127)
            sf[m, k] = shared + 127
            codes = [0 if amax == 0 else ind_e2m1_code(F32(F32(v) * F32(2.0 ** -shared)), bool(np.signbit(v)))
                     for v in blk]
            for j in range(16):
                q[m, 16 * k + j] = codes[2 * j] | (codes[2 * j + 1] << 4)
    return torch.from_numpy(q), torch.from_numpy(sf)


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e30, 1e-40])
def test_mxfp4_matches_independent_implementation(gen, scale):
    x = torch.randn(3, 96, generator=gen) * scale
    x[0, :32] = 0.0  # an all-zero block: scale byte 0, codes 0
    x[1, 5] = float("nan")  # amax skips NaN
    x[2, 40] = -0.0
    q, sf = R.mxfp4_quantize(x)
    eq, esf = independent_mx_quantize(x)
    assert torch.equal(sf.view(torch.uint8), esf)
    assert torch.equal(q, eq)
    qs, sfs = R.mxfp4_quantize(x, swizzled=True)
    assert sfs.shape == (128, 4) and torch.equal(R.nvfp4.unswizzle(sfs, 3, 3).view(torch.uint8), esf)


def test_mxfp4_scale_rule_by_hand():
    blk = torch.zeros(1, 32)
    blk[0, 0] = 6.0  # floor(log2 6) = 2 -> shared 0 -> byte 127, 6 is exactly representable
    blk[0, 1] = -7.9  # 7.9 saturates to 6 (code 0xF)
    blk[0, 2] = 0.75  # a tie: rounds to the even 1.0 (code 2)
    q, sf = R.mxfp4_quantize(blk)
    assert int(sf.view(torch.uint8)) == 127
    assert int(q[0, 0]) == 0x7 | (0xF << 4) and int(q[0, 1]) & 0xF == 2
    back = R.mxfp4_dequantize(q, sf)
    assert back[0, :3].tolist() == [6.0, -6.0, 1.0]


@pytest.mark.parametrize("swizzled", [False, True])
def test_add_rmsnorm_mxfp4quant_matches_composition(gen, swizzled):
    x, res = torch.randn(20, 96, generator=gen).bfloat16(), torch.randn(20, 96, generator=gen).bfloat16()
    w = torch.randn(96, generator=gen).bfloat16()
    res2 = res.clone()
    q, sf, y = R.add_rmsnorm_mxfp4quant(x, res2, w, 1e-6, swizzled, return_y=True)
    assert torch.equal(res2, (x.float() + res.float()).bfloat16())
    rf = res2.double()
    v = (rf / torch.sqrt((rf * rf).mean(-1, keepdim=True) + 1e-6) * w.double()).float()
    iq, isf = independent_mx_quantize(v)
    sf_rm = R.nvfp4.unswizzle(sf, 20, 3) if swizzled else sf
    assert sf.dtype == torch.float8_e8m0fnu and torch.equal(sf_rm.view(torch.uint8), isf)
    assert (q == iq).float().mean() >= 0.99
    torch.testing.assert_close(y.double(), v.double(), atol=3e-2, rtol=1.6e-2)


def test_silu_mul_mxfp4quant(gen):
    x = torch.randn(9, 2 * 64, generator=gen)
    q, sf = R.silu_mul_mxfp4quant(x)
    v = (torch.nn.functional.silu(x[:, :64].double()) * x[:, 64:].double()).float()
    iq, isf = independent_mx_quantize(v)
    assert torch.equal(sf.view(torch.uint8), isf)
    assert (q == iq).float().mean() >= 0.99
    with pytest.raises(ValueError, match="multiple of 32"):
        R.silu_mul_mxfp4quant(torch.randn(2, 2 * 48))


def test_e2m1_rounding_by_one_add():
    """The SM90 kernels' E2M1 rule (``oink.kernels.nvfp4.e2m1_grid``/``e2m1x8``), written out in
    fp32 torch ops: clamp |y| to [0, 6] (NaN -> 0), add and subtract m = 2^(22 + max(exponent, 0)),
    scale by 2^-6, attach y's sign; the E4M3 bits of that hold the code. It must agree with the
    reference's threshold count on every fp32 with exponent -4..3 (the whole grid's range and its
    ties) and on the specials. The GPU tests check the kernels themselves bit-exact."""
    mant = torch.arange(0, 1 << 23, 7, dtype=torch.int64)
    bits = torch.cat([((e + 127) << 23) | mant for e in range(-4, 4)])
    bits = torch.cat([bits, torch.tensor([0, 1, 0x7F800000, 0x7FC00000, 0x7F7FFFFF, 0x00800000])])
    bits = torch.cat([bits, bits | (1 << 31)]).to(torch.int64)
    y = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    a = torch.where(torch.isnan(y), torch.zeros_like(y), y.abs()).clamp(max=6.0)
    e = ((a.view(torch.int32) & 0x7F800000) + 0x0B000000).clamp(min=0x4A800000)
    m = e.view(torch.float32)
    r = ((a + m) - m) * 2.0 ** -6
    r = (r.view(torch.int32) | (y.view(torch.int32) & torch.tensor(-(1 << 31), dtype=torch.int32))).view(torch.float32)
    e4 = r.to(torch.float8_e4m3fn)
    assert torch.equal(e4.float(), r), "the grid value must be exact in E4M3"
    b = e4.view(torch.uint8).int()
    codes = ((b >> 2) & 7) | ((b >> 4) & 8)
    assert torch.equal(codes.to(torch.uint8), R.nvfp4.e2m1_codes(y))
