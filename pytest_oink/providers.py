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
    # whether the provider "oink" promises batch invariance for it, or (N, torch dtype) -> that promise at a width
    # (oink.batch_invariant): with --oink-batch-invariance an Oink row that breaks a promise fails; any other
    # provider's verdict, and one not promised, is reported
    batch_invariant: bool | Callable = False

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
                  oink=b.oink or b.call, block=b.block, only_in=b.only_in, batch_invariant=_aligned_rows)


def _aligned_rows(N: int, dtype) -> bool:
    """Oink's promise of batch invariance at a width: rows of a multiple of 16 bytes (oink.batch_invariant)."""
    return N * dtype.itemsize % 16 == 0


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


_PARAMS = ("weight", "bias", "scale")  # inputs whose first dim is never the rows (N; a static scale's 1)


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


# ---- FlashInfer's FP8 ops (flashinfer-python 0.7.x; flashinfer/norm/__init__.py, flashinfer/activation.py and
# flashinfer/quantization/fp8_quantization.py of flashinfer-ai/flashinfer). Its conventions against Oink's:
# - a static ``scale`` divides, as Oink's does: q = e4m3(sat(v * (1 / scale))) (CUDA: 1.0f / scale[0]; CuTe-DSL:
#   rcp.approx), written to a caller-allocated float8_e4m3fn ``out``; FlashInfer normalizes the fp32 sum and does
#   not round v to x's dtype first (within the gate's one code step of Oink's rule);
# - per_token_group_quant_8bit(x, G): s = fmax(amax, 1e-10) / 448 and q = x * (1 / s), fp32 scales [M, N / G]
#   row-major by default (column_major_scales=True: strides (1, M), Oink's column_major_scales; adding
#   scale_tma_aligned=True: strides (1, round_up(M, 4)), which Oink has no option for);
# - fused_add_rmsnorm_fp8_block_quant: residual <- x + residual in place (Oink's semantics), y rounded to x's dtype
#   and written to ``normed_out`` too, s = fmax(amax, 1e-4) / 448 per 1 x 128 block into a caller-allocated
#   [N / 128, round_up(M, 4)] buffer: the [M, N / 128] scales are its transposed view (DeepGEMM's TMA-aligned
#   column-major layout); N <= 16384, a multiple of 256 (512 above 8192).
# Their builders look for FlashInfer before the GPU, so a run without it says it is not installed. Outputs are
# allocated in the call, as Oink's ops and FlashInfer's own allocating functions do.
def _fi_half(x):
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16):
        raise Unavailable(f"FlashInfer's norms and silu_and_mul take float16 and bfloat16 only, not {x.dtype}")


def _fi_fp8_out(x):
    import torch

    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)


def _fi_norm_path(m, device) -> str:
    """Which of FlashInfer's norm paths its public functions take on ``device``: the CuTe-DSL kernels unless
    FLASHINFER_USE_CUDA_NORM=1 was set before flashinfer.norm was imported (read once, then) or the installed
    CuTe DSL can't target the GPU."""
    chooser = getattr(m, "_use_cuda_norm", None)
    try:
        cuda = None if chooser is None else bool(chooser(device))
    except Exception:  # noqa: BLE001  (a label only)
        cuda = None
    if cuda is None:
        return "FlashInfer's public call (CuTe-DSL path unless FLASHINFER_USE_CUDA_NORM=1)"
    return ("CUDA JIT path (FLASHINFER_USE_CUDA_NORM=1, or no CuTe DSL for this GPU)" if cuda
            else "CuTe-DSL path (the flashinfer-cuda rows: the CUDA JIT path)")


