"""Registry mapping (op, provider) to a callable builder, and the per-op benchmark specs.

A spec makes inputs (keyword arguments of the op's reference signature), computes the fp32
reference outputs, and counts the bytes the op must move. A provider's builder returns a
callable ``run(args) -> outputs`` (outputs in the order the reference gives them), or raises
``Unavailable`` with the reason (peer not installed, op or arch not supported). Peers that do
out of place what Oink does in place are timed with the copies that make the semantics equal,
and their label says so. Imports of torch and peers happen inside builders only.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

EPS = 1e-6


class Unavailable(Exception):
    """The provider can't run this op here (the message says why)."""


@dataclass(frozen=True)
class OpSpec:
    family: str | tuple  # tolerance family, or one per output
    make_inputs: Callable  # (M, N, dtype, device, gen) -> dict of reference kwargs
    reference: Callable  # args -> tuple of outputs (fp32 arithmetic)
    nbytes: Callable  # (M, N, elem_size) -> bytes moved
    mutates: tuple = ()  # in-place ops: names of the args that are the outputs
    gate_view: Callable | None = None  # outputs -> what the gate compares (both sides), if not the outputs
    oink: Callable = None  # (oink module, args) -> outputs: the op through Oink's public API
    block: int = 1  # N must be a multiple of it (the FP4 blocks, FP8 groups)
    only_in: tuple = ()  # the suites that run it (empty: every suite)

    def __post_init__(self):
        # a misspelt family would silently gate with the dtype's default bounds
        from .tolerances import FAMILIES

        for family in self.family if isinstance(self.family, tuple) else (self.family,):
            if family not in FAMILIES:
                raise ValueError(f"OpSpec: unknown tolerance family {family!r}; known: {', '.join(FAMILIES)}")


def _fp4_code_steps(outputs):
    """(q, sf) -> (signed E2M1 magnitude index per element, scale byte as a number): one step
    of either is 1.0 (E4M3 bytes of positive scales are ordered), and -0/+0 codes compare equal.
    The fused ops compute v in another order than the reference, and the unfused peer rounds y
    to x's dtype before quantizing, so the gate holds both to one step; the GPU tests hold the
    fused kernels to exact scales and >= 99.9% exact codes."""
    import torch

    q, sf = outputs[0], outputs[1]
    codes = torch.stack([q & 0xF, q >> 4], -1).reshape(q.shape[0], -1).float()
    signed = torch.where(codes >= 8, -(codes - 8), codes)
    return signed, sf.view(torch.uint8).float()


def _mx_block_ratios(outputs):
    """(q, sf) -> (each signed E2M1 value over its block's largest magnitude, scale byte). Fused
    MXFP4 ops may pick the next power-of-two scale where their fp32 amax and the reference's fall
    on either side of a power of two (often, for a peer that rounds v to bf16 first), which moves
    every code of the block; the ratio moves little (see the tolerance table), and the scale byte
    by one. The GPU tests hold the fused kernels to one code step where the scales agree."""
    import torch

    from oink.reference.nvfp4 import E2M1_VALUES

    q, sf = outputs[0], outputs[1]
    codes = torch.stack([q & 0xF, q >> 4], -1).reshape(q.shape[0], -1).long()
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=q.device)
    vals = table[codes].reshape(q.shape[0], -1, 32)
    top = vals.abs().amax(-1, keepdim=True)
    ratio = torch.where(top > 0, vals / top.clamp_min(0.5), torch.zeros_like(vals))
    return ratio.reshape(q.shape[0], -1), sf.view(torch.uint8).float()


def _fp8_code_steps(outputs):
    """(q, scales) -> (signed e4m3 ordinal per element, scales): one ordinal step is one code
    step (positive e4m3 bytes are ordered), -0 and +0 compare equal. Fused ops round v in another
    order than the reference, so the gate holds codes to one step and scales to the tolerance
    table's; the GPU tests hold the plain quantizers to bit-exact codes and scales."""
    import torch

    b = outputs[0].view(torch.uint8).reshape(outputs[0].shape[0], -1).int()
    signed = torch.where(b >= 128, -(b - 128), b).float()
    return signed, outputs[1].float()


def _fp8_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, N), dtype, device, gen) * 3)


