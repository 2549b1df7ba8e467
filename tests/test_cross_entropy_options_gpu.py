"""Cross-entropy options (#35 item 1) on the kernels: label_smoothing, z_loss and softcap against the
fp32 reference, forward, backward and fused, register-held and streamed rows, aligned and odd
vocabularies (about 30% of the rows ignored, outputs from a NaN-poisoned allocator); the routes (a class
weight with label smoothing takes the reference); autograd against float64 torch; +inf logits with
options; the fused and backward softcap kernels against the float64 reference too (``-k softcap`` selects
the softcap cases)."""
from __future__ import annotations

import math

import pytest
import torch

import oink
from oink import reference as R
from tests.gpu_helpers import close_family, kernel, poison_allocator

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

IGNORE = -100
OPTIONS = {
    "smooth": dict(label_smoothing=0.1),
    "zloss": dict(z_loss=1e-4),
    "softcap": dict(softcap=30.0),
    "all": dict(label_smoothing=0.2, z_loss=1e-3, softcap=15.0),
}


def _case(M, N, dtype, seed, scale=4.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(M, N, device="cuda", generator=g) * scale).to(dtype)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    target[torch.rand(M, device="cuda", generator=g) < 0.3] = IGNORE
    dloss = torch.randn(M, device="cuda", generator=g)
    return logits, target, dloss


def _launch(mode, logits, target, dloss, lse, opts):
    """``mode``'s kernel with the options (``dispatch.launch``: no checks; the backward reads ``lse``), its
    outputs from a poisoned allocator: -> (loss, lse, dlogits), None where the mode has none."""
    poison_allocator(logits.numel() * logits.element_size() + (1 << 26))
    a = dict(logits=logits, target=target, ignore_index=IGNORE, **opts)
    if mode == "forward":
        return kernel("cross_entropy_forward", **a) + (None,)
    if mode == "backward":
        return None, None, kernel("cross_entropy_backward", dloss=dloss, lse=lse, **a)
    loss, dx, lse = kernel("cross_entropy_fwd_bwd", dloss=dloss, return_lse=True, **a)
    return loss, lse, dx


def _checked(mode, logits, target, dloss, opts, dtype, loss_family="cross_entropy_loss"):
    """``_launch``'s outputs against the fp32 reference: loss and lse (forward, fused; within
    ``loss_family``'s tolerance) and dlogits (backward, fused)."""
    e_loss, e_lse = R.cross_entropy_forward(logits, target, IGNORE, **opts)
    loss, lse, dx = _launch(mode, logits, target, dloss, e_lse, opts)
    if mode != "backward":
        close_family(loss, e_loss, loss_family, torch.float32, f"{mode} loss {opts}")
        close_family(lse, e_lse, loss_family, torch.float32, f"{mode} lse {opts}")
    if mode != "forward":
        e_dx = R.cross_entropy_backward(dloss, logits, target, e_lse, IGNORE, **opts)
        close_family(dx, e_dx, "softmax", dtype, f"{mode} dlogits {opts}")
    return loss, dx


