"""Time the infrastructure kernel (row sum of squares) on the GPU against torch and the
device-copy ceiling measured in the same run. Prints a Markdown table.

    python scripts/bench_infra.py
"""
import torch

from pytest_oink.timing import Rotation, measure_roofline, median, time_cuda_graph

from oink.kernels.rowsumsq import rowsumsq


def graph_time(fn, reps=20):
    """Median ms per call: ``reps`` calls captured in one CUDA graph, replays timed with events
    (pytest_oink's timer, so scripts and suites measure alike)."""
    return median(time_cuda_graph(lambda _: fn(), Rotation([None]), calls_per_replay=reps).samples) * 1e3


def main():
    dev = torch.cuda.get_device_name()
    copy_tbs = measure_roofline(torch.device("cuda")).copy_tbs
    print(f"device: {dev}; device copy (read+write, pytest_oink's roofline): {copy_tbs:.2f} TB/s")
    print("| M | N | dtype | oink ms | oink TB/s | frac of copy | torch ms | speedup |")
    print("|---|---|---|---|---|---|---|---|")
    for M, N in [(65536, 4096), (16384, 8192), (4096, 131072), (1024, 262144)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, device="cuda")
        got = rowsumsq(x, out=out)
        torch.testing.assert_close(got.double(), (x.double() ** 2).sum(1), rtol=1e-5, atol=1e-6)
        t_oink = graph_time(lambda: rowsumsq(x, out=out))
        t_torch = graph_time(lambda: x.float().square().sum(1))
        tbs = (M * N * 2 + M * 4) / t_oink / 1e9
        print(f"| {M} | {N} | bf16 | {t_oink:.4f} | {tbs:.2f} | {tbs / copy_tbs:.2f} | {t_torch:.4f} | {t_torch / t_oink:.1f}x |")


if __name__ == "__main__":
    main()