def _silu_fp8_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, 2 * N), dtype, device, gen) * 2)  # N is the quantized width K


def _rand(shape, dtype, device, gen, scale=1.0):
    import torch

    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def _R():
    return importlib.import_module("oink.reference")


def _norm_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, N), dtype, device, gen), weight=_rand((N,), dtype, device, gen))


def _norm_w32_inputs(M, N, dtype, device, gen):
    import torch

    return dict(x=_rand((M, N), dtype, device, gen), weight=_rand((N,), torch.float32, device, gen))


def _gemma_inputs(M, N, dtype, device, gen):
    import torch

    # Gemma's zero-initialised weight (plus noise), applied as (1 + w)
    return dict(x=_rand((M, N), dtype, device, gen), weight=_rand((N,), torch.float32, device, gen, scale=0.1))


def _res32_inputs(M, N, dtype, device, gen):
    import torch

    # the fp32 residual stream of mixed-precision training: x and y in dtype, the residual in fp32
    return dict(x=_rand((M, N), dtype, device, gen), residual=_rand((M, N), torch.float32, device, gen),
                weight=_rand((N,), torch.float32, device, gen))


def _fused_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, N), dtype, device, gen), residual=_rand((M, N), dtype, device, gen),
                weight=_rand((N,), dtype, device, gen))


def _bwd_inputs(M, N, dtype, device, gen):
    x, w = _rand((M, N), dtype, device, gen), _rand((N,), dtype, device, gen)
    rstd = _R().rmsnorm_forward(x, w, store_rstd=True)[1]
    return dict(x=x, weight=w, dout=_rand((M, N), dtype, device, gen), rstd=rstd)


def _ln_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, N), dtype, device, gen), weight=_rand((N,), dtype, device, gen),
                bias=_rand((N,), dtype, device, gen))


def _ce_inputs(M, N, dtype, device, gen):
    import torch

    return dict(logits=_rand((M, N), dtype, device, gen, 4.0),
                target=torch.randint(0, N, (M,), generator=gen, device=device))


def _ln_bwd_inputs(M, N, dtype, device, gen):
    a = _ln_inputs(M, N, dtype, device, gen)
    _, rstd, mean = _R().layernorm(a["x"], a["weight"], a["bias"], EPS, return_rstd=True, return_mean=True)
    return dict(dout=_rand((M, N), dtype, device, gen), rstd=rstd, mean=mean, **a)


def _softmax_bwd_inputs(M, N, dtype, device, gen):
    y = _R().softmax_forward(_rand((M, N), dtype, device, gen, 3.0))
    return dict(dy=_rand((M, N), dtype, device, gen), y=y)


def _softmax_fwd_bwd_inputs(M, N, dtype, device, gen):
    return dict(dy=_rand((M, N), dtype, device, gen), x=_rand((M, N), dtype, device, gen, 3.0))


def _ce_bwd_inputs(M, N, dtype, device, gen):
    import torch

    a = _ce_inputs(M, N, dtype, device, gen)
    a["lse"] = _R().cross_entropy_forward(a["logits"], a["target"])[1]
    a["dloss"] = torch.rand(M, generator=gen, device=device)
    return a


def _ce_fwd_bwd_inputs(M, N, dtype, device, gen):
    a = _ce_bwd_inputs(M, N, dtype, device, gen)
    del a["lse"]
    return a


def _fp4_inputs(M, N, dtype, device, gen):
    import torch

    return dict(x=_rand((M, N), dtype, device, gen), global_scale=torch.tensor([448 * 6 / 5.0], device=device))


def _mx_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, N), dtype, device, gen))


def _silu_fp4_inputs(M, N, dtype, device, gen):
    a = _fp4_inputs(M, 2 * N, dtype, device, gen)  # N is the quantized width K: x is [M, 2K]
    a["x"] = a["x"] * 2
    return a


def _silu_mx_inputs(M, N, dtype, device, gen):
    return dict(x=_rand((M, 2 * N), dtype, device, gen) * 2)


def _add_rms_fp4_inputs(M, N, dtype, device, gen):
    import torch

    return dict(_fused_inputs(M, N, dtype, device, gen), global_scale=torch.tensor([448.0], device=device))


def _oink_ops():
    import torch

    import oink.ops  # noqa: F401  (registers torch.ops.oink)

    return torch.ops.oink


