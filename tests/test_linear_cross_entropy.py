"""oink.linear_cross_entropy on the CPU (each chunk's cross-entropy is the reference's): loss and
gradients against a float64 eager reference, the chunking (sizes that do and don't divide M, one
row, more rows than M), ignore_index, the reductions, odd vocabularies, bias, leading dims, bad
inputs, torch.compile, and that no tensor of the full [M, V] logits' size is ever made."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import oink
from oink import chunked_linear_ce as lce
from pytest_oink.tolerances import tolerance

IGNORE = -100


def _case(M, H, V, dtype=torch.float32, bias=False, seed=0, ignored=0.25, lead=()):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, M, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, V, (*lead, M), generator=g)
    target[torch.rand(*lead, M, generator=g) < ignored] = IGNORE
    return hidden, weight, target, b


def _reference(hidden, weight, target, bias, reduction, grad, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """float64 eager math and autograd: -> (loss, dhidden, dweight, dbias | None)."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    b = bias.detach().double().requires_grad_() if bias is not None else None
    logits = F.linear(leaves[0], leaves[1], b)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    rows = F.cross_entropy(flat, t, ignore_index=IGNORE, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        rows = rows + z_loss * torch.where(t != IGNORE, torch.logsumexp(flat, -1) ** 2, 0)
    count = (t != IGNORE).sum()
    loss = {"none": rows.reshape(target.shape), "sum": rows.sum(),
            "mean": rows.sum() / count if count else rows.sum() * 0}[reduction]
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []), grad.double())
    return (loss.detach(), *grads) + ((None,) if b is None else ())


def _run(hidden, weight, target, bias, reduction, grad, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight)]
    b = bias.detach().clone().requires_grad_() if bias is not None else None
    loss = oink.linear_cross_entropy(leaves[0], leaves[1], target, b, IGNORE, reduction, **kw)
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []), grad)
    return (loss.detach(), *grads) + ((None,) if b is None else ())


