"""Registry mapping (op, provider) to a callable builder, and the per-op benchmark specs.

A spec makes inputs (keyword arguments of the op's reference signature), computes the fp32
reference outputs, and counts the bytes the op must move. Oink's ops declare theirs beside their
references (``oink.reference.BENCH``: each family module's entries, ``oink/reference/bench.py``):
``SPECS`` is built from them on first use (they import torch), with the training suite's. A
provider's builder returns a callable ``run(args) -> outputs`` (outputs in the order the reference
gives them), or raises ``Unavailable`` with the reason (peer not installed, op or arch not
supported); Oink, torch eager and torch.compile serve every such op, the peers' builders below
the ops they have. Peers that do out of place what Oink does in place are timed with the copies
that make the semantics equal, and their label says so. Imports of torch and peers happen inside
builders only.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

EPS = 1e-6  # the bench entries' (oink/reference/bench.py)


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


def _R():
    return importlib.import_module("oink.reference")


# the views a bench entry's gate may compare instead of the outputs (``Bench.gate_view``)
GATE_VIEWS = {"fp4_code_steps": _fp4_code_steps, "mx_block_ratios": _mx_block_ratios,
              "fp8_code_steps": _fp8_code_steps}


def spec_of(b) -> OpSpec:
    """An Oink op's spec from its bench entry (``oink.reference.bench.Bench``): the reference is the entry's
    call on ``oink.reference``, the Oink call the same on ``oink`` (or the entry's own), each module found
    when called (an --oink-against worker's are the other tree's)."""
    view = None
    if b.gate_view is not None:
        if b.gate_view not in GATE_VIEWS:
            raise ValueError(f"unknown gate view {b.gate_view!r}; known: {', '.join(GATE_VIEWS)}")
        view = GATE_VIEWS[b.gate_view]
    return OpSpec(b.family, b.inputs, lambda a: b.call(_R(), a), b.nbytes, mutates=b.mutates, gate_view=view,
                  oink=b.oink or b.call, block=b.block, only_in=b.only_in)


def specs() -> dict:
    """``SPECS``: each bench entry's spec, then the training suite's, built once (importing the entries,
    which import torch); Oink, torch eager and torch.compile registered as each op's providers."""
    built = globals().get("SPECS")
    if built is None:
        from oink.reference import BENCH

        from . import training

        _ENTRIES.update(BENCH)
        built = {op: spec_of(b) for op, b in BENCH.items()}
        for op in built:
            for name, builder in (("oink", _oink_builder), ("torch", _torch_builder),
                                  ("torch.compile", _compile_builder)):
                PROVIDERS.setdefault((op, name), builder(op))  # one registered before stays
        built.update(training.SPECS)
        globals()["SPECS"] = built
    return built


_ENTRIES: dict = {}  # op -> its bench entry (torch.compile compiles the entry's own call: see _compile_builder)


def __getattr__(name: str):
    if name == "SPECS":  # built on first use (see specs)
        return specs()
    if name == "MX_FUSED_GATE":  # the fused MXFP4 entries' families: (code ratios, scale bytes)
        return importlib.import_module("oink.reference.nvfp4").MX_FUSED_GATE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def _compiled(fn, *first):
    """torch.compile of ``fn(*first, args)`` with the rows dimension marked dynamic on first sight (torch's
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
        return compiled(*first, a)

    return run


def _oink_builder(op: str):
    def build(device):
        import oink

        call = specs()[op].oink
        return lambda a: call(oink, a)

    return build


# torch eager and torch.compile run the op's reference (the PyTorch a user would write)
def _torch_builder(op: str):
    return lambda device: specs()[op].reference


def _compile_builder(op: str):
    def build(device):
        if specs()[op].mutates and device.type != "cuda":
            return _compiled_out_of_place_with_copies()
        # the entry's call compiled, on oink.reference: the spec's reference is one lambda for every op (and a
        # partial, a wrapper of torch's), where torch.compile's cache of one function recompiles 8 times, then
        # runs it eagerly
        return _compiled(_ENTRIES[op].call, _R())

    return build


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
    specs()
    names = [p for p in ALL_PROVIDERS if (op, p) in PROVIDERS]
    return [p for p in names if wanted is None or p in wanted]


def build(op: str, name: str, device):
    specs()
    try:
        builder = PROVIDERS[(op, name)]
    except KeyError:
        raise Unavailable(f"no provider {name!r} for {op}") from None
    return builder(device)


from . import training  # noqa: E402,F401  (registers the training suite's providers; specs() adds its specs)
