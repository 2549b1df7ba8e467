"""Prepared launches (``oink.dispatch.prepare``: a kernel's launch made once per argument layout, the
only way a kernel is launched) on a CPU: the compile step is replaced by a recorder, so no kernel runs;
what is checked is the host side, argument by argument: a launch prepared for one call reads the
tensors of the call it is given, never those it was prepared from; an input the kernel can't read as
it is launches as its dense copy would; the outputs have the reference's shapes and dtypes; the
launcher without TVM-FFI types each address as its function was compiled."""
from __future__ import annotations

import pytest
import torch

from oink import config, dispatch, ops, reference  # noqa: F401  (the declarations name each op's kernels to dispatch)

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
    import oink.kernels.partial_sum as partial_sum
    import oink.kernels.rmsnorm as rmsnorm
    import oink.kernels.rmsnorm_bwd as rmsnorm_bwd
    import oink.kernels.rmsnorm_ops as rmsnorm_ops
    import oink.kernels.rope as rope
    import oink.kernels.rope_ops as rope_ops
    import oink.kernels.softmax as softmax
    import oink.kernels.softmax_ops as softmax_ops

    calls = []

    def fake_compile(kernel, *fake_args, arch):
        return lambda *args: calls.append(args)

    for mod in (rmsnorm, rmsnorm_bwd, partial_sum, softmax, fp8, nvfp4, cross_entropy, rope):
        monkeypatch.setattr(mod, "compile_kernel", fake_compile)
    monkeypatch.setattr(rmsnorm_ops, "resident_clusters", lambda index, cluster_n: 132 // cluster_n)
    for mod in (rmsnorm_ops, softmax_ops, fp8_ops, nvfp4_ops, cross_entropy_ops, rope_ops, compile_mod):
        monkeypatch.setattr(mod, "current_stream", lambda device: 0, raising=False)
        monkeypatch.setattr(mod, "stream_of", lambda device: lambda: 0, raising=False)
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
    ("layernorm", lambda: dict(x=_x(6, 128, torch.float32), weight=torch.randn(128), bias=torch.randn(128), eps=1e-5,
                               return_rstd=True, return_mean=True)),
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
    # what only the runners handled before there was one launch path: per-head parameters, static
    # scales and upper bounds, unaligned parameters
    ("rmsnorm_forward", lambda: dict(x=_x(4, 256).view(4, 2, 128), weight=torch.randn(2, 128), bias=torch.randn(128),
                                     residual=None, eps=1e-6, store_rstd=True)),
    ("rmsnorm_backward", lambda: dict(x=_x(4, 256).view(4, 2, 128), weight=torch.randn(2, 128),
                                      dout=_x(4, 256).view(4, 2, 128), rstd=torch.rand(4, 2), dresidual_out=None,
                                      has_bias=True, has_residual=False, weight_offset=0.0)),
    ("rmsnorm_backward", lambda: dict(x=_x(4, 256), weight=torch.randn(260)[1:257], dout=_x(4, 256),
                                      rstd=torch.rand(8)[::2], dresidual_out=None, has_bias=False, has_residual=False,
                                      weight_offset=0.0)),
    ("fp8_quantize", lambda: _fp8(x=_x(4, 256), scale=torch.tensor([0.5]))),
    ("fp8_quantize", lambda: _fp8(x=_x(4, 256), scale_ub=torch.tensor(9.0))),
    ("rmsnorm_fp8quant", lambda: _fp8(x=_x(4, 256), weight=torch.randn(260, dtype=torch.bfloat16)[4:260], eps=1e-5,
                                      scale=torch.tensor([2.0]), return_y=True)),
    ("cross_entropy_forward", lambda: _ce(logits=_x(5, 1000, stride=1008))),
    ("cross_entropy_backward", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000), lse=torch.randn(5))),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000, torch.float32),
                                          target=torch.tensor([1, -100, 3, 999, 0], dtype=torch.int32),
                                          return_lse=True)),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(1), logits=_x(1, 512), target=torch.tensor([7]))),
    # cross-entropy: what only its runners handled before (class weight, reductions, target_logit, options,
    # z-loss output, per-row inputs copied, strided targets, the in-place ops)
    ("cross_entropy_forward", lambda: _ce(logits=_x(5, 1000), weight=torch.rand(1000), reduction="mean", z_loss=1e-3,
                                          return_z_loss=True)),
    ("cross_entropy_forward", lambda: _ce(logits=_x(4, 512, torch.float32), reduction="sum",
                                          target_logit=torch.randn(4), label_smoothing=0.1, softcap=None)),
    ("cross_entropy_forward", lambda: _ce(logits=_x(4, 512), target=torch.randint(0, 512, (8,))[::2], softcap=30.0,
                                          label_smoothing=0.2)),
    ("cross_entropy_backward", lambda: _ce(dloss=torch.randn(()), logits=_x(5, 1000, stride=1008),
                                           target=torch.randint(0, 1000, (10,))[::2], lse=torch.randn(10)[::2],
                                           weight=torch.rand(1000), z_loss=1e-3)),
    ("cross_entropy_backward", lambda: _ce(dloss=torch.randn(5, dtype=torch.float64), logits=_x(5, 1000),
                                           lse=torch.randn(5), softcap=15.0)),
    ("cross_entropy_backward_", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000), lse=torch.randn(5),
                                            label_smoothing=0.1)),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(()), logits=_x(6, 512, stride=520), weight=torch.rand(512),
                                          reduction="mean", return_lse=True, z_loss=1e-3, return_z_loss=True)),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(()), logits=_x(6, 512), reduction="sum", softcap=30.0)),
    ("cross_entropy_fwd_bwd_", lambda: {k: v for k, v in _ce(dloss=torch.randn(()), logits=_x(5, 1000),
                                                             z_loss=1e-3).items() if k != "weight"}),
]


