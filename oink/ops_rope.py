"""The fused per-head QK RMSNorm + rotary embedding on packed qkv: the public ``oink.qk_norm_rope`` (out of place,
returns q and k) and vLLM's in-place ``torch.ops.oink.fused_qk_norm_rope`` under vLLM's name and schema (not a
public ``oink.<name>``). Declared as ``oink.ops`` declares the others (see ``oink.declare``) and imported by it.

Arithmetic (vLLM's CUDA kernel's order, one rounding): ``oink.reference.rope``; docs: docs/ops.md.

Path: the reference; the CuTeDSL kernel (``oink.kernels.rope``) on a GPU once its GPU tests have run (until then
the ``rope_kernel`` development setting asks for it). Batch-invariant on both: the kernel sums a head's squares in a
fixed butterfly of its lanes, the reference as a fixed pairwise tree of elementwise adds, never a torch reduction
(which a GPU splits by the batch's size).
"""
from __future__ import annotations

import torch

from . import checks as c
from .declare import declare

HEAD_DIMS = (64, 128, 256)  # vLLM's kernel ("Unsupported head dimension" otherwise)
HALF = (torch.float16, torch.bfloat16)
QKV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # fp32 beyond vLLM's (reference path)
WARP_GROUPINGS = (1, 2, 4, 8)  # vLLM's forced_token_heads_per_warp when > 0

def rope_kernels():
    from .kernels import rope_ops

    return rope_ops


def _declare(schema: str, **kw):
    return declare(schema, kernels=rope_kernels, batch_invariant=True, check_values=_positions_in_range, **kw)


# ---------------------------------------------------------------- argument checks (metadata only)
def _count(name: str, v, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < least:
        raise ValueError(f"{name}: must be at least {least}, got {v}")
    return v


def _inputs(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
            position_ids) -> None:
    """Every check both forms share (see ``qk_norm_rope``'s Args)."""
    c.tensor("qkv", qkv, QKV_DTYPES)
    if qkv.dim() != 2:
        raise ValueError(f"qkv: expected 2 dims [T, (Hq + Hk + Hv) * head_dim], got shape {tuple(qkv.shape)}")
    Hq, Hk = _count("num_heads_q", num_heads_q, 1), _count("num_heads_k", num_heads_k, 1)
    Hv = _count("num_heads_v", num_heads_v, 0)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim: expected an int, got {type(head_dim).__name__}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: {head_dim} is not supported (expected one of {HEAD_DIMS})")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        raise TypeError(f"eps: expected a float, got {type(eps).__name__}")
    width = (Hq + Hk + Hv) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv: width {qkv.shape[1]} must be (num_heads_q + num_heads_k + num_heads_v) * head_dim = "
                         f"({Hq} + {Hk} + {Hv}) * {head_dim} = {width}")
    if qkv.shape[1] > 1 and qkv.stride(1) != 1:
        raise ValueError(f"qkv: its heads must be contiguous within a row (stride 1 along dim 1; rows may be "
                         f"strided), got strides {tuple(qkv.stride())}; pass qkv.contiguous()")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        c.tensor(name, w)
        if tuple(w.shape) != (head_dim,):
            raise ValueError(f"{name}: expected shape ({head_dim},) (one weight per head_dim column, shared by the "
                             f"heads), got {tuple(w.shape)}")
        if w.dtype not in (torch.float32, qkv.dtype):
            raise TypeError(f"{name}: dtype {w.dtype} must be qkv's ({qkv.dtype}) or float32")
    c.tensor("cos_sin_cache", cos_sin_cache, min_dim=0)
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected 2 dims [max_position, rotary_dim] (cos half, then sin half), "
                         f"got shape {tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.dtype not in (torch.float32, qkv.dtype):
        raise TypeError(f"cos_sin_cache: dtype {cos_sin_cache.dtype} must be qkv's ({qkv.dtype}) or float32")
    max_position, rotary_dim = cos_sin_cache.shape
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache: rotary_dim (its last dim) {rotary_dim} must be even, at least 2 and at "
                         f"most head_dim {head_dim}")
    if max_position < 1:
        raise ValueError(f"cos_sin_cache: too short: {max_position} positions (no position can be looked up)")
    c.tensor("position_ids", position_ids, c.INDEX_DTYPES, min_dim=0)
    if position_ids.dim() != 1 or position_ids.shape[0] != qkv.shape[0]:
        raise ValueError(f"position_ids: expected shape ({qkv.shape[0]},) (one position per token of qkv), got "
                         f"{tuple(position_ids.shape)}")
    c.same_device(qkv=qkv, q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cos_sin_cache,
                  position_ids=position_ids)


