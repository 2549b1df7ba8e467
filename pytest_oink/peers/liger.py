"""Liger's builders (liger-kernel: its RMSNorm, LayerNorm and softmax) for the ops Liger has. Registered by
``pytest_oink.peers.register``."""
from __future__ import annotations

from ..registry import EPS, Peer, needs_cuda, peer

LIGER = Peer("liger")


@LIGER.serves("rmsnorm_forward_w32")
@LIGER.serves("rmsnorm_forward")
def _rms(device):
    needs_cuda(device)
    m = peer("liger_kernel.ops.rms_norm", "liger-kernel")
    return lambda a: (m.LigerRMSNormFunction.apply(a["x"], a["weight"], EPS, 0.0, "llama", False),)


@LIGER.serves("layernorm")
def _ln(device):
    needs_cuda(device)
    m = peer("liger_kernel.ops.layer_norm", "liger-kernel")
    return lambda a: (m.LigerLayerNormFunction.apply(a["x"], a["weight"], a["bias"], EPS),)


@LIGER.serves("softmax_forward")
def _softmax(device):
    needs_cuda(device)
    m = peer("liger_kernel.ops.softmax", "liger-kernel")
    return lambda a: (m.LigerSoftmaxFunction.apply(a["x"]),)
