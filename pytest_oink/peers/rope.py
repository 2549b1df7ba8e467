"""The peers of the fused QK norm + rotary embedding (``qk_norm_rope``, ``vllm_fused_qk_norm_rope``), registered by
``pytest_oink.peers.register``: vLLM-style unfused Oink (Oink's per-head RMSNorm,
then torch's rotary embedding as vLLM's ``forward_native`` writes it) and vLLM's own CUDA op where vllm installs.

Left out: FlashInfer's ``fused_qk_rmsnorm_rope`` (flashinfer.norm, 0.7.x) is a video-DiT op: a 3-D (frame,
height, width) rotary embedding computed from ``base`` and a patch grid, no position ids or cos/sin cache,
weights [H * D], bf16 only, q/k/v written to new buffers: not this op's semantics. vLLM's Helion kernel
(``vllm/kernels/helion``) needs helion and vLLM's Helion config picker: not wired here.
Imports of torch, oink and peers happen inside builders only.
"""
from __future__ import annotations

from ..registry import Peer
from ..registry import needs_cuda as _needs_cuda
from ..registry import peer as _peer
from .oink_unfused import OINK_UNFUSED

VLLM = Peer("vllm")

OPS = ("qk_norm_rope", "vllm_fused_qk_norm_rope")


def _heads(qkv, start: int, H: int, D: int):
    return qkv[:, start * D:(start + H) * D].reshape(qkv.shape[0], H, D)


def _torch_rope(x, cos, sin, is_neox: bool):
    """vLLM's RotaryEmbedding.forward_native on x [T, H, D] in x's dtype (cos, sin [T, R/2] cast to it):
    apply_rotary_emb_torch on the first R columns, the rest passed through."""
    import torch

    R = 2 * cos.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    if is_neox:
        x1, x2 = torch.chunk(rot, 2, dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1)


@OINK_UNFUSED.serves("qk_norm_rope",
          label="oink rmsnorm_forward per head (q, then k), then torch's rotary embedding in the activations' dtype "
                "(vLLM's forward_native)")
def _oink_unfused(device):
    def run(a):
        import oink

        qkv, Hq, Hk, D = a["qkv"], a["num_heads_q"], a["num_heads_k"], a["head_dim"]
        cs = a["cos_sin_cache"].index_select(0, a["position_ids"])
        cos, sin = cs.chunk(2, dim=-1)
        outs = []
        for start, H, w in ((0, Hq, a["q_weight"]), (Hq, Hk, a["k_weight"])):
            n = oink.rmsnorm_forward(_heads(qkv, start, H, D), w, eps=a["eps"], weight_offset=a["weight_offset"])[0]
            outs.append(_torch_rope(n, cos, sin, a["is_neox"]))
        return tuple(outs)

    return run


def _vllm_op():
    _peer("vllm._custom_ops", "vllm")
    import torch

    try:
        return torch.ops._C.fused_qk_norm_rope
    except (AttributeError, RuntimeError) as e:
        from oink.measure.gate import Unavailable

        raise Unavailable(f"this vllm has no torch.ops._C.fused_qk_norm_rope: {e}") from None


def _offset_weights():
    """vLLM's op has no weight offset: Gemma's (1 + w) precomputed in the weight's dtype, once per tensor (kept
    alive with its source, so a reused id never maps to a stale one)."""
    done = {}

    def weight(w, offset):
        if not offset:
            return w
        if id(w) not in done:
            done[id(w)] = (w, (w.float() + offset).to(w.dtype))
        return done[id(w)][1]

    return weight


def _vllm_call(op, a, qkv, weight):
    op(qkv, a["num_heads_q"], a["num_heads_k"], a["num_heads_v"], a["head_dim"], a["eps"],
       weight(a["q_weight"], a.get("weight_offset", 0.0)), weight(a["k_weight"], a.get("weight_offset", 0.0)),
       a["cos_sin_cache"], a["is_neox"], a["position_ids"].long())
    Hq, Hk, D = a["num_heads_q"], a["num_heads_k"], a["head_dim"]
    return _heads(qkv, 0, Hq, D), _heads(qkv, Hq, Hk, D)


@VLLM.serves("qk_norm_rope", label="torch.ops._C.fused_qk_norm_rope in place on a copy of qkv (+1 copy); "
                                        "Gemma's 1 + w precomputed in the weight's dtype")
def _vllm_out_of_place(device):
    op = _vllm_op()
    _needs_cuda(device)
    weight = _offset_weights()
    return lambda a: _vllm_call(op, a, a["qkv"].clone(), weight)


@VLLM.serves("vllm_fused_qk_norm_rope", label="torch.ops._C.fused_qk_norm_rope")
def _vllm_in_place(device):
    op = _vllm_op()
    _needs_cuda(device)
    weight = _offset_weights()
    return lambda a: _vllm_call(op, a, a["qkv"], weight)
