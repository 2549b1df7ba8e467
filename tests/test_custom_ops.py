"""torch.ops.oink.*: schemas, fake kernels and mutation declarations checked by opcheck;
torch.compile(fullgraph=True) sees them with no graph break; the vLLM hook's gating."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing

import oink
import oink.ops  # noqa: F401  (registers the custom ops)

GS = torch.tensor([10.0])


def op_samples():
    M, N = 5, 64
    x = lambda dt=torch.float32: torch.randn(M, N, dtype=dt)  # noqa: E731  (a closure over this scope)
    w = torch.randn(N)
    logits, target = torch.randn(M, N), torch.tensor([1, -100, 3, 0, 63])
    q, sf = oink.reference.nvfp4_quantize(x(), GS)
    qs, sfs = oink.reference.nvfp4_quantize(x(), GS, swizzled=True)
    o = torch.ops.oink
    return [
        (o.rmsnorm, (x(torch.bfloat16), torch.randn(N, dtype=torch.bfloat16), 1e-6)),
        (o.fused_add_rms_norm, (x(), x(), w, 1e-6)),
        (o.rmsnorm_forward, (x(), w, None, x(), 1e-6, True)),
        (o.rmsnorm_forward, (x(torch.float16), None, None, None, 1e-6, False)),
        (o.rmsnorm_backward, (x(), w, x(), torch.rand(M) + 0.5, x(), True)),
        (o.layernorm, (x(), w, torch.randn(N), 1e-6)),
        (o.layernorm_backward, (x(), x(), w, torch.rand(M) + 0.5, torch.randn(M), None)),
        (o.softmax_forward, (x(),)),
        (o.softmax_backward, (x(), x())),
        (o.softmax_fwd_bwd, (x(), x())),
        (o.cross_entropy_forward, (logits, target, -100, "none")),
        (o.cross_entropy_forward, (logits, target, -100, "mean")),
        (o.cross_entropy_backward, (torch.randn(M), logits, target, torch.randn(M), -100)),
        (o.cross_entropy_fwd_bwd, (torch.randn(M), logits, target, -100)),
        (o.nvfp4_quantize, (x(), GS, False)),
        (o.nvfp4_quantize, (x(torch.bfloat16), GS, True)),
        (o.nvfp4_dequantize, (q, sf, GS, False)),
        (o.nvfp4_dequantize, (qs, sfs, GS, True)),
        (o.add_rmsnorm_fp4quant, (x(), x(), w, GS, 1e-6, True, True)),
        (o.silu_mul_fp4quant, (x(), GS, False)),
        (o.mxfp4_quantize, (x(torch.bfloat16), True)),
        (o.mxfp4_dequantize, (*oink.reference.mxfp4_quantize(x()), False)),
        (o.add_rmsnorm_mxfp4quant, (x(), x(), w, 1e-6, True, True)),
        (o.silu_mul_mxfp4quant, (x(torch.bfloat16), False)),
        (o.fp8_quantize, (x(torch.bfloat16), None, 0, False, False, torch.tensor([3.0]))),
        (o.fp8_quantize, (x(), None, 64, True, True, None)),
        (o.fp8_quantize, (x(), torch.tensor([0.05]), 0, False, False, None)),
        (o.rmsnorm_fp8quant, (x(), w, 1e-6, None, 64, False, False, None, True)),
        (o.add_rmsnorm_fp8quant, (x(), x(), w, 1e-6, None, 0, False, False, None, False)),
        (o.silu_mul_fp8quant, (x(), None, 0, False, False, None)),
        # packed qkv [5, (2 + 1 + 1) * 64]: the public op (Gemma's offset) and vLLM's in place (partial GPT-J rotary)
        (o.qk_norm_rope, (x(torch.bfloat16).repeat(1, 4), 2, 1, 1, 64, 1e-6, torch.randn(64, dtype=torch.bfloat16),
                          torch.randn(64), oink.reference.rope.rope_cache(8, 64), True, torch.arange(M), 1.0)),
        (o.fused_qk_norm_rope, (x(torch.float16).repeat(1, 4), 2, 1, 1, 64, 1e-6, torch.randn(64, dtype=torch.float16),
                                torch.randn(64, dtype=torch.float16), oink.reference.rope.rope_cache(8, 32,
                                dtype=torch.float16), False, torch.arange(M))),
    ]


SAMPLES = op_samples()


@pytest.mark.parametrize("op,args", SAMPLES, ids=[f"{s[0]._qualified_op_name}-{i}" for i, s in enumerate(SAMPLES)])
def test_opcheck(op, args):
    if any(isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) for a in args):
        # opcheck's schema test compares inputs with arithmetic CPU float8 lacks ("mul_cpu_reduced_float");
        # the mutation/alias check it would do is still covered by the fake and AOT tests below.
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration",
                                                    "test_aot_dispatch_dynamic"))
    else:
        torch.library.opcheck(op, args)


def test_every_public_op_has_a_custom_op():
    names = {s[0]._qualified_op_name.split("::")[1] for s in SAMPLES}
    from oink.declare import PUBLIC

    expected = {op.op_name for op in PUBLIC.values()} | {"rmsnorm"}
    assert expected <= names


class Block(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n))

    def forward(self, x, res, logits, target):
        h = torch.ops.oink.rmsnorm(x, self.w, 1e-6)
        x2, r2 = x.clone(), res.clone()
        torch.ops.oink.fused_add_rms_norm(x2, r2, self.w, 1e-6)
        y, rstd, _ = oink.rmsnorm_forward(h, self.w, store_rstd=True)
        s = oink.softmax_forward(y)
        loss, _ = oink.cross_entropy_forward(logits, target, reduction="mean")
        q, sf = oink.nvfp4_quantize(s, GS)
        return s, x2, r2, rstd, loss, q, sf


def test_torch_compile_fullgraph_no_graph_break():
    torch._dynamo.reset()
    m = Block(64)
    args = (torch.randn(6, 64), torch.randn(6, 64), torch.randn(6, 10), torch.tensor([1, 2, 3, 4, 5, -100]))
    counts = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(m, fullgraph=True, backend=counts)
    out = compiled(*args)
    with torch.no_grad():
        eager = m(*args)
    for a, b in zip(out, eager):
        assert torch.equal(a, b)
    assert counts.frame_count == 1


def test_torch_compile_inductor_runs_the_ops():
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: torch.ops.oink.rmsnorm(x, w, 1e-6) * 2, fullgraph=True)
    x, w = torch.randn(4, 64), torch.randn(64)
    torch.testing.assert_close(f(x, w), oink.reference.rmsnorm_forward(x, w)[0] * 2)


def _run(code: str, **env):
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_OINK_RMSNORM"}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


CHECK = """
import sys, oink
first = oink.register({force})
second = oink.register({force})
import torch
import torch._dynamo.testing
print(first, second, hasattr(torch.ops.oink, 'rmsnorm') and 'oink.ops' in sys.modules, 'vllm' in sys.modules)
"""


@pytest.mark.parametrize("env,force,expected", [
    ({}, False, "False False False False"),
    ({"VLLM_USE_OINK_RMSNORM": "0"}, False, "False False False False"),
    ({"VLLM_USE_OINK_RMSNORM": "1"}, False, "True True True False"),
    ({"VLLM_USE_OINK_RMSNORM": "Yes"}, False, "True True True False"),
    ({}, True, "True True True False"),
])
def test_register_gating(env, force, expected):
    assert _run(CHECK.format(force=force), **env) == expected


def test_import_is_light():
    assert _run("import sys, oink; print('torch' in sys.modules, 'cutlass' in sys.modules)") == "False False"
