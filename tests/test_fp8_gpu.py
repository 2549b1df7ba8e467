"""FP8 kernels on the GPU against the references (oink/reference/fp8.py), launched through their
prepared launches (``tests.gpu_helpers.kernel``: no checks, no route). The plain quantizer:
bit-exact codes and scales in every mode and layout, on random, heavy-tailed, all-zero-group,
saturating and NaN inputs. The fused ops (RMSNorm's rstd and silu's exp are fast approximations):
>= 99.9% of codes exact, the rest one step away; scales within the gate's tolerance, power-of-two
(ue8m0) scales exact but for at most 1e-4 of the groups, one power of two off."""
from __future__ import annotations

import pytest
import torch

from oink import reference as R
from tests.gpu_helpers import DTYPES, assert_fp8_within_a_step, cuda_arch, fp8_codes, fp8_steps, kernel

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

MODES = [dict(), dict(scale_ub=True), dict(scale=True), dict(group_size=128), dict(group_size=64),
         dict(group_size=128, column_major_scales=True), dict(group_size=128, ue8m0=True),
         dict(group_size=64, column_major_scales=True, ue8m0=True)]
MODE_IDS = ["token", "token-ub", "static", "g128", "g64", "g128-colmajor", "g128-ue8m0", "g64-colmajor-ue8m0"]
KINDS = ("normal", "heavy", "zero_groups", "saturate", "nan")


def _mode_args(mode, device="cuda"):
    a = dict(mode)
    if a.pop("scale", False):
        a["scale"] = torch.tensor([0.02], device=device)
    if a.pop("scale_ub", False):
        a["scale_ub"] = torch.tensor([1.5], device=device)
    return a


