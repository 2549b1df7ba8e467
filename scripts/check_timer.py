"""The timing's own checks.

GPU: pytest_oink's CUDA-graph timer against triton.testing.do_bench on the same calls in the same process; prints
both medians and their ratio (agreement target: within 5%).

    python scripts/check_timer.py

CPU: the regression gate on identical code, run again and again while 2 busy loops load the CPU: every run must
have 0 SLOWER rows. Both ways of gating: --oink-against=HEAD (A/B in one run; the working tree's oink/ must be
HEAD's) and --oink-baseline (a baseline recorded under the same load first).

    python scripts/check_timer.py --cpu-gate [runs, default 20] [--mode=against|baseline|both]
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def gpu_timer():
    import torch
    import triton

    import oink
    from pytest_oink.timing import Rotation, copies_for_cold_cache, median, time_cuda_graph

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


ROOT = Path(__file__).resolve().parents[1]
BENCH = "def test_benchmark(oink_case, oink_benchmark):\n    oink_benchmark(oink_case)\n"
ROWS = ("--oink-suite=smoke", "--oink-providers=oink", "--oink-gate-cpu", "-q", "-p", "pytest_oink.plugin",
        "-p", "no:cacheprovider")


def run(tmp: Path, *args) -> tuple:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "pytest", "test_b.py", *ROWS, *args], cwd=tmp, env=env,
                         capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if re.match(r"^\S+ \d+x\d+ \S+ oink: [A-Z]+", x)]
    verdicts = [x.split(": ")[1].split(",")[0] for x in lines]
    return out.returncode, {v: verdicts.count(v) for v in sorted(set(verdicts))}, [x for x in lines if "SLOWER" in x]


def cpu_gate():
    runs = int(next((a for a in sys.argv[1:] if a.isdigit()), 20))
    mode = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("--mode=")), "both")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    slower = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            (tmp / "test_b.py").write_text(BENCH)
            ways = {"against": ("--oink-against=HEAD",)}
            if mode in ("baseline", "both"):
                rc, _, _ = run(tmp, f"--oink-json={tmp / 'base.json'}", "--oink-against=HEAD")
                ways["baseline"] = (f"--oink-baseline={tmp / 'base.json'}",)
            for way, args in ways.items():
                if mode not in (way, "both"):
                    continue
                for i in range(runs):
                    rc, counts, bad = run(tmp, *args)
                    slower += len(bad)
                    print(f"{way} run {i + 1}: exit {rc}, {counts}, load {os.getloadavg()[0]:.1f}", flush=True)
                    for line in bad:
                        print("  " + line, flush=True)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    print(f"SLOWER rows in all runs: {slower}")
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(cpu_gate() if "--cpu-gate" in sys.argv else gpu_timer())