def _rmsnorm_forward_reference(a):
    return (_R().rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0],)


def _gemma_reference(a):
    return (_R().rmsnorm_forward(a["x"], a["weight"], eps=EPS, weight_offset=1.0)[0],)


def _res32_reference(a):
    y, _, res_out = _R().rmsnorm_forward(a["x"], a["weight"], residual=a["residual"], eps=EPS)
    return y, res_out


def _fused_reference(a):
    x, r = a["x"].clone(), a["residual"].clone()
    _R().fused_add_rmsnorm_(x, r, a["weight"], EPS)
    return x, r


MX_FUSED_GATE = ("mxfp4_block_ratio", "nvfp4_code_step")  # (code ratios, scale bytes)
FP8_SUITES = ("fp8", "smoke", "launch", "random")
# FP4 ops have no peer kernel in the quack and dsv3 suites (Quack's, DeepSeek's shapes for the norms,
# softmax and cross-entropy): their numbers at scale are the nvfp4 suite's
FP4_SUITES = ("nvfp4", "sweep", "smoke", "launch", "random")

SPECS = {
    "rmsnorm_forward": OpSpec("rmsnorm", _norm_inputs, _rmsnorm_forward_reference,
                              lambda M, N, e: 2 * M * N * e + N * e,
                              oink=lambda o, a: (o.rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0],)),
    # the same op with an fp32 weight (mixed-precision training keeps the weight in fp32)
    "rmsnorm_forward_w32": OpSpec("rmsnorm", _norm_w32_inputs, _rmsnorm_forward_reference,
                                  lambda M, N, e: 2 * M * N * e + N * 4,
                                  oink=lambda o, a: (o.rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0],)),
    # Gemma's RMSNorm: y = x_hat * (1 + w), fp32 weight
    "rmsnorm_forward_gemma": OpSpec("rmsnorm", _gemma_inputs, _gemma_reference,
                                    lambda M, N, e: 2 * M * N * e + N * 4,
                                    oink=lambda o, a: (o.rmsnorm_forward(a["x"], a["weight"], eps=EPS,
                                                                          weight_offset=1.0)[0],)),
    # an fp32 residual stream: y in x's dtype and residual_out = x + residual in fp32
    "rmsnorm_forward_res32": OpSpec(("rmsnorm", "rmsnorm"), _res32_inputs, _res32_reference,
                                    lambda M, N, e: 2 * M * N * e + 8 * M * N + N * 4,
                                    oink=lambda o, a: o.rmsnorm_forward(a["x"], a["weight"], residual=a["residual"],
                                                                        eps=EPS)[::2]),
    "fused_add_rmsnorm_": OpSpec("rmsnorm", _fused_inputs, _fused_reference,
                                 lambda M, N, e: 4 * M * N * e + N * e, mutates=("x", "residual"),
                                 oink=lambda o, a: (o.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS),
                                                    a["x"], a["residual"])[1:]),
    # dx and dw: every provider must compute both (a compiler would drop an unused dw)
    "rmsnorm_backward": OpSpec(("norm_backward", "weight_grad"), _bwd_inputs,
                               lambda a: _R().rmsnorm_backward(a["x"], a["weight"], a["dout"], a["rstd"])[:2],
                               lambda M, N, e: 3 * M * N * e + 2 * N * e + 4 * M,
                               oink=lambda o, a: o.rmsnorm_backward(a["x"], a["weight"], a["dout"], a["rstd"])[:2]),
    "layernorm": OpSpec("layernorm", _ln_inputs,
                        lambda a: (_R().layernorm(a["x"], a["weight"], a["bias"], EPS),),
                        lambda M, N, e: 2 * M * N * e + 2 * N * e,
                        oink=lambda o, a: (o.layernorm(a["x"], a["weight"], a["bias"], EPS),)),
    # read x, dout, weight, mean, rstd; write dx, dweight, dbias
    "layernorm_backward": OpSpec(("norm_backward", "weight_grad", "weight_grad"), _ln_bwd_inputs,
                                 lambda a: _R().layernorm_backward(a["dout"], a["x"], a["weight"], a["rstd"],
                                                                   a["mean"], a["bias"]),
                                 lambda M, N, e: 3 * M * N * e + 8 * M + 3 * N * e,
                                 oink=lambda o, a: o.layernorm_backward(a["dout"], a["x"], a["weight"], a["rstd"],
                                                                          a["mean"], a["bias"])),
    "softmax_forward": OpSpec("softmax", _norm_inputs, lambda a: (_R().softmax_forward(a["x"]),),
                              lambda M, N, e: 2 * M * N * e,
                              oink=lambda o, a: (o.softmax_forward(a["x"]),)),
    "softmax_backward": OpSpec("norm_backward", _softmax_bwd_inputs,
                               lambda a: (_R().softmax_backward(a["dy"], a["y"]),),
                               lambda M, N, e: 3 * M * N * e,
                               oink=lambda o, a: (o.softmax_backward(a["dy"], a["y"]),)),
    # fused: read x and dy, write dx (y never touches memory)
    "softmax_fwd_bwd": OpSpec("norm_backward", _softmax_fwd_bwd_inputs,
                              lambda a: (_R().softmax_fwd_bwd(a["dy"], a["x"]),),
                              lambda M, N, e: 3 * M * N * e,
                              oink=lambda o, a: (o.softmax_fwd_bwd(a["dy"], a["x"]),)),
    # read logits and int64 targets; write fp32 loss and lse
    "cross_entropy_forward": OpSpec("cross_entropy_loss", _ce_inputs,
                                    lambda a: (_R().cross_entropy_forward(a["logits"], a["target"])[0],),
                                    lambda M, N, e: M * N * e + 8 * M + 4 * M,
                                    oink=lambda o, a: (o.cross_entropy_forward(a["logits"], a["target"])[0],)),
    # read logits, targets, lse, dloss; write dlogits
    "cross_entropy_backward": OpSpec("softmax", _ce_bwd_inputs,
                                     lambda a: (_R().cross_entropy_backward(a["dloss"], a["logits"], a["target"],
                                                                            a["lse"]),),
                                     lambda M, N, e: 2 * M * N * e + 16 * M,
                                     oink=lambda o, a: (o.cross_entropy_backward(a["dloss"], a["logits"], a["target"],
                                                                                  a["lse"]),)),
    # read logits, targets, dloss; write loss and dlogits
    "cross_entropy_fwd_bwd": OpSpec(("cross_entropy_loss", "softmax"), _ce_fwd_bwd_inputs,
                                    lambda a: _R().cross_entropy_fwd_bwd(a["dloss"], a["logits"], a["target"]),
                                    lambda M, N, e: 2 * M * N * e + 16 * M,
                                    oink=lambda o, a: o.cross_entropy_fwd_bwd(a["dloss"], a["logits"], a["target"])),
    # read x; write codes (half a byte an element) and one scale byte per 16. Gated to one step
    # like the fused ops: torch.compile of the reference is not bit-exact (the kernel is: tests)
    "nvfp4_quantize": OpSpec("nvfp4_code_step", _fp4_inputs,
                             lambda a: _R().nvfp4_quantize(a["x"], a["global_scale"]),
                             lambda M, N, e: M * N * e + M * N // 2 + M * N // 16, gate_view=_fp4_code_steps,
                             oink=lambda o, a: o.nvfp4_quantize(a["x"], a["global_scale"]), block=16,
                             only_in=FP4_SUITES),
    # read x; write codes and one UE8M0 scale byte per 32
    "mxfp4_quantize": OpSpec("nvfp4_code_step", _mx_inputs, lambda a: _R().mxfp4_quantize(a["x"]),
                             lambda M, N, e: M * N * e + M * N // 2 + M * N // 32, gate_view=_fp4_code_steps,
                             oink=lambda o, a: o.mxfp4_quantize(a["x"]), block=32, only_in=FP4_SUITES),
    # read x and residual, write residual (in place), codes and scales; read the weight
    "add_rmsnorm_fp4quant": OpSpec("nvfp4_code_step", _add_rms_fp4_inputs,
                                   lambda a: _R().add_rmsnorm_fp4quant(a["x"], a["residual"], a["weight"],
                                                                       a["global_scale"], EPS),
                                   lambda M, N, e: 3 * M * N * e + M * N // 2 + M * N // 16 + N * e,
                                   gate_view=_fp4_code_steps,
                                   oink=lambda o, a: o.add_rmsnorm_fp4quant(a["x"], a["residual"], a["weight"],
                                                                            a["global_scale"], EPS), block=16,
                                   only_in=FP4_SUITES),
    # read x [M, 2N]; write codes and scales of the N-wide product
    "silu_mul_fp4quant": OpSpec("nvfp4_code_step", _silu_fp4_inputs,
                                lambda a: _R().silu_mul_fp4quant(a["x"], a["global_scale"]),
                                lambda M, N, e: 2 * M * N * e + M * N // 2 + M * N // 16,
                                gate_view=_fp4_code_steps,
                                oink=lambda o, a: o.silu_mul_fp4quant(a["x"], a["global_scale"]), block=16,
                                only_in=FP4_SUITES),
    # the MXFP4 fused variants: the same bytes with one scale byte per 32
    "add_rmsnorm_mxfp4quant": OpSpec(MX_FUSED_GATE, _fused_inputs,
                                     lambda a: _R().add_rmsnorm_mxfp4quant(a["x"], a["residual"], a["weight"], EPS),
                                     lambda M, N, e: 3 * M * N * e + M * N // 2 + M * N // 32 + N * e,
                                     gate_view=_mx_block_ratios,
                                     oink=lambda o, a: o.add_rmsnorm_mxfp4quant(a["x"], a["residual"], a["weight"],
                                                                              EPS), block=32,
                                     only_in=FP4_SUITES),
    "silu_mul_mxfp4quant": OpSpec(MX_FUSED_GATE, _silu_mx_inputs, lambda a: _R().silu_mul_mxfp4quant(a["x"]),
                                  lambda M, N, e: 2 * M * N * e + M * N // 2 + M * N // 32,
                                  gate_view=_mx_block_ratios,
                                  oink=lambda o, a: o.silu_mul_mxfp4quant(a["x"]), block=32, only_in=FP4_SUITES),
    # vLLM's two ops as vLLM calls them (torch.ops.oink.*, through the dispatcher): launch cost only
    "vllm_rmsnorm": OpSpec("rmsnorm", _norm_inputs, _rmsnorm_forward_reference, lambda M, N, e: 2 * M * N * e + N * e,
                           oink=lambda o, a: (_oink_ops().rmsnorm(a["x"], a["weight"], EPS),), only_in=("launch",)),
    "vllm_fused_add_rms_norm": OpSpec("rmsnorm", _fused_inputs, _fused_reference,
                                      lambda M, N, e: 4 * M * N * e + N * e, mutates=("x", "residual"),
                                      oink=lambda o, a: (_oink_ops().fused_add_rms_norm(a["x"], a["residual"],
                                                                                        a["weight"], EPS),
                                                         a["x"], a["residual"])[1:], only_in=("launch",)),
    # FP8 (e4m3 codes, fp32 scales): the fp8 suite's ops (see oink/reference/fp8.py for the modes)
    # per token: read x; write codes and one fp32 scale a row
    "fp8_quantize": OpSpec(("fp8_code_step", "fp8_scale"), _fp8_inputs, lambda a: _R().fp8_quantize(a["x"]),
                           lambda M, N, e: M * N * e + M * N + 4 * M, gate_view=_fp8_code_steps,
                           oink=lambda o, a: o.fp8_quantize(a["x"]), only_in=FP8_SUITES),
    # per 1 x 128 group (DeepSeek-V3's activations): one fp32 scale a group
    "fp8_quantize_group": OpSpec(("fp8_code_step", "fp8_scale"), _fp8_inputs,
                                 lambda a: _R().fp8_quantize(a["x"], group_size=128),
                                 lambda M, N, e: M * N * e + M * N + M * N // 32, gate_view=_fp8_code_steps,
                                 oink=lambda o, a: o.fp8_quantize(a["x"], group_size=128), block=128,
                                 only_in=FP8_SUITES),
    # read x and weight; write codes and per-row scales
    "rmsnorm_fp8quant": OpSpec(("fp8_code_step", "fp8_scale"), _norm_inputs,
                               lambda a: _R().rmsnorm_fp8quant(a["x"], a["weight"], EPS),
                               lambda M, N, e: M * N * e + M * N + 4 * M + N * e, gate_view=_fp8_code_steps,
                               oink=lambda o, a: o.rmsnorm_fp8quant(a["x"], a["weight"], EPS), only_in=FP8_SUITES),
    # read x and residual, write residual (in place), codes and 1 x 128 group scales; read the weight
    "add_rmsnorm_fp8quant": OpSpec(("fp8_code_step", "fp8_scale"), _fused_inputs,
                                   lambda a: _R().add_rmsnorm_fp8quant(a["x"], a["residual"], a["weight"], EPS,
                                                                       group_size=128),
                                   lambda M, N, e: 3 * M * N * e + M * N + M * N // 32 + N * e,
                                   gate_view=_fp8_code_steps, block=128, only_in=FP8_SUITES,
                                   oink=lambda o, a: o.add_rmsnorm_fp8quant(a["x"], a["residual"], a["weight"], EPS,
                                                                            group_size=128)),
    # read x [M, 2N]; write codes and 1 x 128 group scales of the N-wide product
    "silu_mul_fp8quant": OpSpec(("fp8_code_step", "fp8_scale"), _silu_fp8_inputs,
                                lambda a: _R().silu_mul_fp8quant(a["x"], group_size=128),
                                lambda M, N, e: 2 * M * N * e + M * N + M * N // 32, gate_view=_fp8_code_steps,
                                oink=lambda o, a: o.silu_mul_fp8quant(a["x"], group_size=128), block=128,
                                only_in=FP8_SUITES),
}


