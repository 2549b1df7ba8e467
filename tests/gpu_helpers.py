"""Helpers shared by the GPU test files: the device's arch, poisoned-output comparisons, rows."""
from __future__ import annotations

import torch

from pytest_oink.tolerances import tolerance

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MS = (1, 3, 128, 4097, 65536)
MAX_ELEMS = 2**30  # keeps one case's tensors (and their fp32 reference) within a few GB


def shapes_within(ms, ns, limit: int = MAX_ELEMS) -> list[tuple[int, int]]:
    """(M, N) of ms x ns with M * N at most ``limit``: the cases that fit, parametrized (never skipped)."""
    return [(M, N) for M in ms for N in ns if M * N <= limit]


def cuda_arch():
    from oink.dispatch import device_arch

    return device_arch(torch.cuda.current_device())[0]


def poison_allocator(nbytes: int = 1 << 26) -> None:
    """Fill memory the caching allocator hands out next with 0xFF bytes (NaN in every float dtype): a
    kernel's fresh outputs then show any element it leaves unwritten. ``nbytes``: at least the outputs'
    bytes (the large pool); the small pool (blocks under 1 MiB) is filled too."""
    junk = [torch.full((max(nbytes, 1 << 21),), 0xFF, dtype=torch.uint8, device="cuda")]
    junk += [torch.full((1 << 19,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del junk


def kernel(op: str, **args):
    """``op``'s kernel on this GPU, launched once with no checks (``oink.dispatch.launch``)."""
    import oink.ops  # noqa: F401  (the declarations name each op's kernels to dispatch)
    from oink.dispatch import launch

    return launch(op, cuda_arch(), **args)


def assert_close_poisoned(actual, expected, dtype, what):
    atol, rtol = tolerance("rmsnorm", dtype)
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten output?)"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def random_rows(M, N, dtype, padded, gen):
    width = N + (8 if padded else 0)
    return torch.randn(M, width, device="cuda", dtype=torch.float32, generator=gen).to(dtype)[:, :N]


def close_family(actual, expected, family, dtype, what):
    atol, rtol = tolerance(family, dtype)
    assert not torch.isnan(actual).any(), f"{what}: NaN (unwritten output?)"
    scale = max(1.0, expected.float().abs().max().item()) if family == "weight_grad" else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def run_backward_poisoned(x, w, dout, rstd, dres, has_bias, mean=None):
    """The norm backward (LayerNorm with ``mean``) launched as the op launches it, its dx, partials and
    dweight/dbias from a poisoned allocator: -> (dx, dweight, dbias)."""
    M, N = x.shape
    poison_allocator(M * N * x.element_size() + (1 << 26))
    if mean is None:
        return kernel("rmsnorm_backward", x=x, weight=w, dout=dout, rstd=rstd, dresidual_out=dres,
                      has_bias=has_bias)[:3]
    bias = torch.zeros_like(w) if has_bias else None  # only whether there is one is read
    return kernel("layernorm_backward", dout=dout, x=x, weight=w, rstd=rstd, mean=mean, bias=bias)


def scales_exact(sf, esf):
    """Scales exact except where fp32 arithmetic and the fp64 reference put a block's amax on
    opposite sides of an E4M3 rounding boundary: measured 0-3 blocks in 0.5-3.8 million
    (H100), always one step. Allowed: at most 1e-5 of the blocks, one step each."""
    diff = sf.view(torch.uint8).int() - esf.view(torch.uint8).int()
    n = int((diff != 0).sum())
    assert n <= max(1, diff.numel() // 100_000), f"{n} of {diff.numel()} scales differ"
    assert int(diff.abs().max()) <= 1, "a scale is more than one E4M3 step off"


# ---- FP8 codes: a fused op (fast rstd or exp, its own reduction order) lands within a step of the reference
def fp8_codes(q):
    return q.view(torch.uint8)


def fp8_steps(a, b):
    """|ordinal difference| of e4m3 codes (-0 and +0 equal)."""
    def ordinal(q):
        u = fp8_codes(q).int()
        return torch.where(u >= 128, -(u - 128), u)
    return (ordinal(a) - ordinal(b)).abs()


def ue8m0_scales_exact(s, s_ref):
    """Power-of-two scales: exact, but where the fused op's amax (fast rstd or exp, its own
    reduction order: within ~1e-6 relative) and the reference's fall on opposite sides of a power
    of two times 448; a log-uniform amax lands within 1e-6 of one in ~1.5e-6 of groups. Allowed:
    at most 1e-4 of the groups (at least 1), each one power of two up or down. Returns where the
    scales agree."""
    ratio = s / s_ref
    moved = ratio != 1  # a NaN scale counts as moved, then fails the power-of-two check
    n = int(moved.sum())
    assert n <= max(1, s.numel() // 10_000), f"{n} of {s.numel()} ue8m0 scales differ"
    assert bool(((ratio[moved] == 2) | (ratio[moved] == 0.5)).all()), "a ue8m0 scale is more than a power of two off"
    return ~moved


def assert_fp8_within_a_step(q, s, q_ref, s_ref, args):
    steps = fp8_steps(q, q_ref)
    if args.get("ue8m0"):  # a scale a power of two away moves its whole group: judge groups whose scales agree
        same_scale = ue8m0_scales_exact(s, s_ref)
        G = args["group_size"]
        keep = same_scale.reshape(s.shape[0], -1).repeat_interleave(G, dim=1).reshape(steps.shape)
        steps = steps[keep]
    else:
        rel = ((s - s_ref).abs() / s_ref.abs()).max().item()  # NaN fails the comparison
        assert rel <= 1e-2, f"scales off by {rel}"
    assert steps.max().item() <= 1 and (steps == 0).float().mean().item() >= 0.999