@pytest.mark.parametrize("opts", list(OPTIONS), ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("N", (64, 1000, 4097, 32000, 50257, 128256, 256000))
@pytest.mark.parametrize("M", (1, 37, 512))
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_option_kernels_match_the_reference(mode, M, N, dtype, opts, seed):
    logits, target, dloss = _case(M, N, dtype, seed)
    loss, dx = _checked(mode, logits, target, dloss, OPTIONS[opts], dtype)
    if mode != "backward":
        assert torch.all(loss[target == IGNORE] == 0)
    if mode != "forward":
        assert torch.all(dx[target == IGNORE] == 0)


@pytest.mark.parametrize("pad", [24, 0])
@pytest.mark.parametrize("opts", ["smooth", "all"])
@pytest.mark.parametrize("N", (1000, 50257, 200008))
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_streamed_rows_with_options(monkeypatch, mode, N, opts, pad, seed):
    """Every mode forced to stream its rows, rows ``pad`` elements apart or dense (odd widths through
    aligned windows; the dlogits, dense, too where their rows lie at the logits' offsets: dense logits), a
    row of -inf over its first three quarters (masked: capped to -c with a softcap), the target in the
    last quarter."""
    from tests.test_cross_entropy_options import _force_stream

    _force_stream(monkeypatch)
    M = 7
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(M, N + pad, device="cuda", generator=g) * 4
    buf[2, : N * 3 // 4] = -math.inf
    buf[0, N - 1] = 40.0
    logits = buf.to(torch.bfloat16)[:, :N]
    target = torch.randint(N * 3 // 4, N, (M,), device="cuda", generator=g)
    target[4] = IGNORE
    dloss = torch.randn(M, device="cuda", generator=g)
    _checked(mode, logits, target, dloss, OPTIONS[opts], torch.bfloat16)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_public_ops_route_options_to_the_kernels(reduction, seed):
    """The public ops with options run the kernels (a class weight with a z-loss too; with label smoothing
    the reference, which says so) and match the reference, the z-loss output included."""
    logits, target, dloss = _case(1024, 50257, torch.bfloat16, seed)
    w = torch.rand(50257, device="cuda") + 0.5
    opts = OPTIONS["all"]
    assert "kernel" in oink.explain("cross_entropy_forward", logits, target, IGNORE, reduction, **opts)
    assert "kernel" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target, weight=w, z_loss=1e-3)
    assert "class weight" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target, weight=w, **opts)
    got = oink.cross_entropy_forward(logits, target, IGNORE, reduction, return_z_loss=True, **opts)
    want = R.cross_entropy_forward(logits, target, IGNORE, reduction, return_z_loss=True, **opts)
    for a, b, what in zip(got, want, ("loss", "lse", "z-loss")):
        close_family(a, b, "cross_entropy_loss", torch.float32, what)
    up = dloss if reduction == "none" else dloss[0]
    for weight, kw in ((None, opts), (w, dict(z_loss=1e-3, softcap=15.0))):
        got = oink.cross_entropy_fwd_bwd(up, logits, target, weight=weight, reduction=reduction, return_lse=True,
                                         return_z_loss=True, **kw)
        want = R.cross_entropy_fwd_bwd(up, logits, target, weight=weight, reduction=reduction, return_lse=True,
                                       return_z_loss=True, **kw)
        close_family(got[0], want[0], "cross_entropy_loss", torch.float32, "fused loss")
        close_family(got[1], want[1], "softmax", torch.bfloat16, "fused dlogits")
        close_family(got[2], want[2], "cross_entropy_loss", torch.float32, "fused lse")
        close_family(got[3], want[3], "cross_entropy_loss", torch.float32, "fused z-loss")
        lse = got[2]
        close_family(oink.cross_entropy_backward(dloss, logits, target, lse, weight=weight, **kw),
                     R.cross_entropy_backward(dloss, logits, target, lse, weight=weight, **kw), "softmax",
                     torch.bfloat16, "backward")


@pytest.mark.parametrize("inplace", [False, True])
def test_autograd_with_options_against_float64(inplace, seed):
    """oink.cross_entropy with every option on bf16 logits of Llama-3's vocabulary: the loss and dlogits
    against torch.autograd of the float64 formula."""
    logits, target, _ = _case(256, 128256, torch.bfloat16, seed)
    opts = OPTIONS["all"]
    leaf = logits.clone().requires_grad_(True)
    loss = oink.cross_entropy(leaf * 1, target, inplace_backward=inplace, **opts)
    (got,) = torch.autograd.grad(loss, [leaf])
    x = logits.double().requires_grad_(True)
    c = opts["softcap"] * torch.tanh(x / opts["softcap"])
    lse = torch.logsumexp(c, -1)
    valid = target != IGNORE
    ref = torch.nn.functional.cross_entropy(c, target, ignore_index=IGNORE, reduction="sum",
                                            label_smoothing=opts["label_smoothing"])
    ref = (ref + opts["z_loss"] * (lse[valid] ** 2).sum()) / valid.sum()
    (want,) = torch.autograd.grad(ref, [x])
    close_family(loss, ref.float(), "cross_entropy_loss", torch.float32, "loss")
    close_family(got, want.to(torch.bfloat16), "softmax", torch.bfloat16, "dlogits")


@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
@pytest.mark.parametrize("V", (4097, 256000))
def test_softcap_at_gemma_scale(mode, V, seed):
    """bf16 logits spread as wide as the softcap (30, Gemma-2's), most capped near +-c, where the 16-bit
    kernels' tanh.approx errs most: the loss and lse within the capped-loss bound, the dlogits as bf16."""
    logits, target, dloss = _case(64, V, torch.bfloat16, seed, scale=30.0)
    with pytest.raises(AssertionError):  # the bound means something: the uncapped loss is far outside it
        close_family(R.cross_entropy_forward(logits, target, IGNORE)[0],
                     R.cross_entropy_forward(logits, target, IGNORE, softcap=30.0)[0], "cross_entropy_capped_loss",
                     torch.float32, "uncapped")
    _checked(mode, logits, target, dloss, dict(softcap=30.0), torch.bfloat16, "cross_entropy_capped_loss")


@pytest.mark.parametrize("V", (1000, 50257, 128256))
def test_infinite_logits_with_options(V, seed):
    """A softcap makes +-inf logits finite (+-c) on the kernel path; label smoothing of a row holding
    +inf logits gives the reference's limit (+inf, log V where every logit is +inf) and finite dlogits."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(4, V, device="cuda", generator=g)
    logits[0, 3] = math.inf
    logits[1, :] = math.inf
    logits[2, 5] = -math.inf
    logits[3, 7], logits[3, 8] = math.inf, -math.inf
    target = torch.tensor([3, 2, 0, 7], device="cuda")
    dloss = torch.ones(4, device="cuda")
    for opts in (dict(softcap=20.0), dict(label_smoothing=0.1), dict(softcap=5.0, label_smoothing=0.3)):
        assert "kernel" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target, **opts)
        loss, dx, lse = oink.cross_entropy_fwd_bwd(dloss, logits, target, return_lse=True, **opts)
        e_loss, e_dx, e_lse = R.cross_entropy_fwd_bwd(dloss.cpu(), logits.cpu(), target.cpu(), return_lse=True,
                                                      **opts)
        torch.testing.assert_close(loss.cpu(), e_loss, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(lse.cpu(), e_lse, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(dx.cpu(), e_dx, atol=1e-5, rtol=1e-4)
        f_loss, f_lse = oink.cross_entropy_forward(logits, target, **opts)
        torch.testing.assert_close(f_loss.cpu(), e_loss, atol=1e-4, rtol=1e-5)
        d = oink.cross_entropy_backward(dloss, logits, target, e_lse.cuda(), **opts)
        torch.testing.assert_close(d.cpu(), e_dx, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("V", (1000, 32000, 128256))
def test_nan_beside_posinf_stays_nan(V, seed):
    """A row holding +inf and NaN: the +inf limit must not hide the NaN (loss, lse and dlogits NaN, the
    other rows their reference values), plain, with label smoothing, and with a softcap (whose kernels take
    part of their exps on the FMA pipe, ``exp2_fma``, which must keep a NaN too)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(6, V, device="cuda", generator=g).to(torch.bfloat16)
    logits[0, 1], logits[0, V - 1] = math.inf, math.nan
    logits[1, V - 1], logits[1, 0] = math.inf, math.nan  # the NaN first, in another thread's columns
    target = torch.tensor([1, V - 1, 2, 3, IGNORE, 5], device="cuda")
    dloss = torch.ones(6, device="cuda")
    for opts in ({}, dict(label_smoothing=0.1), dict(softcap=30.0), dict(softcap=30.0, label_smoothing=0.1)):
        loss, dx, lse = oink.cross_entropy_fwd_bwd(dloss, logits, target, return_lse=True, **opts)
        f_loss, f_lse = oink.cross_entropy_forward(logits, target, **opts)
        assert loss[:2].isnan().all() and lse[:2].isnan().all() and dx[:2].isnan().all()
        assert f_loss[:2].isnan().all() and f_lse[:2].isnan().all()
        finite_lse = torch.where(lse.isnan(), 10.0, lse)  # the backward's own NaN: the logit's, not the lse's
        d = oink.cross_entropy_backward(dloss, logits, target, finite_lse, **opts)
        assert d[0, V - 1].isnan() and d[1, 0].isnan() and not d[2:].isnan().any()
        e_loss, e_dx = R.cross_entropy_fwd_bwd(dloss[2:], logits[2:], target[2:], **opts)
        close_family(loss[2:], e_loss, "cross_entropy_loss", torch.float32, f"other rows {opts}")
        close_family(dx[2:], e_dx, "softmax", torch.bfloat16, f"other rows' dx {opts}")


@pytest.mark.parametrize("opts", ["plain", "softcap", "all"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("N", (1000, 32000, 50257, 128256, 262144))
def test_fused_in_place(N, dtype, opts, seed):
    """``cross_entropy_fwd_bwd_`` (linear_cross_entropy's chunks): loss, lse and the dlogits written over
    the logits against the reference, on rows holding +inf logits too (their count read from the row
    before any thread stores over it), through the kernel."""
    o = {} if opts == "plain" else OPTIONS[opts]
    logits, target, dloss = _case(37, N, dtype, seed)
    logits[3, 5] = math.inf
    logits[4, :] = math.inf
    logits[5, 7], logits[5, 9] = math.inf, math.inf
    target[5] = 9
    assert "kernel" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target, IGNORE, **o)
    e_loss, e_dx, e_lse = R.cross_entropy_fwd_bwd(dloss, logits, target, IGNORE, return_lse=True, **o)
    x = logits.clone()
    loss, lse = torch.ops.oink.cross_entropy_fwd_bwd_(dloss, x, target, IGNORE, **o)
    family = "cross_entropy_capped_loss" if "softcap" in o and dtype != torch.float32 else "cross_entropy_loss"
    close_family(loss, e_loss, family, torch.float32, "loss")
    close_family(lse, e_lse, family, torch.float32, "lse")
    close_family(x, e_dx, "softmax", dtype, "dlogits in place")


def _fused_against_float64(logits, target, dloss, opts, dtype, inplace, what):
    """The fused kernel's loss, lse and dlogits (``inplace``: the in-place op's, over a copy of the logits)
    against the float64 reference (``oink.reference`` on float64 inputs): the loss and lse within the
    capped-loss bound on 16-bit logits (their tanh.approx), fp32's otherwise; the dlogits as ``dtype``."""
    e_loss, e_dx, e_lse = R.cross_entropy_fwd_bwd(dloss.double(), logits.double(), target, IGNORE, return_lse=True,
                                                  **opts)
    if inplace:
        dx = logits.clone()
        loss, lse = torch.ops.oink.cross_entropy_fwd_bwd_(dloss, dx, target, IGNORE, **opts)
    else:
        loss, lse, dx = _launch("fwd_bwd", logits, target, dloss, None, opts)
    family = "cross_entropy_capped_loss" if dtype != torch.float32 else "cross_entropy_loss"
    close_family(loss, e_loss, family, torch.float32, f"{what} loss")
    close_family(lse, e_lse, family, torch.float32, f"{what} lse")
    close_family(dx, e_dx, "softmax", dtype, f"{what} dlogits")
    assert torch.all(dx[target == IGNORE] == 0) and torch.all(loss[target == IGNORE] == 0)


@pytest.mark.parametrize("inplace", [False, True], ids=["", "inplace"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("N", (1000, 4097, 50257, 128256, 256000))
def test_softcap_fwd_bwd_against_float64(N, dtype, inplace, seed):
    """The fused kernels with a softcap of 30 (register-held rows: one warp, a CTA, shifted windows, clusters;
    in place and out) against the float64 reference: rows of logits
    spread 4 and 30 wide (Gemma-2's cap, most logits capped near +-c), a row of -inf but one logit, a row
    of +inf logits, +-inf at the target."""
    logits, target, dloss = _case(37, N, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    logits[:8] = (torch.randn(8, N, device="cuda", generator=g) * 30.0).to(dtype)
    logits[8, 1:] = -math.inf
    logits[9, :] = math.inf
    logits[10, 3], target[10] = math.inf, 3
    logits[11, 5], target[11] = -math.inf, 5
    _fused_against_float64(logits, target, dloss, OPTIONS["softcap"], dtype, inplace, f"{N}")


@pytest.mark.parametrize("N", (4097, 128256))
def test_softcap_z_loss_fwd_bwd_against_float64(N, seed):
    """The same with a z-loss beside the softcap (the held form's dlogits scale by 1 + 2 z lse)."""
    logits, target, dloss = _case(37, N, torch.bfloat16, seed)
    _fused_against_float64(logits, target, dloss, dict(z_loss=1e-3, softcap=30.0), torch.bfloat16, False, f"{N}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("N", (1000, 50257, 256000))
def test_softcap_backward_against_float64(N, dtype, seed):
    """The backward with a softcap of 30 (its dlogits straight from the logits as loaded), from the float64 lse,
    against the float64 reference; rows spread 4 and 30 wide, +-inf."""
    logits, target, dloss = _case(37, N, dtype, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    logits[:8] = (torch.randn(8, N, device="cuda", generator=g) * 30.0).to(dtype)
    logits[9, :] = math.inf
    logits[10, 3], target[10] = math.inf, 3
    logits[11, 5], target[11] = -math.inf, 5
    opts = OPTIONS["softcap"]
    _, e_dx, e_lse = R.cross_entropy_fwd_bwd(dloss.double(), logits.double(), target, IGNORE, return_lse=True, **opts)
    dx = _launch("backward", logits, target, dloss, e_lse.float(), opts)[2]
    close_family(dx, e_dx, "softmax", dtype, f"{N} dlogits")
    assert torch.all(dx[target == IGNORE] == 0)


@pytest.mark.parametrize("smooth", [0.0, 0.1], ids=["", "smooth"])
@pytest.mark.parametrize("cap", (30.0, 5.0))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("N", (1000, 4097, 32000, 128256, 200008))
def test_softcap_forward_of_16_bit_rows_of_every_spread(N, dtype, cap, smooth, seed):
    """The 16-bit softcap forward (tanh.approx, a third of its exps on the FMA pipe, no max taken) on rows within
    the cap, rows with one logit far past it in either direction, rows spread 3 c wide, fp16 logits too, a NaN:
    loss and lse against the float64 reference."""
    M = 24
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, N, device="cuda", generator=g, dtype=torch.float64) * (cap / 5)
    cols = torch.randint(0, N, (M,), device="cuda", generator=g)
    for r in range(8, 12):  # one logit past the cap (either sign)
        x[r, cols[r]] = (1.0 if r % 2 else -1.0) * cap * 1.5
    x[16:20] = torch.randn(4, N, device="cuda", generator=g, dtype=torch.float64) * 3 * cap
    x[20, cols[20]] = math.nan
    logits = x.to(dtype)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    target[1::5] = IGNORE
    opts = dict(softcap=cap, label_smoothing=smooth)
    loss, lse = kernel("cross_entropy_forward", logits=logits, target=target, ignore_index=IGNORE, **opts)
    e_loss, e_lse = R.cross_entropy_forward(logits.double(), target, IGNORE, **opts)
    assert lse[20].isnan() and (loss[20].isnan() or target[20] == IGNORE)
    rows = torch.arange(M, device="cuda") != 20
    close_family(loss[rows], e_loss[rows].float(), "cross_entropy_capped_loss", torch.float32, "loss")
    close_family(lse[rows], e_lse[rows].float(), "cross_entropy_capped_loss", torch.float32, "lse")
