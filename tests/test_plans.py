"""Launch plans (a route's launch prepared once per argument layout) pass the compiled function
exactly what the kernel runner passes, and return the same outputs, for every op that has plans.
On a CPU: the compile step is replaced by a recorder, so no kernel runs; what is compared is the
host side, argument by argument."""
from __future__ import annotations

import pytest
import torch

from oink import config, dispatch, ops  # noqa: F401  (the declarations name each op's kernels to dispatch)

pytestmark = pytest.mark.skipif(not config.get().tvm_ffi, reason="plans are made for the TVM-FFI launch only")

BIG = 1 << 20  # addresses are above this; M, strides and flags below


@pytest.fixture
def recorder(monkeypatch):
    """Every compiled function is a recorder of its calls; streams are 0. The disk cache is off: a
    kernel compiled by an earlier GPU session would be loaded from it, not recorded."""
    import oink.kernels.compile as compile_mod
    import oink.kernels.cross_entropy as cross_entropy
    import oink.kernels.cross_entropy_ops as cross_entropy_ops
    import oink.kernels.fp8 as fp8
    import oink.kernels.fp8_ops as fp8_ops
    import oink.kernels.nvfp4 as nvfp4
    import oink.kernels.nvfp4_ops as nvfp4_ops
    import oink.kernels.rmsnorm as rmsnorm
    import oink.kernels.rmsnorm_bwd as rmsnorm_bwd
    import oink.kernels.rmsnorm_ops as rmsnorm_ops
    import oink.kernels.softmax as softmax
    import oink.kernels.softmax_ops as softmax_ops

    calls = []

    def fake_compile(kernel, *fake_args, arch):
        return lambda *args: calls.append(args)

    for mod in (rmsnorm, rmsnorm_bwd, softmax, fp8, nvfp4, cross_entropy):
        monkeypatch.setattr(mod, "compile_kernel", fake_compile)
    monkeypatch.setattr(rmsnorm_ops, "resident_clusters", lambda index, cluster_n: 132 // cluster_n)
    for mod in (rmsnorm_ops, softmax_ops, fp8_ops, nvfp4_ops, cross_entropy_ops, compile_mod):
        monkeypatch.setattr(mod, "current_stream", lambda device: 0)
        monkeypatch.setattr(mod, "stream_of", lambda device: lambda: 0)
    monkeypatch.setenv("OINK_CACHE_DIR", "0")
    config.reload()
    compile_mod.CACHE.clear()
    yield calls
    monkeypatch.undo()
    config.reload()
    compile_mod.CACHE.clear()


def _tagged(args, inputs: dict):
    """A launch's arguments with input addresses named and fresh output addresses as "out"."""
    names = {t.data_ptr(): n for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    return [names.get(a, "out") if isinstance(a, int) and a >= BIG else a for a in args]


def _shape(o):
    if isinstance(o, (tuple, list)):
        return [_shape(t) for t in o]
    return None if o is None else (tuple(o.shape), o.dtype)


def _x(M, N, dtype=torch.bfloat16, stride=None):
    base = torch.randn(M, stride or N, dtype=dtype)
    return base[:, :N]


def _fp8(**a):
    """An FP8 op's arguments: the dynamic scale modes (the plans' case) unless given."""
    return {"scale": None, "group_size": 0, "column_major_scales": False, "ue8m0": False, "scale_ub": None, **a}


def _ce(**a):
    """A cross-entropy op's arguments: targets in range with one ignored, no class weight."""
    target = a.pop("target", None)
    if target is None:
        target = torch.randint(0, a["logits"].shape[-1], (a["logits"].shape[0],))
        target[1 % target.numel()] = -100
    base = {"target": target, "ignore_index": -100, "weight": None}
    if "lse" not in a and "dloss" not in a:
        base.update(reduction="none", lse_partial=None, target_logit=None)
    return {**base, **a}


CASES = [
    ("rmsnorm_forward", lambda: dict(x=_x(4, 256), weight=torch.randn(256, dtype=torch.bfloat16), bias=None,
                                     residual=None, eps=1e-5, store_rstd=False, out_dtype=None, residual_dtype=None,
                                     weight_offset=0.0)),
    ("rmsnorm_forward", lambda: dict(x=_x(3, 512, stride=520), weight=torch.randn(512), bias=torch.randn(512),
                                     residual=_x(3, 512), eps=1e-6, store_rstd=True, out_dtype=torch.float32,
                                     residual_dtype=torch.float32, weight_offset=1.0)),
    # vLLM's rmsnorm passes x, weight and eps only; x here is every other 64-wide half-row
    ("rmsnorm_forward", lambda: dict(x=_x(5, 128).view(5, 2, 64)[:, 1],
                                     weight=torch.randn(64, dtype=torch.bfloat16), eps=1e-6)),
    ("fused_add_rmsnorm_", lambda: dict(x=_x(6, 256, torch.float16), residual=_x(6, 256, torch.float16),
                                        weight=torch.randn(256, dtype=torch.float16), eps=1e-6)),
    ("layernorm", lambda: dict(x=_x(4, 384), weight=torch.randn(384, dtype=torch.bfloat16), bias=None, eps=1e-5,
                               return_rstd=True, return_mean=False)),
    ("layernorm", lambda: dict(x=_x(6, 128, torch.float32), weight=torch.randn(128), bias=torch.randn(128), eps=1e-5, return_rstd=True,
                               return_mean=True)),
    ("softmax_forward", lambda: dict(x=_x(7, 1000, stride=1008))),
    ("softmax_backward", lambda: dict(dy=_x(3, 512), y=_x(3, 512))),
    ("softmax_fwd_bwd", lambda: dict(dy=_x(3, 512, torch.float32), x=_x(3, 512, torch.float32))),
    ("fp8_quantize", lambda: _fp8(x=_x(4, 256))),
    ("fp8_quantize", lambda: _fp8(x=_x(3, 512, stride=528), group_size=128, column_major_scales=True, ue8m0=True)),
    ("silu_mul_fp8quant", lambda: _fp8(x=_x(5, 512), group_size=64)),
    ("rmsnorm_fp8quant", lambda: _fp8(x=_x(4, 256), weight=torch.randn(256, dtype=torch.bfloat16), eps=1e-5,
                                      return_y=True)),
    ("add_rmsnorm_fp8quant", lambda: _fp8(x=_x(4, 256), residual=_x(4, 256, stride=272), weight=torch.randn(256),
                                          eps=1e-6, group_size=128, return_y=False)),
    ("nvfp4_quantize", lambda: dict(x=_x(4, 256), global_scale=torch.tensor([2.0]), swizzled=False)),
    ("nvfp4_quantize", lambda: dict(x=_x(130, 256, stride=288), global_scale=torch.tensor([0.5]), swizzled=True)),
    ("mxfp4_quantize", lambda: dict(x=_x(3, 256), swizzled=False)),
    ("silu_mul_fp4quant", lambda: dict(x=_x(4, 512), global_scale=torch.tensor([2.0]), swizzled=True)),
    ("silu_mul_mxfp4quant", lambda: dict(x=_x(4, 512), swizzled=False)),
    ("add_rmsnorm_fp4quant", lambda: dict(x=_x(4, 256), residual=_x(4, 256),
                                          weight=torch.randn(256, dtype=torch.bfloat16),
                                          global_scale=torch.tensor([2.0]), eps=1e-6, swizzled=False, return_y=True)),
    ("add_rmsnorm_mxfp4quant", lambda: dict(x=_x(4, 256), residual=_x(4, 256), weight=torch.randn(256), eps=1e-6,
                                            swizzled=True, return_y=False)),
    ("rmsnorm_backward", lambda: dict(x=_x(5, 256), weight=torch.randn(256, dtype=torch.bfloat16), dout=_x(5, 256),
                                      rstd=torch.rand(5), dresidual_out=None, has_bias=False, has_residual=False,
                                      weight_offset=0.0)),
    ("rmsnorm_backward", lambda: dict(x=_x(300, 512, stride=520), weight=torch.randn(512), dout=_x(300, 512),
                                      rstd=torch.rand(300), dresidual_out=_x(300, 512, stride=528), has_bias=True,
                                      has_residual=True, weight_offset=1.0)),
    ("rmsnorm_backward", lambda: dict(x=_x(3, 128, torch.float16), weight=None, dout=_x(3, 128, torch.float16),
                                      rstd=torch.rand(3), dresidual_out=None, has_bias=False, has_residual=False,
                                      weight_offset=0.0)),
    ("layernorm_backward", lambda: dict(dout=_x(7, 384), x=_x(7, 384), weight=torch.randn(384, dtype=torch.bfloat16),
                                        rstd=torch.rand(7), mean=torch.randn(7), bias=None)),
    ("layernorm_backward", lambda: dict(dout=_x(4, 256, torch.float32), x=_x(4, 256, torch.float32, stride=264),
                                        weight=torch.randn(256), rstd=torch.rand(4), mean=torch.randn(4),
                                        bias=torch.randn(256))),
    ("cross_entropy_forward", lambda: _ce(logits=_x(5, 1000, stride=1008))),
    ("cross_entropy_backward", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000), lse=torch.randn(5))),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000, torch.float32),
                                          target=torch.tensor([1, -100, 3, 999, 0], dtype=torch.int32),
                                          return_lse=True)),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(1), logits=_x(1, 512), target=torch.tensor([7]))),
]


