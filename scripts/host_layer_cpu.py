"""Host cost of Oink's Python layer on a CPU: eager calls on inputs so small (1 x 64 fp32) that the
reference's own arithmetic is the floor; best of 5 x 3000 calls (bench/RESULTS.md, "Launch / host
cost"). On a GPU, ``pytest --oink-suite=launch`` measures the whole eager call instead."""
import time

import torch

import oink
from oink import reference as R


def per_call_us(f, n=3000):
    for _ in range(200):
        f()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)


def main():
    torch.set_num_threads(1)
    x, w, r = torch.randn(1, 64), torch.randn(64), torch.randn(1, 64)
    calls = {
        "oink.rmsnorm_forward": lambda: oink.rmsnorm_forward(x, w),
        "torch.ops.oink.rmsnorm": lambda: torch.ops.oink.rmsnorm(x, w, 1e-6),
        "oink.fused_add_rmsnorm_": lambda: oink.fused_add_rmsnorm_(x, r, w),
        "torch.ops.oink.fused_add_rms_norm": lambda: torch.ops.oink.fused_add_rms_norm(x, r, w, 1e-6),
        "oink.layernorm": lambda: oink.layernorm(x, w),
        "oink.softmax_forward": lambda: oink.softmax_forward(x),
        "reference rmsnorm_forward (floor)": lambda: R.rmsnorm_forward(x, w),
        "reference fused_add_rmsnorm_ (floor)": lambda: R.fused_add_rmsnorm_(x, r, w),
        "reference layernorm (floor)": lambda: R.layernorm(x, w),
        "reference softmax_forward (floor)": lambda: R.softmax_forward(x),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6),
    }
    for name, f in calls.items():
        print(f"{name:40s} {per_call_us(f):7.2f} us")


if __name__ == "__main__":
    main()
