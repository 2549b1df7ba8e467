"""Every op, declared once (see ``oink.declare``): its public signature and docs, input checks,
``torch.ops.oink`` schema, fake, the kernel family that serves it and its autograd.

The function bodies are the metadata checks (they also run on FakeTensors under torch.compile);
the references in ``oink.reference`` compute the same signatures, and kernel modules export
``CHECKS[name]`` / ``RUNNERS[name]``. Importing this module registers ``torch.ops.oink.*``.
"""
from __future__ import annotations

import torch

from . import checks as c
from .declare import PUBLIC, declare, explain  # noqa: F401
from .reference import fp8 as fp8_spec
from .reference.cross_entropy import REDUCTIONS
from .reference.nvfp4 import round_up

NORMS = "oink.kernels.rmsnorm_ops"
SOFTMAX = "oink.kernels.softmax_ops"
CROSS_ENTROPY = "oink.kernels.cross_entropy_ops"
FP4 = "oink.kernels.nvfp4_ops"
FP8 = "oink.kernels.fp8_ops"


def _absent(x):
    """An optional output not asked for (the custom op's placeholder): empty, x's dtype."""
    return x.new_empty(0)


def _keep(t, wanted: bool):
    return t if wanted else None


# ---------------------------------------------------------------- autograd of the differentiable ops
def _rmsnorm_setup(ctx, inputs, output):
    x, weight, bias, residual, eps, store_rstd, out_dtype, residual_dtype, weight_offset = inputs
    y, rstd, res_out = output
    if not store_rstd:
        raise RuntimeError("oink::rmsnorm_forward needs store_rstd=True to be differentiated")
    ctx.has_residual, ctx.has_bias = residual is not None, bias is not None
    ctx.normed_res_out = residual is not None or residual_dtype is not None  # the norm was of res_out
    ctx.x_dtype = x.dtype
    ctx.res_dtype = residual.dtype if residual is not None else None
    ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None
    ctx.weight_offset = weight_offset
    ctx.save_for_backward(res_out if ctx.normed_res_out else x, weight, rstd)


def _rmsnorm_backward(ctx, dy, drstd, dres_out):
    h, weight, rstd = ctx.saved_tensors
    dres = dres_out if ctx.normed_res_out and dres_out is not None and dres_out.numel() else None
    dh, dw, db = torch.ops.oink.rmsnorm_backward(h, weight, dy.contiguous(), rstd, dres, ctx.has_bias,
                                                 ctx.weight_offset)
    dx = dh.to(ctx.x_dtype)
    dresidual = dh.to(ctx.res_dtype) if ctx.has_residual else None
    if ctx.has_bias:  # db comes in the weight's shape and dtype: a [D] bias beside [H, D] weights sums heads
        shape, dtype = ctx.bias_meta
        db = db.reshape(-1, *shape).sum(0).to(dtype)
    else:
        db = None
    return (dx, dw if weight is not None else None, db, dresidual, None, None, None, None, None)


def _layernorm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, rstd, mean = output
    ctx.mark_non_differentiable(rstd, mean)  # statistics are outputs for reuse, not differentiated
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, rstd, mean, bias)


def _layernorm_backward(ctx, dy, _drstd, _dmean):
    x, weight, rstd, mean, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.oink.layernorm_backward(dy.contiguous(), x, weight, rstd, mean, bias)
    return dx, dw, (db if ctx.has_bias else None), None


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return torch.ops.oink.softmax_backward(dy.contiguous(), y)


# ---------------------------------------------------------------- RMSNorm
def _fake_rmsnorm_forward(x, weight, bias, residual, eps, store_rstd, out_dtype=None, residual_dtype=None,
                          weight_offset=0.0):
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32) if store_rstd else _absent(x)
    if residual is not None or residual_dtype is not None:
        res_out = x.new_empty(x.shape, dtype=residual_dtype or residual.dtype)
    else:
        res_out = _absent(x)
    return torch.empty_like(x, dtype=out_dtype or x.dtype), rstd, res_out


@declare("rmsnorm_forward(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool store_rstd, "
         "ScalarType? out_dtype=None, ScalarType? residual_dtype=None, float weight_offset=0.) "
         "-> (Tensor, Tensor, Tensor)",
         kernels=NORMS, fake=_fake_rmsnorm_forward, backward=(_rmsnorm_backward, _rmsnorm_setup),
         to_public=lambda o, a: (o[0], _keep(o[1], a["store_rstd"]),
                                 _keep(o[2], a["residual"] is not None or a["residual_dtype"] is not None)))
