"""Public API: wired to the references (on CPU the op runs its reference: wiring, not
correctness), routes through dispatch, and rejects bad input with errors that name the argument
(or gives a correct result: empty tensors, strided views)."""
from __future__ import annotations

import pytest
import torch

import oink
from oink import reference as R
from tests.helpers import set_knob

GS = torch.tensor([10.0])


def inputs(op, M=4, N=32, dtype=torch.float32):
    """Keyword arguments for ``op`` with fresh random data."""
    x = lambda: torch.randn(M, N, dtype=dtype)  # noqa: E731  (a closure over this scope)
    w = torch.randn(N, dtype=dtype)
    rstd = torch.rand(M) + 0.5
    logits = torch.randn(M, N, dtype=dtype)
    target = torch.randint(0, N, (M,))
    q, sf = R.nvfp4_quantize(x(), GS)
    return {
        "rmsnorm_forward": dict(x=x(), weight=w, residual=x(), store_rstd=True),
        "fused_add_rmsnorm_": dict(x=x(), residual=x(), weight=w),
        "rmsnorm_backward": dict(x=x(), weight=w, dout=x(), rstd=rstd, has_bias=True),
        "layernorm": dict(x=x(), weight=w, bias=torch.randn(N, dtype=dtype), return_rstd=True, return_mean=True),
        "layernorm_backward": dict(dout=x(), x=x(), weight=w, rstd=rstd, mean=torch.randn(M)),
        "softmax_forward": dict(x=x()),
        "softmax_backward": dict(dy=x(), y=x()),
        "softmax_fwd_bwd": dict(dy=x(), x=x()),
        "cross_entropy_forward": dict(logits=logits, target=target, reduction="mean"),
        "cross_entropy_backward": dict(dloss=torch.randn(M), logits=logits, target=target, lse=torch.randn(M)),
        "cross_entropy_fwd_bwd": dict(dloss=torch.randn(M), logits=logits, target=target),
        "nvfp4_quantize": dict(x=x(), global_scale=GS),
        "nvfp4_dequantize": dict(q=q, sf=sf, global_scale=GS),
        "add_rmsnorm_fp4quant": dict(x=x(), residual=x(), weight=w, global_scale=GS, return_y=True),
        "silu_mul_fp4quant": dict(x=x(), global_scale=GS),
        "mxfp4_quantize": dict(x=x()),
        "mxfp4_dequantize": dict(zip(("q", "sf"), R.mxfp4_quantize(x()))),
        "add_rmsnorm_mxfp4quant": dict(x=x(), residual=x(), weight=w, return_y=True),
        "silu_mul_mxfp4quant": dict(x=torch.randn(M, 2 * N, dtype=dtype)),  # each half 32 wide
        "fp8_quantize": dict(x=x()),
        "rmsnorm_fp8quant": dict(x=x(), weight=w, scale=torch.tensor([0.02]), return_y=True),
        "add_rmsnorm_fp8quant": dict(x=x(), residual=x(), weight=w, group_size=64 if N % 64 == 0 else 0),
        "silu_mul_fp8quant": dict(x=torch.randn(M, 2 * N, dtype=dtype)),
        # packed qkv of 2 q heads, 1 k and 1 v head of 64 (its own widths: head_dim is 64, 128 or 256)
        "qk_norm_rope": dict(qkv=torch.randn(M, 256, dtype=torch.bfloat16), num_heads_q=2, num_heads_k=1,
                             num_heads_v=1, head_dim=64, eps=1e-6, q_weight=torch.randn(64, dtype=torch.bfloat16),
                             k_weight=torch.randn(64), cos_sin_cache=R.rope.rope_cache(16, 32), is_neox=False,
                             position_ids=torch.randint(0, 16, (M,)), weight_offset=1.0),
    }[op]




def all_ops():
    import oink.ops  # noqa: F401  (the declarations)
    from oink.declare import PUBLIC

    return tuple(PUBLIC)


