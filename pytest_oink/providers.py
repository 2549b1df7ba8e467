"""The builders of Oink, torch eager, torch.compile and the peers for each op (registered in
``registry``: (op, provider) -> a callable builder), and the per-op benchmark specs.

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

# the spec type and the gate's views (oink.measure.gate: the tuner builds its specs there too), the registry
from oink.measure.gate import GATE_VIEWS, OpSpec, Unavailable, spec_of  # noqa: F401
from oink.measure.gate import _fp4_code_steps, _fp8_code_steps, _mx_block_ratios  # noqa: F401
from oink.measure.gate import reference_module as _R

from . import training
from .registry import LABELS, PROVIDERS, provider  # noqa: F401
from .registry import compiled as _compiled
from .registry import needs_cuda as _needs_cuda
from .registry import peer as _peer

EPS = 1e-6  # the bench entries' (oink/reference/bench.py)


def specs() -> dict:
    """``SPECS``: each bench entry's spec, then the training suite's, built once (importing the entries,
    which import torch); Oink, torch eager and torch.compile registered as each op's providers."""
    built = globals().get("SPECS")
    if built is None:
        from oink.reference import BENCH

        _ENTRIES.update(BENCH)
        built = {op: spec_of(b) for op, b in BENCH.items()}
        for op in built:
            for name, builder in (("oink", _oink_builder), ("torch", _torch_builder),
                                  ("torch.compile", _compile_builder)):
                PROVIDERS.setdefault((op, name), builder(op))  # one registered before stays
        built.update(training.register())  # the training suite's providers too
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
        if specs()[op].mutates == ("x", "residual") and device.type != "cuda":
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


# ---- the fused QK norm + rotary embedding's peers: their own module (registered on import)
from . import rope_peers  # noqa: E402,F401

ALL_PROVIDERS = ("oink", "oink-unfused", "quack", "liger", "flashinfer", "flashinfer-cuda", "vllm", "torch",
                 "torch.compile")


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

