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
    print("| case | pytest_oink ms | do_bench ms | ratio |")
    print("|---|---|---|---|")
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
            theirs = triton.testing.do_bench(lambda: f(x), warmup=25, rep=200, return_mode="median")
            ratio = ours / theirs
            worst = max(worst, abs(ratio - 1))
            print(f"| {name} {M}x{N} | {ours:.4f} | {theirs:.4f} | {ratio:.3f} |")
    print(f"\nworst disagreement: {worst * 100:.1f}%")


if __name__ == "__main__":
    main()