def _fresh(make):
    """Two calls of one layout: the second's tensors are new (other addresses, same alignment)."""
    torch.manual_seed(0)
    first = make()
    torch.manual_seed(0)
    return first, make()


def _shared_storage(args: dict) -> set:
    return {t.untyped_storage().data_ptr() for t in args.values() if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("op,make", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_prepared_launch_reads_the_call_it_is_given(recorder, op, make):
    """A launch prepared from one call and run on another of the same layout passes the second call's
    inputs (by name, in the order the kernel takes them) and fresh outputs, none of the first call's
    tensors; its outputs have the reference's shapes and dtypes."""
    sample, args = _fresh(make)
    launch = dispatch.prepare(op, "sm_90a", sample)
    out = launch(args)
    assert recorder, f"{op}: nothing launched"
    stale = {t.data_ptr() for t in sample.values() if isinstance(t, torch.Tensor)}
    for call in recorder:
        assert not stale & {a for a in call if isinstance(a, int) and a >= BIG}, f"{op}: the sample's addresses"
    fresh = [_tagged(call, args) for call in recorder]
    recorder.clear()
    expected = getattr(reference, op)(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert _shape(out) == _shape(expected)
    again = dispatch.launch(op, "sm_90a", **args)  # prepared for the call itself: the same launches
    assert [_tagged(call, args) for call in recorder] == fresh
    assert _shape(again) == _shape(out)


COPIED = [  # x in a layout the kernel can't read as is: the call's other tensors dense
    ("softmax_forward", lambda x: dict(x=x)),
    ("softmax_backward", lambda x: dict(dy=x, y=x.clone())),
    ("rmsnorm_forward", lambda x: dict(x=x, weight=torch.randn(x.shape[-1]), eps=1e-6)),
    ("layernorm", lambda x: dict(x=x, weight=torch.randn(x.shape[-1]), bias=None, eps=1e-5, return_rstd=True,
                                 return_mean=False)),
    ("rmsnorm_backward", lambda x: dict(x=x, weight=torch.randn(x.shape[-1]), dout=x.clone(),
                                        rstd=torch.rand(x.shape[0]), dresidual_out=None, has_bias=False,
                                        has_residual=False, weight_offset=0.0)),
    ("fp8_quantize", lambda x: _fp8(x=x, group_size=128)),
    ("nvfp4_quantize", lambda x: dict(x=x, global_scale=torch.tensor([2.0]), swizzled=False)),
    ("cross_entropy_forward", lambda x: _ce(logits=x)),
    ("cross_entropy_backward", lambda x: _ce(dloss=torch.randn(x.shape[0]), logits=x, lse=torch.randn(x.shape[0]))),
    ("cross_entropy_fwd_bwd", lambda x: _ce(dloss=torch.randn(()), logits=x, weight=torch.rand(x.shape[1]),
                                            reduction="mean")),
]


@pytest.mark.parametrize("op,make", COPIED, ids=[op for op, _ in COPIED])
@pytest.mark.parametrize("layout", ["transposed", "misaligned"])
def test_an_input_read_through_a_copy_launches_as_the_copy(recorder, op, make, layout):
    """Strided rows (a transposed tensor) or a base off 16 bytes are copied to dense rows: the
    launch is the one of the same call on dense inputs, a fresh address in the copied input's place."""
    M, N = 6, 256
    if layout == "transposed":
        x = torch.randn(N, M, dtype=torch.bfloat16).t()
    else:
        x = torch.randn(M * N + 1, dtype=torch.bfloat16)[1:].view(M, N)
    strided, plain = make(x), make(x.clone())
    out = dispatch.launch(op, "sm_90a", **strided)
    copied = _tagged(recorder[-1], strided)
    recorder.clear()
    dispatch.launch(op, "sm_90a", **plain)
    dense = _tagged(recorder[-1], plain)
    first = next(n for n, t in strided.items() if t is x)
    assert [("out" if a == first else a) for a in dense] == copied
    assert _shape(out) == _shape(getattr(reference, op)(**strided))


EMPTY = [  # no rows
    ("softmax_forward", lambda: dict(x=_x(0, 512))),
    ("softmax_fwd_bwd", lambda: dict(dy=_x(0, 512), x=_x(0, 512))),
    ("rmsnorm_forward", lambda: dict(x=_x(0, 256).view(0, 2, 128), weight=torch.randn(128), bias=None,
                                     residual=_x(0, 256).view(0, 2, 128), eps=1e-6, store_rstd=True, out_dtype=None,
                                     residual_dtype=torch.float32, weight_offset=0.0)),
    ("fused_add_rmsnorm_", lambda: dict(x=_x(0, 256), residual=_x(0, 256), weight=torch.randn(256), eps=1e-6)),
    ("layernorm", lambda: dict(x=_x(0, 384), weight=torch.randn(384), bias=torch.randn(384), eps=1e-5,
                               return_rstd=True, return_mean=True)),
    ("fp8_quantize", lambda: _fp8(x=_x(0, 1024), group_size=128, column_major_scales=True)),
    ("rmsnorm_fp8quant", lambda: _fp8(x=_x(0, 256), weight=torch.randn(256), eps=1e-6, return_y=True)),
    ("nvfp4_quantize", lambda: dict(x=_x(0, 256), global_scale=torch.tensor([2.0]), swizzled=True)),
    ("add_rmsnorm_mxfp4quant", lambda: dict(x=_x(0, 256), residual=_x(0, 256), weight=torch.randn(256), eps=1e-6,
                                            swizzled=False, return_y=True)),
    ("cross_entropy_forward", lambda: _ce(logits=_x(0, 1000), target=torch.zeros(0, dtype=torch.int64))),
    ("cross_entropy_fwd_bwd", lambda: _ce(dloss=torch.randn(0), logits=_x(0, 1000),
                                          target=torch.zeros(0, dtype=torch.int64), return_lse=True)),
]


@pytest.mark.parametrize("op,make", EMPTY, ids=[op for op, _ in EMPTY])
def test_no_rows_launch_no_row_kernel(recorder, op, make):
    """No rows: no kernel launch; the outputs (empty) have the reference's shapes and dtypes."""
    args = make()
    out = dispatch.launch(op, "sm_90a", **args)
    assert recorder == []
    assert _shape(out) == _shape(getattr(reference, op)(**args))


@pytest.mark.parametrize("op,make", [
    ("cross_entropy_backward_", lambda: _ce(dloss=torch.randn(5), logits=_x(5, 1000), lse=torch.randn(5))),
    ("cross_entropy_fwd_bwd_", lambda: dict(dloss=torch.randn(5), logits=_x(5, 1000, torch.float32),
                                            target=torch.randint(0, 1000, (5,)), ignore_index=-100, softcap=30.0)),
], ids=["backward_", "fwd_bwd_"])
def test_cross_entropy_in_place_writes_over_the_logits(recorder, op, make):
    """The in-place ops launch the kernel compiled for dlogits over the logits (its own key): the logits'
    address and row stride as dx's, no fresh dlogits."""
    from oink.kernels.compile import CACHE

    args = make()
    CACHE.clear_used()
    dispatch.launch(op, "sm_90a", **args)
    (call,) = recorder
    x, dx, ldx, ldd = call[0], call[6], call[8], call[9]
    assert x == dx == args["logits"].data_ptr() and ldx == ldd == 1000
    assert [k[0][-1] for k in CACHE.used] == ["inplace"]


def test_cross_entropy_sharded_forward_launches_nothing(recorder):
    """The forward with ``lse_partial`` (vocab-parallel) needs no pass over the logits: no launch, the
    reference's [M]-sized torch ops (its outputs exactly)."""
    args = _ce(logits=_x(4, 512), weight=torch.rand(512), reduction="mean", z_loss=1e-3, return_z_loss=True)
    args.update(lse_partial=torch.randn(4, 3), target_logit=torch.randn(4))
    out = dispatch.launch("cross_entropy_forward", "sm_90a", **args)
    assert recorder == []
    for got, want in zip(out, reference.cross_entropy_forward(**args), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["rmsnorm_backward", "layernorm_backward"])
def test_norm_backward_of_no_rows_sums_zeroed_partials(recorder, op):
    """The norm backward of no rows still gives dweight and dbias (zeros): one launch, the partials' sum
    of a zeroed buffer, no row kernel."""
    x, w = _x(0, 256), torch.randn(256)
    args = (dict(x=x, weight=w, dout=_x(0, 256), rstd=torch.rand(0), dresidual_out=None, has_bias=True,
                 has_residual=False, weight_offset=0.0) if op == "rmsnorm_backward" else
            dict(dout=_x(0, 256), x=x, weight=w, rstd=torch.rand(0), mean=torch.rand(0), bias=torch.randn(256)))
    out = dispatch.launch(op, "sm_90a", **args)
    assert len(recorder) == 1
    assert _shape(out) == _shape(getattr(reference, op)(**args))


def test_typed_launcher_types_each_address_as_compiled():
    """Without TVM-FFI the compiled function takes ``cute.runtime`` pointers and a CUstream: the
    launcher turns each integer address into a pointer of the compiled argument's dtype and alignment,
    the raw stream into a CUstream, and passes None and scalars as they are."""
    import cutlass

    from oink.kernels.compile import _typed_launcher, fake_stream, gmem_ptr

    calls = []
    fake = (gmem_ptr(cutlass.BFloat16), None, gmem_ptr(cutlass.Float32, 4), cutlass.Int32(1), cutlass.Float32(1.0),
            fake_stream())
    _typed_launcher(lambda *a: calls.append(a), fake)(1 << 20, None, (1 << 20) + 4, 7, 0.5, 0)
    (p, none, rstd, m, eps, stream), = calls
    assert (p.dtype, p._assumed_align, p._pointer) == (cutlass.BFloat16, 16, 1 << 20)
    assert (rstd.dtype, rstd._assumed_align, rstd._pointer) == (cutlass.Float32, 4, (1 << 20) + 4)
    assert none is None and (m, eps) == (7, 0.5)
    assert int(stream) == 0 and type(stream).__name__ == "CUstream"


@pytest.mark.parametrize("rows_only", [True, False])
def test_a_few_rows_entry_serves_only_where_it_keeps_the_order(monkeypatch, rows_only):
    """A "/few" launch-table entry (calls of at most ``launch_table.FEW_ROWS`` rows) serves only where it packs
    other rows a CTA with the key's own threads, accesses and cluster a row (``launch_table.same_order``); one
    that splits a row otherwise is ignored, as its rows' bits would differ from the same rows in a larger batch."""
    from oink.kernels import launch_table
    from oink.kernels.row_rules import RowLaunch

    N, key = 4096, "rmsnorm_fwd/x16w16"
    default = RowLaunch(N=N, vec=8, threads_per_row=128, num_threads=128, cluster_n=1)
    few = [128, 512, 1] if rows_only else [256, 256, 1]
    tables = {"sm_90a": {f"{key}/few": {N: {"launch": few, "n": [N, N]}}}}
    monkeypatch.setattr(launch_table, "table", lambda: tables)
    chosen = launch_table.pick(key, "sm_90a", default, few=True)
    assert launch_table.pick(key, "sm_90a", default) == default
    assert (chosen.threads_per_row, chosen.num_threads, chosen.cluster_n) == (tuple(few) if rows_only else
                                                                                (128, 128, 1))
    assert launch_table.same_order(chosen, default)


def _launch_widths() -> set:
    """The launches' N (a row's width, or its window's) in the compile keys looked up since ``clear_used``."""
    from oink.kernels.compile import CACHE

    found, todo = set(), list(CACHE.used)
    while todo:
        part = todo.pop()
        if isinstance(part, tuple):
            todo.extend(part)
        elif hasattr(part, "threads_per_row"):
            found.add(part.N)
    return found


@pytest.mark.parametrize("windows", [True, False, None])
@pytest.mark.parametrize("case", ["rmsnorm", "softmax", "ce_forward", "ce_fwd_bwd", "strided", "residual",
                                  "fp32_weight", "aligned"])
def test_rows_off_boundaries_take_windows_where_asked(recorder, monkeypatch, case, windows):
    """With the ``windows`` setting, dense rows off 16-byte boundaries launch as their aligned windows (455 columns: a
    window of 464; GPT-2's 50257 one of 50264) for the softmax forward, the cross-entropy forward and fused mode,
    and an RMSNorm of x's weight dtype; rows at another stride than the output's, a residual and an fp32 weight
    (measured slower through windows) keep the narrow launch, as aligned rows do theirs. Set False, every row the
    narrow one (a window splits a row by its address); unset, the norms' and softmax's rows the narrow one, the
    cross-entropy reductions' their windows (the element path has not run on a GPU yet)."""
    from oink.kernels.compile import CACHE

    monkeypatch.setitem(config.DEV, "windows", windows)
    config.reload()
    N = 4096 if case == "aligned" else 50257 if case.startswith("ce_") else 455  # a window: one row a CTA
    x = _x(600, N, stride=N + 3 if case == "strided" else None)
    w = torch.randn(N, dtype=torch.float32 if case == "fp32_weight" else torch.bfloat16)
    op, args = "rmsnorm_forward", dict(x=x, weight=w, eps=1e-6)
    if case == "softmax":
        op, args = "softmax_forward", dict(x=x)
    elif case == "residual":
        args.update(residual=_x(600, N))
    elif case.startswith("ce_"):
        op, args = "cross_entropy_forward", dict(logits=x, target=torch.randint(0, N, (600,)))
        if case == "ce_fwd_bwd":
            op, args = "cross_entropy_fwd_bwd", dict(args, dloss=torch.rand(600))
    CACHE.clear_used()
    dispatch.prepare(op, "sm_90a", args)
    windowed = {"rmsnorm": 464, "softmax": 464, "ce_forward": 50264, "ce_fwd_bwd": 50264}
    ce_rule = windows is None and case.startswith("ce_")  # the cross-entropy reductions' rule: windows
    assert _launch_widths() == ({windowed[case]} if (windows or ce_rule) and case in windowed else {N})


@pytest.mark.parametrize("first_row", [0, 1])
def test_fused_add_off_boundaries_runs_the_kernel_on_dense_copies(recorder, monkeypatch, first_row):
    """An in-place fused add whose rows start off 16-byte boundaries (a batch from row 1 of 455-column rows) runs
    the kernel, not the reference, on dense copies of x and the residual, written back after (batch invariance: a
    row's launch the same wherever it sits); operands it can read as they are, in place."""
    from oink.kernels import rmsnorm_ops

    N = 455
    x, res = _x(7, N)[first_row:], _x(7, N)[first_row:]
    args = dict(x=x, residual=res, weight=torch.randn(N, dtype=torch.bfloat16), eps=1e-6)
    assert rmsnorm_ops.CHECKS["fused_add_rmsnorm_"](args, "sm_90a") is None
    staged = first_row == 1
    assert (x.data_ptr() % 16 != 0) == staged
    # a marked copy: what the kernel's buffers hold comes back into x and the residual
    monkeypatch.setattr(rmsnorm_ops, "dense", lambda t: t.clone(memory_format=torch.contiguous_format) + 1)
    want_x, want_res = (x + 1, res + 1) if staged else (x.clone(), res.clone())
    run = dispatch.prepare("fused_add_rmsnorm_", "sm_90a", args)
    recorder.clear()
    run(args)
    (call,) = recorder
    xp, rp = call[0], call[3]
    assert (xp, rp) == (call[4], call[5]) and call[8] == 7 - first_row
    assert (xp == x.data_ptr(), rp == res.data_ptr()) == (not staged, not staged)
    assert call[9:13] == (N, N, N, N)
    assert torch.equal(x, want_x) and torch.equal(res, want_res)


# vLLM's batch sizes and the few-rows bound's both sides: no launch may be chosen by them (batch invariance)
INVARIANCE_ROWS = (1, 3, 16, 32, 33, 255, 256, 300, 1024, 4096)


def _prepared_kernels(op, M, N, make) -> set:
    """The compile keys of the row kernels ``op``'s launch for M rows looks up (the partials' sum, a sum over
    the rows, and the backward's ``direct`` flag, which only says where dweight goes, left out)."""
    from oink.kernels.compile import CACHE

    CACHE.clear_used()
    dispatch.prepare(op, "sm_90a", make(M, N))
    keys = set()
    for k in CACHE.used:
        k = k[0] if isinstance(k, tuple) and isinstance(k[0], tuple) else k
        if isinstance(k, tuple) and k and k[0] in ("rmsnorm_bwd", "layernorm_bwd"):
            k = k[:-1]  # direct
        if not (isinstance(k, tuple) and k and str(k[0]).startswith("partial")):
            keys.add(k)
    return keys


def _norm_args(M, N, **extra):
    return dict(x=_x(M, N), weight=torch.randn(N, dtype=torch.bfloat16), eps=1e-6, **extra)


INVARIANCE_OPS = {
    "rmsnorm_forward": _norm_args,
    "rmsnorm_forward_res32": lambda M, N: _norm_args(M, N, residual=_x(M, N).float()),
    "layernorm": lambda M, N: dict(x=_x(M, N), weight=torch.randn(N, dtype=torch.bfloat16), bias=None, eps=1e-6),
    "softmax_forward": lambda M, N: dict(x=_x(M, N)),
    "rmsnorm_backward": lambda M, N: dict(x=_x(M, N), weight=torch.randn(N, dtype=torch.bfloat16), dout=_x(M, N),
                                          rstd=torch.rand(M), dresidual_out=None, has_bias=False, has_residual=False,
                                          weight_offset=0.0),
}


@pytest.mark.parametrize("N", [763, 3584, 14336, 20234, 32768, 131072])
@pytest.mark.parametrize("case", sorted(INVARIANCE_OPS))
def test_no_launch_is_chosen_by_the_row_count(recorder, monkeypatch, case, N):
    """Batch invariance: the kernels a call launches (their launch shapes, parameter loads, staging) are the same
    at every row count, so a row's reduction order never depends on how many rows came with it. The few-rows
    launch-table entries, windows chosen by the rows, the backward's budget chosen by the rows and the forward's
    late parameters at few rows each broke it (found on an H100: LayerNorm 20234 at 16 rows, the fp32-residual
    RMSNorm at 131072, the backward at 131072)."""
    from oink.kernels import launch_table

    monkeypatch.setattr(launch_table, "CARD", "NVIDIA H100 80GB HBM3")  # the shipped table's entries apply
    op = "rmsnorm_forward" if case == "rmsnorm_forward_res32" else case
    first = _prepared_kernels(op, INVARIANCE_ROWS[0], N, INVARIANCE_OPS[case])
    for M in INVARIANCE_ROWS[1:]:
        assert _prepared_kernels(op, M, N, INVARIANCE_OPS[case]) == first, f"{case} N={N}: M={M} launches otherwise"




@pytest.mark.parametrize("layout", ["row", "column", "tma"])
def test_vllm_group_quant_writes_its_out_parameters(recorder, layout):
    """vLLM's ``per_token_group_fp8_quant`` through the FP8 group kernel: the codes straight into output_q, the
    scales straight into output_s where its layout is the kernel's (row-major, or column-major with strides (1, T)),
    else into the kernel's and copied (TMA-aligned: strides (1, round_up(T, 4))); other bounds, eps or UE8M0 scales
    take the reference, saying why."""
    from oink.kernels import fp8_ops

    M, N, g = 6, 256, 128
    G = N // g
    x, q = _x(M, N), torch.empty(M, N, dtype=torch.float8_e4m3fn)
    s = {"row": lambda: torch.empty(M, G), "column": lambda: torch.empty(G, M).t(),
         "tma": lambda: torch.empty_strided((M, G), (1, 8))}[layout]()
    args = dict(input=x, output_q=q, output_s=s, group_size=g, eps=1e-10, fp8_min=-448.0, fp8_max=448.0,
                scale_ue8m0=False, dummy_is_scale_transposed=False, dummy_is_tma_aligned=False)
    assert fp8_ops.check_group_quant(args, "sm_90a") is None
    for bad, why in ((dict(scale_ue8m0=True), "UE8M0"), (dict(fp8_max=240.0), "bounds"), (dict(eps=1e-6), "eps"),
                     (dict(group_size=32), "group_size")):
        assert why in (fp8_ops.check_group_quant({**args, **bad}, "sm_90a") or ""), bad
    run = dispatch.prepare("per_token_group_fp8_quant", "sm_90a", args)
    recorder.clear()
    s.fill_(-1.0)
    run(args)
    (call,) = recorder
    assert call[0] == x.data_ptr() and call[3] == q.data_ptr() and call[5:7] == (M, N)
    assert (call[4] == s.data_ptr()) == (layout != "tma")


@pytest.mark.parametrize("op,layout", [("rms_norm_static_fp8_quant", None),
                                       ("fused_add_rms_norm_static_fp8_quant", None),
                                       ("rms_norm_dynamic_per_token_quant", "token"),
                                       ("rms_norm_per_block_quant", "row"), ("rms_norm_per_block_quant", "column"),
                                       ("rms_norm_per_block_quant", "tma")])
def test_vllm_norms_write_their_out_parameters(recorder, monkeypatch, op, layout):
    """vLLM's four norm + FP8 ops through the fused FP8 kernel compiled with vLLM's values (``twice``; the norm of
    the fp32 sum where vLLM's dynamic ops take it): codes straight into ``result``, the residual updated in place,
    the static scale and the bound read where they are, scales straight into ``scale`` where its layout is the
    kernel's, else written in the kernel's and copied (TMA-aligned: strides (1, round_up(T, 4)))."""
    from oink.kernels import fp8, fp8_ops

    keys = []
    real = fp8.compiled_rmsnorm_fp8.__wrapped__
    compiled = lambda k: keys.append(k) or real(k)  # noqa: E731 (records the key the plan compiles for)
    M, N, g = 6, 256, 128
    G = N // g
    x, w, out = _x(M, N, stride=384), torch.randn(N, dtype=torch.bfloat16), torch.empty(M, N, dtype=torch.float8_e4m3fn)
    res = torch.randn(M, N, dtype=torch.bfloat16)
    args = dict(result=out, input=x, weight=w, epsilon=1e-6)
    if op.startswith("fused") or layout:
        args["residual"] = res
    if layout is None:
        args["scale"] = torch.tensor([0.5])
    elif layout == "token":
        args.update(scale=torch.empty(M, 1), scale_ub=torch.tensor(3.0))
    else:
        args["scale"] = {"row": lambda: torch.empty(M, G), "column": lambda: torch.empty(G, M).t(),
                         "tma": lambda: torch.empty_strided((M, G), (1, 8))}[layout]()
        args.update(scale_ub=None, group_size=g, is_scale_transposed=layout != "row", scale_ue8m0=True)
    assert fp8_ops.CHECKS[op](args, "sm_90a") is None
    assert "multiple of 16" in fp8_ops.CHECKS[op]({**args, "input": _x(M, 200)}, "sm_90a")
    monkeypatch.setattr(fp8_ops, "compiled_rmsnorm_fp8", compiled)
    run = dispatch.prepare(op, "sm_90a", args)
    (key,) = keys
    mode = fp8_ops.VLLM_NORM_MODES[op]
    assert key.twice and key.mode == mode and key.raw_sum == (mode != "static") and key.x_dtype == "bfloat16"
    assert (key.res_dtype is not None) == ("residual" in args) and key.ub == (layout == "token")
    assert key.group_size == (g if mode == "block" else 0) and key.column_major == (layout in ("column", "tma"))
    recorder.clear()
    if mode != "static":
        args["scale"].fill_(-1.0)
    run(args)
    (call,) = recorder
    px, pres, pw, pscale, pub, py, pq, ps, m, ldx, ldr, ldy, eps, _ = call
    assert (px, pw, pq, m, ldx, eps, py) == (x.data_ptr(), w.data_ptr(), out.data_ptr(), M, 384, 1e-6, None)
    assert pres == (res.data_ptr() if "residual" in args else None) and ldr == (N if "residual" in args else 0)
    assert pscale == (args["scale"].data_ptr() if mode == "static" else None)
    assert pub == (args["scale_ub"].data_ptr() if layout == "token" else None)
    if mode != "static":
        assert (ps == args["scale"].data_ptr()) == (layout != "tma")


@pytest.mark.parametrize("op", ["qk_norm_rope", "fused_qk_norm_rope"])
def test_qk_norm_rope_launch(recorder, op):
    """The fused QK norm + rotary embedding: one launch over qkv (rows strided), q and k to fresh [T, H, D] tensors
    (out of place) or into qkv; the weights, cache and positions read where they are; the declined layouts say why."""
    from oink.kernels import rope_ops
    from oink.reference.rope import rope_cache

    T, Hq, Hk, D = 5, 8, 2, 128
    qkv = torch.randn(T, (Hq + 2 * Hk) * D + 64, dtype=torch.bfloat16)[:, :(Hq + 2 * Hk) * D]
    qw, kw = torch.randn(D, dtype=torch.bfloat16), torch.randn(D, dtype=torch.bfloat16)
    cache, pos = rope_cache(100, 64), torch.tensor([0, 5, 99, 3, 7])
    a = dict(qkv=qkv, num_heads_q=Hq, num_heads_k=Hk, num_heads_v=Hk, head_dim=D, eps=1e-5, q_weight=qw,
             k_weight=kw, cos_sin_cache=cache, is_neox=True, position_ids=pos)
    if op == "qk_norm_rope":
        a["weight_offset"] = 0.0
    else:
        a["forced_token_heads_per_warp"] = -1
    assert "not yet run on a GPU" in rope_ops.check(a, "sm_90a")  # until its GPU tests have run
    with config.override(rope_kernel=True):
        assert rope_ops.check(a, "sm_90a") is None
        for bad, why in ((dict(qkv=qkv.float()), "float16 and bfloat16"), (dict(qkv=qkv[:, 1:]), "aligned"),
                         (dict(cos_sin_cache=rope_cache(100, 12)), "rotary_dim"),
                         (dict(cos_sin_cache=rope_cache(100, 128)[:, :64]), "contiguous"),
                         (dict(position_ids=torch.arange(10)[::2]), "strided"),
                         (dict(k_weight=kw.float()), "different dtypes")):
            assert why in (rope_ops.check({**a, **bad}, "sm_90a") or ""), bad
    run = dispatch.prepare(op, "sm_90a", a)
    recorder.clear()
    out = run(a)
    (call,) = recorder
    pqkv, pq, pk, pwq, pwk, pcache, ppos, t, ld, positions, eps, _ = call
    assert (pqkv, pwq, pwk, pcache, ppos) == (qkv.data_ptr(), qw.data_ptr(), kw.data_ptr(), cache.data_ptr(),
                                             pos.data_ptr())
    assert (t, ld, positions, eps) == (T, (Hq + 2 * Hk) * D + 64, 100, 1e-5)
    if op == "qk_norm_rope":
        q, k = out
        assert q.shape == (T, Hq, D) and k.shape == (T, Hk, D) and (pq, pk) == (q.data_ptr(), k.data_ptr())
    else:
        assert out is None and pq is None and pk is None
