"""Softmax kernels on the GPU against the fp32 reference (outputs poisoned with NaN first)."""
from __future__ import annotations

import pytest
import torch

from oink import reference as R
from pytest_oink.tolerances import tolerance
from tests.gpu_helpers import DTYPES, MS, kernel, poison_allocator, shapes_within

pytestmark = [pytest.mark.gpu, pytest.mark.sm(90)]

NS = (64, 1000, 4096, 6144, 8192, 32768, 50257, 128256, 262144)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N", shapes_within(MS, NS, 2**28))  # one case within a few GB
@pytest.mark.parametrize("mode", ["forward", "backward", "fwd_bwd"])
def test_softmax_kernels(mode, dtype, N, M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(M, N, device="cuda", generator=g) * 3).to(dtype)
    dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    y = R.softmax_forward(x)
    args, expect = {"forward": (dict(x=x), y), "backward": (dict(dy=dy, y=y), R.softmax_backward(dy, y)),
                    "fwd_bwd": (dict(dy=dy, x=x), R.softmax_fwd_bwd(dy, x))}[mode]
    poison_allocator(M * N * x.element_size())  # the output: NaN wherever the kernel leaves it unwritten
    out = kernel(f"softmax_{mode}", **args)
    assert not torch.isnan(out).any()
    atol, rtol = tolerance("softmax" if mode == "forward" else "norm_backward", dtype)
    torch.testing.assert_close(out.float(), expect.float(), atol=atol, rtol=rtol)
    if mode == "forward":  # rows sum to 1 (each output rounds by at most half an ulp of its dtype)
        sum_tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float().sum(-1), torch.ones(M, device="cuda"), atol=sum_tol, rtol=0)


# rows off 16-byte boundaries: vectors of 1, 2 and 4 elements, rows of one warp's accesses to clusters of CTAs
ODD_NS = (7, 455, 1817, 5135, 25630, 94558)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", ODD_NS)
@pytest.mark.parametrize("M", (1, 9, 1000))
@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_softmax_forward_rows_off_boundaries(layout, M, N, dtype, seed):
    """Dense rows move through aligned windows (each row's neighbours in its edge vectors); strided rows
    (another row stride than the output's) take the narrow kernel. NaN lies past the tensor's end and in the
    strided rows' gaps: a value outside the row that reached a sum or an output would show."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    wide = N + (3 if layout == "strided" else 0)
    buf = torch.full((M * wide + 64,), float("nan"), device="cuda", dtype=dtype)
    x = buf[: M * wide].view(M, wide)[:, :N]
    x.copy_((torch.randn(M, N, device="cuda", generator=g) * 3).to(dtype))
    poison_allocator(M * N * x.element_size())
    out = kernel("softmax_forward", x=x)
    assert not torch.isnan(out).any()
    atol, rtol = tolerance("softmax", dtype)
    torch.testing.assert_close(out.float(), R.softmax_forward(x).float(), atol=atol, rtol=rtol)


def test_public_api_routes_to_kernel(seed):
    import oink

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(2, 5, 4096, device="cuda", generator=g).bfloat16()
    dy = torch.randn(2, 5, 4096, device="cuda", generator=g).bfloat16()
    for op, args in (("softmax_forward", (x,)), ("softmax_backward", (dy, R.softmax_forward(x))),
                     ("softmax_fwd_bwd", (dy, x))):
        assert "kernel" in oink.explain(op, *args), op
        got = getattr(oink, op)(*args)
        atol, rtol = tolerance("softmax" if op == "softmax_forward" else "norm_backward", x.dtype)
        torch.testing.assert_close(got.float(), getattr(R, op)(*args).float(), atol=atol, rtol=rtol)