def _grad_for(reduction, target, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(target.shape, generator=g) if reduction == "none" else torch.tensor(1.7)


def _assert_matches(out, ref, dtype, what):
    names = ("loss", "dhidden", "dweight", "dbias")
    for name, a, e in zip(names, out, ref):
        if e is None:
            assert a is None, f"{what}: {name} should be None"
            continue
        assert not torch.isnan(a).any(), f"{what}: {name} has NaN"
        atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else tolerance("norm_backward", dtype)
        scale = max(1.0, float(e.abs().max())) if e.numel() else 1.0  # sums over rows or the vocabulary
        torch.testing.assert_close(a.double(), e, atol=atol * scale, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 1, 8, 13, 37, 64])  # 37 = M: one chunk; 64 > M
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(reduction, chunk_size, bias):
    hidden, weight, target, b = _case(37, 24, 101, bias=bias)  # V = 101: odd
    grad = _grad_for(reduction, target)
    out = _run(hidden, weight, target, b, reduction, grad, chunk_size=chunk_size)
    _assert_matches(out, _reference(hidden, weight, target, b, reduction, grad), torch.float32,
                    f"{reduction} chunk {chunk_size}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_16_bit(dtype, accum_dtype):
    hidden, weight, target, b = _case(70, 32, 257, dtype=dtype, bias=True)
    grad = _grad_for("sum", target)
    out = _run(hidden, weight, target, b, "sum", grad, chunk_size=16, accum_dtype=accum_dtype)
    assert out[1].dtype == out[2].dtype == out[3].dtype == dtype and out[0].dtype == torch.float32
    _assert_matches(out, _reference(hidden, weight, target, b, "sum", grad), dtype, f"{dtype}")


def test_accum_fp32_rounds_dweight_once():
    """Many chunks: fp32 accumulation is at least as close to float64 as the weight's own dtype."""
    hidden, weight, target, _ = _case(256, 16, 64, dtype=torch.bfloat16, ignored=0.0)
    grad = torch.tensor(1.0)
    ref = _reference(hidden, weight, target, None, "sum", grad)[2]
    errs = [(_run(hidden, weight, target, None, "sum", grad, chunk_size=4, accum_dtype=a)[2].double() - ref).norm()
            for a in (None, torch.float32)]
    assert errs[1] <= errs[0]


def test_leading_dims_and_module():
    hidden, weight, target, b = _case(9, 16, 50, lead=(3,), bias=True)
    grad = _grad_for("none", target)
    out = _run(hidden, weight, target, b, "none", grad, chunk_size=5)
    assert out[0].shape == target.shape and out[1].shape == hidden.shape
    _assert_matches(out, _reference(hidden, weight, target, b, "none", grad), torch.float32, "leading dims")

    head = oink.LinearCrossEntropy(16, 50, bias=True, chunk_size=4)
    assert set(head.state_dict()) == set(torch.nn.Linear(16, 50).state_dict())
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(b)
    loss = head(hidden, target)
    torch.testing.assert_close(loss.double(), _reference(hidden, weight, target, b, "mean", torch.tensor(1.0))[0],
                               atol=1e-5, rtol=1e-5)
    loss.backward()
    assert head.weight.grad is not None and head.bias.grad is not None


def test_only_the_gradients_asked_for():
    hidden, weight, target, _ = _case(20, 8, 30)
    w = weight.clone().requires_grad_()
    loss = oink.linear_cross_entropy(hidden, w, target, chunk_size=7)
    (dw,) = torch.autograd.grad(loss, (w,))
    torch.testing.assert_close(dw.double(), _reference(hidden, weight, target, None, "mean", torch.tensor(1.0))[2],
                               atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # no graph: the loss alone
        loss = oink.linear_cross_entropy(hidden, w, target)
    assert not loss.requires_grad


def test_all_rows_ignored_and_no_rows():
    hidden, weight, target, _ = _case(10, 8, 30)
    target[:] = IGNORE
    out = _run(hidden, weight, target, None, "mean", torch.tensor(1.0), chunk_size=3)
    assert float(out[0]) == 0.0 and not out[1].any() and not out[2].any()
    h0, t0 = hidden[:0], target[:0]
    out = _run(h0, weight, t0, None, "mean", torch.tensor(1.0))
    assert float(out[0]) == 0.0 and out[1].shape == (0, 8) and not out[2].any()


def test_second_backward_raises():
    hidden, weight, target, _ = _case(10, 8, 30)
    h = hidden.clone().requires_grad_()
    loss = oink.linear_cross_entropy(h, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op takes or makes while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_never_makes_the_full_logits(reduction):
    """Every tensor any op touches is O(chunk x V): the chunked loop run under a dispatch mode that
    sees each op (the custom op is entered directly, so its inner ops are seen too)."""
    M, H, V, C = 512, 8, 1000, 32
    hidden, weight, target, b = _case(M, H, V, bias=True)
    dloss = torch.rand(M) if reduction == "none" else lce.row_scale(target, IGNORE, reduction)
    with _LargestTensor() as seen:
        loss, dh, dw, db, _ = lce.fwd_bwd(hidden, weight, target, b, dloss, IGNORE, chunk_size=C)
    assert seen.largest <= C * V, f"a tensor of {seen.largest} elements; a chunk's logits are {C * V}"
    assert seen.largest >= C * V  # the observer does see the chunk's logits
    assert M * V > 8 * C * V
    ref = _reference(hidden, weight, target, b, "sum", torch.tensor(1.0)) if reduction == "mean" else None
    if ref is not None:  # the same loop gives the right answer
        torch.testing.assert_close(dh.double() / float(dloss), ref[1], atol=1e-5, rtol=1e-5)


def test_default_chunk_rows():
    cpu = torch.device("cpu")
    V = 128256
    for M, H in ((16384, 4096), (4096, 4096), (100000, 8192), (65536, 8192)):
        rows = lce.default_chunk_rows(M, H, V, 2, 1, cpu)
        wanted = max(M * H, lce.liger_chunk_rows(M, H, V) * V) * 2 // (V * 2)
        want = min(max(lce.CHUNK_MIN_ROWS, wanted), lce.CHUNK_MAX_BYTES // (V * 2))
        assert rows % lce.CHUNK_ROW_MULTIPLE == 0 and rows <= want < rows + lce.CHUNK_ROW_MULTIPLE, (M, H, rows)
        two = lce.default_chunk_rows(M, H, V, 2, 2, cpu)  # two buffers: the budget halves, the floor stays
        assert two <= max(lce.CHUNK_MIN_ROWS, rows // 2 + lce.CHUNK_ROW_MULTIPLE)
    assert lce.default_chunk_rows(16384, 4096, V, 2, 1, cpu) == 512  # the logits no larger than the hidden states
    assert lce.default_chunk_rows(65536, 8192, V, 2, 1, cpu) == 2048  # CHUNK_MAX_BYTES: 512 MiB of logits
    # the training suite's shapes at 16384 tokens: Liger's rows (its memory), but 512 at least
    assert [lce.default_chunk_rows(16384, H, V, 2, 1, cpu) for H, V in ((3584, 151936), (5120, 151936), (2304, 256000))
            ] == [512, 1024, 512]
    assert [lce.liger_chunk_rows(16384, H, V) for H, V in ((3584, 151936), (5120, 151936), (2304, 256000))
            ] == [512, 1024, 256]
    # 4096 tokens: 512 rows (the floor; Liger's 128-64 rows would read and write dweight 4-8x as often)
    assert {lce.default_chunk_rows(4096, H, V, 2, 1, cpu) for H, V in ((4096, 128256), (3584, 151936),
                                                                       (5120, 151936), (2304, 256000))} == {512}
    assert lce.default_chunk_rows(10, 4096, V, 2, 1, cpu) == 10  # never more than M
    assert lce.default_chunk_rows(100000, 4096, 2**31, 4, 2, cpu) == lce.CHUNK_ROW_MULTIPLE  # one tile at least


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    hidden, weight, target, b = _case(40, 16, 61, bias=True)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    f = torch.compile(lambda h, w, t, bb: oink.linear_cross_entropy(h, w, t, bb, chunk_size=16), fullgraph=True)
    loss = f(leaves[0], leaves[1], target, leaves[2])
    grads = torch.autograd.grad(loss, leaves)
    _assert_matches((loss.detach(), *grads), _reference(hidden, weight, target, b, "mean", torch.tensor(1.0)),
                    torch.float32, "compiled")


def test_opcheck():
    hidden, weight, target, b = _case(12, 8, 30, bias=True)
    for reduction, need, z in (("mean", True, False), ("none", False, True), ("sum", True, True)):
        torch.library.opcheck(torch.ops.oink.linear_cross_entropy_fwd_bwd.default,
                              (hidden, weight, target, b, None, IGNORE, reduction, 0.0, 1e-3 if z else 0.0, None, 5,
                               need, need, need, None, z))


@pytest.mark.parametrize("args,kwargs,error,match", [
    (lambda h, w, t: (h, w[:, :-1], t), {}, ValueError, "hidden: last dim"),
    (lambda h, w, t: (h, w[0], t), {}, ValueError, "weight: expected at least 2 dim"),
    (lambda h, w, t: (h, w[None], t), {}, ValueError, "weight: expected 2 dims"),
    (lambda h, w, t: (h, w.double(), t), {}, TypeError, "weight: dtype"),
    (lambda h, w, t: (h, w.half(), t), {}, TypeError, "hidden: dtype"),
    (lambda h, w, t: (h, w, t[:-1]), {}, ValueError, "target: expected shape"),
    (lambda h, w, t: (h, w, t.float()), {}, TypeError, "target: dtype"),
    (lambda h, w, t: (h, w, t, torch.zeros(5)), {}, ValueError, "bias: expected shape"),
    (lambda h, w, t: (h, w, t, torch.zeros(30, dtype=torch.half)), {}, TypeError, "bias: dtype"),
    (lambda h, w, t: (h, w, t.to("meta")), {}, ValueError, "target is on meta"),
    (lambda h, w, t: (h, w, t), {"reduction": "avg"}, ValueError, "reduction"),
    (lambda h, w, t: (h, w, t), {"label_smoothing": 1.0}, ValueError, "label_smoothing"),
    (lambda h, w, t: (h, w, t), {"label_smoothing": -0.1}, ValueError, "label_smoothing"),
    (lambda h, w, t: (h, w, t), {"z_loss": -1e-4}, ValueError, "z_loss"),
    (lambda h, w, t: (h, w, t), {"softcap": 0.0}, ValueError, "softcap"),
    (lambda h, w, t: (h, w, t), {"chunk_size": 0}, ValueError, "chunk_size"),
    (lambda h, w, t: (h, w, t), {"accum_dtype": torch.float16}, ValueError, "accum_dtype"),
])
def test_bad_inputs(args, kwargs, error, match):
    hidden, weight, target, _ = _case(6, 8, 30)
    with pytest.raises(error, match=match):
        oink.linear_cross_entropy(*args(hidden, weight, target), **kwargs)


def test_target_out_of_range():
    hidden, weight, target, _ = _case(6, 8, 30)
    target[2] = 30
    with pytest.raises(ValueError, match=r"target\[2\] = 30"):
        oink.linear_cross_entropy(hidden, weight, target)


def _ce_takes(name):
    return all(name in inspect.signature(f).parameters
               for f in (oink.cross_entropy_forward, oink.cross_entropy_fwd_bwd))


@pytest.mark.parametrize("option,value", [("label_smoothing", 0.1), ("z_loss", 1e-3), ("softcap", 3.0)])
def test_options(option, value):
    """Passed to Oink's cross-entropy where it takes them (then against the float64 reference);
    a clear NotImplementedError until it does, never a silently ignored option."""
    hidden, weight, target, b = _case(33, 16, 77, bias=True)
    grad = torch.tensor(1.3)
    if not _ce_takes(option):
        with pytest.raises(NotImplementedError, match=option):
            _run(hidden, weight, target, b, "mean", grad, chunk_size=8, **{option: value})
        return
    for reduction in ("mean", "none"):
        grad = _grad_for(reduction, target)
        out = _run(hidden, weight, target, b, reduction, grad, chunk_size=8, **{option: value})
        _assert_matches(out, _reference(hidden, weight, target, b, reduction, grad, **{option: value}),
                        torch.float32, f"{option}={value} {reduction}")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_z_loss(reduction):
    """The z-loss part, reduced as the loss is and not differentiated; the loss still holds it."""
    hidden, weight, target, _ = _case(30, 16, 45)
    z = 1e-2
    h = hidden.clone().requires_grad_()
    loss, z_part = oink.linear_cross_entropy(h, weight, target, reduction=reduction, z_loss=z, chunk_size=7,
                                             return_z_loss=True)
    assert not z_part.requires_grad and z_part.shape == loss.shape
    flat = F.linear(hidden.double(), weight.double())
    rows = torch.where(target != IGNORE, z * torch.logsumexp(flat, -1) ** 2, 0)
    want = rows if reduction == "none" else rows.sum() / (target != IGNORE).sum()
    torch.testing.assert_close(z_part.double(), want, atol=1e-6, rtol=1e-5)
    grad = _grad_for(reduction, target)
    (dh,) = torch.autograd.grad(loss, (h,), grad)
    ref = _reference(hidden, weight, target, None, reduction, grad, z_loss=z)
    torch.testing.assert_close(loss.detach().double(), ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dh.double(), ref[1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        loss2, z2 = oink.linear_cross_entropy(hidden, weight, target, reduction=reduction, z_loss=z,
                                              return_z_loss=True)
    torch.testing.assert_close(z2, z_part)


@given(M=st.integers(0, 80), H=st.sampled_from((1, 8, 33)), V=st.sampled_from((1, 7, 101, 1000)),
       chunk=st.one_of(st.none(), st.integers(1, 90)), reduction=st.sampled_from(("mean", "sum", "none")),
       bias=st.booleans(), ignored=st.sampled_from((0.0, 0.3, 1.0)), strided=st.booleans(),
       options=st.sampled_from(({}, {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0})),
       seed=st.integers(0, 2**16))
def test_fuzz_against_float64(M, H, V, chunk, reduction, bias, ignored, strided, options, seed):
    """Random shapes (empty, one class, odd vocabularies), chunk sizes, reductions, ignored rows,
    strided hidden rows and the options, against the float64 reference."""
    hidden, weight, target, b = _case(M, H, V, bias=bias, seed=seed, ignored=ignored)
    if strided:  # rows of a wider tensor: not contiguous
        hidden = torch.cat([hidden, torch.randn(M, 3)], 1)[:, :H]
    grad = _grad_for(reduction, target, seed)
    out = _run(hidden, weight, target, b, reduction, grad, chunk_size=chunk, **options)
    _assert_matches(out, _reference(hidden, weight, target, b, reduction, grad, **options), torch.float32,
                    f"M={M} H={H} V={V} chunk={chunk} {reduction} {options}")
