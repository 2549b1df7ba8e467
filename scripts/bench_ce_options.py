"""Cross-entropy with options against without, and against the copy ceiling (#35's target: with options
>= 0.90 of copy for cases >= 256 MB, and no more than 5% slower than without them).

    python3 scripts/bench_ce_options.py [--shapes 4096x128256,8192x151936,2048x256000] [--dtype bfloat16]
        [--modes forward,backward,fwd_bwd,fwd_bwd_] [--sets plain,softcap,zcap,softcap@plain] [--scale 4]

Per shape and mode (forward, backward, fwd_bwd; ``fwd_bwd_``: the fused op in place, as
``oink.linear_cross_entropy`` runs it, over a copy of the logits): the median of CUDA-event timings of the
kernel launch (the op's launch prepared once, ``oink.dispatch.prepare``: no checks) without options and with
each option set, its bandwidth as a fraction of a device copy's (bytes read + written a second, measured on
the same logits), and its time over the plain kernel's (the first set; "plain" leads by default). Every case
is larger than L2, so no flush is needed. A set named ``NAME@plain`` runs at the launch the plain kernel
takes for the shape and mode (forced as ``oink.tune.trial`` forces a launch), where the options otherwise take
their own (``option_launch``). ``--scale``: the logits' standard deviation (30: as wide as Gemma-2's softcap)."""
from __future__ import annotations

import argparse
import statistics

import torch

OPTION_SETS = {
    "plain": {},
    "smooth": dict(label_smoothing=0.1),
    "zloss": dict(z_loss=1e-4),
    "softcap": dict(softcap=30.0),
    "zcap": dict(z_loss=1e-4, softcap=30.0),
    "all": dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0),
}
DEFAULT_SETS = "plain,smooth,zloss,softcap,all"


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


def _args(mode: str, x, t, dloss, opts: dict, arch: str) -> dict:
    """The op's arguments for ``mode`` with ``opts`` (the backward's lse from the forward with them)."""
    from oink.dispatch import prepare

    a = dict(logits=x, target=t, ignore_index=-100, **opts)
    if mode == "backward":
        a.update(dloss=dloss, lse=prepare("cross_entropy_forward", arch, a)(a)[1])
    elif mode == "fwd_bwd":
        a.update(dloss=dloss, return_lse=True)
    elif mode == "fwd_bwd_":
        a.update(dloss=dloss)
    return a


def _time_set(mode: str, name: str, x, t, dloss, arch: str) -> float:
    """ms of ``mode`` with option set ``name`` (``NAME@plain``: at the plain kernel's launch)."""
    from oink.dispatch import prepare
    from oink.kernels.compile import CACHE
    from oink.tune import trial

    base, at_plain = name.removesuffix("@plain"), name.endswith("@plain")
    op = f"cross_entropy_{mode}"
    forced = {}
    if at_plain:  # the key the plain kernel looks up, and the launch it runs there (a table entry's or the rule's)
        a = _args(mode, x, t, dloss, {}, arch)
        CACHE.clear_used()
        with trial() as looked_up:
            prepare(op, arch, a)
        (key,), (launch,) = looked_up.seen, CACHE.used_launches()
        forced = {key: launch}
    with trial(forced):
        a = _args(mode, x, t, dloss, OPTION_SETS[base], arch)
        launch = prepare(op, arch, a)
        return _median_ms(lambda: launch(a))


def main() -> None:
    from oink.dispatch import device_arch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x128256,8192x151936,2048x256000,16384x32000")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--modes", default="forward,backward,fwd_bwd")
    p.add_argument("--sets", default=DEFAULT_SETS, help=f"of {', '.join(OPTION_SETS)}; NAME@plain: the plain launch")
    p.add_argument("--scale", type=float, default=4.0, help="the logits' standard deviation")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    arch = device_arch(torch.cuda.current_device())[0]
    sets = args.sets.split(",")
    for name in sets:
        if name.removesuffix("@plain") not in OPTION_SETS:
            p.error(f"--sets: {name!r} is none of {', '.join(OPTION_SETS)} (or NAME@plain)")
    print(f"{torch.cuda.get_device_name()} ({arch}), {args.dtype}, logits' deviation {args.scale:g}")
    print(f"{'shape':>14} {'mode':>8} {'options':>14} {'ms':>8} {'of copy':>8} {'/ ' + sets[0]:>8}")
    for shape in args.shapes.split(","):
        M, V = (int(v) for v in shape.split("x"))
        x = torch.randn(M, V, device="cuda", dtype=dtype) * args.scale
        t = torch.randint(0, V, (M,), device="cuda")
        t[::7] = -100
        dloss = torch.rand(M, device="cuda")
        dx = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        copy_ms = _median_ms(lambda: dx.copy_(x))
        copy_bw = 2 * nbytes / copy_ms  # bytes a millisecond, read and written
        for mode in args.modes.split(","):
            moved = nbytes if mode == "forward" else 2 * nbytes
            first_ms = None
            for name in sets:
                # in place: over a copy (each launch writes dlogits over it; the next reads those: finite values)
                xs = dx.copy_(x) if mode == "fwd_bwd_" else x
                ms = _time_set(mode, name, xs, t, dloss, arch)
                first_ms = first_ms or ms
                print(f"{shape:>14} {mode:>8} {name:>14} {ms:8.3f} {moved / ms / copy_bw:8.3f} {ms / first_ms:8.3f}",
                      flush=True)
        del x, dx


if __name__ == "__main__":
    main()
