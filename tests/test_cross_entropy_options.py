"""Cross-entropy's options (#35 item 1: label_smoothing, z_loss, softcap, reductions, return_z_loss) on the
CPU: the reference against a naive float64 formula (Hypothesis over shapes, odd vocabularies, options,
ignore_index and class weights), its gradients against torch.autograd of that formula, the public API,
the autograd function and module, torch.compile(fullgraph=True), the custom ops, bad options; and the
kernels' variants compiled for sm_90a and sm_100a (no spills), the plain path keeping its kernel."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oink
from oink import reference as R

IGNORE = -100


def _naive64(x, target, ignore_index=IGNORE, weight=None, eps=0.0, z=0.0, cap=None):
    """Each row's loss in float64, written out: torch's label smoothing rule with class weights, z * lse^2
    weighted like the row, logits capped first. -> (loss [M], lse [M], z-loss [M], row weights [M])."""
    x = x.double()
    zc = x if cap is None else cap * torch.tanh(x / cap)
    lse = torch.logsumexp(zc, -1)
    logp = zc - lse[:, None]
    valid = target != ignore_index
    safe = torch.where(valid, target, 0).long()
    w = torch.ones(x.shape[-1], dtype=torch.float64) if weight is None else weight.double()
    rw = w[safe] * valid
    nll = -logp.gather(1, safe[:, None])[:, 0]
    smooth = -(logp * w).sum(-1) / x.shape[-1]
    zl = torch.where(valid, z * lse**2 * rw, 0.0)
    loss = torch.where(valid, (1 - eps) * rw * nll + eps * smooth, 0.0) + zl
    return loss, lse, zl, rw


def _reduce(v, rw, reduction):
    if reduction == "none":
        return v
    return v.sum() if reduction == "sum" else (v.sum() / rw.sum() if rw.sum() > 0 else v.sum() * 0)


def _case(M, V, seed, ignore_index=IGNORE, weighted=False, dtype=torch.float64, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.3] = ignore_index
    w = torch.rand(V, generator=g, dtype=torch.float64) + 0.25 if weighted else None
    return x, t, w


OPTIONS = st.fixed_dictionaries({
    "eps": st.sampled_from([0.0, 0.0, 0.1, 0.45, 0.9]),
    "z": st.sampled_from([0.0, 0.0, 1e-4, 0.1]),
    "cap": st.sampled_from([None, None, 0.7, 5.0, 30.0]),
})


@settings(max_examples=80, deadline=None)
@given(M=st.integers(1, 9), V=st.sampled_from([1, 2, 3, 7, 13, 31, 64, 97, 255]), opts=OPTIONS,
       reduction=st.sampled_from(["none", "mean", "sum"]), weighted=st.booleans(),
       ignore_index=st.sampled_from([IGNORE, 0, 2]), seed=st.integers(0, 2**16))
def test_reference_matches_the_float64_formula(M, V, opts, reduction, weighted, ignore_index, seed):
    """float64 logits through the reference's forward, backward and fused ops against the written-out
    formula and torch.autograd of it, every option, reduction, ignore_index and class weight."""
    x, t, w = _case(M, V, seed, ignore_index, weighted)
    eps, z, cap = opts["eps"], opts["z"], opts["cap"]
    kw = dict(weight=w, label_smoothing=eps, z_loss=z, softcap=cap)
    loss, lse, zl = R.cross_entropy_forward(x, t, ignore_index, reduction, return_z_loss=True, **kw)
    e_loss, e_lse, e_zl, rw = _naive64(x, t, ignore_index, w, eps, z, cap)
    torch.testing.assert_close(loss, _reduce(e_loss, rw, reduction), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, e_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(zl, _reduce(e_zl, rw, reduction), rtol=1e-10, atol=1e-12)

    xg = x.clone().requires_grad_()
    dloss = torch.randn(M, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    (want,) = torch.autograd.grad((_naive64(xg, t, ignore_index, w, eps, z, cap)[0] * dloss).sum(), xg)
    got = R.cross_entropy_backward(dloss, x, t, lse, ignore_index, **kw)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    up = dloss if reduction == "none" else dloss[0]
    f_loss, f_d, f_lse, f_zl = R.cross_entropy_fwd_bwd(up, x, t, ignore_index, return_lse=True, reduction=reduction,
                                                       return_z_loss=True, **kw)
    (want_r,) = torch.autograd.grad((_reduce(_naive64(xg, t, ignore_index, w, eps, z, cap)[0], rw, reduction)
                                     * up).sum(), xg)
    torch.testing.assert_close(f_loss, loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f_zl, zl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f_lse, lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f_d, want_r, rtol=1e-9, atol=1e-12)


def test_label_smoothing_is_torchs():
    """Without a z-loss or softcap the loss is torch.nn.functional.cross_entropy's, class weights included."""
    x, t, w = _case(11, 37, 3, weighted=True)
    for weight in (None, w):
        for reduction in ("none", "mean", "sum"):
            got = R.cross_entropy_forward(x, t, IGNORE, reduction, weight=weight, label_smoothing=0.2)[0]
            want = torch.nn.functional.cross_entropy(x, t, weight=weight, ignore_index=IGNORE, reduction=reduction,
                                                     label_smoothing=0.2)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_autograd_with_options(dtype, reduction, inplace):
    """oink.cross_entropy (public path, every option, a class weight, return_z_loss) against torch.autograd
    of the float64 formula: the loss, the z-loss and dlogits (in place too)."""
    x, t, w = _case(10, 50, 7, weighted=True, dtype=dtype)
    opts = dict(label_smoothing=0.15, z_loss=1e-3, softcap=4.0)
    leaf = x.clone().requires_grad_()
    loss, zl = oink.cross_entropy(leaf * 1, t, reduction=reduction, inplace_backward=inplace, weight=w.float(),
                                  return_z_loss=True, **opts)
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    (got,) = torch.autograd.grad(loss, leaf, up)
    x64 = x.double().requires_grad_()
    e_loss, _, e_zl, rw = _naive64(x64, t, IGNORE, w.float().double(), 0.15, 1e-3, 4.0)
    want_loss, want_zl = _reduce(e_loss, rw, reduction), _reduce(e_zl, rw, reduction)
    (want,) = torch.autograd.grad(want_loss, x64, up.double())
    torch.testing.assert_close(loss.double(), want_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zl.double(), want_zl.detach(), rtol=1e-5, atol=1e-6)
    assert not zl.requires_grad
    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)


