"""Fused per-head QK RMSNorm + rotary embedding on packed qkv, in vLLM's ``fused_qk_norm_rope`` order.

qkv is [T, (Hq + Hk + Hv) * D]: per token, Hq query heads, then Hk key heads, then Hv value heads of D values.
Each q and k head (v is never read or written), in fp32 with one rounding to qkv's dtype at the end:

1. x = the head's D values in fp32; ss = sum(x^2); r = rsqrt(ss / D + eps)  (eps after the mean).
2. n_i = x_i * (r * w_i), w = weight (+ ``weight_offset``) in fp32: r * w first, as vLLM's kernel.
3. The first ``rotary_dim = cos_sin_cache.shape[1]`` columns rotate by the cache row of the token's
   position: cos_j = cache[p, j], sin_j = cache[p, rotary_dim / 2 + j] (fp32), j < rotary_dim / 2.
   NeoX (halves): pairs (j, j + rotary_dim / 2); GPT-J (interleaved): pairs (2j, 2j + 1). Each pair (a, b):
   a' = a * cos_j - b * sin_j, b' = b * cos_j + a * sin_j. Columns from rotary_dim on keep n.
4. Rounded once to qkv's dtype.

The sum of squares is a fixed pairwise tree of elementwise adds (D is a power of two), never a torch reduction,
so a row's bits do not depend on the batch on any device (torch's GPU reductions split a row by the batch's
size). Notes and citations: docs/ops.md ("Fused QK norm + rotary embedding").
"""
from __future__ import annotations

import torch
from torch import Tensor

from .bench import EPS, Bench, rand
from .sums import row_sum

__all__ = ["qk_norm_rope"]  # fused_qk_norm_rope: vLLM's in-place op, torch.ops.oink.fused_qk_norm_rope only


def _rotate(n: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """n [T, H, D] fp32 with its first 2 * cos.shape[-1] columns rotated; cos, sin [T, 1, R/2] fp32."""
    half = cos.shape[-1]
    rot = n[..., :2 * half]
    if is_neox:
        a, b = rot[..., :half], rot[..., half:]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    a2 = a * cos - b * sin
    b2 = b * cos + a * sin
    out = n.clone()
    if is_neox:
        out[..., :half], out[..., half:2 * half] = a2, b2
    else:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = a2, b2
    return out


def _heads(qkv: Tensor, start: int, H: int, D: int) -> Tensor:
    return qkv[:, start * D:(start + H) * D].reshape(qkv.shape[0], H, D)


def _norm_rope(x: Tensor, weight: Tensor, eps: float, weight_offset: float, cos: Tensor, sin: Tensor,
               is_neox: bool) -> Tensor:
    xf = x.float()
    r = torch.rsqrt(row_sum(xf * xf) / x.shape[-1] + eps)
    w = weight.float()
    if weight_offset:
        w = w + weight_offset
    n = xf * (r * w)
    return _rotate(n, cos, sin, is_neox).to(x.dtype)


def qk_norm_rope(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int, eps: float,
                 q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor, is_neox: bool, position_ids: Tensor,
                 weight_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    D = head_dim
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, position_ids.reshape(-1).long()).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:2 * half]
    q = _norm_rope(_heads(qkv, 0, num_heads_q, D), q_weight, eps, weight_offset, cos, sin, is_neox)
    k = _norm_rope(_heads(qkv, num_heads_q, num_heads_k, D), k_weight, eps, weight_offset, cos, sin, is_neox)
    return q, k


def fused_qk_norm_rope(qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int,
                       eps: float, q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor, is_neox: bool,
                       position_ids: Tensor, forced_token_heads_per_warp: int = -1) -> None:
    """vLLM's in-place form: the q and k heads of qkv overwritten with ``qk_norm_rope``'s, v untouched
    (``forced_token_heads_per_warp``: vLLM's launch knob, no effect on the values)."""
    q, k = qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
                        cos_sin_cache, is_neox, position_ids)
    D, T = head_dim, qkv.shape[0]
    qkv[:, :num_heads_q * D].copy_(q.reshape(T, num_heads_q * D))
    qkv[:, num_heads_q * D:(num_heads_q + num_heads_k) * D].copy_(k.reshape(T, num_heads_k * D))