def _fi_cuda_norms(m, device):
    """(FlashInfer's CUDA JIT norm module, its enable_pdl default on ``device``): what flashinfer.norm calls in
    place of the CuTe-DSL kernels where FLASHINFER_USE_CUDA_NORM=1. That variable is read once, when
    flashinfer.norm is imported, so both paths in one process call the module directly, with the arguments
    the public function passes it."""
    get = getattr(m, "get_norm_module", None)
    if get is None:
        raise Unavailable("this flashinfer-python has no flashinfer.norm.get_norm_module (its CUDA JIT norms)")
    try:
        module = get()
    except Exception as e:  # noqa: BLE001  (a JIT build that fails here: the rows are unavailable, with why)
        raise Unavailable(f"FlashInfer's CUDA JIT norms did not build here: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    pdl = getattr(_peer("flashinfer.utils", "flashinfer-python"), "device_support_pdl", None)
    return module, bool(pdl(device)) if pdl else False


def _fi_group_quant(q):
    """per_token_group_quant_8bit at 1 x 128 (fp8 e4m3, fp32 row-major scales, eps 1e-10: Oink's group rule);
    its cuTile backend or that backend's compiler (tileiras) missing is a refusal, not a wrong answer."""
    quant = q.per_token_group_quant_8bit

    def run(v):
        try:
            return quant(v, 128)
        except ImportError as e:
            raise Unavailable(f"per_token_group_quant_8bit needs its cuTile backend (cuda-tile): {e}") from None
        except FileNotFoundError as e:  # cuda-tile without its compiler (the cuda-tile[tileiras] extra)
            raise Unavailable(f"per_token_group_quant_8bit's cuTile backend found no compiler: {e}") from None

    return run


def _refuses(reason: str):
    """A builder for an op FlashInfer has no equivalent of: the row is skipped with ``reason``."""
    def build(device):
        raise Unavailable(reason)

    return build


provider("fp8_quantize", "flashinfer")(_refuses(
    "FlashInfer has no per-token dynamic FP8 quantizer (per_token_group_quant_8bit with group_size=N would hold "
    "a whole row in one tile, with another scale floor)"))
provider("rmsnorm_fp8quant", "flashinfer")(_refuses(
    "FlashInfer's rmsnorm_quant takes a static scale only, not per-token scales: see rmsnorm_fp8quant_static"))


@provider("fp8_quantize_group", "flashinfer", label="per_token_group_quant_8bit (cuTile)")
def _fi_group(device):
    q = _peer("flashinfer.quantization", "flashinfer-python")
    _needs_cuda(device)
    quant = _fi_group_quant(q)
    return lambda a: quant(a["x"])


@provider("silu_mul_fp8quant", "flashinfer",
          label="unfused: silu_and_mul, then per_token_group_quant_8bit (the product rounded to x's dtype between)")
def _fi_silu_group(device):
    act = _peer("flashinfer.activation", "flashinfer-python")
    q = _peer("flashinfer.quantization", "flashinfer-python")
    _needs_cuda(device)
    quant = _fi_group_quant(q)

    def run(a):
        _fi_half(a["x"])
        return quant(act.silu_and_mul(a["x"]))

    return run


@provider("add_rmsnorm_fp8quant", "flashinfer",
          label="fused_add_rmsnorm_fp8_block_quant: also writes y (x's dtype; no option to skip it); scales "
                "column-major, M padded to 4 (DeepGEMM's TMA layout), compared as their [M, N/128] view")
def _fi_add_block(device):
    m = _peer("flashinfer.norm", "flashinfer-python")
    _needs_cuda(device)
    if not hasattr(m, "fused_add_rmsnorm_fp8_block_quant"):
        raise Unavailable("this flashinfer-python has no fused_add_rmsnorm_fp8_block_quant "
                          "(flashinfer-ai/flashinfer#4480, after 0.6.18)")

    def run(a):
        import torch

        x = a["x"]
        _fi_half(x)
        M, N = x.shape
        out, normed = _fi_fp8_out(x), torch.empty_like(x)
        scales = torch.empty((N // 128, -(-M // 4) * 4), dtype=torch.float32, device=x.device)
        try:
            m.fused_add_rmsnorm_fp8_block_quant(out, scales, normed, x, a["residual"], a["weight"], EPS)
        except RuntimeError as e:  # its width contract (one row a CTA, single wave): a refusal, not a wrong answer
            said = [line.strip() for line in str(e).splitlines() if "hidden_size" in line]
            if not said:
                raise
            raise Unavailable(f"fused_add_rmsnorm_fp8_block_quant refuses N={N}: {said[0][:200]}") from None
        return out, scales.t()[:M]

    return run


def _fi_static(fn: str, residual: bool, cuda: bool):
    """A builder for FlashInfer's static-scale norm ``fn`` (rmsnorm_quant, fused_add_rmsnorm_quant): its public
    function, or with ``cuda`` the CUDA JIT kernel that FLASHINFER_USE_CUDA_NORM=1 selects (``_fi_cuda_norms``)."""
    def build(device):
        m = _peer("flashinfer.norm", "flashinfer-python")
        _needs_cuda(device)
        if cuda:
            module, pdl = _fi_cuda_norms(m, device)
            call, tail = getattr(module, fn), (EPS, pdl)
        else:
            call, tail = getattr(m, fn), (EPS,)

        def run(a):
            _fi_half(a["x"])
            out = _fi_fp8_out(a["x"])
            inputs = (a["x"], a["residual"]) if residual else (a["x"],)
            call(out, *inputs, a["weight"], a["scale"], *tail)
            return out, a["scale"]

        if not cuda:
            run.label = f"{fn}, " + _fi_norm_path(m, device)
        return run

    return build


for _op, _fn, _residual in (("rmsnorm_fp8quant_static", "rmsnorm_quant", False),
                            ("add_rmsnorm_fp8quant_static", "fused_add_rmsnorm_quant", True)):
    provider(_op, "flashinfer")(_fi_static(_fn, _residual, cuda=False))
    provider(_op, "flashinfer-cuda", label=f"{_fn}'s CUDA JIT kernel (FLASHINFER_USE_CUDA_NORM=1's path)")(
        _fi_static(_fn, _residual, cuda=True))


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
    provider(_op, "oink-unfused", label=_label)(_oink_unfused_fp8(_op))

for _fmt, _q in (("fp4quant", "nvfp4_quantize"), ("mxfp4quant", "mxfp4_quantize")):
    provider(f"add_rmsnorm_{_fmt}", "oink-unfused",
             label=f"oink fused_add_rmsnorm_ then oink {_q}")(_oink_unfused_add_rms(_q))
    provider(f"silu_mul_{_fmt}", "oink-unfused", label=f"torch silu * up then oink {_q}")(_oink_unfused_silu(_q))


ALL_PROVIDERS = ("oink", "oink-unfused", "quack", "liger", "flashinfer", "flashinfer-cuda", "torch", "torch.compile")


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
