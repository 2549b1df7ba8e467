"""Oink's unfused compositions (``oink-unfused``): a fused quantizing op's norm or activation, then Oink's plain
quantizer, as a user without the fused op would call them: the baseline the fused op must beat. Registered by
``pytest_oink.peers.register``."""
from __future__ import annotations

from ..registry import EPS, Peer

OINK_UNFUSED = Peer("oink-unfused")


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
            if op.startswith("rmsnorm_fp8quant"):
                return oink.fp8_quantize(oink.rmsnorm_forward(a["x"], a["weight"], eps=EPS)[0], a.get("scale"))
            if op == "add_rmsnorm_fp8quant_static":
                oink.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS)
                return oink.fp8_quantize(a["x"], a["scale"])
            if op == "add_rmsnorm_fp8quant":
                oink.fused_add_rmsnorm_(a["x"], a["residual"], a["weight"], EPS)
                return oink.fp8_quantize(a["x"], group_size=128)
            K = a["x"].shape[-1] // 2
            return oink.fp8_quantize(torch.nn.functional.silu(a["x"][:, :K]) * a["x"][:, K:], group_size=128)

        return run

    return build


for _op, _label in (("rmsnorm_fp8quant", "oink rmsnorm_forward then oink fp8_quantize"),
                    ("rmsnorm_fp8quant_static", "oink rmsnorm_forward then oink fp8_quantize"),
                    ("add_rmsnorm_fp8quant", "oink fused_add_rmsnorm_ then oink fp8_quantize"),
                    ("add_rmsnorm_fp8quant_static", "oink fused_add_rmsnorm_ then oink fp8_quantize"),
                    ("silu_mul_fp8quant", "torch silu * up then oink fp8_quantize")):
    OINK_UNFUSED.serves(_op, label=_label)(_oink_unfused_fp8(_op))

for _fmt, _q in (("fp4quant", "nvfp4_quantize"), ("mxfp4quant", "mxfp4_quantize")):
    OINK_UNFUSED.serves(f"add_rmsnorm_{_fmt}",
             label=f"oink fused_add_rmsnorm_ then oink {_q}")(_oink_unfused_add_rms(_q))
    OINK_UNFUSED.serves(f"silu_mul_{_fmt}", label=f"torch silu * up then oink {_q}")(_oink_unfused_silu(_q))