def test_fwd_bwd_reductions_scale_the_gradient():
    """fwd_bwd's "mean" and "sum": the reduced loss, and dlogits its gradient times the scalar dloss."""
    x, t, _ = _case(9, 40, 11, dtype=torch.float32)
    per_row, d_none = oink.cross_entropy_fwd_bwd(torch.ones(9), x, t, z_loss=0.01, softcap=10.0)
    count = (t != IGNORE).sum()
    for reduction, scale in (("sum", 1.0), ("mean", 1.0 / count.item())):
        loss, d = oink.cross_entropy_fwd_bwd(torch.tensor(2.0), x, t, reduction=reduction, z_loss=0.01, softcap=10.0)
        torch.testing.assert_close(loss, per_row.sum() * scale)
        torch.testing.assert_close(d, d_none * 2.0 * scale)
    with pytest.raises(ValueError, match="dloss"):
        oink.cross_entropy_fwd_bwd(torch.ones(9), x, t, reduction="mean")


def test_posinf_limit_with_label_smoothing():
    """+inf logits on the reference path with label smoothing: -log p_j's limit is log k at the k +inf
    logits and +inf elsewhere, so the smoothed loss is +inf unless every logit is +inf (log V)."""
    V = 5
    x = torch.zeros(3, V)
    x[0, 1] = math.inf
    x[1, :] = math.inf
    x[2, 3] = -math.inf  # masking: -log p is +inf there
    t = torch.tensor([1, 2, 0])
    loss, lse = oink.cross_entropy_forward(x, t, label_smoothing=0.1)
    assert loss[0] == math.inf and loss[2] == math.inf
    torch.testing.assert_close(loss[1], torch.tensor(math.log(V)))
    d = oink.cross_entropy_backward(torch.ones(3), x, t, lse, label_smoothing=0.1)
    assert torch.isfinite(d[:2]).all()
    torch.testing.assert_close(d[1], torch.full((V,), 1 / V) - 0.1 / V - 0.9 * (torch.arange(V) == 2))


def test_softcap_makes_infinite_logits_finite():
    x = torch.tensor([[math.inf, 0.0, -math.inf]])
    loss, lse = oink.cross_entropy_forward(x, torch.tensor([2]), softcap=2.0)
    zc = torch.tensor([[2.0, 0.0, -2.0]])
    torch.testing.assert_close(lse, torch.logsumexp(zc, -1))
    torch.testing.assert_close(loss, torch.logsumexp(zc, -1) + 2.0)
    d = oink.cross_entropy_backward(torch.ones(1), x, torch.tensor([2]), lse, softcap=2.0)
    assert torch.equal(d[0, [0, 2]], torch.zeros(2))  # 1 - tanh^2 is 0 at +-inf


