"""CrossEntropy kernels on the GPU against the fp32 reference (outputs from a NaN-poisoned allocator;
about 30% of the rows ignored)."""
from __future__ import annotations

import math

import pytest
import torch

import oink
from oink import config
from oink import reference as R
from pytest_oink.tolerances import tolerance
from tests.gpu_helpers import DTYPES, MS, close_family, kernel, poison_allocator, shapes_within

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

# 12800 and 98304: the fused mode's cluster rule at widths no search named
NS = (64, 1000, 3072, 6144, 12800, 50257, 98304, 128256, 262144)
IGNORE = -100


def _case(M, N, dtype, seed, target_dtype=torch.int64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(M, N, device="cuda", generator=g) * 4).to(dtype)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    target[torch.rand(M, device="cuda", generator=g) < 0.3] = IGNORE
    dloss = torch.randn(M, device="cuda", generator=g)
    return logits, target.to(target_dtype), dloss


def _launch_checked(mode, logits, target, dtype, dloss=None, inplace=False):
    """``mode``'s kernel on ``logits`` (``dispatch.launch``: no checks), its outputs from a poisoned
    allocator, or with ``inplace`` the dlogits written over the logits (the in-place ops), checked against
    the fp32 reference: lse (forward), loss (forward, fwd_bwd) and dlogits (backward, fwd_bwd).
    -> (loss, dlogits)."""
    M, N = logits.shape
    loss_ref, lse_ref = R.cross_entropy_forward(logits, target, IGNORE)
    dx_ref = None if mode == "forward" else R.cross_entropy_backward(dloss, logits, target, lse_ref, IGNORE)
    poison_allocator(M * N * logits.element_size() + (1 << 26))
    a = dict(logits=logits, target=target, ignore_index=IGNORE)
    loss = dx = None
    if mode == "forward":
        loss, lse = kernel("cross_entropy_forward", **a)
        close_family(lse, lse_ref, "cross_entropy_loss", torch.float32, "lse")
    elif mode == "backward":
        dx = kernel("cross_entropy_backward_" if inplace else "cross_entropy_backward", dloss=dloss, lse=lse_ref, **a)
    elif inplace:
        loss, _ = kernel("cross_entropy_fwd_bwd_", dloss=dloss, **a)
    else:
        loss, dx = kernel("cross_entropy_fwd_bwd", dloss=dloss, **a)
    if inplace:
        dx = logits
    if mode != "backward":
        close_family(loss, loss_ref, "cross_entropy_loss", torch.float32, "loss")
    if mode != "forward":
        close_family(dx, dx_ref, "softmax", dtype, "dlogits")
    return loss, dx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", shapes_within(MS, NS, 2**28))  # one case within a few GB
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_cross_entropy_kernels(mode, dtype, N, M, seed):
    logits, target, dloss = _case(M, N, dtype, seed)
    loss, dx = _launch_checked(mode, logits, target, dtype, dloss)
    if mode != "backward":
        assert torch.all(loss[target == IGNORE] == 0)
    if mode != "forward":
        assert torch.all(dx[target == IGNORE] == 0)


def _edge_logits(M, N, ld_pad, dtype, g):
    """Logits rows ``ld_pad`` elements apart beyond N (a view of a wider buffer), with a large
    logit at the first and last column of every third row and in the padding (not the row's
    either): what a window reaching past its row would take in."""
    buf = (torch.randn(M, N + ld_pad, device="cuda", generator=g) * 4).to(dtype)
    buf[::3, 0] = 60.0
    buf[::3, N - 1] = 60.0
    buf[:, N:] = 60.0
    return buf[:, :N]


@pytest.mark.parametrize("windows", [None, False], ids=["windows", "elements"])
@pytest.mark.parametrize("ld_pad", [0, 2, 7])
@pytest.mark.parametrize("N", [4097, 32001, 50257, 100277])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shifted_rows_read_only_their_row(dtype, N, ld_pad, windows, seed):
    """The forward reads rows that start off a 16-byte boundary through aligned windows holding the ends of the rows
    beside them (the rule), or by element (the ``windows`` setting False): a large logit at the first and last
    column of every third row would raise its neighbours' lse if their windows let it in. Rows ``ld_pad`` elements
    apart beyond N (a view of a wider buffer)."""
    M = 301
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = _edge_logits(M, N, ld_pad, dtype, g)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    with config.override(windows=windows):
        _launch_checked("forward", logits, target, dtype)


