"""Cross-entropy with options against without, and against the copy ceiling (#35's target: with options
>= 0.90 of copy for cases >= 256 MB, and no more than 5% slower than without them).

    python3 scripts/bench_ce_options.py [--shapes 4096x128256,8192x151936,2048x256000] [--dtype bfloat16]

Per shape and mode (forward, backward, fwd_bwd): the median of CUDA-event timings of the kernel launch
(the op's launch prepared once, ``oink.dispatch.prepare``: no checks) without options and with each
option set, its bandwidth as a fraction of a device copy's (bytes read + written a second, measured on
the same logits), and its time over the plain kernel's. Every case is larger than L2, so no flush is needed."""
from __future__ import annotations

import argparse
import statistics

import torch

OPTION_SETS = {
    "plain": {},
    "smooth": dict(label_smoothing=0.1),
    "zloss": dict(z_loss=1e-4),
    "softcap": dict(softcap=30.0),
    "all": dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0),
}


def _median_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    from oink.dispatch import device_arch, prepare

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x128256,8192x151936,2048x256000,16384x32000")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    arch = device_arch(torch.cuda.current_device())[0]
    print(f"{torch.cuda.get_device_name()} ({arch}), {args.dtype}")
    print(f"{'shape':>14} {'mode':>8} {'options':>8} {'ms':>8} {'of copy':>8} {'/ plain':>8}")
    for shape in args.shapes.split(","):
        M, V = (int(v) for v in shape.split("x"))
        x = torch.randn(M, V, device="cuda", dtype=dtype) * 4
        t = torch.randint(0, V, (M,), device="cuda")
        t[::7] = -100
        dloss = torch.rand(M, device="cuda")
        dx = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        copy_ms = _median_ms(lambda: dx.copy_(x))
        copy_bw = 2 * nbytes / copy_ms  # bytes a millisecond, read and written
        for mode in ("forward", "backward", "fwd_bwd"):
            moved = nbytes if mode == "forward" else 2 * nbytes
            plain_ms = None
            for name, opts in OPTION_SETS.items():
                a = dict(logits=x, target=t, ignore_index=-100, **opts)
                _, lse = prepare("cross_entropy_forward", arch, a)(a)  # this option's lse
                if mode == "backward":
                    a.update(dloss=dloss, lse=lse)
                elif mode == "fwd_bwd":
                    a.update(dloss=dloss, return_lse=True)
                launch = prepare(f"cross_entropy_{mode}", arch, a)
                ms = _median_ms(lambda: launch(a))
                plain_ms = plain_ms or ms
                print(f"{shape:>14} {mode:>8} {name:>8} {ms:8.3f} {moved / ms / copy_bw:8.3f} {ms / plain_ms:8.3f}")
        del x, dx


if __name__ == "__main__":
    main()