def rmsnorm_forward(x, weight=None, bias=None, residual=None, eps=1e-6, store_rstd=False, *, out_dtype=None,
                    residual_dtype=None, weight_offset=0.0):
    """RMSNorm over the last dim, optionally of x + residual (vLLM's and Quack's arguments).

    y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset) + bias in fp32, where h is x, or with a residual
    the stored sum residual_out = x + residual in ``residual_dtype``.

    Args:
        x: [..., N] activations, fp32, fp16 or bf16.
        weight, bias: [N], or [H, D] per head for x [..., H, D] (a per-head bias needs a per-head
            weight); any float dtype; None for none.
        residual: x's shape, any float dtype, or None.
        eps: added to the mean of squares.
        store_rstd: also return rstd (``rmsnorm_backward`` and autograd need it).
        out_dtype: y's dtype (default x's).
        residual_dtype: residual_out's dtype (default the residual's; without a residual,
            residual_out is x in that dtype).
        weight_offset: added to the weight (Gemma's ``1 + w``: 1.0).

    Returns:
        (y, rstd, residual_out): rstd fp32 [x.shape[:-1]], or None without ``store_rstd``;
        residual_out None without a residual or ``residual_dtype``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.norm_param("weight", weight, x)
    c.norm_param("bias", bias, x)
    if bias is not None and bias.dim() == 2 and (weight is None or weight.dim() != 2):
        raise ValueError("bias: a per-head bias [H, D] needs a per-head weight [H, D]")
    c.optional("residual", residual)
    c.same_shape("residual", residual, "x", x)
    c.dtype_arg("out_dtype", out_dtype)
    c.dtype_arg("residual_dtype", residual_dtype)
    c.same_device(x=x, weight=weight, bias=bias, residual=residual)


@declare("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor", kernels=None, route="rmsnorm_forward",
         fake=lambda x, weight, eps: torch.empty_like(x), public=False, autograd=False)
def rmsnorm(x, weight, eps):
    """vLLM's op: y = rmsnorm(x) * weight (its schema is vLLM's; don't change it)."""
    rmsnorm_forward.op.check(x, weight, eps=eps)


@declare("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
         kernels=NORMS, fake=lambda *a: None)
def fused_add_rmsnorm_(x, residual, weight, eps=1e-6):
    """Fused add + RMSNorm in place, vLLM's ``fused_add_rms_norm``.

    residual <- x + residual (in its dtype); x <- rmsnorm(residual) * weight.

    Args:
        x: [..., N] activations, fp32, fp16 or bf16; overwritten with the output.
        residual: x's shape, any float dtype; overwritten with the sum.
        weight: [N], any float dtype.
        eps: added to the mean of squares.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    c.rows_input("x", x)
    c.tensor("residual", residual)
    c.same_shape("residual", residual, "x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.same_device(x=x, residual=residual, weight=weight)


def _fake_rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, weight_offset=0.0):
    shape, wdt = (weight.shape, weight.dtype) if weight is not None else ((x.shape[-1],), x.dtype)
    dw = x.new_empty(shape, dtype=wdt) if weight is not None else _absent(x)
    db = x.new_empty(shape, dtype=wdt) if has_bias else _absent(x)
    return torch.empty_like(x), dw, db


@declare("rmsnorm_backward(Tensor x, Tensor? weight, Tensor dout, Tensor rstd, Tensor? dresidual_out, "
         "bool has_bias, float weight_offset=0.) -> (Tensor, Tensor, Tensor)",
         kernels=NORMS, fake=_fake_rmsnorm_backward, fixed={"has_residual": False},
         to_public=lambda o, a: (o[0], _keep(o[1], a["weight"] is not None), _keep(o[2], a["has_bias"]),
                                 _keep(o[0], a["has_residual"])))
def rmsnorm_backward(x, weight, dout, rstd, dresidual_out=None, has_bias=False, has_residual=False, *,
                     weight_offset=0.0):
    """Gradients of ``rmsnorm_forward``.

    Args:
        x: the tensor the forward normalised (its residual_out where it had a residual).
        weight: the forward's weight, or None.
        dout: the gradient of y, x's shape.
        rstd: the forward's rstd, fp32, one per row.
        dresidual_out: the gradient reaching residual_out from later layers (added to dx), or None.
        has_bias, has_residual: also return db / dresidual.
        weight_offset: the forward's.

    Returns:
        (dx, dw, db, dresidual): dx in x's dtype; dw and db summed over rows in fp32, in the weight's
        shape and dtype (None without a weight / ``has_bias``); dresidual is dx (None without
        ``has_residual``).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.norm_param("weight", weight, x)
    c.tensor("dout", dout)
    c.same_shape("dout", dout, "x", x)
    c.row_stat("rstd", rstd, x.shape[:-1])
    c.optional("dresidual_out", dresidual_out)
    c.same_shape("dresidual_out", dresidual_out, "x", x)
    c.same_device(x=x, weight=weight, dout=dout, rstd=rstd, dresidual_out=dresidual_out)


# ---------------------------------------------------------------- LayerNorm
def _fake_layernorm(x, weight, bias, eps):
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


