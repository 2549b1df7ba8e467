"""The FP8 references (the spec, oink/reference/fp8.py) against independent float64 arithmetic:
nearest-code search over all 256 e4m3 values, vLLM's scale rules, layouts and edge cases."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oink
from oink import reference as R
from oink.reference.sums import row_sum

_ALL = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
VALUES = torch.unique(_ALL[torch.isfinite(_ALL)])  # the 253 distinct finite values (one zero)


def nearest_codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 -> (value of the nearest finite e4m3 after saturating at 448, whether t sits within
    1e-9 relative of a midpoint, where the tie rule decides)."""
    t = t.clamp(-448, 448).reshape(-1, 1)
    d = (t - VALUES.reshape(1, -1)).abs()
    best, second = d.topk(2, dim=1, largest=False).values.unbind(1)
    near_tie = (second - best) <= 1e-9 * t.abs().squeeze(1).clamp_min(1e-30)
    return VALUES[d.argmin(1)], near_tie


def check_codes(q: torch.Tensor, expect64: torch.Tensor):
    got = q.reshape(-1).double()
    want, tie = nearest_codes(expect64.reshape(-1))
    assert torch.equal(got[~tie], want[~tie])
    assert tie.float().mean() < 0.01


def heavy_tailed(M, N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, N, generator=g) * torch.exp(2 * torch.randn(M, 1, generator=g))


@pytest.mark.parametrize("seed", range(3))
def test_per_token(seed):
    x = heavy_tailed(16, 256, seed)
    q, s = oink.fp8_quantize(x)
    x64 = x.double()
    s64 = (x64.abs().amax(1, keepdim=True) / 448).clamp_min(1 / (448 * 512))
    assert s.shape == (16, 1) and torch.allclose(s.double(), s64, rtol=1e-6, atol=0)
    check_codes(q, (x / s).double())  # the quotient is fp32 by the spec; the rounding to codes is checked
    ub = torch.tensor([0.5])
    _, s_ub = oink.fp8_quantize(x, scale_ub=ub)
    assert torch.allclose(s_ub.double(), (x64.abs().amax(1, keepdim=True).clamp_max(0.5) / 448).clamp_min(1 / 229376))


@pytest.mark.parametrize("G", [64, 128])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_group(G, ue8m0):
    x = heavy_tailed(8, 512, G)
    x[2, :G] = 0  # an all-zero group
    q, s = oink.fp8_quantize(x, group_size=G, ue8m0=ue8m0)
    raw = (x.double().reshape(8, -1, G).abs().amax(-1).clamp_min(1e-10) / 448)
    if ue8m0:
        m, _ = torch.frexp(s.double())
        assert (m == 0.5).all() and (s.double() >= raw * (1 - 1e-7)).all() and (s.double() < 2 * raw).all()
    else:
        assert torch.allclose(s.double(), raw, rtol=1e-6, atol=0)
    floor = torch.tensor(1e-10, dtype=torch.float32) / 448  # the all-zero group's scale
    assert s[2, 0] == (2.0**-42 if ue8m0 else floor)
    assert (q[2, :G].float() == 0).all()
    check_codes(q, (x.reshape(8, -1, G) / s.unsqueeze(-1)).reshape(8, -1).double())
    qc, sc = oink.fp8_quantize(x, group_size=G, ue8m0=ue8m0, column_major_scales=True)
    assert sc.stride() == (1, 8) and torch.equal(sc, s) and torch.equal(qc.view(torch.uint8), q.view(torch.uint8))


def test_static_nan_and_saturation():
    x = torch.tensor([[1.0, -1.0, 1e6, -1e6, float("nan"), 0.0, 2.5e-3, -0.0]])
    q, s = oink.fp8_quantize(x, torch.tensor([0.01]))
    assert s.shape == (1,) and s.item() == pytest.approx(0.01)
    v = q.float()[0]
    assert v[2] == 448 and v[3] == -448 and v[4] == 448  # NaN saturates to +448 (vLLM's fmin/fmax clamp)
    assert v[0] == 96 and v[1] == -96  # 1 * float32(1 / 0.01) = 100: a tie between 96 and 104, to even
    check_codes(q[:, [5, 6]], (x[:, [5, 6]] * (1 / torch.tensor(0.01))).double())


def test_fused_references_are_the_unfused_pair():
    x, r, w = torch.randn(8, 256).bfloat16(), torch.randn(8, 256).bfloat16(), torch.randn(256).bfloat16()
    r2 = r.clone()
    q, s, y = oink.add_rmsnorm_fp8quant(x, r2, w, group_size=128, return_y=True)
    assert torch.equal(r2, (x.float() + r.float()).bfloat16())
    y_ref = R.rmsnorm_forward(r2, w)[0]
    assert torch.equal(y, y_ref)  # the quantized values are the rounded RMSNorm output
    q2, s2 = oink.fp8_quantize(y, group_size=128)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    g = torch.randn(8, 512)
    qs, ss = oink.silu_mul_fp8quant(g, group_size=64)
    q3, s3 = R.fp8.quantize_rows(torch.nn.functional.silu(g[:, :256]) * g[:, 256:], None, 64)
    assert torch.equal(qs.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(ss, s3)


def test_empty_rows():
    q, s = oink.fp8_quantize(torch.randn(0, 128), group_size=128)
    assert q.shape == (0, 128) and s.shape == (0, 1)


@settings(max_examples=80, deadline=None)
@given(N=st.integers(1, 3000), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16), special=st.sampled_from(["none", "nan_x", "inf_x", "inf_w", "zero", "tiny", "huge"]))
def test_per_token_amax_is_the_largest_product_times_rstd(N, dtype, seed, special):
    """The per-token fused kernels' amax rides the norm's one reduction round as max |x * w|, times rstd after it:
    fp32 rounding of p * rstd, then to x's dtype, is monotone in |p|, so a row's max |v| of v = (x * w) * rstd
    (NaN skipped) is exactly that product rounded (a NaN product, 0), for every dtype and the rows that make
    rstd NaN, 0 or huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, N, generator=g) * torch.exp(3 * torch.randn(4, 1, generator=g))
    w = torch.randn(N, generator=g) * 2
    if special == "nan_x":
        x[1, N // 2] = float("nan")
    elif special == "inf_x":
        x[2, N // 3] = float("inf")
    elif special == "inf_w":
        w[N // 2] = -float("inf")
    elif special == "zero":
        x[0] = 0
    elif special == "tiny":
        x[3] *= 1e-20
    elif special == "huge":
        x[3] *= 1e30
    x, w = x.to(dtype), w.to(dtype)
    p = x.float() * w.float()
    rstd = torch.rsqrt(row_sum(x.float().square()) / N + 1e-6)  # the reference's fixed tree
    v = (p * rstd).to(dtype).float()
    torch.testing.assert_close(v, R.fp8._normed(x, w, 1e-6, dtype, per_token=True), rtol=0, atol=0, equal_nan=True)
    want = torch.where(v.isnan(), 0, v.abs()).amax(-1)
    a = torch.where(p.isnan(), 0, p.abs()).amax(-1, keepdim=True)
    got = (a * rstd).nan_to_num(nan=0.0, posinf=float("inf")).to(dtype).float().squeeze(-1)  # fmax(0, NaN) = 0
    assert torch.equal(got, want)
