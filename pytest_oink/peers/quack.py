"""Quack's builders (quack-kernels: its RMSNorm, LayerNorm, softmax and cross-entropy) for the ops Quack has.
Registered by ``pytest_oink.peers.register``."""
from __future__ import annotations

from ..registry import EPS, Peer, needs_cuda, peer

QUACK = Peer("quack")


@QUACK.serves("rmsnorm_forward_w32")
@QUACK.serves("rmsnorm_forward")
def _rms_fwd(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    return lambda a: (m.rmsnorm_fwd(a["x"], a["weight"], eps=EPS)[0],)


@QUACK.serves("rmsnorm_forward_gemma")
def _rms_gemma(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    return lambda a: (m.rmsnorm_fwd(a["x"], a["weight"], eps=EPS, weight_offset=1.0)[0],)


@QUACK.serves("rmsnorm_forward_res32")
def _rms_res32(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    return lambda a: m.rmsnorm_fwd(a["x"], a["weight"], residual=a["residual"], eps=EPS)[:2]


@QUACK.serves("fused_add_rmsnorm_", label="out-of-place + 2 copies")
def _fused(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")

    def run(a):
        out, res_out, _ = m.rmsnorm_fwd(a["x"], a["weight"], residual=a["residual"], eps=EPS)
        a["x"].copy_(out)
        a["residual"].copy_(res_out)
        return a["x"], a["residual"]

    return run


@QUACK.serves("rmsnorm_backward")
def _rms_bwd(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    return lambda a: m.rmsnorm_bwd(a["x"], a["weight"], a["dout"], a["rstd"])[:2]


def _fp32_once():
    """Quack's LayerNorm asserts fp32 weight/bias: a converter that runs once per tensor object,
    outside the timing. Keyed on id() with the source kept alive, so an id (or a freed tensor's
    address, reused by the next seed's weight) never maps to a stale conversion."""
    import torch

    fp32 = {}

    def as_fp32(t):
        if t is None or t.dtype == torch.float32:
            return t
        if id(t) not in fp32:
            fp32[id(t)] = (t, t.float())
        return fp32[id(t)][1]

    return as_fp32


@QUACK.serves("layernorm", label="fp32 weight and bias (Quack requires them)")
def _ln(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    f32 = _fp32_once()
    return lambda a: (m.layernorm_fwd(a["x"], f32(a["weight"]), f32(a["bias"]), EPS),)


@QUACK.serves("layernorm_backward", label="fp32 weight (Quack requires it)")
def _ln_bwd(device):
    needs_cuda(device)
    m = peer("quack.rmsnorm", "quack-kernels")
    f32 = _fp32_once()
    return lambda a: m.layernorm_bwd(a["x"], f32(a["weight"]), a["dout"], a["rstd"], a["mean"], has_bias=True)


@QUACK.serves("softmax_forward")
def _softmax(device):
    needs_cuda(device)
    m = peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_fwd(a["x"]),)


@QUACK.serves("softmax_backward")
def _softmax_bwd(device):
    needs_cuda(device)
    m = peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_bwd(a["dy"], a["y"]),)


@QUACK.serves("softmax_fwd_bwd", label="forward then backward (Quack has no fused kernel)")
def _softmax_fwd_then_bwd(device):
    needs_cuda(device)
    m = peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_bwd(a["dy"], m.softmax_fwd(a["x"])),)


@QUACK.serves("cross_entropy_forward")
def _ce(device):
    needs_cuda(device)
    m = peer("quack.cross_entropy", "quack-kernels")
    return lambda a: (m.cross_entropy_fwd(a["logits"], a["target"]),)


@QUACK.serves("cross_entropy_backward")
def _ce_bwd(device):
    needs_cuda(device)
    m = peer("quack.cross_entropy", "quack-kernels")
    return lambda a: (m.cross_entropy_bwd(a["logits"], a["target"], a["dloss"], a["lse"]),)


@QUACK.serves("cross_entropy_fwd_bwd", label="forward then backward")
def _ce_fwd_then_bwd(device):
    needs_cuda(device)
    m = peer("quack.cross_entropy", "quack-kernels")

    def run(a):
        loss, lse = m.cross_entropy_fwd(a["logits"], a["target"], return_lse=True)
        return loss, m.cross_entropy_bwd(a["logits"], a["target"], a["dloss"], lse)

    return run