# ------------------------------------------------------------------------------ providers
PROVIDERS: dict[tuple[str, str], Callable] = {}
LABELS: dict[tuple[str, str], str] = {}  # (op, provider) -> note shown in reports


def provider(op: str, name: str, label: str = ""):
    def deco(builder):
        PROVIDERS[(op, name)] = builder
        if label:
            LABELS[(op, name)] = label
        return builder

    return deco


def _peer(module: str, pip_name: str):
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise Unavailable(f"{pip_name} not installed")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (a peer that fails to import is unavailable, with its reason)
        raise Unavailable(f"{pip_name} failed to import: {e}") from None


def _needs_cuda(device):
    if device.type != "cuda":
        raise Unavailable("GPU-only provider; no CUDA device")


_PARAMS = ("weight", "bias")  # per-column inputs: their first dim is N, never the rows


def _compiled(fn):
    """torch.compile of ``fn(args)`` with the rows dimension marked dynamic on first sight (torch's
    ``maybe_mark_dynamic``: Inductor may still specialize it): one compile serves every M, as the
    automatic-dynamic recompile of torch's default would from the second M on, without compiling a
    static kernel first. N stays static."""
    import torch

    compiled = torch.compile(fn)
    mark = torch._dynamo.maybe_mark_dynamic

    def run(a):
        x = next(v for v in a.values() if isinstance(v, torch.Tensor))
        rows = x.shape[0] if x.dim() > 1 else None
        for name, v in a.items():
            if (rows is not None and isinstance(v, torch.Tensor) and name not in _PARAMS and v.dim()
                    and v.shape[0] == rows and not hasattr(v, "_dynamo_weak_dynamic_indices")):
                mark(v, 0)
        return compiled(a)

    return run



