"""The fused QK RMSNorm + rotary embedding (``oink.qk_norm_rope``, vLLM's ``torch.ops.oink.fused_qk_norm_rope``) on
CPU: the reference against an independent float64 formula (complex rotation), in place against out of place, v
untouched, vLLM's kernel test ported (its unfused reference and cases, its tolerances), every bad input named,
opcheck, torch.compile, batch invariance by the plugin's check, and the qk-norm-rope suite through pytester."""
from __future__ import annotations

import itertools

import pytest
import torch

import oink
import oink.ops  # noqa: F401  (registers torch.ops.oink.*)
from oink import reference as R
from oink.reference.rope import MODELS, heads_of, rope_cache
from tests.helpers import _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

OPS = torch.ops.oink
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}


# ---------------------------------------------------------------- an independent float64 formula
def exact(qkv, Hq, Hk, D, eps, qw, kw, cache, is_neox, pos, offset=0.0):
    """float64: rms over the head, the pairs as complex numbers times exp(i theta) from the cache's cos and sin."""
    T = qkv.shape[0]
    R_ = cache.shape[1]
    h = R_ // 2
    cs = cache.double()[pos.long()]
    rot = torch.complex(cs[:, :h], cs[:, h:])[:, None, :]  # cos + i sin, [T, 1, R/2]
    outs = []
    for start, H, w in ((0, Hq, qw), (Hq, Hk, kw)):
        x = qkv[:, start * D:(start + H) * D].double().reshape(T, H, D)
        n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (w.double() + offset)
        if is_neox:
            a, b = n[..., :h], n[..., h:R_]
        else:
            a, b = n[..., 0:R_:2], n[..., 1:R_:2]
        z = torch.complex(a, b) * rot
        out = n.clone()
        if is_neox:
            out[..., :h], out[..., h:R_] = z.real, z.imag
        else:
            out[..., 0:R_:2], out[..., 1:R_:2] = z.real, z.imag
        outs.append(out)
    return outs


FP32_CANCEL = 2e-6  # fp32's own error where a rotation cancels (a cos - b sin of O(1) terms near 0)


def assert_within_one_ulp(got, want, dtype):
    """|got - want| <= one ulp of want at ``dtype`` (a correctly rounded result is within half of one), plus the
    fp32 arithmetic's absolute error where the rotation cancels to a value far below its terms (vLLM's kernel
    computes in fp32 too)."""
    w = want.abs().clamp_min(torch.finfo(dtype).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(w)) - MANTISSA[dtype])
    err = (got.double() - want).abs()
    bad = err > ulp + FP32_CANCEL
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} beyond 1 ulp; worst {float((err / ulp).max()):.2f} ulp"


def make(T=7, Hq=4, Hk=2, Hv=None, D=64, dtype=torch.bfloat16, rotary_dim=None, wdtype=None, cdtype=torch.float32,
         max_pos=50, pos_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hv = Hk if Hv is None else Hv
    qkv = (torch.randn(T, (Hq + Hk + Hv) * D, generator=g) * 2).to(dtype)
    wdtype = wdtype or dtype
    qw = (1 + 0.2 * torch.randn(D, generator=g)).to(wdtype)
    kw = (1 + 0.2 * torch.randn(D, generator=g)).to(wdtype)
    cache = rope_cache(max_pos, rotary_dim or D, 10000.0, cdtype)
    pos = torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype)
    return dict(qkv=qkv, num_heads_q=Hq, num_heads_k=Hk, num_heads_v=Hv, head_dim=D, eps=1e-6, q_weight=qw,
                k_weight=kw, cos_sin_cache=cache, is_neox=True, position_ids=pos)


def vllm_args(a):
    return tuple(a[k] for k in ("qkv", "num_heads_q", "num_heads_k", "num_heads_v", "head_dim", "eps", "q_weight",
                                "k_weight", "cos_sin_cache", "is_neox", "position_ids"))


