"""The fp8 suite's FlashInfer providers (pytest_oink/peers/flashinfer.py) on a CPU: without FlashInfer their rows are
skipped with the reason, and against a fake ``flashinfer`` package (plain torch, FlashInfer's arithmetic and
layouts as its 0.7 sources have them) each passes Oink's correctness gate, which proves the argument mapping
and the outputs' conversion; the same fake with the scale inverted, or the block scales in the wrong layout,
fails it."""
from __future__ import annotations

import sys

import pytest
import torch

from pytest_oink import providers
from pytest_oink.peers import flashinfer as flashinfer_builders
from pytest_oink.bench_runner import gate
from pytest_oink.providers import SPECS, Unavailable
from pytest_oink.suites import Case
from tests.helpers import BENCH, PLUGIN, _plugin_runs_see_no_gpu  # noqa: F401  (autouse: plugin runs see no GPU)

# FlashInfer's functions as plain torch: the arithmetic its kernels do (flashinfer/norm/__init__.py,
# include/flashinfer/norm.cuh, flashinfer/quantization/kernels/cutile/per_token_group_quant_8bit_cutile.py);
# FAKE_FLASHINFER=inverted hands back 448 / amax (quantizing by it) or multiplies by the static scale, and
# =row_major writes the 1 x 128 block scales row-major into the column-major buffer.
FAKE = {
    "__init__.py": "",
    "utils.py": "def device_support_pdl(device):\n    return False\n",
    "activation.py": '''
import torch


def silu_and_mul(input, out=None, enable_pdl=None):
    K = input.shape[-1] // 2
    x = input.float()
    return (torch.nn.functional.silu(x[..., :K]) * x[..., K:]).to(input.dtype)
''',
    "_fp8.py": '''
import os

import torch

MAX = 448.0


def mode():
    return os.environ.get("FAKE_FLASHINFER", "right")


def codes(t):
    return t.clamp(-MAX, MAX).to(torch.float8_e4m3fn)


def by_amax(v, amax):
    """(q, s) of v against its amax (broadcast): s = amax / 448, q = v * (1 / s); inverted: s = 448 / amax."""
    if mode() == "inverted":
        s = MAX / amax
        return codes(v / s), s
    s = amax / MAX
    return codes(v * (1.0 / s)), s


def static(v, scale):
    inv = scale.float() if mode() == "inverted" else 1.0 / scale.float()
    return codes(v * inv)


def normed(h, weight, eps):
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight.float()
''',
    "norm.py": '''
import torch

from ._fp8 import by_amax, mode, normed, static


def _use_cuda_norm(device):
    return False


def rmsnorm_quant(out, input, weight, scale, eps=1e-6, enable_pdl=None):
    out.copy_(static(normed(input.float(), weight, eps), scale))


def fused_add_rmsnorm_quant(out, input, residual, weight, scale, eps=1e-6, enable_pdl=None):
    h = input.float() + residual.float()
    residual.copy_(h.to(residual.dtype))
    out.copy_(static(normed(h, weight, eps), scale))  # the fp32 sum, v not rounded to x's dtype


def fused_add_rmsnorm_fp8_block_quant(out, block_scale, normed_out, input, residual, weight, eps=1e-6,
                                      enable_pdl=None):
    M, N = input.shape
    if N > 16384 or N % (256 if N <= 8192 else 512):
        raise RuntimeError(f"Check failed: fused_add_rmsnorm_fp8_block_quant: hidden_size {N} unsupported")
    assert block_scale.shape == (N // 128, -(-M // 4) * 4) and block_scale.is_contiguous()
    h = input.float() + residual.float()
    residual.copy_(h.to(residual.dtype))
    y = normed(h, weight, eps).to(input.dtype)
    normed_out.copy_(y)
    g = y.float().view(M, N // 128, 128)
    q, s = by_amax(g, g.abs().amax(-1, keepdim=True).clamp_min(1e-4))
    out.copy_(q.view(M, N))
    if mode() == "row_major":
        block_scale.view(-1)[: M * (N // 128)] = s.reshape(-1)
    else:
        block_scale[:, :M] = s.squeeze(-1).t()


class _CudaNorms:
    def rmsnorm_quant(self, out, input, weight, scale, eps, enable_pdl):
        rmsnorm_quant(out, input, weight, scale, eps)

    def fused_add_rmsnorm_quant(self, out, input, residual, weight, scale, eps, enable_pdl):
        fused_add_rmsnorm_quant(out, input, residual, weight, scale, eps)


def get_norm_module():
    return _CudaNorms()
''',
    "quantization.py": '''
from ._fp8 import by_amax


def per_token_group_quant_8bit(x, group_size, eps=1e-10, dst_dtype=None, column_major_scales=False,
                               scale_tma_aligned=False, scale_ue8m0=False, backend="cutile"):
    import os

    assert not (column_major_scales or scale_tma_aligned or scale_ue8m0)
    if os.environ.get("FAKE_FLASHINFER") == "no_tileiras":  # cuda-tile installed without its compiler
        raise FileNotFoundError("'tileiras' compiler not found, make sure it is available")
    M, N = x.shape
    g = x.float().view(M, N // group_size, group_size)
    q, s = by_amax(g, g.abs().amax(-1, keepdim=True).clamp_min(eps))
    return q.view(M, N), s.squeeze(-1)
''',
}