def rope_cache(max_position: int, rotary_dim: int, base: float = 10000.0, dtype=torch.float32,
               device=None) -> Tensor:
    """[max_position, rotary_dim] cos half then sin half, built as vLLM's RotaryEmbedding builds it (fp32, then
    ``dtype``)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


# ---- bench entries (``.bench``): the suite's N is qkv's width, (Hq + 2 Hk) * D
# the qk-norm-rope suite's models by width: (Hq, Hk, D, weight_offset); published configs (Hugging Face config.json)
MODELS = {
    6144: (32, 8, 128, 0.0),  # Qwen3-8B
    10240: (64, 8, 128, 0.0),  # Qwen3-32B
    8192: (32, 16, 128, 1.0),  # Gemma 3 27B: GemmaRMSNorm's (1 + w)
    7168: (40, 8, 128, 0.0),  # Llama 4 Scout (its qk norm has no weight: ones)
}
MODEL_NAMES = {6144: "Qwen3-8B", 10240: "Qwen3-32B", 8192: "Gemma 3 27B", 7168: "Llama 4 Scout"}
GQA_RATIOS = (4, 2, 1, 8, 16, 3, 5, 6, 7)  # the fallback's preference for Hq / Hk
MAX_POSITION = 40960  # Qwen3's max_position_embeddings: the cache's rows
ROPE_BASE = 1e6  # Qwen3's rope_theta
DECODE_ROWS = 256  # up to this many tokens: a decode batch (one position each); more: a prefill chunk


def heads_of(N: int) -> tuple[int, int, int, float]:
    """(Hq, Hk, D, weight_offset) of a suite width N = (Hq + 2 Hk) * D (Hv = Hk): a model's where MODELS has N,
    else D = 128 (64 for N = 256) and the first GQA ratio g of GQA_RATIOS with N / D = (g + 2) Hk (or Hk = 1)."""
    if N in MODELS:
        return MODELS[N]
    D = 128 if N % 128 == 0 and N // 128 >= 3 else 64
    n = N // D
    if N % D or n < 3:
        raise ValueError(f"qk_norm_rope: width {N} is not (Hq + 2 Hk) * D for D 64 or 128 and Hq, Hk >= 1")
    g = next((g for g in GQA_RATIOS if n % (g + 2) == 0), None)
    Hk = n // (g + 2) if g is not None else 1
    return n - 2 * Hk, Hk, D, 0.0


def _qk_inputs(M, N, dtype, device, gen):
    Hq, Hk, D, offset = heads_of(N)
    if N == 7168:  # Llama 4's weightless norm
        qw, kw = torch.ones(D, dtype=dtype, device=device), torch.ones(D, dtype=dtype, device=device)
    elif offset:  # Gemma's zero-initialised weights plus noise
        qw, kw = rand((D,), dtype, device, gen, 0.1), rand((D,), dtype, device, gen, 0.1)
    else:
        qw, kw = (1 + rand((D,), torch.float32, device, gen, 0.1)).to(dtype), \
            (1 + rand((D,), torch.float32, device, gen, 0.1)).to(dtype)
    if M <= DECODE_ROWS:  # each token a sequence of its own length
        pos = torch.randint(0, MAX_POSITION, (M,), generator=gen, device=device)
    else:  # a prefill chunk of consecutive positions
        start = int(torch.randint(0, max(1, MAX_POSITION - M), (1,), generator=gen, device=device))
        pos = (start + torch.arange(M, device=device)) % MAX_POSITION
    return dict(qkv=rand((M, N), dtype, device, gen), num_heads_q=Hq, num_heads_k=Hk, num_heads_v=Hk, head_dim=D,
                eps=EPS, q_weight=qw, k_weight=kw, cos_sin_cache=_cache(D, dtype, device), is_neox=True,
                position_ids=pos, weight_offset=offset)


_CACHES: dict = {}


def _cache(D, dtype, device) -> Tensor:
    key = (D, dtype, str(device))
    if key not in _CACHES:
        _CACHES[key] = rope_cache(MAX_POSITION, D, ROPE_BASE, dtype, device)
    return _CACHES[key]


def _qk_bytes(M, N, e):
    """q and k read and written once (v not touched), the positions (8 B each), each token's cache row (in the
    activations' dtype, as vLLM keeps it) and the two weights."""
    Hq, Hk, D, _ = heads_of(N)
    return 2 * M * (Hq + Hk) * D * e + 8 * M + M * D * e + 2 * D * e


def _args(a):
    return (a["qkv"], a["num_heads_q"], a["num_heads_k"], a["num_heads_v"], a["head_dim"], a["eps"], a["q_weight"],
            a["k_weight"], a["cos_sin_cache"], a["is_neox"], a["position_ids"])


def _fused(o, a):
    """vLLM's op in place: the outputs are qkv's q and k heads (the gate's views)."""
    o.fused_qk_norm_rope(*_args(a))
    return _qk_views(a)


def _qk_views(a):
    qkv, Hq, Hk, D = a["qkv"], a["num_heads_q"], a["num_heads_k"], a["head_dim"]
    return _heads(qkv, 0, Hq, D), _heads(qkv, Hq, Hk, D)


def _torch_ops_fused(o, a):
    o.qk_norm_rope  # noqa: B018  (the declarations loaded: torch.ops.oink.fused_qk_norm_rope registered)
    torch.ops.oink.fused_qk_norm_rope(*_args(a))
    return _qk_views(a)


SUITES = ("qk-norm-rope", "random", "launch", "invariance")  # the suites that draw it (not smoke: N >= 256)

BENCH = {
    "qk_norm_rope": Bench("rope", _qk_inputs, _qk_bytes,
                          lambda o, a: o.qk_norm_rope(*_args(a), weight_offset=a["weight_offset"]), block=64,
                          only_in=SUITES),
    # vLLM's in-place op as vLLM calls it (torch.ops.oink, through the dispatcher); Gemma's offset has no slot
    "vllm_fused_qk_norm_rope": Bench("rope", lambda *a: dict(_qk_inputs(*a), weight_offset=0.0), _qk_bytes, _fused,
                                     oink=_torch_ops_fused, mutates=("qkv",), block=64,
                                     only_in=("qk-norm-rope", "launch", "invariance")),
}