CASES = [  # (D, Hq, Hk, dtype, weight dtype, cache dtype, rotary fraction, is_neox, offset, positions' dtype)
    (D, Hq, Hk, dt, wd, cd, rf, neox, off, pd)
    for (D, (Hq, Hk)), dt, (wd, cd), rf, neox, off, pd in itertools.product(
        ((64, (4, 4)), (128, (8, 2)), (256, (16, 1))), (torch.bfloat16, torch.float16),
        (("x", torch.float32), (torch.float32, "x")), (1.0, 0.5), (True, False), (0.0, 1.0),
        (torch.int64, torch.int32))
    if not (off and pd == torch.int32)  # the offset and the positions' dtype are independent: half the product
]


@pytest.mark.parametrize("D,Hq,Hk,dtype,wdtype,cdtype,frac,is_neox,offset,pos_dtype", CASES)
def test_reference_within_one_ulp_of_float64(D, Hq, Hk, dtype, wdtype, cdtype, frac, is_neox, offset, pos_dtype):
    a = make(T=5, Hq=Hq, Hk=Hk, D=D, dtype=dtype, rotary_dim=int(D * frac), wdtype=dtype if wdtype == "x" else wdtype,
             cdtype=dtype if cdtype == "x" else cdtype, pos_dtype=pos_dtype)
    a["is_neox"] = is_neox
    q, k = oink.qk_norm_rope(**a, weight_offset=offset)
    assert q.shape == (5, Hq, D) and k.shape == (5, Hk, D) and q.dtype == k.dtype == dtype
    eq, ek = exact(a["qkv"], Hq, Hk, D, a["eps"], a["q_weight"], a["k_weight"], a["cos_sin_cache"], is_neox,
                   a["position_ids"], offset)
    assert_within_one_ulp(q, eq, dtype)
    assert_within_one_ulp(k, ek, dtype)


