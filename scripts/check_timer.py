"""Cross-check pytest_oink's CUDA-graph timer against triton.testing.do_bench on the same calls
in the same process; prints both medians and their ratio (agreement target: within 5%).

    python scripts/check_timer.py
"""
import torch
import triton

import oink
from pytest_oink.timing import Rotation, copies_for_cold_cache, median, time_cuda_graph


def main():
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"device: {torch.cuda.get_device_name()}")
    print("| case | pytest_oink ms | do_bench_cudagraph ms | ratio | do_bench (eager launches) ms |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for M, N in [(4096, 7168), (16384, 8192), (65536, 4096), (65536, 8192)]:
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        cases = {
            "rmsnorm_forward": lambda x: oink.rmsnorm_forward(x, w),
            "rmsnorm_backward": lambda x: oink.rmsnorm_backward(x, w, x, torch.ones(M, device="cuda")),
        }
        for name, f in cases.items():
            nbytes = 2 * M * N * 2
            rot = Rotation([torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
                            for _ in range(copies_for_cold_cache(nbytes, l2))])
            ours = median(time_cuda_graph(f, rot).samples) * 1e3
            x = rot.sets[0]
            # do_bench flushes L2 between calls (cold cache, like our rotation); median of its samples
            # do_bench_cudagraph: graph-replayed like ours (no host launch overhead); same call, same inputs
            theirs = triton.testing.do_bench_cudagraph(lambda: f(x), rep=100, return_mode="median")
            eager = triton.testing.do_bench(lambda: f(x), warmup=25, rep=200, return_mode="median")
            ratio = ours / theirs
            worst = max(worst, abs(ratio - 1))
            print(f"| {name} {M}x{N} | {ours:.4f} | {theirs:.4f} | {ratio:.3f} | {eager:.4f} |")
    print(f"\nworst disagreement: {worst * 100:.1f}%")
    # host cost of one eager call (validation, custom-op dispatch, launch) at a tiny shape
    import time

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for name, f in (("oink.rmsnorm_forward", lambda: oink.rmsnorm_forward(x, w)),
                    ("torch.ops.oink.rmsnorm", lambda: torch.ops.oink.rmsnorm(x, w, 1e-6))):
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(1000):
            f()
        torch.cuda.synchronize()
        print(f"host cost per eager call, {name} 1x4096: {(time.perf_counter() - t0) * 1e3:.1f} us")


if __name__ == "__main__":
    main()
