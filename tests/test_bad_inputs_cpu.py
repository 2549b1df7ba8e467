"""Issue #35's bad-input defects on the reference path (CPU): non-finite rows give the math's
answer, and an in-place op that refuses its arguments leaves every input as it was."""
from __future__ import annotations

import math

import pytest
import torch

import oink
from oink import reference as R
from pytest_oink.tolerances import tolerance

INF, NAN = math.inf, math.nan
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- 1. LayerNorm statistics of a non-finite row
def _rows_with_nonfinite(N, dtype, gen):
    """Rows 0-3: a NaN, a +inf, a -inf, +inf and -inf together; rows 4-5 finite."""
    x = torch.randn(6, N, generator=gen)
    x[0, N // 2] = NAN
    x[1, 0] = INF
    x[2, N - 1] = -INF
    x[3, 0], x[3, N - 1] = INF, -INF
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", (1, 7, 4096))
@pytest.mark.parametrize("path", ("eager", "op", "autograd"))
def test_layernorm_statistics_of_a_nonfinite_row_are_nan(dtype, N, path):
    """rstd is NaN on a row holding NaN or +-inf (its variance is undefined), as y is; the
    finite rows are untouched by their neighbours."""
    gen = torch.Generator().manual_seed(N)
    x, w, b = _rows_with_nonfinite(N, dtype, gen), torch.ones(N, dtype=dtype), torch.zeros(N, dtype=dtype)
    if path == "op":
        oink.register(force=True)
        y, rstd, mean = torch.ops.oink.layernorm(x, w, b, 1e-6)
    else:
        y, rstd, mean = oink.layernorm(x.requires_grad_(path == "autograd"), w, b, return_rstd=True,
                                       return_mean=True)
    bad = slice(0, 4)
    assert torch.isnan(rstd[bad]).all(), rstd
    assert not torch.isfinite(mean[bad]).any(), mean
    assert torch.isnan(y[bad]).all()
    xf = x.detach()[4:].double()
    expect_rstd = 1 / torch.sqrt(xf.var(-1, unbiased=False) + 1e-6)
    torch.testing.assert_close(rstd[4:].double(), expect_rstd, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mean[4:].double(), xf.mean(-1), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- 2. cross-entropy with +inf logits
V = 9
# (row's logits as {column: value}, target): each row also holds finite random logits elsewhere
CE_ROWS = (
    ({2: INF}, 2),                   # one +inf at the target: loss -> 0
    ({5: INF}, 2),                   # one +inf elsewhere: loss -> +inf
    ({2: INF, 6: INF}, 2),           # two at +inf, the target one of them: softmax 1/2 each, loss log 2
    ({0: INF, 1: INF, 8: INF}, 4),   # three at +inf, not the target: loss +inf
    ({3: INF, 0: -INF, 7: -INF}, 3),  # +inf at the target beside -inf masks
    ({0: -INF, 7: -INF}, 3),         # -inf masks only: an ordinary row (must stay so)
    ({}, 1),                         # an ordinary row
    ({4: INF}, -100),                # ignored: loss 0, dlogits 0 whatever the row holds
    ({c: INF for c in range(V)}, 5),  # every logit +inf: softmax 1/V, loss log V
)
IGNORED = 7


def _ce_case(dtype, gen):
    logits = torch.randn(len(CE_ROWS), V, generator=gen)
    for i, (cols, _) in enumerate(CE_ROWS):
        for c, v in cols.items():
            logits[i, c] = v
    return logits.to(dtype), torch.tensor([t for _, t in CE_ROWS])


def _ce_limit(logits, target, dloss, weight=None):
    """(loss, dlogits, lse) in float64 as the logits at +inf grow together: +inf replaced by a
    common finite C large enough that exp(x - C) is 0 for every finite x, so softmax and loss are
    the limit's; a loss of about C stands for +inf, and lse is +inf on those rows."""
    C = 1e4
    x = logits.double()
    posinf = torch.isposinf(x)
    z = torch.where(posinf, torch.full_like(x, C), x)
    valid = target != -100
    safe = torch.where(valid, target, 0)
    lse = torch.logsumexp(z, -1)
    loss = lse - z.gather(-1, safe[:, None]).squeeze(-1)
    loss = torch.where(loss > C / 2, INF, loss)
    lse = torch.where(posinf.any(-1), INF, lse)
    rw = (weight.double()[safe] if weight is not None else torch.ones_like(loss)) * valid
    loss = torch.where(valid, loss, 0.0) * rw
    d = torch.softmax(z, -1) - torch.nn.functional.one_hot(safe, x.shape[-1]).double()
    d = d * (dloss.double() * rw)[:, None]
    return loss, d, lse


def _close(actual, expect, dtype, what):
    atol, rtol = tolerance("cross_entropy_loss" if actual.dtype == torch.float32 else "softmax", dtype)
    torch.testing.assert_close(actual.double(), expect, atol=max(atol, 1e-6), rtol=max(rtol, 1e-5),
                               equal_nan=False, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", (False, True))
def test_cross_entropy_with_posinf_logits_gives_the_limit(dtype, weighted):
    gen = torch.Generator().manual_seed(0)
    logits, target = _ce_case(dtype, gen)
    weight = torch.rand(V, generator=gen) + 0.5 if weighted else None
    dloss = torch.rand(len(CE_ROWS), generator=gen) + 0.5
    e_loss, e_d, e_lse = _ce_limit(logits, target, dloss, weight)

    loss, lse = oink.cross_entropy_forward(logits, target, weight=weight)
    _close(loss, e_loss, dtype, "forward loss")
    _close(lse[torch.arange(len(CE_ROWS)) != IGNORED], e_lse[torch.arange(len(CE_ROWS)) != IGNORED], dtype, "lse")
    for reduction in ("sum", "mean"):
        total, _ = oink.cross_entropy_forward(logits, target, reduction=reduction, weight=weight)
        assert total.item() == INF  # rows 1 and 3 are +inf: so are their sum and mean
        finite = torch.isfinite(e_loss)
        part, _ = oink.cross_entropy_forward(logits[finite], target[finite], reduction=reduction, weight=weight)
        denom = 1.0 if reduction == "sum" else ((weight[target[finite].clamp_min(0)] if weighted else
                                                 torch.ones(int(finite.sum()))) * (target[finite] != -100)).sum()
        torch.testing.assert_close(part.double(), e_loss[finite].sum() / float(denom), atol=1e-5, rtol=1e-5)

    loss2, d, lse2 = oink.cross_entropy_fwd_bwd(dloss, logits, target, weight=weight, return_lse=True)
    _close(loss2, e_loss, dtype, "fwd_bwd loss")
    _close(d, e_d, dtype, "fwd_bwd dlogits")
    assert torch.equal(lse2, lse)
    _close(oink.cross_entropy_backward(dloss, logits, target, lse, weight=weight), e_d, dtype, "backward")


def test_cross_entropy_module_backward_at_posinf():
    """oink.cross_entropy's autograd (in place too) gives the limit's gradient."""
    logits, target = _ce_case(torch.float32, torch.Generator().manual_seed(1))
    _, e_d, _ = _ce_limit(logits, target, torch.ones(len(CE_ROWS)))
    finite = torch.tensor([i not in (1, 3) for i in range(len(CE_ROWS))])  # a +inf loss has no finite sum
    for inplace in (False, True):
        x = logits[finite].clone().requires_grad_()
        oink.cross_entropy(x, target[finite], reduction="sum", inplace_backward=inplace).backward()
        _close(x.grad, e_d[finite], torch.float32, f"autograd (inplace={inplace})")


def test_cross_entropy_vocab_parallel_posinf_stays_nan():
    """With lse_partial the other shards' count of +inf logits is unknown: the loss of a row
    whose lse and target logit are both +inf stays NaN rather than guessing."""
    logits = torch.tensor([[INF, 0.0, 1.0]])
    lse_partial = torch.tensor([[INF, 2.0]])
    loss, lse = oink.cross_entropy_forward(logits, torch.tensor([0]), lse_partial=lse_partial)
    assert lse.item() == INF and math.isnan(loss.item())


def test_cross_entropy_nan_logit_stays_nan():
    """A NaN beside a +inf is not made finite by the limit."""
    logits = torch.tensor([[INF, NAN, 1.0], [INF, 0.0, NAN]])
    loss, d = oink.cross_entropy_fwd_bwd(torch.ones(2), logits, torch.tensor([0, 0]))
    assert torch.isnan(loss).all() and torch.isnan(d).all()


# ---------------------------------------------------------------- 3, 4. in-place ops refuse before writing
GS = torch.tensor([10.0])
FP8 = torch.float8_e4m3fn


def _inplace_cases():
    """(op name, keyword arguments builder, the written arguments) for every op that writes an input."""
    N = 64

    def norm(extra=None):
        return lambda: dict(x=torch.randn(3, N), residual=torch.randn(3, N), weight=torch.rand(N) + 0.5,
                            **(extra or {}))

    def ce():
        return dict(dloss=torch.rand(3), logits=torch.randn(3, N), target=torch.tensor([1, 2, 3]),
                    lse=torch.rand(3) + 5)

    def vllm(extra):
        return lambda: dict(result=torch.zeros(3, N, dtype=FP8), input=torch.randn(3, N), weight=torch.rand(N) + 0.5,
                            epsilon=1e-6, **{k: v.clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in extra.items()})

    return {
        "fused_add_rmsnorm_": (norm(), ("x", "residual")),
        "add_rmsnorm_fp8quant": (norm(dict(group_size=64)), ("residual",)),
        "add_rmsnorm_fp4quant": (norm(dict(global_scale=GS)), ("residual",)),
        "add_rmsnorm_mxfp4quant": (norm(), ("residual",)),
        "cross_entropy_backward_": (ce, ("logits",)),
        "cross_entropy_fwd_bwd_": (lambda: {k: v for k, v in ce().items() if k != "lse"}, ("logits",)),
        # vLLM's ops (torch.ops.oink only); outputs zeroed: torch.equal of uninitialised fp8 may meet NaN
        "rms_norm_static_fp8_quant": (vllm(dict(scale=GS)), ("result",)),
        "fused_add_rms_norm_static_fp8_quant": (vllm(dict(scale=GS, residual=torch.randn(3, N))),
                                                ("result", "residual")),
        "rms_norm_dynamic_per_token_quant": (vllm(dict(scale=torch.zeros(3, 1), scale_ub=None,
                                                       residual=torch.randn(3, N))), ("result", "scale", "residual")),
        "rms_norm_per_block_quant": (vllm(dict(scale=torch.zeros(3, 1), scale_ub=None, residual=torch.randn(3, N),
                                               group_size=64, is_scale_transposed=False)),
                                     ("result", "scale", "residual")),
        "per_token_group_fp8_quant": (lambda: dict(input=torch.randn(3, N), output_q=torch.zeros(3, N, dtype=FP8),
                                                   output_s=torch.zeros(3, 1), group_size=64, eps=1e-10,
                                                   fp8_min=-448.0, fp8_max=448.0, scale_ue8m0=False),
                                      ("output_q", "output_s")),
        "fused_qk_norm_rope": (lambda: dict(qkv=torch.randn(3, 4 * N), num_heads_q=2, num_heads_k=1, num_heads_v=1,
                                            head_dim=N, eps=1e-6, q_weight=torch.rand(N) + 0.5,
                                            k_weight=torch.rand(N) + 0.5, cos_sin_cache=torch.randn(8, N),
                                            is_neox=True, position_ids=torch.arange(3)), ("qkv",)),
    }


INPLACE = _inplace_cases()


def test_every_inplace_op_is_covered():
    import oink.ops  # noqa: F401  (the declarations)
    from oink.declare import OPS

    assert {op.name for op in OPS.values() if op.mutated} == set(INPLACE)


def _call(name, args, path):
    import oink.ops  # noqa: F401  (the declarations)
    from oink.declare import OPS

    op = next(o for o in OPS.values() if o.name == name)
    if path == "public" and op.function is not None:
        return op.function(**args)
    a = {**op.defaults, **args}
    return op.op(*[a[n] for n in op.op_params])  # torch.ops.oink.<op>


def _spoil(kind, t):
    """``t`` made unwritable in the way ``kind`` names, the values kept."""
    if kind == "leaf_requires_grad":
        return t.clone().requires_grad_()
    if kind == "view_of_leaf":
        return t.clone().requires_grad_()[:]
    if kind == "inference":
        with torch.inference_mode():
            return t.clone()
    if kind == "broadcast":
        return t[:1].expand_as(t)
    raise AssertionError(kind)


MESSAGES = {"leaf_requires_grad": "leaf Variable that requires grad", "view_of_leaf": "view of a leaf Variable",
            "inference": "Inplace update to inference tensor outside InferenceMode", "broadcast": "share memory"}


def _snapshot(args):
    return {k: v.detach().clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def _unchanged(args, before):
    for k, v in before.items():
        assert torch.equal(args[k].detach(), v), f"{k} was written by a call that raised"


@pytest.mark.parametrize("path", ("public", "op"))
@pytest.mark.parametrize("kind", tuple(MESSAGES))
@pytest.mark.parametrize("name", tuple(INPLACE))
def test_inplace_op_refusing_a_written_argument_changes_nothing(name, kind, path):
    """Each written argument made unwritable in turn (alone, and with the others too): the call
    raises naming it, and no input was written (the reference used to write ``residual`` and then
    fail on ``x``)."""
    if path == "public" and name in ("cross_entropy_backward_", "cross_entropy_fwd_bwd_"):
        pytest.skip("not a public op (it backs oink.cross_entropy's in-place backward, linear_cross_entropy's chunks)")
    make, written = INPLACE[name]
    for spoiled in [(n,) for n in written] + ([written] if len(written) > 1 else []):
        args = make()
        for n in spoiled:
            args[n] = _spoil(kind, args[n])
        before = _snapshot(args)
        with pytest.raises((RuntimeError, ValueError), match=MESSAGES[kind]) as info:
            _call(name, args, path)
        assert str(info.value).startswith(spoiled[0]), info.value  # the first written argument is named
        _unchanged(args, before)


BAD_OTHERS = {  # (the argument named, arguments replaced): one that is read, not written, and wrong
    "fused_add_rmsnorm_": [("weight", dict(weight=torch.ones(63))),
                           ("weight", dict(weight=torch.ones(64, dtype=torch.int32)))],
    "add_rmsnorm_fp8quant": [("group_size", dict(group_size=48)),
                             ("scale_ub", dict(scale_ub=torch.tensor([1.0]))),  # with groups of 64
                             ("scale", dict(group_size=0, scale=torch.tensor([1.0, 2.0])))],
    "add_rmsnorm_fp4quant": [("global_scale", dict(global_scale=torch.tensor([1.0, 2.0]))),
                             ("global_scale", dict(global_scale=torch.tensor([1.0], dtype=torch.float16)))],
    "add_rmsnorm_mxfp4quant": [("weight", dict(weight=torch.ones(32)))],
    "cross_entropy_backward_": [("target", dict(target=torch.tensor([1, 64, 3]))), ("lse", dict(lse=torch.rand(2))),
                                ("weight", dict(weight=torch.ones(63)))],
    "cross_entropy_fwd_bwd_": [("target", dict(target=torch.tensor([1, 64, 3]))),
                               ("dloss", dict(dloss=torch.rand(2))), ("softcap", dict(softcap=-1.0))],
    "rms_norm_static_fp8_quant": [("scale", dict(scale=torch.tensor([1.0, 2.0]))),
                                  ("weight", dict(weight=torch.ones(64, dtype=torch.float16)))],
    "fused_add_rms_norm_static_fp8_quant": [("weight", dict(weight=torch.ones(63)))],
    "rms_norm_dynamic_per_token_quant": [("scale_ub", dict(scale_ub=torch.tensor([1.0, 2.0])))],
    "rms_norm_per_block_quant": [("group_size", dict(group_size=32)), ("input", dict(input=torch.randn(3, 96)))],
    "per_token_group_fp8_quant": [("group_size", dict(group_size=48))],
    "fused_qk_norm_rope": [("q_weight", dict(q_weight=torch.ones(32))),
                           ("position_ids", dict(position_ids=torch.tensor([0, 8, 1])))],  # past the cache's 8
}


@pytest.mark.parametrize("path", ("public", "op"))
@pytest.mark.parametrize("name", tuple(INPLACE))
def test_inplace_op_refusing_another_argument_changes_nothing(name, path):
    if path == "public" and name in ("cross_entropy_backward_", "cross_entropy_fwd_bwd_"):
        pytest.skip("not a public op")
    make, _ = INPLACE[name]
    for named, bad in BAD_OTHERS[name]:
        args = {**make(), **bad}
        before = _snapshot(args)
        with pytest.raises((TypeError, ValueError), match=named):
            _call(name, args, path)
        _unchanged(args, before)


@pytest.mark.parametrize("name", tuple(INPLACE))
def test_inplace_op_writes_where_torch_allows_it(name):
    """What torch allows stays allowed: a leaf that requires grad under no_grad, and inference
    tensors inside inference mode; the results are the reference's."""
    make, written = INPLACE[name]
    base = make()
    expect = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
    ref = getattr(R, name)
    ref(**expect)
    with torch.no_grad():
        args = {k: (_spoil("leaf_requires_grad", v) if k in written else v) for k, v in base.items()}
        _call(name, args, "op")
    with torch.inference_mode():
        inf_args = {k: (v.clone() if k in written else v) for k, v in base.items()}
        _call(name, inf_args, "op")
    for n in written:
        assert torch.equal(args[n].detach(), expect[n]), n
        assert torch.equal(inf_args[n], expect[n]), n


@pytest.mark.parametrize("arg,number,flag", [("label_smoothing", 0.0, False), ("softcap", 1.0, True),
                                             ("z_loss", 0.0, False)])
def test_a_bool_is_refused_after_the_equal_number_was_taken(arg, number, flag):
    """True == 1.0 and False == 0.0: a call with the number must not leave a cached route that a bool
    then takes without its check (a bool and a float are checked apart, whatever was called before)."""
    logits, target = torch.randn(4, 100), torch.randint(0, 100, (4,))
    oink.cross_entropy_forward(logits, target, **{arg: number})
    with pytest.raises(TypeError, match=f"{arg}: expected a float, got bool"):
        oink.cross_entropy_forward(logits, target, **{arg: flag})