def _values(kind, M, N, g):
    v = torch.randn(M, N, device="cuda", generator=g)
    if kind == "heavy":
        v = v / torch.rand(M, N, device="cuda", generator=g).clamp_min(1e-3)
    elif kind == "zero_groups":
        v.view(M, -1, 64)[:, ::3] = 0
    elif kind == "saturate":
        v = v * 1e4
    elif kind == "nan":
        v.view(-1)[torch.randperm(M * N, device="cuda", generator=g)[: max(1, M * N // 50)]] = float("nan")
        v.view(-1)[:1] = -float("nan")
    return v


def _poison():
    """Memory the allocator hands out next holds 0xFF bytes: an unwritten code or scale shows."""
    junk = torch.full((1 << 26,), 0xFF, dtype=torch.uint8, device="cuda")
    del junk


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", [(1, 128), (3, 1024), (130, 7168), (4097, 2048), (17, 18432)])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_quantize_bit_exact(kind, dtype, M, N, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _values(kind, M, N, g).to(dtype)
    from oink.kernels.fp8_ops import CHECKS

    args = _mode_args(mode)
    assert CHECKS["fp8_quantize"](dict(x=x, group_size=args.get("group_size", 0)), cuda_arch()) is None
    _poison()
    q, s = kernel("fp8_quantize", x=x, **args)
    q_ref, s_ref = R.fp8_quantize(x, **args)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape and s.stride() == s_ref.stride()
    differ = (fp8_codes(q) != fp8_codes(q_ref)).sum().item()
    assert not differ, f"{differ} codes differ"
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [512, 7168, 18432])
@pytest.mark.parametrize("mode", [MODES[0], MODES[2], MODES[3], MODES[6]],
                         ids=["token", "static", "g128", "g128-ue8m0"])
def test_silu_mul_within_a_step(dtype, N, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(257, 2 * N, device="cuda", generator=g) * 2).to(dtype)
    args = _mode_args(mode)
    _poison()
    q, s = kernel("silu_mul_fp8quant", x=x, **args)
    q_ref, s_ref = R.silu_mul_fp8quant(x, **args)
    assert_fp8_within_a_step(q, s, q_ref, s_ref, args)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["rmsnorm", "add_rmsnorm"])
@pytest.mark.parametrize("N", [256, 4096, 7168, 17408, 40960, 131072])  # 17408, 40960: fp8_rule's clusters
@pytest.mark.parametrize("mode", [MODES[0], MODES[1], MODES[2], MODES[3], MODES[7]],
                         ids=["token", "token-ub", "static", "g128", "g64-colmajor-ue8m0"])
def test_fused_rmsnorm_within_a_step(dtype, residual, N, mode, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    M = 257 if N < 131072 else 9
    x = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    w = (torch.rand(N, device="cuda", generator=g) + 0.5).to(dtype)
    args = _mode_args(mode)
    _poison()
    if residual:
        r = torch.randn(M, N, device="cuda", generator=g).to(dtype)
        r_ref = r.clone()
        q, s, y = kernel("add_rmsnorm_fp8quant", x=x, residual=r, weight=w, eps=1e-6, return_y=True, **args)
        q_ref, s_ref, y_ref = R.add_rmsnorm_fp8quant(x, r_ref, w, 1e-6, return_y=True, **args)
        assert torch.equal(r, r_ref)  # the residual stream, updated in place, exactly
    else:
        q, s, y = kernel("rmsnorm_fp8quant", x=x, weight=w, eps=1e-6, return_y=True, **args)
        q_ref, s_ref, y_ref = R.rmsnorm_fp8quant(x, w, 1e-6, return_y=True, **args)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert_fp8_within_a_step(q, s, q_ref, s_ref, args)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["rmsnorm", "add_rmsnorm"])
@pytest.mark.parametrize("N", [256, 2944, 7168, 11008, 17408, 40960, 131072])
def test_per_token_scale_is_its_outputs_amax(dtype, residual, N, seed):
    """Per token the amax rides the norm's one reduction round (max |x * w| times rstd): each row's scale is
    exactly its own returned y's amax / 448 (floored), rows of zeros, a NaN and an inf included."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    M = 64 if N < 131072 else 9
    x = (torch.randn(M, N, device="cuda", generator=g) * torch.exp(torch.randn(M, 1, device="cuda", generator=g)))
    x[1] = 0
    x[2, N // 2] = float("nan")
    x[3, N // 3] = float("inf")
    x = x.to(dtype)
    w = (torch.randn(N, device="cuda", generator=g) * 2).to(dtype)
    _poison()
    if residual:
        r = torch.randn(M, N, device="cuda", generator=g).to(dtype)
        q, s, y = kernel("add_rmsnorm_fp8quant", x=x, residual=r, weight=w, eps=1e-6, return_y=True)
    else:
        q, s, y = kernel("rmsnorm_fp8quant", x=x, weight=w, eps=1e-6, return_y=True)
    yf = y.float()
    amax = torch.where(yf.isnan(), 0, yf.abs()).amax(-1)
    want = torch.clamp_min(R.fp8._per_e4m3_max(amax), R.fp8.MIN_TOKEN_SCALE)
    assert torch.equal(s.reshape(-1), want)

def test_odd_inputs():
    from oink.kernels.fp8_ops import CHECKS

    arch = cuda_arch()
    # a strided (sliced) input and a misaligned one give the reference's answer
    wide = torch.randn(64, 1024 + 8, device="cuda", dtype=torch.bfloat16)
    for t in (wide[:, :1024], wide.view(-1)[1:1 + 64 * 1024].view(64, 1024)):
        q, s = kernel("fp8_quantize", x=t, group_size=128)
        q_ref, s_ref = R.fp8_quantize(t, group_size=128)
        assert torch.equal(fp8_codes(q), fp8_codes(q_ref)) and torch.equal(s, s_ref)
    q, s = kernel("fp8_quantize", x=wide[:0, :1024], group_size=128)  # empty
    assert q.shape == (0, 1024) and s.shape == (0, 8)
    # in place needs an aligned residual: a misaligned one is declined (the reference takes it)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(64, 1024)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    assert "residual" in CHECKS["add_rmsnorm_fp8quant"](dict(x=x, residual=r, weight=w, group_size=0), arch)
    r = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    r_ref = r.clone()
    q, s = kernel("add_rmsnorm_fp8quant", x=x, residual=r, weight=w)
    q_ref, s_ref = R.add_rmsnorm_fp8quant(x, r_ref, w)
    assert torch.equal(r, r_ref) and (fp8_steps(q, q_ref) <= 1).all()
