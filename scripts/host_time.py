"""Host time of one eager call, per op and provider: CALLS calls back to back, then one sync;
microseconds per call (at M = 1 the GPU finishes each kernel long before the next launch, so
this is the host's cost). Every op of the bench specs through Oink's public API, next to the
peers that have it. Prints a Markdown table (the #12 launch table in bench/RESULTS.md).

    python3 scripts/host_time.py [N] [M ...]        (default N=4096, M = 1 128)
"""
from __future__ import annotations

import sys
import time

import torch

from pytest_oink.providers import PROVIDERS, SPECS, Unavailable, build

CALLS = 400
PEERS = ("quack", "liger", "flashinfer")


def host_us(fn, a) -> float:
    for _ in range(20):  # compile and warm every cache first
        fn(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn(a)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / CALLS * 1e6


def main(N: int = 4096, Ms=(1, 128)) -> None:
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, N={N}, bf16, {CALLS} calls then one sync")
    print("| op | M | " + " | ".join(("oink",) + PEERS) + " |")
    print("|---|---|" + "---|" * (1 + len(PEERS)))
    for op, spec in SPECS.items():
        if N % spec.block:
            continue
        for M in Ms:
            gen = torch.Generator(device=dev).manual_seed(0)
            a = spec.make_inputs(M, N, torch.bfloat16, dev, gen)
            cells = []
            for name in ("oink",) + PEERS:
                if (op, name) not in PROVIDERS:
                    cells.append("")
                    continue
                try:
                    cells.append(f"{host_us(build(op, name, dev), a):.1f}")
                except Unavailable as e:
                    cells.append(f"n/a ({str(e)[:30]})")
                except Exception as e:  # noqa: BLE001  (a peer's failure is a cell, not the end of the table)
                    cells.append(f"error {type(e).__name__}")
            print(f"| {op} | {M} | " + " | ".join(cells) + " |", flush=True)
    x, w, r = (torch.randn(1, N, device=dev, dtype=torch.bfloat16) for _ in range(3))
    w = w[0]
    ops = torch.ops.oink
    print(f"| torch.ops.oink.rmsnorm | 1 | {host_us(lambda a: ops.rmsnorm(x, w, 1e-6), None):.1f} |")
    fused = ops.fused_add_rms_norm
    print(f"| torch.ops.oink.fused_add_rms_norm | 1 | {host_us(lambda a: fused(x, r, w, 1e-6), None):.1f} |")
    rms = torch.nn.functional.rms_norm
    print(f"| torch F.rms_norm | 1 | {host_us(lambda a: rms(x, (N,), w, 1e-6), None):.1f} |")
    print(f"| torch.empty_like (floor) | 1 | {host_us(lambda a: torch.empty_like(x), None):.1f} |")


if __name__ == "__main__":
    args = [int(v) for v in sys.argv[1:]]
    main(args[0] if args else 4096, tuple(args[1:]) or (1, 128))