@pytest.mark.parametrize("op,make", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_plan_launches_as_the_runner_does(recorder, op, make):
    module = dispatch._kernel_module(op)
    args = make()
    route = dispatch.Route(op, "kernel", "test", "sm_90a")
    planned = dispatch.with_plan(route, args)
    assert planned.plan is not None, f"{op}: no plan for a kernel-ready layout"
    out_runner = module.RUNNERS[op]("sm_90a", **args)
    launches = len(recorder)  # the norm backwards launch twice (dx with partials, their sum)
    assert launches in (1, 2)
    out_plan = dispatch.run(planned, args)
    assert len(recorder) == 2 * launches
    for i in range(launches):
        assert _tagged(recorder[launches + i], args) == _tagged(recorder[i], args)
    assert _shape(out_plan) == _shape(out_runner)


def test_no_plan_where_a_copy_is_needed(recorder):
    """A layout the kernel can't read as is (a transposed x) keeps the runner, which copies; so do
    the FP8 ops' static scale and upper bound (fp32 copies of scalars)."""
    x = torch.randn(256, 4, dtype=torch.bfloat16).t()
    route = dispatch.Route("softmax_forward", "kernel", "test", "sm_90a")
    assert dispatch.with_plan(route, {"x": x}).plan is None
    route = dispatch.Route("fp8_quantize", "kernel", "test", "sm_90a")
    assert dispatch.with_plan(route, _fp8(x=_x(4, 256), scale=torch.tensor([1.0]))).plan is None
    assert dispatch.with_plan(route, _fp8(x=_x(4, 256), scale_ub=torch.tensor([9.0]))).plan is None
    assert dispatch.with_plan(route, _fp8(x=x.t().contiguous().t())).plan is None
    # a reduction, a class weight or a scalar dloss (broadcast by the runner) keep the runner
    route = dispatch.Route("cross_entropy_forward", "kernel", "test", "sm_90a")
    assert dispatch.with_plan(route, _ce(logits=_x(4, 256), reduction="mean")).plan is None
    assert dispatch.with_plan(route, _ce(logits=_x(4, 256), weight=torch.rand(256))).plan is None
    route = dispatch.Route("cross_entropy_fwd_bwd", "kernel", "test", "sm_90a")
    assert dispatch.with_plan(route, _ce(dloss=torch.tensor(1.0), logits=_x(4, 256))).plan is None


def test_norm_backward_plans_leave_copies_to_the_runner(recorder):
    """A strided row statistic or per-head weights keep the runner."""
    route = dispatch.Route("rmsnorm_backward", "kernel", "test", "sm_90a")
    base = dict(x=_x(4, 256), weight=torch.randn(256), dout=_x(4, 256), rstd=torch.rand(4), dresidual_out=None,
                has_bias=False, has_residual=False, weight_offset=0.0)
    assert dispatch.with_plan(route, base).plan is not None
    assert dispatch.with_plan(route, {**base, "rstd": torch.rand(8)[::2]}).plan is None
    heads = dict(base, x=_x(4, 256).view(4, 2, 128), dout=_x(4, 256).view(4, 2, 128), rstd=torch.rand(4, 2),
                 weight=torch.randn(2, 128))
    assert dispatch.with_plan(route, heads).plan is None


@pytest.mark.parametrize("M,few", [(32, True), (33, False)])
@pytest.mark.parametrize("op", ["rmsnorm_forward", "softmax_forward", "rmsnorm_backward", "rmsnorm_backward_split"])
def test_plan_and_runner_take_the_same_few_rows_launch(recorder, op, M, few):
    """At most ``launch_table.FEW_ROWS`` rows take the key's "/few" entry, in the runner and in the plan
    alike (a plan is made for one shape); one row more, the key's own entry. The norm backward takes
    its split kernels at a width too wide for one kernel either way (``rmsnorm_bwd.split_rows``)."""
    from oink.kernels import launch_table
    from oink.kernels.compile import CACHE
    from oink.kernels.rmsnorm_bwd import backward_launch, split_launches

    N = 262144 if op == "rmsnorm_backward_split" else 131072
    shape = lambda L: (L.threads_per_row, L.num_threads, L.cluster_n)  # noqa: E731
    if op == "rmsnorm_backward_split":
        op, expected = "rmsnorm_backward", {shape(L) for L in split_launches(N, 16)}
    elif op == "rmsnorm_backward":
        expected = {shape(backward_launch(N, 16, "sm_90a", False, few))}
    else:
        key = {"rmsnorm_forward": "rmsnorm_fwd/x16w16", "softmax_forward": "softmax/forward/x16"}[op]
        entry = launch_table.table().get("sm_90a", {}).get(f"{key}/few" if few else key, {}).get(N)
        if entry is None:  # the key's own choice: the heuristic's, where the table has no entry
            pytest.skip(f"no {key} entry at {N} for {M} rows in the table")
        expected = {tuple(entry["launch"])}
    x = _x(M, N)
    args = {"rmsnorm_forward": dict(x=x, weight=torch.randn(N, dtype=torch.bfloat16), eps=1e-6),
            "softmax_forward": dict(x=x),
            "rmsnorm_backward": dict(x=x, weight=torch.randn(N, dtype=torch.bfloat16), dout=_x(M, N),
                                     rstd=torch.rand(M), dresidual_out=None, has_bias=False, has_residual=False,
                                     weight_offset=0.0)}[op]
    module = dispatch._kernel_module(op)
    CACHE.clear_used()
    module.RUNNERS[op]("sm_90a", **args)
    by_runner = CACHE.used_launches()
    CACHE.clear_used()  # the plan looks its kernels up when it is made, and launches them as made
    planned = dispatch.with_plan(dispatch.Route(op, "kernel", "test", "sm_90a"), args)
    dispatch.run(planned, args)
    assert expected <= by_runner, by_runner
    assert CACHE.used_launches() == by_runner
