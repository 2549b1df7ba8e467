"""Every op, declared once (see ``oink.declare``): its public signature and docs, input checks,
``torch.ops.oink`` schema, fake, the kernel family that serves it and its autograd.

The function bodies are the metadata checks (they also run on FakeTensors under torch.compile);
the references in ``oink.reference`` compute the same signatures, and kernel modules export
``CHECKS[name]`` / ``PLANS[name]``. Importing this module registers ``torch.ops.oink.*``.
"""
from __future__ import annotations

import torch

from . import checks as c
from .declare import PUBLIC, batch_invariant, declare, explain  # noqa: F401  (re-exported: oink.ops' declaration helpers)
from .declare import absent as _absent
from .reference.cross_entropy import REDUCTIONS


# The kernel family serving each op (``kernels=``), imported on the first dispatch to a supported GPU:
# the kernel modules import cutlass, which ``import oink`` and a CPU never need.
def norm_kernels():
    from .kernels import rmsnorm_ops

    return rmsnorm_ops


def softmax_kernels():
    from .kernels import softmax_ops

    return softmax_ops


def cross_entropy_kernels():
    from .kernels import cross_entropy_ops

    return cross_entropy_ops


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
         kernels=norm_kernels, fake=_fake_rmsnorm_forward, backward=(_rmsnorm_backward, _rmsnorm_setup),
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
         kernels=norm_kernels, fake=lambda *a: None)
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
    c.fused_add_inputs(x, residual, weight)


def _fake_rmsnorm_backward(x, weight, dout, rstd, dresidual_out, has_bias, weight_offset=0.0):
    shape, wdt = (weight.shape, weight.dtype) if weight is not None else ((x.shape[-1],), x.dtype)
    dw = x.new_empty(shape, dtype=wdt) if weight is not None else _absent(x)
    db = x.new_empty(shape, dtype=wdt) if has_bias else _absent(x)
    return torch.empty_like(x), dw, db


@declare("rmsnorm_backward(Tensor x, Tensor? weight, Tensor dout, Tensor rstd, Tensor? dresidual_out, "
         "bool has_bias, float weight_offset=0.) -> (Tensor, Tensor, Tensor)",
         kernels=norm_kernels, fake=_fake_rmsnorm_backward, fixed={"has_residual": False},
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
         kernels=norm_kernels, fake=_fake_layernorm, fixed={"return_rstd": True, "return_mean": True},
         eager_unfixed=True,
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
         kernels=norm_kernels, fake=_fake_layernorm_backward,
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
@declare("softmax_forward(Tensor x) -> Tensor", kernels=softmax_kernels, fake=lambda x: torch.empty_like(x),
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


@declare("softmax_backward(Tensor dy, Tensor y) -> Tensor", kernels=softmax_kernels,
         fake=lambda dy, y: torch.empty_like(y))
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


@declare("softmax_fwd_bwd(Tensor dy, Tensor x) -> Tensor", kernels=softmax_kernels,
         fake=lambda dy, x: torch.empty_like(x))
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
         kernels=cross_entropy_kernels, fake=_fake_ce_forward, check_values=_forward_targets_in_range,
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
         kernels=cross_entropy_kernels, fake=lambda dloss, logits, *a: torch.empty_like(logits),
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
         kernels=cross_entropy_kernels, fake=lambda *a: None, check_values=_targets_in_range, public=False)
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
         kernels=cross_entropy_kernels, fake=_fake_ce_fwd_bwd, check_values=_targets_in_range,
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


def _fake_ce_fwd_bwd_(dloss, logits, target, ignore_index, label_smoothing=0.0, z_loss=0.0, softcap=None):
    row = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return row, torch.empty_like(row)


@declare("cross_entropy_fwd_bwd_(Tensor dloss, Tensor(a!) logits, Tensor target, SymInt ignore_index, "
         f"{_CE_OPTIONS}) -> (Tensor, Tensor)",
         kernels=cross_entropy_kernels, fake=_fake_ce_fwd_bwd_, check_values=_targets_in_range, public=False)
def cross_entropy_fwd_bwd_(dloss, logits, target, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """-> (loss, lse) per row, fp32, the dlogits written over the logits in the same pass (no second
    [M, V] buffer): backs the chunks of ``oink.linear_cross_entropy``."""
    cross_entropy_fwd_bwd.op.check(dloss, logits, target, ignore_index, label_smoothing=label_smoothing,
                                   z_loss=z_loss, softcap=softcap)


# the FP4 and FP8 ops: their own module, imported here so that every op is declared with oink.ops
from .ops_quant import (add_rmsnorm_fp4quant, add_rmsnorm_fp8quant, add_rmsnorm_mxfp4quant,  # noqa: E402,F401  (at the end: declared after the ops it builds on; re-exported)
                        fp8_quantize, mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_quantize,
                        rmsnorm_fp8quant, silu_mul_fp4quant, silu_mul_fp8quant, silu_mul_mxfp4quant)
# vLLM's fused RMSNorm + FP8 ops under vLLM's names: torch.ops.oink.<name> only (not public oink.<name>)
from . import ops_vllm  # noqa: E402,F401  (at the end: declared after the ops it builds on; re-exported)
# the fused QK norm + rotary embedding: oink.qk_norm_rope, and vLLM's in-place torch.ops.oink.fused_qk_norm_rope
from .ops_rope import qk_norm_rope  # noqa: E402,F401


__all__ = list(PUBLIC)