def clone_args(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def assert_same(a, b):
    if isinstance(a, (tuple, list)):
        assert type(b) in (tuple, list) and len(a) == len(b)
        for u, v in zip(a, b):
            assert_same(u, v)
    elif a is None:
        assert b is None
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", all_ops())
def test_public_op_wiring_on_cpu(op):
    """Wiring, not correctness: on CPU the public op runs its reference, so this checks that
    arguments, outputs and in-place effects pass through unchanged. The references are checked
    against float64 in tests/test_references.py, the kernels against the references in the GPU tests."""
    args = inputs(op)
    ref_args = clone_args(args)
    assert_same(getattr(oink, op)(**args), getattr(R, op)(**ref_args))
    for k in args:  # in-place ops mutate the same way
        if isinstance(args[k], torch.Tensor):
            assert torch.equal(args[k], ref_args[k]), k


def dispatched(fn) -> set[str]:
    """The torch.ops.oink ops the dispatcher ran during ``fn()``."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events if e.name.startswith("oink::")}


@pytest.mark.parametrize("op", all_ops())
def test_eager_call_skips_the_dispatcher_and_the_op_path_agrees(op, monkeypatch):
    from oink import declare

    args = inputs(op)
    eager_args, op_args = clone_args(args), clone_args(args)
    fn = getattr(oink, op)
    assert dispatched(lambda: fn(**clone_args(args))) == set()
    eager = fn(**eager_args)
    # what torch.compile, dispatch modes and functorch transforms take: the custom op
    monkeypatch.setattr(declare, "_eager_key", lambda values, differentiable=False: False)
    box = []
    assert dispatched(lambda: box.append(fn(**op_args))) == {f"oink::{fn.op.op_name}"}
    assert_same(eager, box[0])
    for k in args:  # the same mutations either way
        if isinstance(args[k], torch.Tensor):
            assert torch.equal(eager_args[k], op_args[k]), k


def test_differentiable_ops_keep_the_op_when_a_graph_is_needed():
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32)
    assert dispatched(lambda: oink.softmax_forward(x).sum().backward()) >= {"oink::softmax_forward",
                                                                              "oink::softmax_backward"}
    assert torch.allclose(x.grad, torch.zeros_like(x), atol=1e-6)  # softmax rows sum to 1: zero gradient
    with torch.no_grad():
        assert dispatched(lambda: oink.rmsnorm_forward(x, w)) == set()
        assert oink.layernorm(x, w).grad_fn is None
    assert oink.layernorm(x, w).grad_fn is not None


def test_modes_and_fake_tensors_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        y, rstd, mean = oink.layernorm(torch.empty(4, 32), torch.empty(32), return_rstd=True, return_mean=True)
    assert isinstance(y, FakeTensor) and rstd.shape == mean.shape == (4,)


@pytest.mark.parametrize("op", all_ops())
def test_public_signature_is_the_references(op):
    import inspect

    pub, ref = inspect.signature(getattr(oink, op)).parameters, inspect.signature(getattr(R, op)).parameters
    assert [(n, p.default) for n, p in pub.items()] == [(n, p.default) for n, p in ref.items()]


def test_namespace_comes_from_the_declarations():
    from oink.declare import PUBLIC

    assert set(PUBLIC) <= set(oink.__all__) and set(PUBLIC) <= set(dir(oink))
    assert oink.rmsnorm_forward.__doc__ and oink.rmsnorm_forward.op.op_name == "rmsnorm_forward"
    assert oink.fused_add_rmsnorm_.op.op_name == "fused_add_rms_norm"
    with pytest.raises(AttributeError):
        oink.no_such_op


@pytest.mark.parametrize("op", all_ops())
def test_explain_names_the_route(op, monkeypatch):
    assert "reference (cpu tensors" in oink.explain(op, **inputs(op))
    set_knob(monkeypatch, "OINK_FORCE_REFERENCE", "1")
    assert "forced by OINK_FORCE_REFERENCE" in oink.explain(op, **inputs(op))


def test_explain_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        oink.explain("nope", torch.zeros(1))


def test_nd_inputs_flatten_leading_dims():
    x = torch.randn(2, 3, 64)
    y, rstd, _ = oink.rmsnorm_forward(x, torch.ones(64), store_rstd=True)
    assert y.shape == x.shape and rstd.shape == (2, 3)
    q, sf = oink.nvfp4_quantize(x, GS)
    assert q.shape == (6, 32) and sf.shape == (6, 4)


def test_empty_rows_give_empty_results():
    x = torch.empty(0, 64)
    y, rstd, _ = oink.rmsnorm_forward(x, torch.ones(64), store_rstd=True)
    assert y.shape == (0, 64) and rstd.shape == (0,)
    assert oink.softmax_forward(x).shape == (0, 64)
    q, sf = oink.nvfp4_quantize(x, GS, swizzled=True)
    assert q.shape == (0, 32) and sf.shape == (0, 4)
    loss, lse = oink.cross_entropy_forward(x, torch.empty(0, dtype=torch.long))
    assert loss.shape == (0,) and lse.shape == (0,)


@pytest.mark.parametrize("swizzled", [False, True])
def test_empty_rows_dequantize(swizzled):
    # regression: the dequantize references reshaped 0 elements to [0, -1] (found on the GPU fuzz run)
    x = torch.empty(0, 32000)
    q, sf = oink.nvfp4_quantize(x, GS, swizzled=swizzled)
    assert oink.nvfp4_dequantize(q, sf, GS, swizzled=swizzled).shape == (0, 32000)
    q, sf = oink.mxfp4_quantize(x, swizzled=swizzled)
    assert oink.mxfp4_dequantize(q, sf, swizzled=swizzled).shape == (0, 32000)


def test_strided_inputs_give_correct_results():
    base = torch.randn(8, 128)
    x = base[:, ::2]  # non-contiguous last dim
    w = torch.randn(64)
    torch.testing.assert_close(oink.rmsnorm_forward(x, w)[0], R.rmsnorm_forward(x.contiguous(), w)[0])
    padded = base[:, :96]  # padded rows
    torch.testing.assert_close(oink.softmax_forward(padded), R.softmax_forward(padded.contiguous()))
    xs, rs = torch.randn(8, 128)[:, ::2], torch.randn(8, 128)[:, ::2]
    assert not xs.is_contiguous()
    xc, rc = xs.contiguous(), rs.contiguous()  # copies
    oink.fused_add_rmsnorm_(xs, rs, w)
    R.fused_add_rmsnorm_(xc, rc, w)
    assert torch.equal(xs, xc) and torch.equal(rs, rc)


def test_out_of_range_targets_raise():
    with pytest.raises(ValueError, match=r"target\[1\] = 7 is outside \[0, 5\)"):
        oink.cross_entropy_forward(torch.randn(3, 5), torch.tensor([0, 7, -100]))
    with pytest.raises(ValueError, match="target"):
        oink.cross_entropy_fwd_bwd(torch.ones(2), torch.randn(2, 5), torch.tensor([-1, 0]))


@pytest.mark.parametrize("setting", [None, "0"])
def test_value_checks_stay_where_the_reference_serves(monkeypatch, setting):
    """By default (and with OINK_CHECK_VALUES=0) the host-synced target check is skipped only where
    a kernel (which answers a bad row with NaN) serves the call: the reference, here on the CPU,
    still raises."""
    from oink import config

    if setting is None:
        monkeypatch.delenv("OINK_CHECK_VALUES", raising=False)
    else:
        monkeypatch.setenv("OINK_CHECK_VALUES", setting)
    assert config.reload().check_values is False
    with pytest.raises(ValueError, match="outside"):
        oink.cross_entropy_forward(torch.randn(3, 5), torch.tensor([0, 7, -100]))
    with pytest.raises(ValueError, match="outside"):
        torch.ops.oink.cross_entropy_fwd_bwd(torch.ones(2), torch.randn(2, 5), torch.tensor([-1, 0]), -100)


BAD = [
    # (op, overrides, exception, message fragment)
    ("rmsnorm_forward", dict(x=torch.randn(4, 32).int()), TypeError, "x: dtype"),
    ("rmsnorm_forward", dict(x="not a tensor"), TypeError, "x: expected a torch.Tensor"),
    ("rmsnorm_forward", dict(x=torch.randn(4, 0)), ValueError, "x: the last dim"),
    ("rmsnorm_forward", dict(weight=torch.randn(31)), ValueError, "weight: expected shape"),
    ("rmsnorm_forward", dict(weight=torch.randn(32, dtype=torch.float64)), TypeError, "weight: dtype"),
    ("rmsnorm_forward", dict(out_dtype=torch.int8), TypeError, "out_dtype"),
    ("rmsnorm_forward", dict(weight=torch.randn(3, 32)), ValueError, "weight: expected shape"),
    ("cross_entropy_forward", dict(weight=torch.randn(7)), ValueError, "weight: expected shape"),
    ("cross_entropy_forward", dict(lse_partial=torch.randn(3)), ValueError, "lse_partial"),
    ("rmsnorm_forward", dict(residual=torch.randn(4, 16)), ValueError, "residual: shape"),
    ("fused_add_rmsnorm_", dict(residual=torch.randn(5, 32)), ValueError, "residual: shape"),
    ("fused_add_rmsnorm_", dict(weight=None), TypeError, "weight: expected a torch.Tensor"),
    ("rmsnorm_backward", dict(rstd=torch.rand(3)), ValueError, "rstd: expected 4 elements"),
    ("rmsnorm_backward", dict(dout=torch.randn(4, 31)), ValueError, "dout: shape"),
    ("rmsnorm_backward", dict(rstd=torch.rand(4).double()), TypeError, "rstd: dtype"),
    ("layernorm", dict(bias=torch.randn(3)), ValueError, "bias: expected shape"),
    ("layernorm_backward", dict(mean=torch.randn(2)), ValueError, "mean: expected 4 elements"),
    ("softmax_backward", dict(dy=torch.randn(4, 31)), ValueError, "dy: shape"),
    ("softmax_fwd_bwd", dict(dy=torch.randn(4, 32).long()), TypeError, "dy: dtype"),
    ("cross_entropy_forward", dict(target=torch.zeros(4)), TypeError, "target: dtype"),
    ("cross_entropy_forward", dict(target=torch.zeros(3, dtype=torch.long)), ValueError, "target: expected shape"),
    ("cross_entropy_forward", dict(logits=torch.randn(2, 4, 32)), ValueError, "logits: expected 2 dims"),
    ("cross_entropy_forward", dict(reduction="avg"), ValueError, "reduction"),
    ("cross_entropy_backward", dict(dloss=torch.randn(3)), ValueError, "dloss"),
    ("cross_entropy_backward", dict(lse=torch.randn(5)), ValueError, "lse"),
    ("nvfp4_quantize", dict(x=torch.randn(4, 24)), ValueError, "multiple of 16"),
    ("nvfp4_quantize", dict(global_scale=torch.tensor([1.0, 2.0])), ValueError, "global_scale: expected a 1-element"),
    ("nvfp4_quantize", dict(global_scale=torch.tensor([1.0]).double()), TypeError, "global_scale: dtype"),
    ("nvfp4_dequantize", dict(sf=torch.zeros(4, 3, dtype=torch.float8_e4m3fn)), ValueError, "sf: expected shape"),
    ("nvfp4_dequantize", dict(q=torch.zeros(4, 16, dtype=torch.int8)), TypeError, "q: dtype"),
    ("add_rmsnorm_fp4quant", dict(x=torch.randn(4, 24), residual=torch.randn(4, 24), weight=torch.randn(24)),
     ValueError, "multiple of 16"),
    ("silu_mul_fp4quant", dict(x=torch.randn(4, 33)), ValueError, "must be even"),
    ("fp8_quantize", dict(group_size=32), ValueError, "group_size: 32 is not"),
    ("fp8_quantize", dict(x=torch.randn(4, 96), group_size=64), ValueError, "not a multiple of group_size"),
    ("fp8_quantize", dict(x=torch.randn(4, 64), scale=torch.tensor([1.0]), group_size=64), ValueError,
     "scale: a static scale"),
    ("fp8_quantize", dict(scale=torch.tensor([1.0]).half()), TypeError, "scale: dtype"),
    ("fp8_quantize", dict(ue8m0=True), ValueError, "apply to per-group scales"),
    ("fp8_quantize", dict(x=torch.randn(4, 64), group_size=64, scale_ub=torch.tensor([1.0])), ValueError, "scale_ub"),
    ("rmsnorm_fp8quant", dict(weight=torch.randn(31)), ValueError, "weight: expected shape"),
    ("add_rmsnorm_fp8quant", dict(residual=torch.randn(4, 31)), ValueError, "residual: shape"),
    ("silu_mul_fp8quant", dict(x=torch.randn(4, 33)), ValueError, "must be even"),
    ("silu_mul_fp4quant", dict(x=torch.randn(4, 48)), ValueError, "multiple of 16"),
    ("add_rmsnorm_mxfp4quant", dict(x=torch.randn(4, 48), residual=torch.randn(4, 48), weight=torch.randn(48)),
     ValueError, "multiple of 32"),
    ("silu_mul_mxfp4quant", dict(x=torch.randn(4, 65)), ValueError, "must be even"),
    ("silu_mul_mxfp4quant", dict(x=torch.randn(4, 96)), ValueError, "multiple of 32"),
    ("qk_norm_rope", dict(num_heads_k=2), ValueError, "qkv: width 256 must be"),
    ("qk_norm_rope", dict(head_dim=32), ValueError, "head_dim: 32 is not supported"),
    ("qk_norm_rope", dict(position_ids=torch.tensor([0, 1, 2, 16])), ValueError, r"position_ids\[3\] = 16 is outside"),
]


@pytest.mark.parametrize("op,override,exc,msg", BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_bad_input_is_named(op, override, exc, msg):
    args = inputs(op)
    args.update(override)
    with pytest.raises(exc, match=msg):
        getattr(oink, op)(**args)


def test_mixed_devices_are_named():
    x = torch.randn(4, 32)
    w = torch.randn(32, device="meta")
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        oink.rmsnorm_forward(x, w)
    with pytest.raises(ValueError, match="global_scale is on meta"):
        oink.nvfp4_quantize(x, torch.ones(1, device="meta"))


def test_arch_choice_and_override(monkeypatch):
    from oink.arch import arch_for_capability

    set_knob(monkeypatch, "OINK_ARCH", None)
    assert arch_for_capability(9, 0) == "sm_90a"
    assert arch_for_capability(10, 0) == "sm_100a"
    assert arch_for_capability(8, 0) is None and arch_for_capability(12, 0) is None
    set_knob(monkeypatch, "OINK_ARCH", "sm_100a")
    assert arch_for_capability(9, 0) == "sm_100a"
    set_knob(monkeypatch, "OINK_ARCH", "sm_80")
    with pytest.raises(ValueError, match="OINK_ARCH"):
        arch_for_capability(9, 0)


def test_routing_on_a_pretend_gpu(monkeypatch):
    """The CUDA branch of the dispatch path, with the device capability faked (no GPU needed)."""
    pytest.importorskip("cutlass", reason="kernel modules import nvidia-cutlass-dsl")
    from oink import dispatch

    dispatch.device_arch.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "pretend")
    monkeypatch.setattr(dispatch, "_use_card", lambda name: None)  # no launch-table card chosen for the process
    cuda = torch.device("cuda", 0)
    x, w = torch.randn(4, 4096), torch.randn(4096)
    try:
        r = dispatch._route_device("rmsnorm_forward", cuda, {"x": x, "weight": w})
        assert (r.backend, r.arch) == ("kernel", "sm_90a")
        wide = torch.randn(1, 262144 * 2)
        r = dispatch._route_device("rmsnorm_forward", cuda, {"x": wide, "weight": None})
        assert r.backend == "reference" and "262144" in r.reason
        monkeypatch.delitem(dispatch.KERNEL_MODULES, "softmax_forward")
        assert dispatch._route_device("softmax_forward", cuda, {"x": x}).reason == (
            "no CuTeDSL kernel for softmax_forward yet")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
        dispatch.device_arch.cache_clear()
        r = dispatch._route_device("rmsnorm_forward", cuda, {"x": x, "weight": w})
        assert r.backend == "reference" and "compute capability 8.0" in r.reason
    finally:
        dispatch.device_arch.cache_clear()


def test_cross_entropy_vocab_parallel_shard():
    # one rank's logits shard [M, V/4] with global targets: lse from the shards' lse_partial, the
    # target logit gathered elsewhere; loss equals the full-vocabulary loss
    full = torch.randn(6, 400)
    target = torch.randint(0, 400, (6,))
    lse_partial = torch.logsumexp(full.view(6, 4, 100), -1)
    target_logit = full.gather(-1, target[:, None]).squeeze(-1)
    loss, lse = oink.cross_entropy_forward(full[:, :100].contiguous(), target, lse_partial=lse_partial,
                                           target_logit=target_logit)
    expect = torch.nn.functional.cross_entropy(full.double(), target, reduction="none")
    torch.testing.assert_close(loss.double(), expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(full.double(), -1), atol=1e-5, rtol=1e-5)


def test_knobs_are_read_once_and_reloaded(monkeypatch):
    from oink import config

    assert [config.truthy(v) for v in ("1", " TRUE ", "yes", "On", "0", "", None, "no")] == [True] * 4 + [False] * 4
    before = config.get()
    monkeypatch.setenv("OINK_PDL", "0")
    assert config.get() is before  # the hot path does not read the environment
    set_knob(monkeypatch, "OINK_PDL", "0")
    assert not config.get().pdl and config.get().bwd_depth is None


def test_development_settings_are_not_environment_knobs(monkeypatch):
    """The A/B switches and the sweeps' launch dials are set in code (``config.override``, ``python -m
    oink.tune --set``), never from the environment: an OINK_* variable named like one is not read; an override
    holds inside its block only, nested ones included."""
    from oink import config

    monkeypatch.setenv("OINK_BWD_DEPTH", "3")
    assert config.reload().bwd_depth is None
    monkeypatch.delenv("OINK_BWD_DEPTH")
    with config.override(bwd_depth=3, fwd_stage=True) as inside:
        assert inside is config.get() and (inside.bwd_depth, inside.fwd_stage) == (3, True)
        with config.override(bwd_depth=1):
            assert (config.get().bwd_depth, config.get().fwd_stage) == (1, True)
        assert config.get().bwd_depth == 3
    assert (config.get().bwd_depth, config.get().fwd_stage) == (None, None)
    with pytest.raises(ValueError, match="unknown development setting"):
        with config.override(bwd_dpeth=3):
            pass
    assert config.DEV == {} and config.get() == config.reload()


def test_tune_set_parses_development_settings():
    import argparse

    from oink import tune

    ap = argparse.ArgumentParser()
    assert tune.dev_settings(ap, ["bwd_depth=3", "fwd_stage=1", "ce_stream=none", "softmax_online=off"]) == {
        "bwd_depth": 3, "fwd_stage": True, "ce_stream": None, "softmax_online": False}
    for bad in ("nope=1", "bwd_depth=x", "fwd_stage=maybe", "bwd_depth"):
        with pytest.raises(SystemExit):
            tune.dev_settings(ap, [bad])


def test_the_environment_knobs_are_the_documented_ones():
    """docs/knobs.md names every OINK_* variable oink.config reads (and the plugin's OINK_FAKE_SM), and
    no other: a retired one left in the docs, or a new one left out, fails here."""
    import re
    from pathlib import Path

    from oink import config

    text = (Path(__file__).resolve().parents[1] / "docs" / "knobs.md").read_text()
    assert set(re.findall(r"`(OINK_[A-Z0-9_]+)", text)) == {*config.ENV_KNOBS, "OINK_FAKE_SM"}
    assert len(set(config.ENV_KNOBS) - {"OINK_KEEP_CUBIN"}) <= 6  # the knobs a user needs (issue #33)