for _op in SPECS:
    def _oink_builder(device, _op=_op):
        import oink

        call = SPECS[_op].oink
        return lambda a: call(oink, a)

    provider(_op, "oink")(_oink_builder)

    # torch eager and torch.compile run the op's reference (the PyTorch a user would write)
    def _torch_builder(device, _op=_op):
        return SPECS[_op].reference if not SPECS[_op].mutates else _inplace_reference(_op)

    def _compile_builder(device, _op=_op):
        if SPECS[_op].mutates and device.type != "cuda":
            return _compiled_out_of_place_with_copies()
        return _compiled(_torch_builder(device, _op))

    provider(_op, "torch")(_torch_builder)
    provider(_op, "torch.compile")(_compile_builder)


def _compiled_out_of_place_with_copies():
    """Inductor on CPU fails to compile the in-place reference (KeyError in its loop body,
    torch 2.13); the functional form plus the two copies has the same semantics."""
    import torch

    def functional(x, r, w):
        h = (x.float() + r.float()).to(r.dtype)
        return _R().rmsnorm_forward(h, w, eps=EPS)[0], h

    f = torch.compile(functional)

    def run(a):
        y, h = f(a["x"], a["residual"], a["weight"])
        a["x"].copy_(y)
        a["residual"].copy_(h)
        return a["x"], a["residual"]

    run.label = "on CPU: compiled out of place + 2 copies"  # this device's rows only (see run_case)
    return run