BAD_OPTIONS = [
    (dict(softcap=0.0), ValueError, "softcap"), (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=math.inf), ValueError, "softcap"), (dict(softcap=math.nan), ValueError, "softcap"),
    (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=math.nan), ValueError, "label_smoothing"),
    (dict(z_loss=-1e-4), ValueError, "z_loss"), (dict(z_loss=math.inf), ValueError, "z_loss"),
    (dict(z_loss="0.1"), TypeError, "z_loss"), (dict(softcap=True), TypeError, "softcap"),
]


@pytest.mark.parametrize("bad,error,name", BAD_OPTIONS, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_bad_options_name_the_argument(bad, error, name):
    x, t = torch.randn(4, 9), torch.tensor([1, 2, IGNORE, 8])
    calls = [
        lambda: oink.cross_entropy_forward(x, t, **bad),
        lambda: oink.cross_entropy_backward(torch.ones(4), x, t, torch.zeros(4), **bad),
        lambda: oink.cross_entropy_fwd_bwd(torch.ones(4), x, t, **bad),
        lambda: oink.cross_entropy(x, t, **bad),
        lambda: oink.CrossEntropyLoss(**bad),
    ]
    if error is ValueError:  # (the op's schema refuses a wrong type itself, with torch's words)
        calls.append(lambda: torch.ops.oink.cross_entropy_forward(x, t, IGNORE, "none", **bad))
    for call in calls:
        with pytest.raises(error, match=f"^{name}: "):
            call()


def test_label_smoothing_needs_the_whole_row():
    x, t = torch.randn(4, 9), torch.tensor([1, 2, IGNORE, 8])
    with pytest.raises(ValueError, match="^label_smoothing: .*lse_partial"):
        oink.cross_entropy_forward(x, t, lse_partial=torch.randn(4, 2), label_smoothing=0.1)
    loss, lse = oink.cross_entropy_forward(x, t, lse_partial=torch.logsumexp(x, -1, keepdim=True), z_loss=0.5)
    torch.testing.assert_close(loss, oink.cross_entropy_forward(x, t, z_loss=0.5)[0])


def test_module_matches_torch():
    """oink.CrossEntropyLoss on [B, T, V] logits: torch.nn.CrossEntropyLoss's result (class dim moved),
    weight a buffer in the state_dict; the z-loss returned on request."""
    x, t, w = _case(12, 33, 5, weighted=True, dtype=torch.float32)
    x3, t3 = x.view(3, 4, 33), t.view(3, 4)
    for reduction in ("mean", "sum", "none"):
        ours = oink.CrossEntropyLoss(weight=w.float(), reduction=reduction, label_smoothing=0.1)
        theirs = torch.nn.CrossEntropyLoss(weight=w.float(), reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(ours(x3, t3), theirs(x3.transpose(1, 2), t3))
    assert "weight" in oink.CrossEntropyLoss(weight=w.float()).state_dict()
    loss, zl = oink.CrossEntropyLoss(reduction="none", z_loss=0.1, softcap=3.0, return_z_loss=True)(x3, t3)
    assert loss.shape == zl.shape == (3, 4)
    e_loss, _, e_zl, _ = _naive64(x, t, z=0.1, cap=3.0)
    torch.testing.assert_close(loss.double().view(-1), e_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(zl.double().view(-1), e_zl, rtol=1e-5, atol=1e-6)


def test_compiles_fullgraph_with_options():
    """torch.compile(fullgraph=True) of the differentiable loss with every option and the z-loss output,
    and of fwd_bwd with a reduction (the reference path's custom ops on the CPU)."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(16, 40)
    target = torch.tensor([1, 5, IGNORE, 39])
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)

    def step(h):
        loss, zl = oink.cross_entropy(lin(h), target, return_z_loss=True, **opts)
        return loss, zl

    f = torch.compile(step, fullgraph=True)
    h = torch.randn(4, 16, requires_grad=True)
    loss, zl = f(h)
    loss.backward()
    e_loss, e_zl = step(h.detach())
    torch.testing.assert_close(loss, e_loss)
    torch.testing.assert_close(zl, e_zl)
    assert h.grad is not None and torch.isfinite(h.grad).all()
    g = torch.compile(lambda x: oink.cross_entropy_fwd_bwd(torch.tensor(1.0), x, target, reduction="mean",
                                                           return_z_loss=True, **opts), fullgraph=True)
    x = torch.randn(4, 40)
    for a, b in zip(g(x), oink.cross_entropy_fwd_bwd(torch.tensor(1.0), x, target, reduction="mean",
                                                     return_z_loss=True, **opts)):
        torch.testing.assert_close(a, b)


def test_custom_ops_with_options_pass_opcheck():
    x, t = torch.randn(5, 64), torch.tensor([1, IGNORE, 3, 0, 63])
    o = torch.ops.oink
    samples = [
        (o.cross_entropy_forward, (x, t, IGNORE, "mean"), dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0,
                                                                 return_z_loss=True)),
        (o.cross_entropy_forward, (x, t, IGNORE, "none"), dict(z_loss=1e-3)),
        (o.cross_entropy_backward, (torch.randn(5), x, t, torch.randn(5), IGNORE), dict(label_smoothing=0.2,
                                                                                       softcap=3.0)),
        (o.cross_entropy_fwd_bwd, (torch.tensor(1.0), x, t, IGNORE), dict(reduction="sum", z_loss=0.1,
                                                                          return_z_loss=True)),
    ]
    for op, args, kwargs in samples:
        torch.library.opcheck(op, args, kwargs)


# ---------------------------------------------------------------- the kernels' variants (compiled on the CPU)
def test_kernel_routes():
    """Options go to the kernels, except label smoothing with a class weight and a forward's target_logit
    with an option (the reference, with the reason); no option is the plain kernel's compile key."""
    pytest.importorskip("cutlass")
    from oink.kernels.cross_entropy_rules import PLAIN, CEOptions
    from oink.kernels.cross_entropy_ops import CHECKS, options_of

    x, t, w = torch.empty(4, 4096), torch.zeros(4, dtype=torch.long), torch.ones(4096)
    base = dict(logits=x, target=t, ignore_index=IGNORE, weight=None, label_smoothing=0.0, z_loss=0.0, softcap=None)
    assert options_of(base) is PLAIN
    assert options_of({**base, "softcap": 30}) == CEOptions(0.0, 0.0, 30.0)
    for name in ("cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd"):
        assert CHECKS[name]({**base, "label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0}, "sm_90a") is None
        assert CHECKS[name]({**base, "weight": w, "z_loss": 1e-4}, "sm_90a") is None
        assert "class weight" in CHECKS[name]({**base, "weight": w, "label_smoothing": 0.1}, "sm_90a")
    assert "target_logit" in CHECKS["cross_entropy_forward"]({**base, "target_logit": t.float(), "z_loss": 0.1},
                                                              "sm_90a")


def _option_sets():
    from oink.kernels.cross_entropy_rules import CEOptions

    return [CEOptions(0.1, 0.0, None), CEOptions(0.0, 1e-4, None), CEOptions(0.0, 0.0, 30.0),
            CEOptions(0.1, 1e-4, 30.0)]


def _force_stream(monkeypatch):
    """Every mode streams its rows (a development setting; the environment knob where that is what reads it)."""
    from oink import config

    if hasattr(config, "dev_settings"):
        from tests.helpers import set_dev

        set_dev(monkeypatch, ce_stream=True)
    else:
        from tests.helpers import set_knob

        set_knob(monkeypatch, "OINK_CE_STREAM", "1")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_option_kernels_compile(monkeypatch, arch, mode):
    """Each option alone and all together: register-held rows (aligned and uneven, odd widths through
    aligned windows or element accesses, fp32 and int32 targets) and streamed ones; the plain options
    are the plain kernel itself (one compile key)."""
    pytest.importorskip("cutlass")
    from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy
    from oink.kernels.cross_entropy_rules import PLAIN

    def compiled(dtype, target_dtype, N, **fields):
        return compiled_cross_entropy(CrossEntropyKey(mode, dtype, target_dtype, N, arch, **fields))

    for o in _option_sets():
        for N in (1000, 50257):
            assert callable(compiled("bfloat16", "int64", N, options=o))
    every = _option_sets()[-1]
    assert callable(compiled("float32", "int32", 4096, options=every))
    assert callable(compiled("bfloat16", "int64", 50257, window=False, options=every))
    plain = compiled("bfloat16", "int64", 1000)
    assert compiled("bfloat16", "int64", 1000, options=PLAIN) is plain
    assert compiled("bfloat16", "int64", 1000, options=every) is not plain
    _force_stream(monkeypatch)
    for o in (_option_sets()[0], every):
        for N in (1000, 50257, 200008):
            assert callable(compiled("bfloat16", "int64", N, options=o))


# Known limit (the heuristic's launch, 1024 threads of 64 registers; a cluster of 8 CTAs of 512 would leave a
# thread 13 units): every option at 201088 fp32 fwd_bwd spills 8 bytes on both archs
OPTION_SPILL_LIMITS = {(arch, "float32", 201088, "fwd_bwd", 0) for arch in ("sm_90a", "sm_100a")}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_option_kernels_do_not_spill(monkeypatch, arch, dtype):
    """Every option (with and without the softcap) at the sweep's vocabularies keeps its values in
    registers, as the plain kernels do (read from the cubins' notes)."""
    pytest.importorskip("cutlass")
    from oink.kernels.cross_entropy import CrossEntropyKey, compiled_cross_entropy
    from oink.kernels.cross_entropy_rules import CEOptions
    from oink.kernels.profile import compiled_resources
    from pytest_oink.suites import SWEEP_VOCABS
    from tests.helpers import set_knob

    set_knob(monkeypatch, "OINK_KEEP_CUBIN", "1")
    sets = [CEOptions(0.1, 1e-4, 30.0), CEOptions(0.1, 1e-4, None)]
    spilled = {}
    for N in SWEEP_VOCABS:
        for mode in ("forward", "backward", "fwd_bwd"):
            for i, o in enumerate(sets):
                res = compiled_resources(compiled_cross_entropy(CrossEntropyKey(mode, dtype, "int64", N, arch,
                                                                                options=o)))
                assert res["registers"] > 0
                if res["frame_bytes"] and (arch, dtype, N, mode, i) not in OPTION_SPILL_LIMITS:
                    spilled[(N, mode, o)] = res
    assert not spilled, spilled


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_softcap_dlogits_compile_without_spill(monkeypatch, arch, dtype):
    """The dlogits kernels with a softcap of 30 (and a z-loss beside it): the fused mode's register-held rows of a
    warp, a CTA, shifted windows (dlogits through them, or element accesses), clusters, in place and out; the
    backward's; streamed rows of both; no spill (read from the cubins' notes). Which softcap form each takes
    (``softcap_form``)."""
    pytest.importorskip("cutlass")
    from oink.kernels import cross_entropy as ce
    from oink.kernels import cross_entropy_rules as rules
    from oink.kernels.profile import compiled_resources
    from tests.helpers import set_dev, set_knob

    set_knob(monkeypatch, "OINK_KEEP_CUBIN", "1")
    cap, zcap = rules.CEOptions(softcap=30.0), rules.CEOptions(z_loss=1e-4, softcap=30.0)
    assert rules.softcap_form("fwd_bwd", cap, False) == rules.softcap_form("fwd_bwd", zcap, False) == "held"
    assert rules.softcap_form("backward", cap, False) == rules.softcap_form("fwd_bwd", cap, True) == "raw"
    assert rules.softcap_form("backward", rules.CEOptions(0.1, 0.0, 80.0), True) == "raw"
    assert rules.softcap_form("forward", cap, False) is rules.softcap_form("forward", cap, True) is None
    assert rules.softcap_form("fwd_bwd", rules.CEOptions(0.1, 0.0, 30.0), False) is None  # label smoothing
    assert rules.softcap_form("fwd_bwd", rules.CEOptions(softcap=rules.SOFTCAP_LEAN_MAX * 2), False) is None
    assert rules.softcap_form("backward", rules.CEOptions(0.1, 1e-4, None), False) is None
    spilled = {}

    def check(mode, N, inplace=False, options=cap, window=True):
        fn = ce.compiled_cross_entropy(ce.CrossEntropyKey(mode, dtype, "int64", N, arch, window=window, options=options,
                                                          inplace=inplace))
        res = compiled_resources(fn)
        assert res["registers"] > 0
        if res["frame_bytes"]:
            spilled[(mode, N, inplace, options, window)] = res
        return fn

    for N in (1000, 4097, 32000, 50257, 128256, 151936, 256000, 262144):
        check("fwd_bwd", N)
        check("fwd_bwd", N, inplace=True)
    for N in (1000, 50257, 256000):
        check("backward", N)
    check("fwd_bwd", 4097, options=zcap)
    check("fwd_bwd", 50257, options=zcap, window=False)
    check("fwd_bwd", 1000, options=rules.CEOptions(0.1, 0.0, 30.0))
    set_dev(monkeypatch, ce_stream=True)
    for N in (1000, 50257, 200008):
        for mode in ("backward", "fwd_bwd"):
            check(mode, N)
    assert not spilled, spilled