@pytest.mark.parametrize("rotary_dim", [2, 8, 24, 64, 96])
@pytest.mark.parametrize("is_neox", [True, False])
def test_partial_rotary_rotates_only_the_first_columns(rotary_dim, is_neox):
    a = make(D=128, rotary_dim=rotary_dim)
    a["is_neox"] = is_neox
    q, k = oink.qk_norm_rope(**a)
    plain = oink.qk_norm_rope(**dict(a, cos_sin_cache=torch.cat(
        (torch.ones(50, rotary_dim // 2), torch.zeros(50, rotary_dim // 2)), -1)))  # angle 0: the norm alone
    assert torch.equal(q[..., rotary_dim:], plain[0][..., rotary_dim:])
    assert torch.equal(k[..., rotary_dim:], plain[1][..., rotary_dim:])
    eq, ek = exact(a["qkv"], 4, 2, 128, 1e-6, a["q_weight"], a["k_weight"], a["cos_sin_cache"], is_neox,
                   a["position_ids"])
    assert_within_one_ulp(q, eq, torch.bfloat16)
    assert_within_one_ulp(k, ek, torch.bfloat16)


def test_arithmetic_order_is_vllms_kernel():
    """fp32, n = x * (r * w) (r * w first), the rotation, one rounding: the reference bit for bit."""
    a = make(T=3, Hq=2, Hk=1, D=64, rotary_dim=32)
    q, _ = oink.qk_norm_rope(**a)
    x = a["qkv"][:, :128].float().reshape(3, 2, 64)
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) / 64 + 1e-6)
    n = x * (r * a["q_weight"].float())
    cs = a["cos_sin_cache"][a["position_ids"]].float()[:, None]
    c, s = cs[..., :16], cs[..., 16:]
    x1, x2 = n[..., :16], n[..., 16:32]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, n[..., 32:]), -1).bfloat16()
    # the reference's pairwise sum may differ from torch's sum in the last bit of r: within one bf16 step
    assert (q.float() - want.float()).abs().le(want.float().abs() * 2**-7).all()
    assert (q == want).float().mean() > 0.99


@pytest.mark.parametrize("Hq,Hk", [(1, 1), (4, 1), (16, 1), (32, 8), (6, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_place_matches_out_of_place_and_v_is_untouched(Hq, Hk, dtype):
    a = make(T=6, Hq=Hq, Hk=Hk, Hv=Hk + 1 if Hq == 6 else Hk, D=128, dtype=dtype, rotary_dim=64)
    a["is_neox"] = Hq % 2 == 0
    q, k = oink.qk_norm_rope(**a)
    before = a["qkv"].clone()
    OPS.fused_qk_norm_rope(*vllm_args(a))
    qkv, D = a["qkv"], 128
    assert torch.equal(qkv[:, :Hq * D].reshape(6, Hq, D), q)
    assert torch.equal(qkv[:, Hq * D:(Hq + Hk) * D].reshape(6, Hk, D), k)
    assert torch.equal(qkv[:, (Hq + Hk) * D:], before[:, (Hq + Hk) * D:])  # v bit-identical
    again = before.clone()
    R.fused_qk_norm_rope(again, *vllm_args(a)[1:])
    assert torch.equal(again, qkv)


def test_strided_rows_and_the_out_of_place_input_unchanged():
    a = make(T=4, D=64)
    base = torch.zeros(4, a["qkv"].shape[1] + 64, dtype=a["qkv"].dtype)
    base[:, :a["qkv"].shape[1]] = a["qkv"]
    view = base[:, :a["qkv"].shape[1]]
    assert not view.is_contiguous()
    keep = base.clone()
    q, k = oink.qk_norm_rope(**dict(a, qkv=view))
    assert torch.equal(base, keep)
    want = oink.qk_norm_rope(**a)
    assert torch.equal(q, want[0]) and torch.equal(k, want[1])
    OPS.fused_qk_norm_rope(view, *vllm_args(a)[1:])
    assert torch.equal(view[:, :256].reshape(4, 4, 64), q)
    assert torch.equal(base[:, -64:], keep[:, -64:])  # the pad columns beyond the view


def test_empty_tokens():
    a = make(T=0)
    q, k = oink.qk_norm_rope(**a)
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64)
    OPS.fused_qk_norm_rope(*vllm_args(a))


def test_gemma_offset_is_one_plus_w():
    a = make(T=3, D=64)
    w0 = a["q_weight"]
    q1 = oink.qk_norm_rope(**a, weight_offset=1.0)[0]
    q2 = oink.qk_norm_rope(**dict(a, q_weight=w0.float() + 1.0), weight_offset=0.0)[0]
    assert torch.equal(q1, q2)


# ---------------------------------------------------------------- vLLM's kernel test, ported
def rms_norm_forward_native(x, weight, eps):
    """vLLM's RMSNorm.forward_native (no residual): fp32, (x * rsqrt(var + eps)).to(T) * weight."""
    orig = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(orig) * weight


def apply_rotary_emb_torch(x, cos, sin, is_neox_style):
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)


def rope_forward_native(positions, query, key, head_size, rotary_dim, cache, is_neox):
    """vLLM's RotaryEmbedding.forward_native."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    out = []
    for t in (query, key):
        shape = t.shape
        t = t.view(num_tokens, -1, head_size)
        rot = apply_rotary_emb_torch(t[..., :rotary_dim], cos, sin, is_neox)
        out.append(torch.cat((rot, t[..., rotary_dim:]), dim=-1).reshape(shape))
    return out


def apply_qk_norm_rope(qkv, positions, qw, kw, eps, cache, rotary_dim, is_neox, Hq, Hkv, D):
    """test_fused_qk_norm_rope.py's _apply_qk_norm_rope: split, per-head norm, rope, cat."""
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = rms_norm_forward_native(q.view(*q.shape[:-1], Hq, D), qw, eps).view(q.shape)
    k = rms_norm_forward_native(k.view(*k.shape[:-1], Hkv, D), kw, eps).view(k.shape)
    q, k = rope_forward_native(positions, q, k, D, rotary_dim, cache, is_neox)
    return torch.cat([q, k, v], dim=-1)


@pytest.mark.parametrize("rotary_ratio", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("seed", [13])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_fused_qk_norm_rope_matches_vllms_reference(dtype, is_neox, eps, seed, rotary_ratio):
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim, num_tokens = 16, 4, 128, 4
    total_dim = (num_heads + 2 * num_kv_heads) * head_dim
    qkv_base = torch.randn(num_tokens, total_dim, dtype=dtype)
    qkv_fused = qkv_base.clone()
    positions = torch.arange(num_tokens, dtype=torch.long)
    q_weight = torch.empty(head_dim, dtype=dtype).normal_(mean=1.0, std=0.1)
    k_weight = torch.empty(head_dim, dtype=dtype).normal_(mean=1.0, std=0.1)
    rotary_dim = int(head_dim * rotary_ratio)
    cache = rope_cache(4096, rotary_dim, 10000.0, dtype)  # RotaryEmbedding(..., dtype=dtype).cos_sin_cache
    ref = apply_qk_norm_rope(qkv_base, positions, q_weight, k_weight, eps, cache, rotary_dim, is_neox, num_heads,
                             num_kv_heads, head_dim)
    args = (qkv_fused, num_heads, num_kv_heads, num_kv_heads, head_dim, eps, q_weight, k_weight, cache, is_neox,
            positions.view(-1))
    torch.library.opcheck(OPS.fused_qk_norm_rope.default, (qkv_fused.clone(), *args[1:]))
    OPS.fused_qk_norm_rope(*args)
    atol = rtol = 2e-3 if dtype == torch.float16 else 1e-2
    # vLLM's reference rounds to the dtype three times (the norm, then each product of the rotation): on this CPU's
    # random draw a few elements where the rotation cancels fall outside its tolerance. There the float64 formula
    # decides: Oink's value must be the closer one (and within one ulp, as everywhere)
    far = ~torch.isclose(qkv_fused.double(), ref.double(), atol=atol, rtol=rtol)
    assert far.sum() <= 4, int(far.sum())
    Hq, Hk, D = num_heads, num_kv_heads, head_dim
    eq, ek = exact(qkv_base, Hq, Hk, D, eps, q_weight, k_weight, cache, is_neox, positions)
    exact_qkv = torch.cat([eq.reshape(num_tokens, -1), ek.reshape(num_tokens, -1),
                           qkv_base[:, (Hq + Hk) * D:].double()], -1)
    assert_within_one_ulp(qkv_fused, exact_qkv, dtype)
    ours, theirs = (qkv_fused.double() - exact_qkv).abs(), (ref.double() - exact_qkv).abs()
    assert (ours[far] < theirs[far]).all()


# ---------------------------------------------------------------- bad inputs: each named
def _bad_cases():
    a = make(T=4, Hq=4, Hk=2, D=64, rotary_dim=32)
    yield "width", dict(num_heads_q=3), ValueError, r"qkv: width 512 must be \(num_heads_q \+ num_heads_k"
    yield "heads_v", dict(num_heads_v=3), ValueError, "qkv: width 512 must be"
    yield "no q heads", dict(num_heads_q=0), ValueError, "num_heads_q: must be at least 1"
    yield "heads type", dict(num_heads_k=2.0), TypeError, "num_heads_k: expected an int"
    yield "head_dim", dict(head_dim=32, num_heads_q=10, num_heads_k=3), ValueError, "head_dim: 32 is not supported"
    yield "qkv 3-D", dict(qkv=a["qkv"].reshape(4, 8, 64)), ValueError, "qkv: expected 2 dims"
    yield "qkv columns strided", dict(qkv=torch.randn(4, 1024, dtype=torch.bfloat16)[:, ::2]), ValueError, \
        "qkv: its heads must be contiguous within a row"
    yield "qkv dtype", dict(qkv=a["qkv"].double()), TypeError, "qkv: dtype torch.float64 is not supported"
    yield "qkv int", dict(qkv=a["qkv"].int()), TypeError, "qkv: dtype torch.int32"
    yield "q_weight shape", dict(q_weight=torch.ones(32, dtype=torch.bfloat16)), ValueError, \
        r"q_weight: expected shape \(64,\)"
    yield "k_weight per head", dict(k_weight=torch.ones(2, 64, dtype=torch.bfloat16)), ValueError, \
        r"k_weight: expected shape \(64,\)"
    yield "weight dtype", dict(q_weight=torch.ones(64, dtype=torch.float16)), TypeError, \
        r"q_weight: dtype torch.float16 must be qkv's \(torch.bfloat16\) or float32"
    yield "cache dtype", dict(cos_sin_cache=a["cos_sin_cache"].half()), TypeError, \
        "cos_sin_cache: dtype torch.float16 must be qkv's"
    yield "cache 1-D", dict(cos_sin_cache=torch.ones(64)), ValueError, "cos_sin_cache: expected 2 dims"
    yield "rotary odd", dict(cos_sin_cache=torch.ones(50, 31)), ValueError, "rotary_dim .* 31 must be even"
    yield "rotary > D", dict(cos_sin_cache=torch.ones(50, 128)), ValueError, "at most head_dim 64"
    yield "rotary 0", dict(cos_sin_cache=torch.ones(50, 0)), ValueError, "rotary_dim .* 0 must be even, at least 2"
    yield "cache empty", dict(cos_sin_cache=torch.ones(0, 32)), ValueError, "cos_sin_cache: too short: 0 positions"
    yield "positions past the cache", dict(position_ids=torch.tensor([0, 1, 50, 2])), ValueError, \
        r"position_ids\[2\] = 50 is outside the cos_sin_cache's \[0, 50\)"
    yield "negative position", dict(position_ids=torch.tensor([-1, 1, 2, 3], dtype=torch.int32)), ValueError, \
        r"position_ids\[0\] = -1 is outside"
    yield "positions float", dict(position_ids=torch.zeros(4)), TypeError, "position_ids: dtype torch.float32"
    yield "positions 2-D", dict(position_ids=torch.zeros(4, 1, dtype=torch.long)), ValueError, \
        r"position_ids: expected shape \(4,\)"
    yield "positions count", dict(position_ids=torch.zeros(3, dtype=torch.long)), ValueError, \
        r"position_ids: expected shape \(4,\)"
    yield "positions device", dict(position_ids=torch.zeros(4, dtype=torch.long, device="meta")), ValueError, \
        "position_ids is on meta but qkv is on cpu"
    yield "eps", dict(eps="1e-6"), TypeError, "eps: expected a float"


BAD = list(_bad_cases())


@pytest.mark.parametrize("name,override,exc,msg", BAD, ids=[b[0] for b in BAD])
@pytest.mark.parametrize("form", ["public", "vllm"])
def test_bad_inputs_are_named(form, name, override, exc, msg):
    a = dict(make(T=4, Hq=4, Hk=2, D=64, rotary_dim=32), **override)
    keep = a["qkv"].clone() if isinstance(a["qkv"], torch.Tensor) else None
    if form == "vllm" and name in ("heads type", "eps"):
        exc, msg = RuntimeError, "Expected a value of type"  # a scalar of the wrong type: the schema refuses it
    with pytest.raises(exc, match=msg):
        if form == "public":
            oink.qk_norm_rope(**a)
        else:
            OPS.fused_qk_norm_rope(*vllm_args(a))
    if keep is not None:
        assert torch.equal(a["qkv"], keep)  # a refused call writes nothing


def test_public_only_and_vllm_only_arguments():
    a = make()
    with pytest.raises(TypeError, match="weight_offset: expected a float"):
        oink.qk_norm_rope(**a, weight_offset="1")
    with pytest.raises(ValueError, match="forced_token_heads_per_warp: must be 1, 2, 4 or 8"):
        OPS.fused_qk_norm_rope(*vllm_args(a), 3)
    for f in (-1, 0, 1, 2, 4, 8):  # vLLM's launch knob: the values do not change
        b = make()
        OPS.fused_qk_norm_rope(*vllm_args(b), f)
        if f == -1:
            first = b["qkv"]
        assert torch.equal(b["qkv"], first)
    with pytest.raises(ValueError, match="elements share memory"):
        b = make(T=4)
        OPS.fused_qk_norm_rope(b["qkv"][:1].expand(4, -1), *vllm_args(b)[1:])


def test_capture_skips_the_position_check(monkeypatch):
    """A CUDA graph being captured forbids the host sync: the value check steps aside (on CUDA tensors only)."""
    from oink import ops_rope

    calls = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: calls.append(1) or True)

    class Cuda:
        is_cuda = True

        def numel(self):
            return 4

    ops_rope._positions_in_range(torch.ones(1, 2), Cuda())  # returns before reading the data
    assert calls == [1]


# ---------------------------------------------------------------- custom ops, torch.compile, invariance
def test_opcheck_both_forms():
    a = make(T=5, Hq=3, Hk=1, D=128, rotary_dim=64, wdtype=torch.float32)
    torch.library.opcheck(OPS.qk_norm_rope.default, (*vllm_args(a), 1.0))
    b = make(T=5, Hq=2, Hk=2, D=64, dtype=torch.float16)
    b["is_neox"] = False
    torch.library.opcheck(OPS.fused_qk_norm_rope.default, vllm_args(b))


def test_torch_compile_of_the_public_op_and_vllms_pattern():
    torch._dynamo.reset()
    a = make(T=6, D=64)

    def f(qkv, qw, kw, cache, pos):
        q, k = oink.qk_norm_rope(qkv, 4, 2, 2, 64, 1e-6, qw, kw, cache, True, pos, weight_offset=0.5)
        return q * 2, k

    def g(qkv, qw, kw, cache, pos):  # vLLM's fusion pass's replacement: the op in place, then the split
        OPS.fused_qk_norm_rope(qkv, 4, 2, 2, 64, 1e-6, qw, kw, cache, True, pos)
        return qkv.split([256, 128, 128], dim=-1)

    args = (a["qkv"], a["q_weight"], a["k_weight"], a["cos_sin_cache"], a["position_ids"])
    q, k = torch.compile(f, fullgraph=True)(*args)
    eq, ek = f(*args)
    assert torch.equal(q, eq) and torch.equal(k, ek)
    got = torch.compile(g, fullgraph=True)(a["qkv"].clone(), *args[1:])
    want = g(a["qkv"].clone(), *args[1:])
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_batch_invariant_by_the_plugins_check():
    from pytest_oink import invariance
    from pytest_oink.providers import SPECS, build

    assert oink.batch_invariant("qk_norm_rope") and oink.batch_invariant("fused_qk_norm_rope")
    for op, N in (("qk_norm_rope", 6144), ("vllm_fused_qk_norm_rope", 1024)):
        spec = SPECS[op]
        run = build(op, "oink", torch.device("cpu"))
        v = invariance.check(spec, run, N, torch.bfloat16, torch.device("cpu"), sizes=(1, 3, 16), big=64, op=op)
        assert v.held and v.outputs == (0, 1), v.report()


def test_suite_widths_are_the_models():
    from pytest_oink import suites

    assert set(suites.QK_NORM_ROPE_MODELS.values()) == set(MODELS)
    assert heads_of(6144) == (32, 8, 128, 0.0) and heads_of(8192) == (32, 16, 128, 1.0)
    assert heads_of(4096) == (16, 8, 128, 0.0)  # a width of no model: D 128, GQA 2 (32 heads = 16 + 2 x 8)
    assert heads_of(256) == (2, 1, 64, 0.0)
    with pytest.raises(ValueError, match="width 128"):
        heads_of(128)
    cases = suites.expand("qk-norm-rope")
    assert {c.op for c in cases} == {"qk_norm_rope", "vllm_fused_qk_norm_rope"} and len(cases) == 2 * 4 * 7
    assert {c.op for c in suites.expand("smoke")}.isdisjoint({"qk_norm_rope", "vllm_fused_qk_norm_rope"})
    assert any(c.op == "qk_norm_rope" for c in suites.expand("random", seed=1))


BENCH = '''
def test_benchmark(oink_case, oink_benchmark):
    oink_benchmark(oink_case)
'''


def test_the_suite_runs_on_cpu(pytester, tmp_path):
    import csv

    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess(
        "--oink-suite=qk-norm-rope", "--oink-configs=3x6144", "--oink-run-on-cpu", "--oink-gate-cpu",
        f"--oink-csv={tmp_path / 'r.csv'}", "-p", "pytest_oink.plugin", "-p", "no:cacheprovider",
        )
    assert res.ret == 0, res.stdout.str()[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    got = {(r["op"], r["provider"], r["status"]) for r in rows}
    want = {(op, p, "ok") for op in ("qk_norm_rope", "vllm_fused_qk_norm_rope") for p in ("oink", "torch",
                                                                                         "torch.compile")}
    assert want | {("qk_norm_rope", "oink-unfused", "ok")} == got