@pytest.mark.parametrize("windows", [None, False], ids=["windows", "elements"])
@pytest.mark.parametrize("dx_rows", ["in_place", "dense"])
@pytest.mark.parametrize("ld_pad", [0, 7])
@pytest.mark.parametrize("N", [4097, 32001, 50257, 100277])
@pytest.mark.parametrize("mode", ["backward", "fwd_bwd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shifted_rows_write_only_their_row(dtype, mode, N, ld_pad, dx_rows, windows, seed):
    """dlogits of rows off 16-byte boundaries: stored through the logits' aligned windows where
    dx's rows lie at the same offsets (dense logits, or in place: whole vectors inside the row, the two
    edge vectors a column at a time, as neighbouring rows' CTAs write the rest of them), scalar stores
    where they do not (dense dx under padded logits). Large logits at the rows' ends and in the padding;
    every row must match the reference, and in place the padding between the rows keep its logits."""
    M = 301
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = _edge_logits(M, N, ld_pad, dtype, g)
    target = torch.randint(0, N, (M,), device="cuda", generator=g)
    target[::5] = N - 1  # the target in an edge vector
    target[1::5] = 0
    dloss = torch.randn(M, device="cuda", generator=g)
    with config.override(windows=windows):  # False: the fused mode's rows by element
        _launch_checked(mode, logits, target, dtype, dloss, inplace=dx_rows == "in_place")
    rows = logits.as_strided((M, N + ld_pad), (N + ld_pad, 1))
    assert (rows[:, N:] == 60.0).all(), "a store left its row"


@pytest.mark.parametrize("pad", [24, 0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [520, 4104, 40000, 50257, 128256, 200008, 262144])
@pytest.mark.parametrize("M", [1, 7, 300])
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_streamed_rows(monkeypatch, mode, dtype, N, M, pad, seed):
    """Streamed rows (forced at every width, ``ce_stream=True``: a row in passes, a running (max, sum
    of exp) a thread; the dlogits modes read the row again to store dx) against the fp32 reference
    where the row's max sits in its first or last column, where whole passes of a row are -inf
    (masked), where every logit is far below zero, with rows ``pad`` elements apart beyond N (a view of
    a wider buffer) or dense: rows of 50257 start off 16-byte boundaries and go through their aligned
    windows (the dlogits too where their dense rows lie at the logits' offsets: dense logits); targets
    some ignored."""
    from tests.helpers import set_dev

    set_dev(monkeypatch, ce_stream=True)
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(M, N + pad, device="cuda", generator=g) * 4
    logits = buf[:, :N]
    logits[0, N - 1] = 40.0
    if M > 1:
        logits[1, 0] = 40.0
        logits[2, : N * 3 // 4] = -math.inf
        logits[3] -= 300.0
    logits = buf.to(dtype)[:, :N]
    target = torch.randint(N * 3 // 4, N, (M,), device="cuda", generator=g)
    target[torch.rand(M, device="cuda", generator=g) < 0.3] = IGNORE
    dloss = torch.randn(M, device="cuda", generator=g)
    _launch_checked(mode, logits, target, dtype, dloss)


def _limit_rows(N, dtype, g):
    """Rows of N logits holding the cases of the +inf limit, NaN, -inf masks and ignored targets, streamed as a
    thread's tiles (``STREAM_UNITS`` 128-bit units of each of 128 or 256 threads, 4096-8192 columns; a thread's
    columns of one tile are a vector apart, of its next tile a tile apart): -> (logits, target)."""
    inf, nan = math.inf, math.nan
    q = N * 3 // 4
    cases = [
        ({0: inf}, 0),  # loss log 1 at the row's first column
        ({N - 1: inf}, 5),  # the last column (the last CTA of a cluster): loss +inf
        ({3: inf, N // 2: inf}, N // 2),  # two threads: log 2
        ({8: inf, 9: inf, 10: inf}, 9),  # one vector of one thread: log 3
        ({7: inf, 7 + 8192: inf, 7 + 16384: inf}, 4),  # one thread's lane in three tiles: +inf
        ({1: inf, N - 2: nan}, 1),  # NaN beside +inf (another thread's, a later tile): NaN
        ({N - 1: nan, 0: inf}, IGNORE),  # ignored: loss 0 (lse NaN)
        ({("mask", 0, q): -inf}, q + 11),  # -inf over three quarters (whole tiles, passes of every thread)
        ({("mask", 0, N - 3): -inf, ("mask", N - 2, N): -inf}, N - 3),  # one logit left: loss 0
        ({("mask", 0, N // 2): -inf, q: inf}, q),  # a mask and a +inf beyond it: log 1
        ({5: inf}, IGNORE),  # ignored, lse +inf
        ({N - 1: 40.0}, N - 1),  # finite: the max in the last column
        ({}, IGNORE),
        ({("mask", 0, N): inf}, 17),  # every logit +inf: log N
        ({2: -inf, 3: inf}, 2),  # a -inf target beside a +inf: +inf
        ({("mask", 0, N): -300.0, 6: -290.0}, 6),  # every logit far below zero
    ]
    logits = torch.randn(len(cases), N, device="cuda", generator=g) * 4
    for i, (cols, _) in enumerate(cases):
        for c, v in cols.items():
            if isinstance(c, tuple):
                logits[i, c[1]:c[2]] = v
            else:
                logits[i, c] = v
    target = torch.tensor([t for _, t in cases], device="cuda")
    return logits.to(dtype), target


def _close_nan(actual, expected, family, dtype, what):
    """``close_family`` where NaN (and +-inf) must match exactly."""
    atol, rtol = tolerance(family, dtype)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("opts", ["plain", "smooth", "zloss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N", [19298, 49207, 129280, 256000])
@pytest.mark.parametrize("mode", ["forward", "fwd_bwd"])
def test_streamed_forward_limits(monkeypatch, mode, N, dtype, opts, seed):
    """The streamed forward (these widths stream by default; the fused mode forced to, ``ce_stream=True``) on rows
    of the +inf limit (lse +inf, loss log k at one of k +inf logits, +inf elsewhere; label smoothing's and the
    z-loss's limits), NaN beside +inf (NaN), -inf masks over whole tiles, a row of one finite logit, every logit
    +inf, ignored targets (loss 0), against the reference on the same logits. Each tile folds with no +inf
    branch; a thread whose max is +inf counts its +inf logits by reading its tiles again."""
    from oink.kernels import cross_entropy_rules as rules
    from oink.kernels.row_rules import shifted_window
    from tests.helpers import set_dev

    o = {"plain": {}, "smooth": dict(label_smoothing=0.1), "zloss": dict(z_loss=1e-4)}[opts]
    if mode == "fwd_bwd" and opts == "zloss":
        pytest.skip("a z-loss's gradient at +inf logits is undefined (the kernels leave it as it falls)")
    set_dev(monkeypatch, ce_stream=True if mode == "fwd_bwd" else None)
    bits = 16 if dtype == torch.bfloat16 else 32
    assert rules.stream_rows(shifted_window(N, bits) or N, bits, mode)
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits, target = _limit_rows(N, dtype, g)
    dloss = torch.rand(len(target), device="cuda", generator=g) + 0.5
    cpu = dict(logits=logits.cpu(), target=target.cpu(), ignore_index=IGNORE, **o)
    e_loss, e_lse = R.cross_entropy_forward(**cpu)
    if mode == "forward":
        assert "kernel" in oink.explain("cross_entropy_forward", logits, target, IGNORE, **o)
        loss, lse = oink.cross_entropy_forward(logits, target, IGNORE, **o)
    else:
        assert "kernel" in oink.explain("cross_entropy_fwd_bwd", dloss, logits, target, IGNORE, **o)
        loss, dx, lse = oink.cross_entropy_fwd_bwd(dloss, logits, target, IGNORE, return_lse=True, **o)
        e_dx = R.cross_entropy_fwd_bwd(dloss.cpu(), **cpu)[1]
        _close_nan(dx, e_dx, "softmax", dtype, "dlogits")
    _close_nan(loss, e_loss, "cross_entropy_loss", torch.float32, "loss")
    _close_nan(lse, e_lse, "cross_entropy_loss", torch.float32, "lse")
    assert torch.all(loss[target == IGNORE] == 0)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
def test_public_api_routes_to_kernel(reduction, target_dtype, seed):
    logits, target, dloss = _case(4097, 50257, torch.bfloat16, seed, target_dtype)
    assert "kernel" in oink.explain("cross_entropy_forward", logits, target, IGNORE, reduction)
    loss, lse = oink.cross_entropy_forward(logits, target, IGNORE, reduction)
    loss_ref, lse_ref = R.cross_entropy_forward(logits, target, IGNORE, reduction)
    close_family(loss, loss_ref, "cross_entropy_loss", torch.float32, "loss")
    close_family(lse, lse_ref, "cross_entropy_loss", torch.float32, "lse")
    scalar = torch.tensor(0.5, device="cuda")
    close_family(oink.cross_entropy_backward(scalar, logits, target, lse), R.cross_entropy_backward(
        scalar, logits, target, lse_ref), "softmax", torch.bfloat16, "dlogits with a scalar dloss")
    loss2, dx2 = oink.cross_entropy_fwd_bwd(dloss, logits, target, IGNORE)
    close_family(loss2, R.cross_entropy_forward(logits, target, IGNORE)[0], "cross_entropy_loss", torch.float32,
                 "fused")
    close_family(dx2, R.cross_entropy_fwd_bwd(dloss, logits, target, IGNORE)[1], "softmax", torch.bfloat16, "fused dx")


@pytest.mark.parametrize("inplace", [False, True])
def test_differentiable_cross_entropy(inplace, seed):
    logits, target, _ = _case(1000, 128256, torch.bfloat16, seed)
    leaf = logits.clone().requires_grad_(True)
    work = leaf * 1  # a non-leaf whose storage the in-place backward may take over
    loss = oink.cross_entropy(work, target, inplace_backward=inplace)
    (got,) = torch.autograd.grad(loss, [leaf])
    x = logits.float().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(x, target, ignore_index=IGNORE)
    (want,) = torch.autograd.grad(ref, [x])
    close_family(loss, ref, "cross_entropy_loss", torch.float32, "loss")
    close_family(got, want, "softmax", torch.bfloat16, "dlogits")


def test_out_of_range_target_raises_with_value_checks(monkeypatch):
    """OINK_CHECK_VALUES=1: the target range is checked on the host (one sync) and a bad one raises."""
    from oink import config

    monkeypatch.setenv("OINK_CHECK_VALUES", "1")
    config.reload()
    logits = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="outside"):
        oink.cross_entropy_forward(logits, torch.tensor([0, 64, 1, 2], device="cuda"))


@pytest.mark.parametrize("setting", [None, "0"])
def test_value_checks_off_give_bad_rows_nan(seed, monkeypatch, setting):
    """By default (or OINK_CHECK_VALUES=0): no host sync for the target range; the kernels give a bad
    target's row a NaN loss and NaN dlogits, every other row its reference value."""
    from oink import config

    if setting is None:
        monkeypatch.delenv("OINK_CHECK_VALUES", raising=False)
    else:
        monkeypatch.setenv("OINK_CHECK_VALUES", setting)
    config.reload()
    logits, target, dloss = _case(256, 32000, torch.bfloat16, seed)
    target[5], target[7] = 32000, -3  # out of range, not ignored
    loss, dx = oink.cross_entropy_fwd_bwd(dloss, logits, target)
    fwd_loss, lse = oink.cross_entropy_forward(logits, target)
    dx2 = oink.cross_entropy_backward(dloss, logits, target, lse)
    assert loss[[5, 7]].isnan().all() and fwd_loss[[5, 7]].isnan().all()
    assert dx[[5, 7]].isnan().all() and dx2[[5, 7]].isnan().all()
    keep = torch.ones(256, dtype=torch.bool, device="cuda")
    keep[[5, 7]] = False
    good = target.clone()
    good[[5, 7]] = 0
    ref_loss, ref_dx = R.cross_entropy_fwd_bwd(dloss, logits, good)
    close_family(loss[keep], ref_loss[keep], "cross_entropy_loss", torch.float32, "other rows")
    close_family(dx[keep], ref_dx[keep], "softmax", torch.bfloat16, "other rows' dx")
    close_family(dx2[keep], ref_dx[keep], "softmax", torch.bfloat16, "other rows' dx (backward)")


def test_cuda_graph_capture(seed):
    """The public ops capture (the host target check is skipped while capturing); a bad target
    then gives its row a NaN loss and NaN dlogits instead of an out-of-bounds read."""
    logits, target, dloss = _case(256, 32000, torch.bfloat16, seed)
    oink.cross_entropy_fwd_bwd(dloss, logits, target)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, dx = oink.cross_entropy_fwd_bwd(dloss, logits, target)
        fwd_loss, lse = oink.cross_entropy_forward(logits, target)
    graph.replay()
    ref_loss, ref_dx = R.cross_entropy_fwd_bwd(dloss, logits, target)
    close_family(loss, ref_loss, "cross_entropy_loss", torch.float32, "graph loss")
    close_family(fwd_loss, ref_loss, "cross_entropy_loss", torch.float32, "graph forward loss")
    close_family(dx, ref_dx, "softmax", torch.bfloat16, "graph dx")
    target[5], target[7] = 32000, -3  # out of range, not ignored
    graph.replay()
    assert loss[[5, 7]].isnan().all() and dx[[5, 7]].isnan().all() and fwd_loss[[5, 7]].isnan().all()
    keep = torch.ones(256, dtype=torch.bool, device="cuda")
    keep[[5, 7]] = False
    close_family(loss[keep], ref_loss[keep], "cross_entropy_loss", torch.float32, "other rows")
