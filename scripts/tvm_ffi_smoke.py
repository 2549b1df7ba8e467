"""On a GPU: does the TVM-FFI launch give the reference's answer, and what does an eager call cost
with it and without it (OINK_TVM_FFI=0), next to Quack's rmsnorm_fwd? Exit 1 if the TVM-FFI
launch is wrong or fails, so a script can fall back. Prints one line per measurement."""
import os
import sys
import time

import torch

import oink
from oink import config


def host_us(fn, calls=400):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    print("card:", torch.cuda.get_device_name(), "torch", torch.__version__)
    ok = True
    for mode in ("1", "0"):
        os.environ["OINK_TVM_FFI"] = mode
        cfg = config.reload()
        print(f"OINK_TVM_FFI={mode}: tvm_ffi={cfg.tvm_ffi}")
        for M, N in ((1, 4096), (128, 7168)):
            x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            res = torch.randn_like(x)
            try:
                y = oink.rmsnorm_forward(x, w)
                want = oink.reference.rmsnorm_forward(x.double(), w.double())[0]
                err = (y[0] if isinstance(y, tuple) else y).double().sub(want).abs().max().item()
                xs, rs = x.clone(), res.clone()
                oink.fused_add_rmsnorm_(xs, rs, w)
                err2 = (rs.double() - (x.double() + res.double())).abs().max().item()
            except Exception as e:  # noqa: BLE001 - report and fall back
                print(f"  M={M} N={N}: FAILED {type(e).__name__}: {e}"[:400])
                ok = ok and mode == "0"
                continue
            good = err < 0.1 and err2 < 0.1
            ok = ok and (good or mode == "0")
            t_fwd = host_us(lambda: oink.rmsnorm_forward(x, w))
            t_add = host_us(lambda: oink.fused_add_rmsnorm_(xs, rs, w))
            t_op = host_us(lambda: torch.ops.oink.fused_add_rms_norm(xs, rs, w, 1e-6))
            print(f"  M={M} N={N}: max err {err:.3g}/{err2:.3g} {'ok' if good else 'WRONG'}; host us per call: "
                  f"rmsnorm_forward {t_fwd:.1f}, fused_add_rmsnorm_ {t_add:.1f}, torch.ops.oink.fused_add_rms_norm {t_op:.1f}")
    try:
        from quack.rmsnorm import rmsnorm_fwd

        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        print(f"  quack rmsnorm_fwd (residual) M=1 N=4096: {host_us(lambda: rmsnorm_fwd(x, w, residual=r)):.1f} us; "
              f"F.rms_norm {host_us(lambda: torch.nn.functional.rms_norm(x, (4096,), w)):.1f} us")
    except Exception as e:  # noqa: BLE001
        print("  quack:", type(e).__name__, str(e)[:200])
    if os.environ.get("OINK_SMOKE_PROFILE"):  # where an eager call's host time goes
        import cProfile
        import pstats

        os.environ["OINK_TVM_FFI"] = "1"
        config.reload()
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
        oink.rmsnorm_forward(x, w)
        from oink.kernels.compile import CACHE
        print("launcher types:", sorted({type(f).__name__ for f in CACHE._fns.values()}))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            oink.rmsnorm_forward(x, w)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