def _positions_in_range(cos_sin_cache, position_ids, **_) -> None:
    """Value check (reads the data, not for fake tensors): every position in [0, max_position). One host sync,
    which CUDA-graph capture forbids: while the stream captures it is skipped (vLLM's kernel checks nothing and
    reads past the cache; a kernel here must bound its reads)."""
    if position_ids.numel() == 0:
        return
    if position_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    max_position = cos_sin_cache.shape[0]
    lo, hi = torch.stack(torch.aminmax(position_ids)).tolist()
    if lo < 0 or hi >= max_position:
        i = int(((position_ids < 0) | (position_ids >= max_position)).nonzero()[0, 0])
        raise ValueError(f"position_ids[{i}] = {int(position_ids[i])} is outside the cos_sin_cache's "
                         f"[0, {max_position}) positions (a longer cache, or positions within it)")


def _fake_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, *rest):
    T = qkv.shape[0]
    return qkv.new_empty((T, num_heads_q, head_dim)), qkv.new_empty((T, num_heads_k, head_dim))


# ---------------------------------------------------------------- the ops
@_declare("qk_norm_rope(Tensor qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, "
          "Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids, "
          "float weight_offset=0.) -> (Tensor, Tensor)", fake=_fake_qk_norm_rope)
def qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                 is_neox, position_ids, weight_offset=0.0):
    """Per-head RMSNorm of q and k, then the rotary embedding, from packed qkv (vLLM's ``fused_qk_norm_rope``
    out of place; qkv is not written).

    Per q and k head, in fp32, rounded once: n = x * (rsqrt(sum(x^2) / D + eps) * (w + weight_offset)); its
    first rotary_dim columns rotated by position: NeoX pairs (j, j + rotary_dim / 2), GPT-J pairs (2j, 2j + 1),
    (a, b) -> (a cos_j - b sin_j, b cos_j + a sin_j), cos_j = cos_sin_cache[p, j], sin_j =
    cos_sin_cache[p, rotary_dim / 2 + j]; the other columns keep n.

    Args:
        qkv: [T, (Hq + Hk + Hv) * head_dim], fp16 or bf16 (fp32 too, a reference-path extension): per token the
            q heads, then the k heads, then the v heads. Rows may be strided; within a row, contiguous.
        num_heads_q, num_heads_k: q and k heads, >= 1 (any GQA ratio).
        num_heads_v: v heads, >= 0 (only qkv's width reads it: v is never touched).
        head_dim: 64, 128 or 256.
        eps: added to the mean of squares.
        q_weight, k_weight: [head_dim], qkv's dtype or fp32 (vLLM's op takes qkv's only).
        cos_sin_cache: [max_position, rotary_dim], cos half then sin half (vLLM's RotaryEmbedding.cos_sin_cache);
            qkv's dtype or fp32; rotary_dim even, 2 <= rotary_dim <= head_dim (partial rotary below head_dim).
        is_neox: NeoX (halves) pairing; False: GPT-J (interleaved).
        position_ids: [T] int32 or int64 (vLLM's op: int64), each in [0, max_position).
        weight_offset: added to both weights (Gemma's ``1 + w``: 1.0); vLLM's op has no such argument.

    Returns:
        (q [T, Hq, head_dim], k [T, Hk, head_dim]) in qkv's dtype.

    Path: the reference, on a GPU too until the CuTeDSL kernel (``oink.kernels.rope``, compile-checked) has run
    its GPU tests (the ``rope_kernel`` development setting runs it; ``oink.kernels.rope_ops.check`` says which calls
    it declines). Batch-invariant on both.

    Raises:
        TypeError, ValueError: an argument's type, dtype, shape, layout or device does not fit (the message names
            it), or a position outside the cache (checked where the reference serves the call; skipped while
            a CUDA graph is captured).
    """
    _inputs(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
            position_ids)
    if not isinstance(weight_offset, (int, float)) or isinstance(weight_offset, bool):
        raise TypeError(f"weight_offset: expected a float, got {type(weight_offset).__name__}")


@_declare("fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, "
          "float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids, "
          "int forced_token_heads_per_warp=-1) -> ()", fake=lambda *a: None, public=False)
def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                       is_neox, position_ids, forced_token_heads_per_warp=-1):
    """vLLM's ``fused_qk_norm_rope`` (``torch.ops._C``'s schema, with current vLLM's trailing launch knob): the q
    and k heads of qkv overwritten in place with ``oink.qk_norm_rope``'s q and k; v untouched; returns nothing.

    Args: as ``oink.qk_norm_rope`` (no weight_offset), and
        forced_token_heads_per_warp: vLLM's launch grouping (-1 or <= 0 auto, else 1, 2, 4 or 8); no effect on
            the values, ignored here.

    Path: the reference, on a GPU too until the CuTeDSL kernel (``oink.kernels.rope``, compile-checked) has run
    its GPU tests (the ``rope_kernel`` development setting runs it; ``oink.kernels.rope_ops.check`` says which calls
    it declines). Batch-invariant on both.

    Raises:
        TypeError, ValueError: as ``oink.qk_norm_rope``; qkv's elements must not share memory.
    """
    _inputs(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
            position_ids)
    f = _count("forced_token_heads_per_warp", forced_token_heads_per_warp, -(2**62))
    if f > 0 and f not in WARP_GROUPINGS:
        raise ValueError(f"forced_token_heads_per_warp: must be 1, 2, 4 or 8 when positive (vLLM's), got {f}")
