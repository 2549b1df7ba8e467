"""oink.linear_cross_entropy (its default chunk) against Liger's fused linear cross-entropy and against its own serial
loop (``lce_overlap=False``: dweight's matmul on the main stream), forward + backward, at the training suite's heads,
in interleaved rounds (issue #35's time target; the card's power cap moves the matmuls by several percent from call
to call, so they take turns): the gradients' relative difference (and whether the serial loop's are the same bits),
per shape the median times and the median (min, max) of the rounds' ratios, then a profile of one call each (kernel
time by kernel name).

    python3 scripts/lce_vs_liger.py
"""
import statistics

import torch

import oink
from oink import config
from lce_chunks import _fwd_bwd, _timed  # this directory's (run as a script)
from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

SHAPES = [(16384, 4096, 128256), (32768, 4096, 128256), (16384, 2304, 256000), (16384, 3584, 151936),
          (16384, 5120, 151936), (4096, 4096, 128256)]


def _serial(fn):
    def run():
        with config.override(lce_overlap=False):
            return fn()
    return run


def _ratios(a, b):
    r = [x / y for x, y in zip(a, b)]
    return f"{statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"


def profile(fn, label):
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:70]
            c, tot = rows.get(k, (0, 0.0))
            rows[k] = (c + 1, tot + e.device_time)
    total = sum(v[1] for v in rows.values())
    print(f"  [{label}] kernels total {total/1e3:.2f} ms")
    for k, (c, tot) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:7]:
        print(f"     {tot/1e3:8.3f} ms {c:4d}x  {k}")


def main() -> None:
    for M, H, V in SHAPES:
        softcap = 30.0 if V == 256000 else None
        h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        t = torch.randint(0, V, (M,), device="cuda")
        t[::10] = -100
        kw = {} if softcap is None else dict(softcap=softcap)
        fo = _fwd_bwd(lambda h_, w_, t_: oink.linear_cross_entropy(h_, w_, t_, **kw), h, w, t)
        fs = _serial(fo)
        fl = _fwd_bwd(lambda h_, w_, t_: liger(h_, w_, t_, **kw), h, w, t)
        go, gs, gl = fo(), fs(), fl()
        same = all(torch.equal(a, b) for a, b in zip(go, gs))
        for a, b, nm in zip(go, gl, ("dh", "dw")):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            print(f"{M}x{H}x{V} cap={softcap} {nm} rel diff oink vs liger {err:.2e}; serial loop's bits: {same}")
        del go, gs, gl
        runs = {"oink": fo, "serial": fs, "liger": fl}
        for f in runs.values():
            f()
        times = {k: [] for k in runs}
        for r in range(8):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                times[k].append(_timed(runs[k], iters=3, warmup=0))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{M}x{H}x{V} cap={softcap}: oink {med['oink']:.2f} ms  serial {med['serial']:.2f} ms  liger "
              f"{med['liger']:.2f} ms; oink / serial {_ratios(times['oink'], times['serial'])}, oink / liger "
              f"{_ratios(times['oink'], times['liger'])}", flush=True)
        profile(fs, "oink, serial")
        profile(fl, "liger")
        del h, w, t, fo, fs, fl
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
