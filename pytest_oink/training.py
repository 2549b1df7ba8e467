"""The training suite's specs and providers: an lm head and its loss (linear cross-entropy), forward
and backward, per model of ``TRAINING_MODELS`` (``register`` registers the providers and returns the specs:
providers.SPECS takes them after the ops' own).

Every provider returns (loss, dhidden, dweight) of the "mean" loss from hidden [M, H], weight [V, H]
and targets (10% ignored). The gate compares the loss, and each gradient as its shape (divided by its
root mean square; dweight every DWEIGHT_ROW_STRIDE-th row, keeping the fp64 comparison small) and its
root mean square: bf16 gradients whose magnitudes span decades are judged against their own scale,
not a fixed absolute bound. No bytes are counted (the matmuls bound the time, not memory traffic),
so rows carry no bandwidth; the peak-memory column is what they are about. Imports of torch and
peers happen inside builders only."""
from __future__ import annotations

from oink.measure.gate import OpSpec, Unavailable

from .registry import PROVIDERS, compiled, needs_cuda, peer, provider

# The training suite: lm heads of real models and their loss (linear cross-entropy, forward and
# backward). op -> (model, vocabulary V, hidden H, logit softcap or None, tokens M a step). A case's N
# is V (--oink-configs MxN: M tokens, vocabulary N, the op's hidden size). The largest M only where
# the suite's time allows: each row is a few full training steps' lm heads. (``suites`` takes its shapes.)
TRAINING_MODELS = {
    "linear_cross_entropy_llama3": ("Llama-3 8B", 128256, 4096, None, (4096, 16384, 32768)),
    "linear_cross_entropy_qwen7b": ("Qwen-2.5 7B", 151936, 3584, None, (4096, 16384)),
    "linear_cross_entropy_qwen14b": ("Qwen-2.5 14B", 151936, 5120, None, (4096, 16384)),
    "linear_cross_entropy_gemma2": ("Gemma-2 2B", 256000, 2304, 30.0, (4096, 16384)),
}

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
    loss = compiled(lambda a: _eager_loss(a["hidden"], a["weight"], a["target"], a["softcap"]))
    return _fwd_bwd(lambda h, w, t, cap: loss(dict(hidden=h, weight=w, target=t, softcap=cap)))


def _oink_builder(device):
    import oink

    return lambda a: _oink_call(oink, a)


def _liger_builder(device):
    needs_cuda(device)
    m = peer("liger_kernel.transformers.functional", "liger-kernel")
    return _fwd_bwd(lambda h, w, t, cap: m.liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX,
                                                                            softcap=cap))


def _quack_builder(op):
    def build(device):
        needs_cuda(device)
        if _model(op)[1] is not None:
            raise Unavailable("Quack's linear_cross_entropy has no logit softcap")
        m = peer("quack.linear_cross_entropy", "quack-kernels")

        def loss(h, w, t, cap):
            if h.shape[0] % 8:  # its chunked path needs whole 8-row groups (TMA alignment)
                raise Unavailable(f"Quack's chunked linear_cross_entropy needs M % 8 == 0, got {h.shape[0]}")
            return m.chunked_linear_cross_entropy(h, w, t, chunk_size=QUACK_CHUNK, ignore_index=IGNORE_INDEX)

        return _fwd_bwd(loss)

    return build


def register() -> dict:
    """Registers the training suite's providers (Oink, torch eager, torch.compile, Liger, Quack) for each
    model's op, where none is registered yet (one registered before stays), and returns its specs
    (``providers.specs`` calls it once)."""
    for op in TRAINING_MODELS:
        for name, label, builder in (
                ("oink", "", _oink_builder),
                ("torch", "eager: bf16 logits, the loss on their fp32 copy (Hugging Face's)", _torch_builder),
                ("torch.compile", "", _compile_builder),
                ("liger", "LigerFusedLinearCrossEntropy", _liger_builder),
                ("quack", f"chunked_linear_cross_entropy, chunk {QUACK_CHUNK}", _quack_builder(op))):
            if (op, name) not in PROVIDERS:
                provider(op, name, label=label)(builder)
    return SPECS