def _inplace_reference(op):
    def run(a):
        _R().fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS)
        return a["x"], a["residual"]

    return run


@provider("rmsnorm_forward_w32", "quack")
@provider("rmsnorm_forward", "quack")
def _quack_rms_fwd(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
    return lambda a: (m.rmsnorm_fwd(a["x"], a["weight"], eps=EPS)[0],)


@provider("rmsnorm_forward_gemma", "quack")
def _quack_rms_gemma(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
    return lambda a: (m.rmsnorm_fwd(a["x"], a["weight"], eps=EPS, weight_offset=1.0)[0],)


@provider("rmsnorm_forward_res32", "quack")
def _quack_rms_res32(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
    return lambda a: m.rmsnorm_fwd(a["x"], a["weight"], residual=a["residual"], eps=EPS)[:2]


@provider("fused_add_rmsnorm_", "quack", label="out-of-place + 2 copies")
def _quack_fused(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")

    def run(a):
        out, res_out, _ = m.rmsnorm_fwd(a["x"], a["weight"], residual=a["residual"], eps=EPS)
        a["x"].copy_(out)
        a["residual"].copy_(res_out)
        return a["x"], a["residual"]

    return run


@provider("rmsnorm_backward", "quack")
def _quack_rms_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
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


@provider("layernorm", "quack", label="fp32 weight and bias (Quack requires them)")
def _quack_ln(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
    f32 = _fp32_once()
    return lambda a: (m.layernorm_fwd(a["x"], f32(a["weight"]), f32(a["bias"]), EPS),)


@provider("layernorm_backward", "quack", label="fp32 weight (Quack requires it)")
def _quack_ln_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.rmsnorm", "quack-kernels")
    f32 = _fp32_once()
    return lambda a: m.layernorm_bwd(a["x"], f32(a["weight"]), a["dout"], a["rstd"], a["mean"], has_bias=True)


@provider("softmax_forward", "quack")
def _quack_softmax(device):
    _needs_cuda(device)
    m = _peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_fwd(a["x"]),)


@provider("softmax_backward", "quack")
def _quack_softmax_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_bwd(a["dy"], a["y"]),)


@provider("softmax_fwd_bwd", "quack", label="forward then backward (Quack has no fused kernel)")
def _quack_softmax_fwd_then_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.softmax", "quack-kernels")
    return lambda a: (m.softmax_bwd(a["dy"], m.softmax_fwd(a["x"])),)


@provider("cross_entropy_forward", "quack")
def _quack_ce(device):
    _needs_cuda(device)
    m = _peer("quack.cross_entropy", "quack-kernels")
    return lambda a: (m.cross_entropy_fwd(a["logits"], a["target"]),)


@provider("cross_entropy_backward", "quack")
def _quack_ce_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.cross_entropy", "quack-kernels")
    return lambda a: (m.cross_entropy_bwd(a["logits"], a["target"], a["dloss"], a["lse"]),)


@provider("cross_entropy_fwd_bwd", "quack", label="forward then backward")
def _quack_ce_fwd_then_bwd(device):
    _needs_cuda(device)
    m = _peer("quack.cross_entropy", "quack-kernels")

    def run(a):
        loss, lse = m.cross_entropy_fwd(a["logits"], a["target"], return_lse=True)
        return loss, m.cross_entropy_bwd(a["logits"], a["target"], a["dloss"], lse)

    return run


@provider("rmsnorm_forward_w32", "liger")
@provider("rmsnorm_forward", "liger")
def _liger_rms(device):
    _needs_cuda(device)
    m = _peer("liger_kernel.ops.rms_norm", "liger-kernel")
    return lambda a: (m.LigerRMSNormFunction.apply(a["x"], a["weight"], EPS, 0.0, "llama", False),)


@provider("layernorm", "liger")
def _liger_ln(device):
    _needs_cuda(device)
    m = _peer("liger_kernel.ops.layer_norm", "liger-kernel")
    return lambda a: (m.LigerLayerNormFunction.apply(a["x"], a["weight"], a["bias"], EPS),)


@provider("softmax_forward", "liger")
def _liger_softmax(device):
    _needs_cuda(device)
    m = _peer("liger_kernel.ops.softmax", "liger-kernel")
    return lambda a: (m.LigerSoftmaxFunction.apply(a["x"]),)


@provider("rmsnorm_forward", "flashinfer")
def _fi_rms(device):
    _needs_cuda(device)
    m = _peer("flashinfer.norm", "flashinfer-python")
    return lambda a: (m.rmsnorm(a["x"], a["weight"], EPS),)


@provider("layernorm", "flashinfer", label="weight and bias cast to fp32 in the call (FlashInfer takes fp32 only)")
def _fi_ln(device):
    _needs_cuda(device)
    m = _peer("flashinfer.norm", "flashinfer-python")
    return lambda a: (m.layernorm(a["x"], a["weight"].float(), a["bias"].float(), EPS),)


@provider("fused_add_rmsnorm_", "flashinfer")
def _fi_fused(device):
    _needs_cuda(device)
    m = _peer("flashinfer.norm", "flashinfer-python")

    def run(a):
        m.fused_add_rmsnorm(a["x"], a["residual"], a["weight"], EPS)
        return a["x"], a["residual"]

    return run


def _quantizer(name: str):
    """(v, args) -> codes and scales by Oink's plain quantizer ``name``."""
    import oink

    if name == "nvfp4_quantize":
        return lambda v, a: oink.nvfp4_quantize(v, a["global_scale"])
    return lambda v, a: oink.mxfp4_quantize(v)


def _oink_unfused_add_rms(quantizer: str):
    def build(device):
        import oink

        quantize = _quantizer(quantizer)

        def run(a):
            oink.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS)
            return quantize(a["x"], a)

        return run

    return build


def _oink_unfused_silu(quantizer: str):
    def build(device):
        import torch

        quantize = _quantizer(quantizer)

        def run(a):
            K = a["x"].shape[-1] // 2
            return quantize(torch.nn.functional.silu(a["x"][:, :K]) * a["x"][:, K:], a)

        return run

    return build


def _oink_unfused_fp8(op: str):
    """Oink's norm (or torch's silu * up) then Oink's fp8_quantize, with the spec's scale mode."""
    def build(device):
        import torch

        import oink

        def run(a):
            if op == "rmsnorm_fp8quant":
                return oink.fp8_quantize(oink.rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0])
            if op == "add_rmsnorm_fp8quant":
                oink.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS)
                return oink.fp8_quantize(a["x"], group_size=128)
            K = a["x"].shape[-1] // 2
            return oink.fp8_quantize(torch.nn.functional.silu(a["x"][:, :K]) * a["x"][:, K:], group_size=128)

        return run

    return build


