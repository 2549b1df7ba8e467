"""Kernels on rows that break naive formulas, and Quack's arguments on the kernel path (GPU).

Rows: a large mean with a small spread (the LayerNorm variance must not cancel), constant rows
(zero variance), and one huge outlier, at ragged and aligned widths, for every norm and softmax
kernel; compared against float64 formulas written here, outputs checked for NaN. The extra
absolute allowance (2e-3) for the large-mean rows is fp32's own limit: the row mean is summed in
fp32, so it carries a few ulps of |mean| (~1e-4 at 1000) that divide by the spread (0.3); the bug
this guards against was 0.07 at N=769 (issue #16).
"""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from pytest_oink.tolerances import tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

WIDTHS = (769, 1000, 1128, 4096, 4097, 16384)
KINDS = ("large_mean", "constant", "outlier")
DTYPES = (torch.float32, torch.bfloat16)
M = 37


def rows(kind: str, N: int, dtype, g) -> torch.Tensor:
    """[M, N] in ``dtype``; fresh random data for each call."""
    base = torch.randn(M, N, device="cuda", generator=g)
    if kind == "large_mean":  # Quack's case: mean ~1000 (rows differ), spread ~0.3
        x = 1000.0 + torch.arange(M, device="cuda").unsqueeze(1) * 10.0 + 0.3 * base
    elif kind == "constant":  # dyadic values: the row sum is exact in fp32
        x = torch.full((M, N), 1.5, device="cuda") * (1 + torch.arange(M, device="cuda").unsqueeze(1) % 3)
    else:  # in every other row the first column (LayerNorm's pivot: its second round, every warp's rows alike)
        x = base.clone()
        x[0::2, 0] = 1e4
        x[1::2, (7 * N) // 11] = 1e4
    return x.to(dtype)


def _allowance(kind: str) -> float:
    return {"large_mean": 2e-3, "constant": 2e-3, "outlier": 0.0}[kind]


def check(actual, expect64, family, dtype, kind, what):
    atol, rtol = tolerance(family, dtype)
    assert not torch.isnan(actual).any(), f"{what}: NaN"
    torch.testing.assert_close(actual.double(), expect64, atol=atol + _allowance(kind), rtol=rtol,
                               msg=lambda m: f"{what} ({kind}): {m}")


def _rms64(h, w, eps=1e-6):
    return h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w


def _ln64(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    rstd = 1 / torch.sqrt((xc * xc).mean(-1, keepdim=True) + eps)
    return xc * rstd * w + b, rstd.squeeze(-1), mu.squeeze(-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", WIDTHS)
def test_layernorm_rows(kind, dtype, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = rows(kind, N, dtype, g)
    w, b = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    assert "kernel" in oink.explain("layernorm", x, w, b)
    y, rstd, mean = oink.layernorm(x, w, b, return_rstd=True, return_mean=True)
    ey, erstd, emean = _ln64(x.double(), w.double(), b.double())
    check(y, ey, "layernorm", dtype, kind, "y")
    torch.testing.assert_close(mean.double(), emean, atol=1e-5 * emean.abs().max().item() + 1e-6, rtol=1e-6)
    if kind != "constant":  # rstd = 1/sqrt(eps) there: any rounding of the mean shows, relatively
        torch.testing.assert_close(rstd.double(), erstd, atol=0, rtol=2e-3 if kind == "large_mean" else 1e-4)
    # backward with the statistics the forward stored: dw, db treat them as constants
    dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    dx, dw, db = oink.layernorm_backward(dy, x, w, rstd, mean, b)
    xhat = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    wdy = dy.double() * w.double()
    ex = (wdy - xhat * (xhat * wdy).sum(-1, keepdim=True) / N - wdy.sum(-1, keepdim=True) / N) * rstd.double()[:, None]
    check(dx, ex, "norm_backward", dtype, kind, "dx")
    check(dw, (dy.double() * xhat).sum(0), "weight_grad", torch.float32, kind, "dw")
    check(db, dy.double().sum(0), "weight_grad", torch.float32, "outlier", "db")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", WIDTHS)
def test_rmsnorm_rows(kind, dtype, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, res = rows(kind, N, dtype, g), rows(kind, N, dtype, g)
    w = torch.randn(N, device="cuda", generator=g)
    assert "kernel" in oink.explain("rmsnorm_forward", x, w, None, res)
    y, rstd, r_out = oink.rmsnorm_forward(x, w, residual=res, store_rstd=True)
    assert torch.equal(r_out, (x.float() + res.float()).to(dtype))
    h = r_out.double()
    check(y, _rms64(h, w.double()), "rmsnorm", dtype, kind, "y")
    xi, ri = x.clone(), res.clone()
    oink.fused_add_rmsnorm_(xi, ri, w.to(dtype))
    assert torch.equal(ri, r_out)
    check(xi, _rms64(h, w.to(dtype).double()), "rmsnorm", dtype, kind, "fused add in place")
    dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    dx, dw, _, _ = oink.rmsnorm_backward(r_out, w, dy, rstd)
    hd, wd = h.clone().requires_grad_(), w.double().requires_grad_()
    gx, gw = torch.autograd.grad(_rms64(hd, wd), (hd, wd), dy.double())
    check(dx, gx, "norm_backward", dtype, kind, "dx")
    check(dw, gw, "weight_grad", torch.float32, "outlier", "dw")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", WIDTHS)
def test_softmax_rows(kind, dtype, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = rows(kind, N, dtype, g)
    dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    assert "kernel" in oink.explain("softmax_forward", x)
    y64 = torch.softmax(x.double(), -1)
    check(oink.softmax_forward(x), y64, "softmax", dtype, "outlier", "y")
    g64 = y64 * (dy.double() - (dy.double() * y64).sum(-1, keepdim=True))
    check(oink.softmax_fwd_bwd(dy, x), g64, "norm_backward", dtype, "outlier", "fused dx")
    y = y64.to(dtype)
    yd = y.double()
    check(oink.softmax_backward(dy, y), yd * (dy.double() - (dy.double() * yd).sum(-1, keepdim=True)),
          "norm_backward", dtype, "outlier", "dx")


# ---- Quack's arguments on the kernel path
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("N", (769, 4096, 7168))
@pytest.mark.parametrize("offset", (0.0, 1.0))
def test_rmsnorm_weight_dtype_and_offset(x_dtype, w_dtype, N, offset, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(300, N, device="cuda", generator=g).to(x_dtype)
    w = (0.1 * torch.randn(N, device="cuda", generator=g)).to(w_dtype)
    b = torch.randn(N, device="cuda", generator=g).to(w_dtype)
    assert "kernel" in oink.explain("rmsnorm_forward", x, w, b, weight_offset=offset)
    y, rstd, _ = oink.rmsnorm_forward(x, w, b, store_rstd=True, weight_offset=offset)
    ey, erstd, _ = R.rmsnorm_forward(x, w, b, store_rstd=True, weight_offset=offset)
    check(y, ey.double(), "rmsnorm", x_dtype, "outlier", "y")
    dy = torch.randn(300, N, device="cuda", generator=g).to(x_dtype)
    dx, dw, db, _ = oink.rmsnorm_backward(x, w, dy, rstd, has_bias=True, weight_offset=offset)
    ex, ew, eb, _ = R.rmsnorm_backward(x, w, dy, rstd, has_bias=True, weight_offset=offset)
    assert dw.dtype == db.dtype == w_dtype
    check(dx, ex.double(), "norm_backward", x_dtype, "outlier", "dx")
    scale = max(1.0, ew.float().abs().max().item())
    check(dw.float() / scale, ew.double() / scale, "weight_grad", w_dtype, "outlier", "dw")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("N", (1000, 4096, 8192))
def test_rmsnorm_fp32_residual_stream_and_out_dtype(dtype, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(257, N, device="cuda", generator=g).to(dtype)
    res = torch.randn(257, N, device="cuda", generator=g)  # the fp32 residual stream
    w = torch.randn(N, device="cuda", generator=g)
    for res_in, res_dtype in ((res, None), (res.to(dtype), torch.float32)):
        assert "kernel" in oink.explain("rmsnorm_forward", x, w, None, res_in, residual_dtype=res_dtype)
        y, rstd, r_out = oink.rmsnorm_forward(x, w, residual=res_in, store_rstd=True, residual_dtype=res_dtype)
        assert r_out.dtype == torch.float32 and y.dtype == dtype
        assert torch.equal(r_out, x.float() + res_in.float())
        check(y, _rms64(r_out.double(), w.double()), "rmsnorm", dtype, "outlier", "y")
    y32 = oink.rmsnorm_forward(x, w.to(dtype), out_dtype=torch.float32)[0]
    assert y32.dtype == torch.float32
    check(y32, _rms64(x.double(), w.to(dtype).double()), "rmsnorm", torch.float32, "outlier", "fp32 out")
    # autograd through an fp32 residual stream with bf16 activations
    xg, rg = x.clone().requires_grad_(), res.to(dtype).requires_grad_()
    wg = w.clone().requires_grad_()
    yg, rog = oink.rmsnorm(xg, wg, residual=rg, residual_dtype=torch.float32, prenorm=True)
    dy, dr = torch.randn_like(yg), torch.randn_like(rog)
    (yg.float() * dy.float()).sum().add((rog * dr).sum()).backward()
    hd = (x.double() + res.to(dtype).double()).requires_grad_()
    wd = w.double().requires_grad_()
    ey = _rms64(hd, wd)
    gh, gw = torch.autograd.grad((ey * dy.double()).sum() + (hd * dr.double()).sum(), (hd, wd))
    check(xg.grad, gh, "norm_backward", dtype, "outlier", "dx")
    check(rg.grad, gh, "norm_backward", dtype, "outlier", "dresidual")


@pytest.mark.parametrize("V", (1000, 32000, 128256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_cross_entropy_weight_and_lse_partial(V, dtype, seed):
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(seed)
    M2 = 129
    logits = torch.randn(M2, V, device="cuda", generator=g).to(dtype)
    target = torch.randint(0, V, (M2,), device="cuda", generator=g)
    target[::5] = -100
    cw = torch.rand(V, device="cuda", generator=g) + 0.1
    x64 = logits.double()
    assert "kernel" in oink.explain("cross_entropy_forward", logits, target, weight=cw)
    for reduction in ("none", "mean", "sum"):
        loss, lse = oink.cross_entropy_forward(logits, target, reduction=reduction, weight=cw)
        expect = F.cross_entropy(x64, target, weight=cw.double(), reduction=reduction)
        check(loss, expect, "cross_entropy_loss", torch.float32, "outlier", f"loss {reduction}")
    check(lse, torch.logsumexp(x64, -1), "cross_entropy_loss", torch.float32, "outlier", "lse")
    dloss = torch.randn(M2, device="cuda", generator=g)
    xd = x64.clone().requires_grad_()
    (gx,) = torch.autograd.grad(F.cross_entropy(xd, target, weight=cw.double(), reduction="none"), xd, dloss.double())
    check(oink.cross_entropy_backward(dloss, logits, target, lse, weight=cw), gx, "norm_backward", dtype, "outlier",
          "dlogits")
    loss2, dx2, lse2 = oink.cross_entropy_fwd_bwd(dloss, logits, target, weight=cw, return_lse=True)
    check(dx2, gx, "norm_backward", dtype, "outlier", "fused dlogits")
    check(lse2, torch.logsumexp(x64, -1), "cross_entropy_loss", torch.float32, "outlier", "fused lse")
    check(loss2, F.cross_entropy(x64, target, weight=cw.double(), reduction="none"), "cross_entropy_loss",
          torch.float32, "outlier", "fused loss")
    if V % 8 == 0:  # vocab-parallel: 8 shards' logsumexps, the target logit gathered [M]
        lp = torch.logsumexp(logits.float().view(M2, 8, V // 8), -1)
        tl = logits.float().gather(-1, target.clamp_min(0)[:, None]).squeeze(-1)
        for kw in (dict(lse_partial=lp), dict(lse_partial=lp, target_logit=tl), dict(target_logit=tl)):
            loss3, lse3 = oink.cross_entropy_forward(logits, target, **kw)
            check(loss3, F.cross_entropy(x64, target, reduction="none"), "cross_entropy_loss", torch.float32,
                  "outlier", f"loss {sorted(kw)}")


def test_cross_entropy_inplace_backward_under_compile(seed):
    """Regression (#16): inplace_backward=True under torch.compile failed in AOTAutograd (a leaf
    that requires grad mutated in place); compiled graphs now take the out-of-place backward."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (0.1 * torch.randn(77, 1024, device="cuda", generator=g)).bfloat16().requires_grad_()
    target = torch.randint(0, 1024, (77,), device="cuda", generator=g)
    f = torch.compile(oink.cross_entropy, fullgraph=True)
    loss = f(x, target, reduction="none", inplace_backward=True)
    dloss = torch.randn_like(loss)
    (dx,) = torch.autograd.grad(loss, x, dloss)
    xd = x.detach().double().requires_grad_()
    (ex,) = torch.autograd.grad(F.cross_entropy(xd, target, reduction="none"), xd, dloss.double())
    check(dx, ex, "norm_backward", torch.bfloat16, "outlier", "dlogits")


# head widths off 16-byte boundaries too (100, 78: the backward's budget counted in values, rows of 8 threads)
@pytest.mark.parametrize("shape", [(2, 16, 4, 64), (1, 1, 32, 128), (3, 50, 40, 256), (4, 33, 8, 1000), (2, 9, 4, 100),
                                   (3, 7, 6, 78)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_rmsnorm_per_head_kernel(shape, dtype, seed):
    """QK-norm with per-head weight and bias [H, D]: forward and backward on the kernel path."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, D = shape[-2:]
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    w, b = torch.randn(H, D, device="cuda", generator=g), torch.randn(H, D, device="cuda", generator=g)
    assert "kernel" in oink.explain("rmsnorm_forward", x, w, b)
    y, rstd, _ = oink.rmsnorm_forward(x, w, b, store_rstd=True)
    x64 = x.double()
    check(y, _rms64(x64, w.double()) + b.double(), "rmsnorm", dtype, "outlier", "y")
    dy = torch.randn(shape, device="cuda", generator=g).to(dtype)
    from oink.kernels.rmsnorm_bwd_rules import backward_launch, head_launch

    # a CTA must hold whole heads: fp32 at 40 x 256 would need 1280 threads, so it is the reference
    fits = head_launch(backward_launch(D, x.element_size() * 8, "sm_90a"), H) is not None
    route = oink.explain("rmsnorm_backward", x, w, dy, rstd, has_bias=True)
    assert ("kernel" in route) if fits else ("whole heads" in route), route
    dx, dw, db, _ = oink.rmsnorm_backward(x, w, dy, rstd, has_bias=True)
    xd, wd = x64.clone().requires_grad_(), w.double().requires_grad_()
    gx, gw = torch.autograd.grad(_rms64(xd, wd), (xd, wd), dy.double())
    assert dw.shape == db.shape == (H, D)
    check(dx, gx, "norm_backward", dtype, "outlier", "dx")
    check(dw, gw, "weight_grad", torch.float32, "outlier", "dw")
    check(db, dy.double().reshape(-1, H, D).sum(0), "weight_grad", torch.float32, "outlier", "db")


# ---------------------------------------------------------------- issue #35: non-finite rows, refused in-place calls
def _nonfinite_rows(N, dtype, g):
    """Rows 0-3 hold a NaN, a +inf, a -inf, +inf and -inf together; the rest are finite."""
    x = torch.randn(M, N, device="cuda", generator=g)
    x[0, N // 2] = float("nan")
    x[1, 0] = float("inf")
    x[2, N - 1] = -float("inf")
    x[3, 0], x[3, N - 1] = float("inf"), -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", WIDTHS)
def test_layernorm_statistics_of_a_nonfinite_row_are_nan(dtype, N, seed):
    """rstd is NaN on a row holding NaN or +-inf, as the reference's (the variance is undefined);
    the kernel's clamp of the variance at 0 must not turn NaN into 0 (rstd = 1/sqrt(eps))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _nonfinite_rows(N, dtype, g)
    w, b = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    assert "kernel" in oink.explain("layernorm", x, w, b)
    y, rstd, mean = oink.layernorm(x, w, b, return_rstd=True, return_mean=True)
    assert torch.isnan(rstd[:4]).all(), f"rstd of the non-finite rows: {rstd[:4].tolist()}"
    assert not torch.isfinite(mean[:4]).any(), f"mean of the non-finite rows: {mean[:4].tolist()}"
    assert torch.isnan(y[:4]).all()
    ey, erstd, emean = _ln64(x[4:].double(), w.double(), b.double())
    check(y[4:], ey, "layernorm", dtype, "outlier", "y of the finite rows")
    torch.testing.assert_close(rstd[4:].double(), erstd, atol=0, rtol=1e-4)


@pytest.mark.parametrize("V", (1000, 4096, 32000, 50257, 128256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
def test_cross_entropy_posinf_logits_give_the_limit(V, dtype, seed):
    """+inf logits on the kernel path (#35 defect 2: exp2(x - m) was NaN at x = m = +inf): the
    reference's limits (softmax 1/k on the k +inf logits, loss log k at one of them, +inf otherwise,
    lse +inf), forward (register-held and streamed rows), backward and fused; -inf masking unchanged."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cases = (({2: 1}, 2), ({5: 1}, 2), ({2: 1, 6: 1}, 2), ({0: 1, 1: 1, V - 1: 1}, 4), ({3: 1, 0: -1}, 3),
             ({0: -1, 7: -1}, 3), ({}, 1), ({4: 1}, -100), ({V // 2: 1, V // 2 + 1: 1}, V // 2 + 1))
    logits = torch.randn(len(cases), V, device="cuda", generator=g)
    for i, (cols, _) in enumerate(cases):
        for c, sign in cols.items():
            logits[i, c] = sign * float("inf")
    logits = logits.to(dtype)
    target = torch.tensor([t for _, t in cases], device="cuda")
    dloss = torch.rand(len(cases), device="cuda", generator=g) + 0.5
    assert "kernel" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target)
    cpu = dict(logits=logits.cpu(), target=target.cpu())
    e_loss, e_lse = R.cross_entropy_forward(**cpu)
    e_loss2, e_d, _ = R.cross_entropy_fwd_bwd(dloss.cpu(), **cpu, return_lse=True)
    atol, rtol = tolerance("norm_backward", dtype)
    loss, lse = oink.cross_entropy_forward(logits, target)
    torch.testing.assert_close(loss.cpu(), e_loss, atol=1e-4, rtol=1e-5, msg=lambda m: f"forward loss: {m}")
    torch.testing.assert_close(lse.cpu(), e_lse, atol=1e-4, rtol=1e-5, msg=lambda m: f"forward lse: {m}")
    loss2, d, lse2 = oink.cross_entropy_fwd_bwd(dloss, logits, target, return_lse=True)
    torch.testing.assert_close(loss2.cpu(), e_loss2, atol=1e-4, rtol=1e-5, msg=lambda m: f"fused loss: {m}")
    torch.testing.assert_close(lse2.cpu(), e_lse, atol=1e-4, rtol=1e-5, msg=lambda m: f"fused lse: {m}")
    torch.testing.assert_close(d.float().cpu(), e_d.float(), atol=atol, rtol=rtol, msg=lambda m: f"fused dx: {m}")
    db = oink.cross_entropy_backward(dloss, logits, target, e_lse.cuda())
    torch.testing.assert_close(db.float().cpu(), e_d.float(), atol=atol, rtol=rtol, msg=lambda m: f"backward: {m}")


@pytest.mark.parametrize("kind", ("leaf_requires_grad", "inference"))
def test_inplace_ops_refuse_before_the_kernel_writes(kind):
    """The kernels write in place without torch's checks: a leaf that requires grad (grad mode on)
    or an inference tensor outside inference mode is refused before the launch, inputs unchanged."""
    N = 4096
    x, res = (torch.randn(8, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5

    def spoil(t):
        if kind == "inference":
            with torch.inference_mode():
                return t.clone()
        return t.clone().requires_grad_()

    for name, extra, written in (("fused_add_rmsnorm_", {}, ("x", "residual")),
                                 ("add_rmsnorm_fp8quant", {"group_size": 128}, ("residual",))):
        fn = getattr(oink, name)
        assert "kernel" in oink.explain(name, x, res, w, **extra)
        for n in written:
            a = {"x": x.clone(), "residual": res.clone()}
            a[n] = spoil(a[n])
            before = {k: v.detach().clone() for k, v in a.items()}
            with pytest.raises(RuntimeError, match=f"^{n}: "):
                fn(a["x"], a["residual"], w, **extra)
            for k, v in before.items():
                assert torch.equal(a[k].detach(), v), f"{name}: {k} written by a call that raised"
