"""On a GPU: where the host time of an eager call goes. First issue #12's targets side by side:
Oink's rmsnorm calls (public and torch.ops) against Quack's rmsnorm_fwd, measured in interleaved
rounds (the shared host's slow spells fall on every call alike). Then for rmsnorm_forward the
pieces: the cached launch plan alone, the layout key, one output allocation, torch.ops.oink.rmsnorm
with and without inference mode, and a profile of Quack's rmsnorm_fwd. Then for each op (its bench
spec's call, as the launch suite makes it, M = 128, N = 4096 bf16): the per-call host time (400
calls, then one sync), then a cProfile of 1000 calls, the functions with the most own time.

    python3 scripts/host_profile.py [op,op,...] > host_profile.txt
"""
import cProfile
import io
import pstats
import sys
import time

import torch

import oink
from oink import declare
from pytest_oink.providers import SPECS


def host_us(fn, calls=400, rounds=5):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def interleaved_us(calls: dict, n=200, rounds=15) -> dict:
    """Host us per call of each function, measured in alternating rounds (n calls, then one sync) so
    that a slow spell of the shared host falls on every function alike: (min, median) over rounds."""
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: (min(t), sorted(t)[len(t) // 2]) for name, t in times.items()}


def versus_quack(M=128, N=4096):
    """Issue #12's host targets, interleaved: Oink's public and torch.ops calls against Quack's."""
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    calls = {"oink.rmsnorm_forward": lambda: oink.rmsnorm_forward(x, w),
             "torch.ops.oink.rmsnorm": lambda: torch.ops.oink.rmsnorm(x, w, 1e-6),
             "oink.fused_add_rmsnorm_": lambda: oink.fused_add_rmsnorm_(x, r, w),
             "torch.ops.oink.fused_add_rms_norm": lambda: torch.ops.oink.fused_add_rms_norm(x, r, w, 1e-6),
             "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6),
             "torch.empty_like (floor)": lambda: torch.empty_like(x)}
    try:
        from quack.rmsnorm import rmsnorm_fwd

        calls["quack rmsnorm_fwd"] = lambda: rmsnorm_fwd(x, w, eps=1e-6)
        calls["quack rmsnorm_fwd + residual"] = lambda: rmsnorm_fwd(x, w, residual=r, eps=1e-6)
    except Exception as e:  # noqa: BLE001  (Quack is optional)
        print(f"  quack: {type(e).__name__}: {e}")
    got = interleaved_us(calls)
    print(f"interleaved, M={M}, N={N} bf16, us per call (min / median of 15 rounds of 200 calls):")
    for name, (lo, med) in got.items():
        print(f"  {name}: {lo:.2f} / {med:.2f}")


def profile(fn, calls=1000, top=14):
    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return "\n".join(lines[start:])


def pieces(M=128, N=4096):
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    op = oink.rmsnorm_forward.op
    a = {**op.defaults, "x": x, "weight": w}
    key = declare._eager_key(a.values())
    route = op._checked_route(a, a, key)
    print(f"  route: {route}; plan: {route.plan is not None}")
    if route.plan is not None:
        print(f"  plan alone: {host_us(lambda: route.plan(a)):.2f} us")
    print(f"  eager verdict and layout key: {host_us(lambda: declare._eager_key(a.values())):.2f} us")
    print(f"  checked route (cached): {host_us(lambda: op._checked_route(a, a, key)):.2f} us")
    print(f"  torch.empty [M, N]: {host_us(lambda: torch.empty((M, N), device=x.device, dtype=x.dtype)):.2f} us")
    print(f"  torch.empty_like: {host_us(lambda: torch.empty_like(x)):.2f} us")
    print(f"  torch.ops.oink.rmsnorm: {host_us(lambda: torch.ops.oink.rmsnorm(x, w, 1e-6)):.2f} us")
    with torch.inference_mode():  # as vLLM calls it: no autograd step in the dispatcher
        print(f"  torch.ops.oink.rmsnorm, inference mode: {host_us(lambda: torch.ops.oink.rmsnorm(x, w, 1e-6)):.2f} us")
    try:
        from quack.rmsnorm import rmsnorm_fwd

        print("  quack rmsnorm_fwd profile:\n" + profile(lambda: rmsnorm_fwd(x, w, eps=1e-6)))
    except Exception as e:  # noqa: BLE001  (Quack is optional)
        print(f"  quack: {type(e).__name__}: {e}")


def main():
    print("card:", torch.cuda.get_device_name(), "torch", torch.__version__)
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else ["rmsnorm_forward", "layernorm", "rmsnorm_backward",
                                                             "fp8_quantize", "nvfp4_quantize", "cross_entropy_forward",
                                                             "add_rmsnorm_fp8quant"]
    versus_quack(M=1)
    versus_quack(M=128)
    print("rmsnorm_forward pieces (M=128, N=4096 bf16):")
    pieces()
    for name in ops:
        spec = SPECS[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        a = spec.make_inputs(128, 4096, torch.bfloat16, torch.device("cuda"), gen)
        call = lambda: spec.oink(oink, a)  # noqa: E731
        print(f"\n== {name}: {host_us(call):.2f} us per eager call")
        print(profile(call))


if __name__ == "__main__":
    main()
