"""The training suite's specs and providers: an lm head and its loss (linear cross-entropy), forward
and backward, per model of ``suites.TRAINING_MODELS`` (providers.SPECS takes them after the ops' own;
the providers registered when providers is imported).

Every provider returns (loss, dhidden, dweight) of the "mean" loss from hidden [M, H], weight [V, H]
and targets (10% ignored). The gate compares the loss, and each gradient as its shape (divided by its
root mean square; dweight every DWEIGHT_ROW_STRIDE-th row, keeping the fp64 comparison small) and its
root mean square: bf16 gradients whose magnitudes span decades are judged against their own scale,
not a fixed absolute bound. No bytes are counted (the matmuls bound the time, not memory traffic),
so rows carry no bandwidth; the peak-memory column is what they are about. Imports of torch and
peers happen inside builders only."""
from __future__ import annotations

from .providers import EPS, OpSpec, Unavailable, _compiled, _needs_cuda, _peer, provider  # noqa: F401
from .suites import TRAINING_MODELS

IGNORE_INDEX = -100
IGNORED_FRACTION = 0.1
LOGIT_STD = 4.0  # logits of std 4: a softmax as peaked as a trained model's
CAPPED_LOGIT_STD = 10.0  # capped models: logits spread to where the cap bends them (tanh' ~ 0.8 at 1 std)
DWEIGHT_ROW_STRIDE = 16
FAMILIES = ("linear_ce_loss", "linear_ce_grad", "linear_ce_scale", "linear_ce_grad", "linear_ce_scale")
QUACK_CHUNK = 4096  # Quack's own default


def _model(op):
    _, V, H, softcap, _ = TRAINING_MODELS[op]
    return H, softcap


def _inputs(op):
    H, softcap = _model(op)

    def make(M, N, dtype, device, gen):
        import torch

        std = CAPPED_LOGIT_STD if softcap else LOGIT_STD
        target = torch.randint(0, N, (M,), generator=gen, device=device)
        target[torch.rand(M, generator=gen, device=device) < IGNORED_FRACTION] = IGNORE_INDEX
        return dict(hidden=torch.randn(M, H, generator=gen, device=device).to(dtype),
                    weight=(torch.randn(N, H, generator=gen, device=device) * (std / H**0.5)).to(dtype),
                    target=target, softcap=softcap)

    return make


def _eager_loss(hidden, weight, target, softcap):
    """What a trainer writes (Hugging Face's models): logits in the inputs' dtype, capped, the loss on
    their fp32 copy."""
    import torch.nn.functional as F

    logits = F.linear(hidden, weight)
    if softcap is not None:
        logits = softcap * (logits / softcap).tanh()
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX)


def _fwd_bwd(loss_fn):
    """run(args) -> (loss, dhidden, dweight) of ``loss_fn(hidden, weight, target, softcap)``."""
    import torch

    def run(a):
        h, w = a["hidden"].detach().requires_grad_(), a["weight"].detach().requires_grad_()
        loss = loss_fn(h, w, a["target"], a["softcap"])
        dh, dw = torch.autograd.grad(loss, (h, w))
        return loss.detach(), dh, dw

    return run


def _reference(a):
    """fp32 math and autograd; gradients returned in their inputs' dtypes."""
    h, w = a["hidden"], a["weight"]
    loss, dh, dw = _fwd_bwd(_eager_loss)(dict(a, hidden=h.float(), weight=w.float()))
    return loss, dh.to(h.dtype), dw.to(w.dtype)


def _scale_free(outputs):
    """(loss, dhidden / rms, rms, dweight[::stride] / rms, rms): see the module docstring."""
    import torch

    loss, dh, dw = outputs

    def unit(t):
        rms = t.float().square().mean().sqrt()
        return (t.float() / rms.clamp_min(torch.finfo(torch.float32).tiny)).to(t.dtype), rms.reshape(1)

    (dh_unit, dh_rms), (dw_unit, dw_rms) = unit(dh), unit(dw)
    return loss.float().reshape(1), dh_unit, dh_rms, dw_unit[::DWEIGHT_ROW_STRIDE], dw_rms


def _oink_call(o, a):
    return _fwd_bwd(lambda h, w, t, cap: o.linear_cross_entropy(h, w, t, softcap=cap))(a)


SPECS = {op: OpSpec(FAMILIES, _inputs(op), _reference, lambda M, N, e: 0, gate_view=_scale_free, oink=_oink_call,
                    only_in=("training",))
         for op in TRAINING_MODELS}


def _torch_builder(device):
    return _fwd_bwd(_eager_loss)


def _compile_builder(device):
    loss = _compiled(lambda a: _eager_loss(a["hidden"], a["weight"], a["target"], a["softcap"]))
    return _fwd_bwd(lambda h, w, t, cap: loss(dict(hidden=h, weight=w, target=t, softcap=cap)))


def _oink_builder(device):
    import oink

    return lambda a: _oink_call(oink, a)


def _liger_builder(device):
    _needs_cuda(device)
    m = _peer("liger_kernel.transformers.functional", "liger-kernel")
    return _fwd_bwd(lambda h, w, t, cap: m.liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX,
                                                                            softcap=cap))


def _quack_builder(op):
    def build(device):
        _needs_cuda(device)
        if _model(op)[1] is not None:
            raise Unavailable("Quack's linear_cross_entropy has no logit softcap")
        m = _peer("quack.linear_cross_entropy", "quack-kernels")

        def loss(h, w, t, cap):
            if h.shape[0] % 8:  # its chunked path needs whole 8-row groups (TMA alignment)
                raise Unavailable(f"Quack's chunked linear_cross_entropy needs M % 8 == 0, got {h.shape[0]}")
            return m.chunked_linear_cross_entropy(h, w, t, chunk_size=QUACK_CHUNK, ignore_index=IGNORE_INDEX)

        return _fwd_bwd(loss)

    return build


for _op in TRAINING_MODELS:
    provider(_op, "oink")(_oink_builder)
    provider(_op, "torch", label="eager: bf16 logits, the loss on their fp32 copy (Hugging Face's)")(_torch_builder)
    provider(_op, "torch.compile")(_compile_builder)
    provider(_op, "liger", label="LigerFusedLinearCrossEntropy")(_liger_builder)
    provider(_op, "quack", label=f"chunked_linear_cross_entropy, chunk {QUACK_CHUNK}")(_quack_builder(_op))
