"""The fused QK norm + rotary embedding's CuTeDSL kernel on a GPU: q and k within one ulp of the float64 formula
at the activation dtype (the reference's own bound), the same as the reference's but for a rounding step, v and
the padding of strided rows untouched, nothing left unwritten (poisoned outputs), both pairings, partial rotary,
Gemma's offset, GQA, fp32 or 16-bit weights and caches; a row's bits the same alone and in a batch; a position
outside the cache gives NaN, never a read past it."""
from __future__ import annotations

import pytest
import torch

import oink
import oink.ops  # noqa: F401  (registers torch.ops.oink.*)
from oink import dispatch
from oink import reference as R
from oink.reference.rope import rope_cache
from tests.gpu_helpers import poison_allocator
from tests.test_qk_norm_rope import assert_within_one_ulp, exact

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]


@pytest.fixture(autouse=True)
def kernel_on():
    """The kernel serves GPU calls only with the ``rope_kernel`` development setting until these tests have run."""
    from oink import config

    with config.override(rope_kernel=True):
        yield
OPS = torch.ops.oink
HEADS = [(32, 8), (16, 16), (40, 8), (8, 1)]


def _inputs(T, Hq, Hk, D, rd, dtype, w_dtype, cache_dtype, gen, pad=0):
    width = (Hq + 2 * Hk) * D
    qkv = (torch.randn(T, width + pad, device="cuda", generator=gen) * 2).to(dtype)[:, :width]
    qw = (1 + 0.3 * torch.randn(D, device="cuda", generator=gen)).to(w_dtype)
    kw = (1 + 0.3 * torch.randn(D, device="cuda", generator=gen)).to(w_dtype)
    cache = rope_cache(4096, rd, dtype=cache_dtype, device="cuda")
    pos = torch.randint(0, 4096, (T,), device="cuda", generator=gen)
    return qkv, qw, kw, cache, pos


def _ulps(a, b):
    """|ordinal difference| of 16-bit floats (-0 and +0 equal)."""
    def ordinal(t):
        u = t.view(torch.int16).int()
        return torch.where(u < 0, -(u & 0x7FFF), u)
    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("D,rd", [(64, 64), (64, 32), (128, 128), (128, 64), (128, 32), (256, 256), (256, 128)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("Hq,Hk", HEADS)
@pytest.mark.parametrize("T", [1, 7, 300])
def test_kernel_within_one_ulp(dtype, D, rd, neox, Hq, Hk, T):
    gen = torch.Generator(device="cuda").manual_seed(T * 1000 + D + rd + Hq)
    offset = 1.0 if Hq == 16 else 0.0
    w_dtype = torch.float32 if Hk == 8 else dtype
    cache_dtype = torch.float32 if Hq == 32 else dtype
    qkv, qw, kw, cache, pos = _inputs(T, Hq, Hk, D, rd, dtype, w_dtype, cache_dtype, gen, pad=8 * (T % 2))
    a = dict(qkv=qkv, num_heads_q=Hq, num_heads_k=Hk, num_heads_v=Hk, head_dim=D, eps=1e-6, q_weight=qw,
             k_weight=kw, cos_sin_cache=cache, is_neox=neox, position_ids=pos, weight_offset=offset)
    assert dispatch.route("qk_norm_rope", a).backend == "kernel"
    poison_allocator()
    q, k = oink.qk_norm_rope(**a)
    want_q, want_k = exact(qkv, Hq, Hk, D, 1e-6, qw, kw, cache, neox, pos, offset)
    assert_within_one_ulp(q, want_q, dtype)
    assert_within_one_ulp(k, want_k, dtype)
    ref_q, ref_k = R.qk_norm_rope(**a)
    assert int(_ulps(q, ref_q).max()) <= 1 and int(_ulps(k, ref_k).max()) <= 1
    if offset == 0.0:  # vLLM's in-place op: the same bits, v and the rows' padding untouched
        base = qkv._base if qkv._base is not None else qkv
        before = base.clone()
        args = {k_: v for k_, v in a.items() if k_ != "weight_offset"}
        OPS.fused_qk_norm_rope(*args.values())
        Hqk = (Hq + Hk) * D
        assert torch.equal(qkv[:, :Hq * D].reshape(T, Hq, D), q)
        assert torch.equal(qkv[:, Hq * D:Hqk].reshape(T, Hk, D), k)
        assert torch.equal(base[:, Hqk:], before[:, Hqk:])


@pytest.mark.parametrize("neox", [True, False])
def test_rows_alone_and_in_a_batch(neox):
    gen = torch.Generator(device="cuda").manual_seed(3)
    Hq, Hk, D = 32, 8, 128
    qkv, qw, kw, cache, pos = _inputs(4096, Hq, Hk, D, D, torch.bfloat16, torch.bfloat16, torch.bfloat16, gen)
    call = lambda s, e: oink.qk_norm_rope(qkv[s:e], Hq, Hk, Hk, D, 1e-6, qw, kw, cache, neox, pos[s:e])  # noqa: E731 (a batch's slice)
    q, k = call(0, 4096)
    for s, e in ((0, 1), (5, 6), (0, 255), (0, 300), (1000, 1256), (4095, 4096)):
        qs, ks = call(s, e)
        assert torch.equal(qs, q[s:e]) and torch.equal(ks, k[s:e]), (s, e)


def test_position_outside_the_cache_is_nan_not_a_read():
    """With values unchecked (the default on the kernel path), a position outside the cache reads nothing: its
    rotated values are NaN, the rest of the row and the other tokens exact."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    Hq, Hk, D, rd = 8, 2, 128, 64
    qkv, qw, kw, cache, pos = _inputs(4, Hq, Hk, D, rd, torch.bfloat16, torch.float32, torch.float32, gen)
    pos[1], pos[2] = 4096, -1
    q, k = OPS.qk_norm_rope(qkv, Hq, Hk, Hk, D, 1e-6, qw, kw, cache, True, pos)
    for t in (1, 2):
        assert q[t, :, :rd].isnan().all() and not q[t, :, rd:].isnan().any()
    ok = pos.clone()
    ok[1] = ok[2] = 0
    q0, k0 = OPS.qk_norm_rope(qkv, Hq, Hk, Hk, D, 1e-6, qw, kw, cache, True, ok)
    assert torch.equal(q[[0, 3]], q0[[0, 3]]) and torch.equal(k[[0, 3]], k0[[0, 3]])


def test_declined_layouts_take_the_reference_saying_why():
    gen = torch.Generator(device="cuda").manual_seed(6)
    qkv, qw, kw, cache, pos = _inputs(3, 8, 2, 128, 128, torch.bfloat16, torch.bfloat16, torch.bfloat16, gen)
    a = dict(qkv=qkv, num_heads_q=8, num_heads_k=2, num_heads_v=2, head_dim=128, eps=1e-6, q_weight=qw,
             k_weight=kw, cos_sin_cache=cache, is_neox=True, position_ids=pos, weight_offset=0.0)
    assert dispatch.route("qk_norm_rope", {**a, "qkv": qkv.float()}).backend == "reference"
    short = rope_cache(4096, 12, dtype=torch.bfloat16, device="cuda")  # a NeoX half of 6: not whole lanes of 4
    assert "rotary_dim" in dispatch.route("qk_norm_rope", {**a, "cos_sin_cache": short}).reason
    assert dispatch.route("qk_norm_rope", {**a, "position_ids": pos.repeat_interleave(2)[::2]}).backend == "reference"
