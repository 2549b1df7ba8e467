"""FlashInfer's builders (flashinfer-python: its norms and FP8 ops; ``flashinfer-cuda``: the CUDA JIT path of its
static-scale norms) for the ops FlashInfer has, and refusals for those it has no equivalent of. Registered by
``pytest_oink.peers.register``."""
from __future__ import annotations

from oink.measure.gate import Unavailable

from ..registry import EPS, Peer, needs_cuda, peer

FLASHINFER = Peer("flashinfer")


@FLASHINFER.serves("rmsnorm_forward")
def _rms(device):
    needs_cuda(device)
    m = peer("flashinfer.norm", "flashinfer-python")
    return lambda a: (m.rmsnorm(a["x"], a["weight"], EPS),)


@FLASHINFER.serves("layernorm", label="weight and bias cast to fp32 in the call (FlashInfer takes fp32 only)")
def _ln(device):
    needs_cuda(device)
    m = peer("flashinfer.norm", "flashinfer-python")
    return lambda a: (m.layernorm(a["x"], a["weight"].float(), a["bias"].float(), EPS),)


@FLASHINFER.serves("fused_add_rmsnorm_")
def _fused(device):
    needs_cuda(device)
    m = peer("flashinfer.norm", "flashinfer-python")

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
def _half(x):
    import torch

    if x.dtype not in (torch.float16, torch.bfloat16):
        raise Unavailable(f"FlashInfer's norms and silu_and_mul take float16 and bfloat16 only, not {x.dtype}")


def _fp8_out(x):
    import torch

    return torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)


def _norm_path(m, device) -> str:
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


def _cuda_norms(m, device):
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
    pdl = getattr(peer("flashinfer.utils", "flashinfer-python"), "device_support_pdl", None)
    return module, bool(pdl(device)) if pdl else False


def _group_quant(q):
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


FLASHINFER.serves("fp8_quantize")(_refuses(
    "FlashInfer has no per-token dynamic FP8 quantizer (per_token_group_quant_8bit with group_size=N would hold "
    "a whole row in one tile, with another scale floor)"))
FLASHINFER.serves("rmsnorm_fp8quant")(_refuses(
    "FlashInfer's rmsnorm_quant takes a static scale only, not per-token scales: see rmsnorm_fp8quant_static"))


@FLASHINFER.serves("fp8_quantize_group", label="per_token_group_quant_8bit (cuTile)")
def _group(device):
    q = peer("flashinfer.quantization", "flashinfer-python")
    needs_cuda(device)
    quant = _group_quant(q)
    return lambda a: quant(a["x"])


@FLASHINFER.serves("silu_mul_fp8quant",
          label="unfused: silu_and_mul, then per_token_group_quant_8bit (the product rounded to x's dtype between)")
def _silu_group(device):
    act = peer("flashinfer.activation", "flashinfer-python")
    q = peer("flashinfer.quantization", "flashinfer-python")
    needs_cuda(device)
    quant = _group_quant(q)

    def run(a):
        _half(a["x"])
        return quant(act.silu_and_mul(a["x"]))

    return run


@FLASHINFER.serves("add_rmsnorm_fp8quant",
          label="fused_add_rmsnorm_fp8_block_quant: also writes y (x's dtype; no option to skip it); scales "
                "column-major, M padded to 4 (DeepGEMM's TMA layout), compared as their [M, N/128] view")
def _add_block(device):
    m = peer("flashinfer.norm", "flashinfer-python")
    needs_cuda(device)
    if not hasattr(m, "fused_add_rmsnorm_fp8_block_quant"):
        raise Unavailable("this flashinfer-python has no fused_add_rmsnorm_fp8_block_quant "
                          "(flashinfer-ai/flashinfer#4480, after 0.6.18)")

    def run(a):
        import torch

        x = a["x"]
        _half(x)
        M, N = x.shape
        out, normed = _fp8_out(x), torch.empty_like(x)
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


def _static(fn: str, residual: bool, cuda: bool):
    """A builder for FlashInfer's static-scale norm ``fn`` (rmsnorm_quant, fused_add_rmsnorm_quant): its public
    function, or with ``cuda`` the CUDA JIT kernel that FLASHINFER_USE_CUDA_NORM=1 selects (``_cuda_norms``)."""
    def build(device):
        m = peer("flashinfer.norm", "flashinfer-python")
        needs_cuda(device)
        if cuda:
            module, pdl = _cuda_norms(m, device)
            call, tail = getattr(module, fn), (EPS, pdl)
        else:
            call, tail = getattr(m, fn), (EPS,)

        def run(a):
            _half(a["x"])
            out = _fp8_out(a["x"])
            inputs = (a["x"], a["residual"]) if residual else (a["x"],)
            call(out, *inputs, a["weight"], a["scale"], *tail)
            return out, a["scale"]

        if not cuda:
            run.label = f"{fn}, " + _norm_path(m, device)
        return run

    return build


for _op, _fn, _residual in (("rmsnorm_fp8quant_static", "rmsnorm_quant", False),
                            ("add_rmsnorm_fp8quant_static", "fused_add_rmsnorm_quant", True)):
    FLASHINFER.serves(_op)(_static(_fn, _residual, cuda=False))
    FLASHINFER.serves(_op, name="flashinfer-cuda",
                      label=f"{_fn}'s CUDA JIT kernel (FLASHINFER_USE_CUDA_NORM=1's path)")(
        _static(_fn, _residual, cuda=True))
