"""Host cost of the kernel launch path's Python side on a CPU, no GPU: every compiled function is a no-op
(``cute.compile`` replaced: no kernel is compiled, the launcher around it is kept), streams are 0, tensors are CPU
tensors. Per op, the
two ways ``oink.dispatch.run`` launches a kernel route: with the route's prepared launch (``cached``: what
an eager ``oink.<op>`` or ``torch.ops.oink`` call takes once its layout is known) and without one
(``per call``: the route not cached, e.g. under DEBUG logging). Interleaved rounds, min us per call.
``--public``: the whole public call instead, ``oink.<op>(...)`` as a user makes it (argument checks, the
layout key, the route and its prepared launch), CPU tensors routed to the kernel path as on an sm_90a GPU.
Ops a tree does not declare are skipped, so the same script compares an older tree (``PYTHONPATH=TREE``),
one process a tree, taking turns.

    python3 scripts/host_launch_cpu.py [--tvm-ffi 0|1] [--public] [filter]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def patch():
    """No-op compiled functions, stream 0, a fixed SM count (the host's part only)."""
    from oink import config, dispatch, ops  # noqa: F401  (the declarations name the kernel modules)
    from oink.kernels import compile as compile_mod
    from oink.kernels import cross_entropy_ops, fp8_ops, nvfp4_ops, rmsnorm_ops, softmax_ops

    def noop(*args):
        return None

    compile_mod.cute.compile = lambda kernel, *fake, options: noop
    rmsnorm_ops.resident_clusters = lambda index, cluster_n: 132 // cluster_n
    for mod in (rmsnorm_ops, softmax_ops, fp8_ops, nvfp4_ops, cross_entropy_ops, compile_mod):
        if hasattr(mod, "current_stream"):
            mod.current_stream = lambda device: 0
        if hasattr(mod, "stream_of"):
            mod.stream_of = lambda device: (lambda: 0)
    config.reload()
    compile_mod.CACHE.clear()
    return dispatch


def cases():
    import torch

    bf = torch.bfloat16
    M, N = 8, 1024
    x, w, r = torch.randn(M, N, dtype=bf), torch.randn(N, dtype=bf), torch.randn(M, N, dtype=bf)
    xt = torch.randn(N, M, dtype=bf).t()  # strided: a copy before the kernel
    rstd, lse = torch.rand(M), torch.randn(M)
    logits, target = torch.randn(M, 4096, dtype=bf), torch.randint(0, 4096, (M,))
    fp8 = dict(scale=None, group_size=128, column_major_scales=False, ue8m0=False, scale_ub=None)
    ce = dict(target=target, ignore_index=-100, weight=None)
    return {
        "rmsnorm_forward": dict(x=x, weight=w, eps=1e-6),
        "rmsnorm_forward+res": dict(x=x, weight=w, bias=None, residual=r, eps=1e-6, store_rstd=True, out_dtype=None,
                                    residual_dtype=None, weight_offset=0.0),
        "rmsnorm_forward/strided": dict(x=xt, weight=w, eps=1e-6),
        "fused_add_rmsnorm_": dict(x=x, residual=r, weight=w, eps=1e-6),
        "layernorm": dict(x=x, weight=w, bias=None, eps=1e-6, return_rstd=True, return_mean=True),
        "rmsnorm_backward": dict(x=x, weight=w, dout=r, rstd=rstd, dresidual_out=None, has_bias=False,
                                 has_residual=False, weight_offset=0.0),
        "softmax_forward": dict(x=x),
        "softmax_forward/strided": dict(x=xt),
        "softmax_backward": dict(dy=r, y=x),
        "cross_entropy_forward": dict(logits=logits, reduction="none", lse_partial=None, target_logit=None, **ce),
        "cross_entropy_forward/mean": dict(logits=logits, reduction="mean", lse_partial=None, target_logit=None, **ce),
        "cross_entropy_backward": dict(dloss=torch.randn(M), logits=logits, lse=lse, **ce),
        "cross_entropy_backward_": dict(dloss=torch.randn(M), logits=logits, lse=lse, **ce),
        "cross_entropy_fwd_bwd": dict(dloss=torch.randn(M), logits=logits, return_lse=True, **ce),
        "cross_entropy_fwd_bwd/scalar": dict(dloss=torch.tensor(1.0), logits=logits, **ce),
        "cross_entropy_fwd_bwd_": dict(dloss=torch.randn(M), logits=logits, target=target, ignore_index=-100),
        "fp8_quantize": dict(x=x, **fp8),
        "fp8_quantize/static": dict(x=x, **{**fp8, "scale": torch.tensor([2.0]), "group_size": 0}),
        "rmsnorm_fp8quant": dict(x=x, weight=w, eps=1e-6, return_y=False, **fp8),
        "nvfp4_quantize": dict(x=x, global_scale=torch.tensor([2.0]), swizzled=True),
        "add_rmsnorm_fp4quant": dict(x=x, residual=r, weight=w, global_scale=torch.tensor([2.0]), eps=1e-6,
                                     swizzled=False, return_y=False),
    }


def public_cases() -> dict:
    """Public calls (the ops whose checks or keys a change touched, and two others to compare with)."""
    import torch

    import oink

    bf = torch.bfloat16
    M, N = 8, 1024
    x, w, r = torch.randn(M, N, dtype=bf), torch.randn(N, dtype=bf), torch.randn(M, N, dtype=bf)
    logits, target = torch.randn(M, 4096, dtype=bf), torch.randint(0, 4096, (M,))
    dloss, lse, scale = torch.randn(M), torch.randn(M), torch.tensor([2.0])
    return {
        "rmsnorm_forward": lambda: oink.rmsnorm_forward(x, w),
        "softmax_forward": lambda: oink.softmax_forward(x),
        "fused_add_rmsnorm_": lambda: oink.fused_add_rmsnorm_(x, r, w),
        "add_rmsnorm_fp4quant": lambda: oink.add_rmsnorm_fp4quant(x, r, w, scale),
        "cross_entropy_forward": lambda: oink.cross_entropy_forward(logits, target),
        "cross_entropy_backward": lambda: oink.cross_entropy_backward(dloss, logits, target, lse),
        "cross_entropy_fwd_bwd": lambda: oink.cross_entropy_fwd_bwd(dloss, logits, target),
    }


def route_cpu_to_kernels(dispatch) -> None:
    """CPU tensors take the kernel route an sm_90a GPU would (its checks decide), for ``--public``."""
    def route(op, device, args):
        module = dispatch._kernel_module(op)
        if module is None:
            return dispatch.Route(op, "reference", "no kernel")
        why = module.CHECKS[op](args, "sm_90a")
        return dispatch.Route(op, "reference", why, "sm_90a") if why else dispatch.Route(op, "kernel", "cpu", "sm_90a")
    dispatch._route_device = route


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tvm-ffi", default=None, help="OINK_TVM_FFI for this run")
    p.add_argument("--public", action="store_true", help="time the public oink.<op> calls")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("filter", nargs="?", default="")
    args = p.parse_args()
    if args.tvm_ffi is not None:
        os.environ["OINK_TVM_FFI"] = args.tvm_ffi
    os.environ["OINK_CACHE_DIR"] = "0"
    import torch

    torch.set_num_threads(1)
    dispatch = patch()
    from oink import config

    print(f"tvm_ffi={config.get().tvm_ffi}", file=sys.stderr)
    calls = {}
    if args.public:
        import oink

        route_cpu_to_kernels(dispatch)
        for name, f in public_cases().items():
            if args.filter in name and hasattr(oink, name):
                calls[(name, "public")] = f
    for name, a in {} if args.public else cases().items():
        op = name.split("/")[0].split("+")[0]
        if args.filter not in name or op not in dispatch.KERNEL_MODULES:  # (an op an older tree lacks)
            continue
        route = dispatch.Route(op, "kernel", "cpu", "sm_90a")
        planned = dispatch.with_plan(route, a)
        calls[(name, "cached")] = (lambda r=planned, a=a: dispatch.run(r, a)) if planned.plan is not None else None
        calls[(name, "per call")] = lambda r=route, a=a: dispatch.run(r, a)
    live = {k: f for k, f in calls.items() if f is not None}
    for f in live.values():
        for _ in range(50):
            f()
    for name, mode in live if args.public else ():  # the kernel's prepared launch, not the reference, was timed
        routes = getattr(getattr(getattr(oink, name), "op", None), "_routes", None)
        if routes is not None and not all(r.backend == "kernel" and r.plan is not None for r in routes.values()):
            raise SystemExit(f"{name}: not on the kernel route ({[r.why for r in routes.values()]})")
    times = {k: [] for k in live}
    for _ in range(args.rounds):
        for k, f in live.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            times[k].append((time.perf_counter() - t0) / args.calls * 1e6)
    modes = ("public",) if args.public else ("cached", "per call")
    print(f"{'op':32s} " + " ".join(f"{m:>9s}" for m in modes) + f"  (us, min of {args.rounds} rounds of {args.calls})")
    for name in dict.fromkeys(k[0] for k in calls):
        cells = [f"{min(times[(name, m)]):9.2f}" if (name, m) in times else f"{'-':>9s}" for m in modes]
        print(f"{name:32s} {' '.join(cells)}")


if __name__ == "__main__":
    main()