# (op, provider) of every FlashInfer row the fp8 suite gates
ROWS = [("fp8_quantize_group", "flashinfer"), ("silu_mul_fp8quant", "flashinfer"),
        ("add_rmsnorm_fp8quant", "flashinfer"), ("rmsnorm_fp8quant_static", "flashinfer"),
        ("rmsnorm_fp8quant_static", "flashinfer-cuda"), ("add_rmsnorm_fp8quant_static", "flashinfer"),
        ("add_rmsnorm_fp8quant_static", "flashinfer-cuda")]


def _drop_flashinfer_modules():
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        del sys.modules[name]


@pytest.fixture
def fake_flashinfer(tmp_path, monkeypatch):
    """The fake package first on sys.path (any real FlashInfer's modules set aside), the providers' GPU check off."""
    package = tmp_path / "fake" / "flashinfer"
    package.mkdir(parents=True)
    for name, text in FAKE.items():
        (package / name).write_text(text)
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(flashinfer_builders, "needs_cuda", lambda device: None)
    monkeypatch.delenv("FAKE_FLASHINFER", raising=False)
    yield package
    _drop_flashinfer_modules()  # before monkeypatch puts back whatever was there


def _gate(op, provider, M=6, N=256, dtype="bfloat16"):
    """The fp8 suite's gate of one row on the CPU: 3 seeds against the reference. M = 6 is not a multiple of 4,
    so FlashInfer's TMA padding of the block scales is in the way."""
    device = torch.device("cpu")
    run = providers.build(op, provider, device)
    return gate(SPECS[op], run, Case("fp8", op, M, N, dtype), getattr(torch, dtype), device)


@pytest.mark.parametrize("op,provider", ROWS)
def test_flashinfer_rows_pass_the_gate_against_the_fake(fake_flashinfer, op, provider):
    result = _gate(op, provider)
    assert result["passed"], result.get("report")
    assert sys.modules["flashinfer"].__file__.startswith(str(fake_flashinfer))  # the fake served it


@pytest.mark.parametrize("op,provider", ROWS)
def test_an_inverted_scale_convention_fails_the_gate(fake_flashinfer, monkeypatch, op, provider):
    monkeypatch.setenv("FAKE_FLASHINFER", "inverted")
    result = _gate(op, provider)
    assert not result["passed"] and "output" in result["report"], result


def test_block_scales_read_in_another_layout_fail_the_gate(fake_flashinfer, monkeypatch):
    monkeypatch.setenv("FAKE_FLASHINFER", "row_major")
    result = _gate("add_rmsnorm_fp8quant", "flashinfer")
    assert not result["passed"] and "output 1" in result["report"], result  # the codes pass, the scales don't


def test_flashinfer_refusals_are_unavailable_rows(fake_flashinfer, monkeypatch):
    # the fused block quant's width contract (N <= 16384): FlashInfer's own error, as a refusal
    with pytest.raises(Unavailable, match="refuses N=18432.*hidden_size 18432"):
        _gate("add_rmsnorm_fp8quant", "flashinfer", M=2, N=18432)
    with pytest.raises(Unavailable, match="float16 and bfloat16 only"):
        _gate("rmsnorm_fp8quant_static", "flashinfer", dtype="float32")
    # cuTile's compiler missing (as on a machine with cuda-tile but not its tileiras extra): both rows refused
    monkeypatch.setenv("FAKE_FLASHINFER", "no_tileiras")
    for op in ("fp8_quantize_group", "silu_mul_fp8quant"):
        with pytest.raises(Unavailable, match="found no compiler.*tileiras"):
            _gate(op, "flashinfer")
    monkeypatch.delenv("FAKE_FLASHINFER")
    # the modes FlashInfer has no function for: refused before FlashInfer is looked for
    for op in ("fp8_quantize", "rmsnorm_fp8quant"):
        with pytest.raises(Unavailable, match="FlashInfer"):
            providers.build(op, "flashinfer", torch.device("cpu"))


@pytest.mark.parametrize("op", ["rmsnorm_fp8quant_static", "add_rmsnorm_fp8quant_static"])
@pytest.mark.parametrize("provider", ["oink", "oink-unfused"])
def test_static_scale_entries_gate_oink(op, provider):
    spec = SPECS[op]
    assert "fp8" in spec.only_in and "flashinfer-cuda" in providers.providers_for(op)
    scale = spec.make_inputs(2, 128, torch.bfloat16, torch.device("cpu"), torch.Generator().manual_seed(0))["scale"]
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (1,)
    result = _gate(op, provider)
    assert result["passed"], result.get("report")


# Imported as "absent" even where flashinfer-python is installed: find_spec answers None for a None entry.
ABSENT = "import sys\n\nsys.modules['flashinfer'] = None\n"


def test_fp8_suite_flashinfer_rows_are_unavailable_without_it(pytester):
    pytester.makeconftest(ABSENT)
    pytester.makepyfile(BENCH)
    res = pytester.runpytest_subprocess("-rs", "--oink-suite=fp8", "--oink-providers=flashinfer,flashinfer-cuda",
                                        "--oink-configs=4x256", "--oink-run-on-cpu", *PLUGIN)
    res.assert_outcomes(skipped=9)  # 7 fp8 ops with a flashinfer row, 2 with a flashinfer-cuda row
    for reason in ("flashinfer: flashinfer-python not installed", "flashinfer-cuda: flashinfer-python not installed",
                   "flashinfer: FlashInfer has no per-token dynamic FP8 quantizer*",
                   "flashinfer: FlashInfer's rmsnorm_quant takes a static scale only*"):
        res.stdout.fnmatch_lines([f"SKIPPED *: {reason}"])