for _op, _label in (("rmsnorm_fp8quant", "oink rmsnorm_forward then oink fp8_quantize"),
                    ("add_rmsnorm_fp8quant", "oink fused_add_rmsnorm_ then oink fp8_quantize"),
                    ("silu_mul_fp8quant", "torch silu * up then oink fp8_quantize")):
    provider(_op, "oink-unfused", label=_label)(_oink_unfused_fp8(_op))

for _fmt, _q in (("fp4quant", "nvfp4_quantize"), ("mxfp4quant", "mxfp4_quantize")):
    provider(f"add_rmsnorm_{_fmt}", "oink-unfused",
             label=f"oink fused_add_rmsnorm_ then oink {_q}")(_oink_unfused_add_rms(_q))
    provider(f"silu_mul_{_fmt}", "oink-unfused", label=f"torch silu * up then oink {_q}")(_oink_unfused_silu(_q))


ALL_PROVIDERS = ("oink", "oink-unfused", "quack", "liger", "flashinfer", "torch", "torch.compile")


def providers_for(op: str, wanted=None) -> list[str]:
    names = [p for p in ALL_PROVIDERS if (op, p) in PROVIDERS]
    return [p for p in names if wanted is None or p in wanted]


def build(op: str, name: str, device):
    try:
        builder = PROVIDERS[(op, name)]
    except KeyError:
        raise Unavailable(f"no provider {name!r} for {op}") from None
    return builder(device)


from . import training  # noqa: E402,F401  (registers the training suite's specs and providers)