def _layernorm_outputs(o, a):
    extra = ([o[1]] if a["return_rstd"] else []) + ([o[2]] if a["return_mean"] else [])
    return (o[0], *extra) if extra else o[0]


@declare("layernorm(Tensor x, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
         kernels=NORMS, fake=_fake_layernorm, fixed={"return_rstd": True, "return_mean": True}, eager_unfixed=True,
         backward=(_layernorm_backward, _layernorm_setup),
         to_public=_layernorm_outputs)
def layernorm(x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
    """LayerNorm over the last dim: y = (x - mean) * rstd * weight + bias in fp32; differentiable.

    Args:
        x: [..., N] activations, fp32, fp16 or bf16.
        weight: [N]; bias: [N] or None; any float dtype.
        eps: added to the variance.
        return_rstd, return_mean: also return these statistics.

    Returns:
        y in x's dtype, or (y, rstd), (y, mean), (y, rstd, mean) as asked (fp32, one per row).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.vector("bias", bias, x.shape[-1])
    c.same_device(x=x, weight=weight, bias=bias)


def _fake_layernorm_backward(dout, x, weight, rstd, mean, bias):
    db = torch.empty_like(bias) if bias is not None else _absent(x)
    return torch.empty_like(x), torch.empty_like(weight), db


@declare("layernorm_backward(Tensor dout, Tensor x, Tensor weight, Tensor rstd, Tensor mean, Tensor? bias) "
         "-> (Tensor, Tensor, Tensor)",
         kernels=NORMS, fake=_fake_layernorm_backward,
         to_public=lambda o, a: (o[0], o[1], _keep(o[2], a["bias"] is not None)))
def layernorm_backward(dout, x, weight, rstd, mean, bias=None):
    """Gradients of ``layernorm``.

    Args:
        dout: the gradient of y, x's shape.
        x, weight, bias: the forward's inputs (bias None: no db).
        rstd, mean: the forward's statistics, fp32, one per row.

    Returns:
        (dx, dw, db): dx in x's dtype; dw and db summed over rows in fp32, in the weight's and the
        bias's dtype (db None without a bias).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.tensor("dout", dout)
    c.same_shape("dout", dout, "x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.vector("bias", bias, x.shape[-1])
    c.row_stat("rstd", rstd, x.shape[:-1])
    c.row_stat("mean", mean, x.shape[:-1])
    c.same_device(dout=dout, x=x, weight=weight, rstd=rstd, mean=mean, bias=bias)


# ---------------------------------------------------------------- Softmax
@declare("softmax_forward(Tensor x) -> Tensor", kernels=SOFTMAX, fake=lambda x: torch.empty_like(x),
         backward=(_softmax_backward, _softmax_setup))
def softmax_forward(x):
    """Softmax over the last dim, fp32 arithmetic; differentiable.

    Args:
        x: [..., N], fp32, fp16 or bf16.

    Returns:
        softmax(x) in x's dtype.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)


@declare("softmax_backward(Tensor dy, Tensor y) -> Tensor", kernels=SOFTMAX, fake=lambda dy, y: torch.empty_like(y))
def softmax_backward(dy, y):
    """Softmax's gradient from its output: dx = y * (dy - sum(dy * y)) per row, in fp32.

    Args:
        dy: the gradient of y, y's shape.
        y: the forward's output.

    Returns:
        dx in y's dtype.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _rows_and_grad("y", y, dy)


def _rows_and_grad(name, t, dy):
    """An activation ``name`` and its gradient dy: same shape, same device."""
    c.rows_input(name, t)
    c.tensor("dy", dy)
    c.same_shape("dy", dy, name, t)
    c.same_device(dy=dy, **{name: t})


@declare("softmax_fwd_bwd(Tensor dy, Tensor x) -> Tensor", kernels=SOFTMAX, fake=lambda dy, x: torch.empty_like(x))
def softmax_fwd_bwd(dy, x):
    """Softmax's gradient from its input: y = softmax(x) recomputed in the same pass, never stored.

    Args:
        dy: the gradient of softmax(x), x's shape.
        x: the forward's input.

    Returns:
        dx = y * (dy - sum(dy * y)) in x's dtype.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _rows_and_grad("x", x, dy)


# ---------------------------------------------------------------- CrossEntropy
def _logits_target(logits, target):
    c.rows_input("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected 2 dims [M, V], got shape {tuple(logits.shape)}")
    c.tensor("target", target, c.INDEX_DTYPES)
    if tuple(target.shape) != (logits.shape[0],):
        raise ValueError(f"target: expected shape ({logits.shape[0]},), got {tuple(target.shape)}")
    c.same_device(logits=logits, target=target)


def _class_weight(weight, logits):
    if weight is not None:
        c.vector("weight", weight, logits.shape[-1])
        c.same_device(logits=logits, weight=weight)


def _dloss(dloss, M):
    c.tensor("dloss", dloss, min_dim=0)
    if dloss.numel() not in (1, M) or dloss.dim() > 1:
        raise ValueError(f"dloss: expected a scalar or shape ({M},), got {tuple(dloss.shape)}")


def _targets_in_range(logits, target, ignore_index, **_):
    c.target_values(logits, target, ignore_index)


def _forward_targets_in_range(logits, target, ignore_index, target_logit=None, **_):
    indexed = target_logit if target_logit is not None else logits  # what the targets index
    if indexed.dim() == 2:  # a gathered [M] target logit: the vocabulary is another rank's to check
        c.target_values(indexed, target, ignore_index)


def _ce_options(label_smoothing, z_loss, softcap, lse_partial=None) -> None:
    """The cross-entropy options (see ``oink.reference.cross_entropy``): Python numbers in range."""
    c.ce_options(label_smoothing, z_loss, softcap)
    if lse_partial is not None and label_smoothing:
        raise ValueError("label_smoothing: needs every logit of the row (mean_j -log p_j), which lse_partial's "
                         "shards do not give; smooth on the full logits or leave lse_partial out")


def _reduced(t, reduction):
    return torch.empty_like(t) if reduction == "none" else t.new_empty(())


def _fake_ce_forward(logits, target, ignore_index, reduction, weight=None, lse_partial=None, target_logit=None,
                     label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    lse = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return _reduced(lse, reduction), lse, (_reduced(lse, reduction) if return_z_loss else _absent(lse))


_CE_OPTIONS = "float label_smoothing=0., float z_loss=0., float? softcap=None"


@declare("cross_entropy_forward(Tensor logits, Tensor target, SymInt ignore_index, str reduction, "
         f"Tensor? weight=None, Tensor? lse_partial=None, Tensor? target_logit=None, {_CE_OPTIONS}, "
         "bool return_z_loss=False) -> (Tensor, Tensor, Tensor)",
         kernels=CROSS_ENTROPY, fake=_fake_ce_forward, check_values=_forward_targets_in_range,
         to_public=lambda o, a: tuple(o) if a["return_z_loss"] else tuple(o[:2]))
def cross_entropy_forward(logits, target, ignore_index=-100, reduction="none", *, weight=None, lse_partial=None,
                          target_logit=None, label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    """Cross-entropy loss and logsumexp of each row of ``logits`` against ``target``.

    Args:
        logits: [M, V] fp32, fp16 or bf16.
        target: [M] int32 or int64 class indices in [0, V), or ``ignore_index``.
        ignore_index: rows with this target have loss 0 (and gradient 0) and do not count in "mean".
        reduction: "none" (per-row [M]), "mean" (over rows not ignored, weighted by ``weight``[target]
            where given; 0 when none counts) or "sum".
        weight: per-class weights [V]: row i's loss is scaled by weight[target_i].
        lse_partial: [M, K] per-shard logsumexps (vocab-parallel): the row's lse is theirs.
        target_logit: [M] or [M, V]: where to read the target's logit instead of ``logits``.
        label_smoothing: eps in [0, 1): loss = (1 - eps) * nll + eps * mean_j(-log p_j), class weights
            applied as ``torch.nn.functional.cross_entropy`` does.
        z_loss: coefficient z >= 0 of the auxiliary loss z * lse^2 added to each row (scaled by the
            row's weight like the rest).
        softcap: c > 0: logits become c * tanh(logits / c) first (Gemma-2); None for none.
        return_z_loss: also return the z-loss part of the loss, reduced as the loss is.

    Returns:
        (loss, lse), or (loss, lse, z_loss) with ``return_z_loss``: fp32, loss and z-loss [M] for
        "none" and 0-d otherwise; lse [M] (of the capped logits with ``softcap``).

    Raises:
        ValueError: a shape, reduction or option out of range (named), label smoothing with
            ``lse_partial``, or (with value checks on) a target outside [0, V) that is not ignored.
        TypeError: a dtype not supported.
    """
    _logits_target(logits, target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {REDUCTIONS}")
    _class_weight(weight, logits)
    _ce_options(label_smoothing, z_loss, softcap, lse_partial)
    M = logits.shape[0]
    if lse_partial is not None:
        c.tensor("lse_partial", lse_partial, min_dim=2)
        if lse_partial.dim() != 2 or lse_partial.shape[0] != M:
            raise ValueError(f"lse_partial: expected shape ({M}, K), got {tuple(lse_partial.shape)}")
    if target_logit is not None:
        c.tensor("target_logit", target_logit)
        if target_logit.shape[0] != M or target_logit.dim() > 2:
            raise ValueError(f"target_logit: expected shape ({M},) or ({M}, V), got {tuple(target_logit.shape)}")
    c.same_device(logits=logits, lse_partial=lse_partial, target_logit=target_logit)


@declare("cross_entropy_backward(Tensor dloss, Tensor logits, Tensor target, Tensor lse, SymInt ignore_index, "
         f"Tensor? weight=None, {_CE_OPTIONS}) -> Tensor",
         kernels=CROSS_ENTROPY, fake=lambda dloss, logits, *a: torch.empty_like(logits),
         check_values=_targets_in_range)
def cross_entropy_backward(dloss, logits, target, lse, ignore_index=-100, *, weight=None, label_smoothing=0.0,
                           z_loss=0.0, softcap=None):
    """Gradient of the per-row cross-entropy loss with respect to the logits.

    Args:
        dloss: the upstream gradient of the per-row loss, a scalar or [M].
        logits: [M, V] as given to the forward.
        target: [M] as given to the forward.
        lse: [M] fp32 the forward returned.
        ignore_index, weight, label_smoothing, z_loss, softcap: as given to the forward.

    Returns:
        dlogits [M, V] in the logits' dtype (0 on ignored rows).

    Raises:
        ValueError, TypeError: as the forward's.
    """
    _logits_target(logits, target)
    _dloss(dloss, logits.shape[0])
    c.row_stat("lse", lse, logits.shape[:-1])
    c.same_device(dloss=dloss, logits=logits, target=target, lse=lse)
    _class_weight(weight, logits)
    _ce_options(label_smoothing, z_loss, softcap)


@declare("cross_entropy_backward_(Tensor dloss, Tensor(a!) logits, Tensor target, Tensor lse, SymInt ignore_index, "
         f"Tensor? weight=None, {_CE_OPTIONS}) -> ()",
         kernels=CROSS_ENTROPY, fake=lambda *a: None, check_values=_targets_in_range, public=False)
def cross_entropy_backward_(dloss, logits, target, lse, ignore_index=-100, weight=None, label_smoothing=0.0,
                            z_loss=0.0, softcap=None):
    """dlogits written over the logits (no second [M, V] buffer): backs
    ``oink.cross_entropy(..., inplace_backward=True)``."""
    cross_entropy_backward.op.check(dloss, logits, target, lse, ignore_index, weight=weight,
                                    label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)


def _fake_ce_fwd_bwd(dloss, logits, target, ignore_index, weight=None, reduction="none", label_smoothing=0.0,
                     z_loss=0.0, softcap=None, return_z_loss=False):
    row = logits.new_empty(logits.shape[0], dtype=torch.float32)
    zl = _reduced(row, reduction) if return_z_loss else _absent(row)
    return _reduced(row, reduction), torch.empty_like(logits), torch.empty_like(row), zl


def _fwd_bwd_outputs(o, a):
    return (o[0], o[1]) + ((o[2],) if a["return_lse"] else ()) + ((o[3],) if a["return_z_loss"] else ())


@declare("cross_entropy_fwd_bwd(Tensor dloss, Tensor logits, Tensor target, SymInt ignore_index, "
         f"Tensor? weight=None, str reduction='none', {_CE_OPTIONS}, bool return_z_loss=False) "
         "-> (Tensor, Tensor, Tensor, Tensor)",
         kernels=CROSS_ENTROPY, fake=_fake_ce_fwd_bwd, check_values=_targets_in_range,
         fixed={"return_lse": True}, to_public=_fwd_bwd_outputs)
def cross_entropy_fwd_bwd(dloss, logits, target, ignore_index=-100, *, weight=None, return_lse=False,
                          reduction="none", label_smoothing=0.0, z_loss=0.0, softcap=None, return_z_loss=False):
    """Cross-entropy loss and its gradient with respect to the logits in one pass.

    Args:
        dloss: the upstream gradient of the returned loss: [M] or a scalar for "none", a scalar for
            "mean" and "sum".
        logits, target, ignore_index, weight, label_smoothing, z_loss, softcap: as
            ``cross_entropy_forward``'s.
        return_lse: also return lse [M].
        reduction: "none" (the default), "mean" or "sum", as ``cross_entropy_forward``'s; dlogits are
            the reduced loss's gradient times ``dloss``.
        return_z_loss: also return the z-loss part of the loss, reduced as the loss is.

    Returns:
        (loss, dlogits), then lse with ``return_lse``, then the z-loss with ``return_z_loss``; loss
        fp32, dlogits in the logits' dtype.

    Raises:
        ValueError, TypeError: as ``cross_entropy_forward``'s; a non-scalar ``dloss`` for a reduced loss.
    """
    _logits_target(logits, target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {REDUCTIONS}")
    _dloss(dloss, logits.shape[0])
    if reduction != "none" and dloss.numel() != 1:
        raise ValueError(f"dloss: the {reduction!r} loss is a scalar, so its gradient is one; got shape "
                         f"{tuple(dloss.shape)}")
    c.same_device(dloss=dloss, logits=logits, target=target)
    _class_weight(weight, logits)
    _ce_options(label_smoothing, z_loss, softcap)


# ---------------------------------------------------------------- NVFP4 / MXFP4
def _fp4_fake(x, N: int, swizzled: bool, mx: bool = False):
    """Codes [M, N/2] and scales (NVFP4: E4M3 per 16; MXFP4: UE8M0 per 32) of an N-wide quantization."""
    M = x.numel() // x.shape[-1]
    K = N // (32 if mx else 16)
    q = x.new_empty((M, N // 2), dtype=torch.uint8)
    shape = (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)
    return q, x.new_empty(shape, dtype=torch.float8_e8m0fnu if mx else torch.float8_e4m3fn)


def _fake_add_rmsnorm_fp4(x, residual, weight, *rest, mx=False):
    swizzled, return_y = rest[-2:]
    q, sf = _fp4_fake(x, x.shape[-1], swizzled, mx)
    return q, sf, (torch.empty_like(x) if return_y else _absent(x))


def _codes_and_scales(q, sf, swizzled, block, sf_dtype):
    c.tensor("q", q, (torch.uint8,), min_dim=2)
    c.tensor("sf", sf, (sf_dtype,), min_dim=2)
    if q.dim() != 2 or sf.dim() != 2:
        raise ValueError(f"q and sf must be 2-D, got {tuple(q.shape)} and {tuple(sf.shape)}")
    M, K = q.shape[0], q.shape[1] * 2 // block
    if (q.shape[1] * 2) % block:
        raise ValueError(f"q: {q.shape[1]} bytes a row is not a whole number of {block}-element blocks")
    want = (round_up(M, 128), round_up(K, 4)) if swizzled else (M, K)
    if tuple(sf.shape) != want:
        raise ValueError(f"sf: expected shape {want} for q of shape {tuple(q.shape)}, got {tuple(sf.shape)}")
    c.same_device(q=q, sf=sf)


def _gate_up(name, x, multiple_of):
    c.rows_input(name, x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dim {x.shape[-1]} must be even (gate and up halves)")
    multiple_of(f"{name} (each half)", x.shape[-1] // 2)


def _with_y(o, a):
    return tuple(o) if a["return_y"] else tuple(o[:2])


@declare("nvfp4_quantize(Tensor x, Tensor global_scale, bool swizzled) -> (Tensor, Tensor)",
         kernels=FP4, fake=lambda x, g, swizzled: _fp4_fake(x, x.shape[-1], swizzled), to_public=lambda o, a: tuple(o))
def nvfp4_quantize(x, global_scale, swizzled=False):
    """NVFP4: E2M1 codes with an E4M3 scale per 16 values (rules: ``oink.reference.nvfp4``).

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 16 (leading dims flattened into M).
        global_scale: 1-element fp32 tensor on x's device (never read on the host).
        swizzled: scales in FlashInfer's 128x4 layout instead of row-major.

    Returns:
        (q, sf): q uint8 [M, N/2], two codes a byte (element 2j in the low nibble); sf
        float8_e4m3fn [M, N/16], or [round_up(M, 128), round_up(N/16, 4)] swizzled.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


@declare("nvfp4_dequantize(Tensor q, Tensor sf, Tensor global_scale, bool swizzled) -> Tensor", kernels=None,
         fake=lambda q, *a: q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32))
def nvfp4_dequantize(q, sf, global_scale, swizzled=False):
    """The values NVFP4 codes stand for: e2m1(code) * sf / global_scale, fp32 [M, N].

    Args:
        q, sf: codes and scales as ``nvfp4_quantize`` returns them.
        global_scale: the 1-element fp32 tensor they were quantized with.
        swizzled: sf is in the 128x4 layout.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _codes_and_scales(q, sf, swizzled, 16, torch.float8_e4m3fn)
    c.global_scale("global_scale", global_scale, q.device)


@declare("add_rmsnorm_fp4quant(Tensor x, Tensor(a!) residual, Tensor weight, Tensor global_scale, float eps, "
         "bool swizzled, bool return_y) -> (Tensor, Tensor, Tensor)",
         kernels=FP4, fake=_fake_add_rmsnorm_fp4, to_public=_with_y)
def add_rmsnorm_fp4quant(x, residual, weight, global_scale, eps=1e-6, swizzled=False, return_y=False):
    """Fused add + RMSNorm + NVFP4: residual <- x + residual, then rmsnorm(residual) * weight quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 16.
        residual: x's shape; overwritten with the sum (in its dtype).
        weight: [N], any float dtype.
        global_scale, swizzled: as ``nvfp4_quantize``.
        eps: added to the mean of squares.
        return_y: also return the normalised values (fp32 arithmetic) in x's dtype.

    Returns:
        (q, sf) as ``nvfp4_quantize``, or (q, sf, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    fused_add_rmsnorm_.op.check(x, residual, weight, eps)
    c.multiple_of_16("x", x.shape[-1])
    c.global_scale("global_scale", global_scale, x.device)


@declare("silu_mul_fp4quant(Tensor x, Tensor global_scale, bool swizzled) -> (Tensor, Tensor)", kernels=FP4,
         fake=lambda x, g, swizzled: _fp4_fake(x, x.shape[-1] // 2, swizzled), to_public=lambda o, a: tuple(o))
def silu_mul_fp4quant(x, global_scale, swizzled=False):
    """Fused SiLU-and-multiply + NVFP4: silu(x[..., :K]) * x[..., K:] in fp32, quantized.

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up), K a multiple of 16.
        global_scale, swizzled: as ``nvfp4_quantize``.

    Returns:
        (q, sf) of the [M, K] product, as ``nvfp4_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _gate_up("x", x, c.multiple_of_16)
    c.global_scale("global_scale", global_scale, x.device)


@declare("mxfp4_quantize(Tensor x, bool swizzled) -> (Tensor, Tensor)", kernels=FP4,
         fake=lambda x, swizzled: _fp4_fake(x, x.shape[-1], swizzled, mx=True), to_public=lambda o, a: tuple(o))
def mxfp4_quantize(x, swizzled=False):
    """MXFP4 (OCP MX): E2M1 codes, a power-of-two scale per 32 values, no global scale.

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 32.
        swizzled: scales in FlashInfer's 128x4 layout instead of row-major.

    Returns:
        (q, sf): q uint8 [M, N/2]; sf float8_e8m0fnu [M, N/32], or [round_up(M, 128),
        round_up(N/32, 4)] swizzled. The scale rule: ``oink.reference.nvfp4``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.multiple_of_32("x", x.shape[-1])


@declare("mxfp4_dequantize(Tensor q, Tensor sf, bool swizzled) -> Tensor", kernels=None,
         fake=lambda q, *a: q.new_empty((q.shape[0], q.shape[1] * 2), dtype=torch.float32))
def mxfp4_dequantize(q, sf, swizzled=False):
    """The values MXFP4 codes stand for: e2m1(code) * 2^(sf - 127), fp32 [M, N].

    Args:
        q, sf: codes and scales as ``mxfp4_quantize`` returns them.
        swizzled: sf is in the 128x4 layout.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _codes_and_scales(q, sf, swizzled, 32, torch.float8_e8m0fnu)


@declare("add_rmsnorm_mxfp4quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, bool swizzled, "
         "bool return_y) -> (Tensor, Tensor, Tensor)",
         kernels=FP4, fake=lambda *a: _fake_add_rmsnorm_fp4(*a, mx=True), to_public=_with_y)
def add_rmsnorm_mxfp4quant(x, residual, weight, eps=1e-6, swizzled=False, return_y=False):
    """``add_rmsnorm_fp4quant`` quantizing to MXFP4 (``mxfp4_quantize``'s blocks and scales).

    Args:
        x: [..., N], fp32, fp16 or bf16, N a multiple of 32.
        residual: x's shape; overwritten with x + residual.
        weight: [N], any float dtype.
        eps, swizzled, return_y: as ``add_rmsnorm_fp4quant``.

    Returns:
        (q, sf) as ``mxfp4_quantize``, or (q, sf, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    fused_add_rmsnorm_.op.check(x, residual, weight, eps)
    c.multiple_of_32("x", x.shape[-1])


@declare("silu_mul_mxfp4quant(Tensor x, bool swizzled) -> (Tensor, Tensor)", kernels=FP4,
         fake=lambda x, swizzled: _fp4_fake(x, x.shape[-1] // 2, swizzled, mx=True), to_public=lambda o, a: tuple(o))
def silu_mul_mxfp4quant(x, swizzled=False):
    """``silu_mul_fp4quant`` quantizing to MXFP4 (``mxfp4_quantize``'s blocks and scales).

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up), K a multiple of 32.
        swizzled: scales in the 128x4 layout.

    Returns:
        (q, sf) of the [M, K] product, as ``mxfp4_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    _gate_up("x", x, c.multiple_of_32)


# ---------------------------------------------------------------- FP8 (float8_e4m3fn codes, fp32 scales)
def _fp8_check(name, x, N, scale, group_size, column_major_scales, ue8m0, scale_ub):
    fp8_spec.check_args(N, scale, group_size, column_major_scales, ue8m0, scale_ub, name)
    if scale is not None:
        c.global_scale("scale", scale, x.device)
    if scale_ub is not None:
        c.global_scale("scale_ub", scale_ub, x.device)


def _fp8_fake(x, N, scale, group_size, column_major_scales):
    """Codes [..., N] float8_e4m3fn and the mode's fp32 scales (see ``oink.reference.fp8``)."""
    q = x.new_empty((*x.shape[:-1], N), dtype=torch.float8_e4m3fn)
    return q, fp8_spec.empty_scales(x, x.numel() // x.shape[-1], N, scale, group_size, column_major_scales)


def _fake_fp8_norm(x, *rest):
    scale, group_size, column_major_scales = rest[-6:-3]
    q, s = _fp8_fake(x, x.shape[-1], scale, group_size, column_major_scales)
    return q, s, (torch.empty_like(x) if rest[-1] else _absent(x))


_FP8_ARGS = "Tensor? scale, int group_size, bool column_major_scales, bool ue8m0, Tensor? scale_ub"


@declare(f"fp8_quantize(Tensor x, {_FP8_ARGS}) -> (Tensor, Tensor)", kernels=FP8,
         fake=lambda x, scale, g, cm, ue, ub: _fp8_fake(x, x.shape[-1], scale, g, cm), to_public=lambda o, a: tuple(o))
def fp8_quantize(x, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False, scale_ub=None):
    """FP8 (float8_e4m3fn) in vLLM's scale modes: static, per token (default) or per group.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        scale: 1-element fp32 tensor: a static scale (q = x * (1 / scale)); None otherwise.
        group_size: 0, or 64 / 128 for a scale per 1 x group_size (N a multiple of it).
        column_major_scales: per-group scales with strides (1, M) (DeepGEMM's layout).
        ue8m0: per-group scales rounded up to powers of two.
        scale_ub: 1-element fp32 bound on each row's amax (per token only), or None.

    Returns:
        (q, scales): q float8_e4m3fn in x's shape; scales fp32 [1] (static), [M, 1] (per token) or
        [M, N / group_size]. Rounding, scale floors and NaN: ``oink.reference.fp8``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"rmsnorm_fp8quant(Tensor x, Tensor weight, float eps, {_FP8_ARGS}, bool return_y) "
         "-> (Tensor, Tensor, Tensor)", kernels=FP8, fake=_fake_fp8_norm, to_public=_with_y)
def rmsnorm_fp8quant(x, weight, eps=1e-6, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False,
                     scale_ub=None, return_y=False):
    """Fused RMSNorm + FP8: y = rmsnorm(x) * weight, rounded to x's dtype, then quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        weight: [N], any float dtype.
        eps: added to the mean of squares.
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``.
        return_y: also return y.

    Returns:
        (q, scales) as ``fp8_quantize``, or (q, scales, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    c.tensor("weight", weight)
    c.vector("weight", weight, x.shape[-1])
    c.same_device(x=x, weight=weight)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"add_rmsnorm_fp8quant(Tensor x, Tensor(a!) residual, Tensor weight, float eps, {_FP8_ARGS}, "
         "bool return_y) -> (Tensor, Tensor, Tensor)", kernels=FP8, fake=_fake_fp8_norm, to_public=_with_y)
def add_rmsnorm_fp8quant(x, residual, weight, eps=1e-6, scale=None, group_size=0, *, column_major_scales=False,
                         ue8m0=False, scale_ub=None, return_y=False):
    """Fused add + RMSNorm + FP8: vLLM's ``fused_add_rms_norm``, then y quantized.

    Args:
        x: [..., N], fp32, fp16 or bf16.
        residual: x's shape; overwritten with x + residual (in its dtype), which is normalised.
        weight: [N], any float dtype.
        eps: added to the mean of squares.
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``.
        return_y: also return y = rmsnorm(residual) * weight in x's dtype.

    Returns:
        (q, scales) as ``fp8_quantize``, or (q, scales, y).

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
        RuntimeError: ``residual`` cannot be written in place (where torch refuses it); nothing is written.
    """
    fused_add_rmsnorm_.op.check(x, residual, weight, eps)
    _fp8_check("x", x, x.shape[-1], scale, group_size, column_major_scales, ue8m0, scale_ub)


@declare(f"silu_mul_fp8quant(Tensor x, {_FP8_ARGS}) -> (Tensor, Tensor)", kernels=FP8,
         fake=lambda x, scale, g, cm, ue, ub: _fp8_fake(x, x.shape[-1] // 2, scale, g, cm),
         to_public=lambda o, a: tuple(o))
def silu_mul_fp8quant(x, scale=None, group_size=0, *, column_major_scales=False, ue8m0=False, scale_ub=None):
    """Fused SiLU-and-multiply + FP8: silu(x[..., :K]) * x[..., K:] in fp32, quantized.

    Args:
        x: [..., 2K], fp32, fp16 or bf16 (gate, then up).
        scale, group_size, column_major_scales, ue8m0, scale_ub: the mode, as ``fp8_quantize``
            (per group: K a multiple of group_size).

    Returns:
        (q [..., K], scales) as ``fp8_quantize``.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape or device does not fit (the message names it).
    """
    c.rows_input("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim {x.shape[-1]} must be even (gate and up halves)")
    _fp8_check("x (each half)", x, x.shape[-1] // 2, scale, group_size, column_major_scales, ue8m0, scale_ub)


__all__ = list(PUBLIC)
