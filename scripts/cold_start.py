"""On a GPU: what a fresh process's first calls cost with the disk cache (OINK_CACHE_DIR) warm, cold,
and off. Each measurement is its own Python process; a call is timed to the end of its kernel.

    python3 scripts/cold_start.py            # prints one line per process and call
"""
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import time
t0 = time.perf_counter()
import torch
import oink
t_import = time.perf_counter() - t0
x = {N: torch.randn(64, N, device="cuda", dtype=torch.bfloat16) for N in (4096, 5120)}
w = {N: torch.randn(N, device="cuda", dtype=torch.bfloat16) for N in x}
torch.cuda.synchronize()
times = []
for N in (4096, 5120):
    t0 = time.perf_counter()
    y = oink.rmsnorm_forward(x[N], w[N])[0]
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
    ref = oink.reference.rmsnorm_forward(x[N].float(), w[N].float())[0]
    assert (y.float() - ref).abs().max().item() < 0.1, "wrong answer"
from oink.kernels.compile import CACHE
print(f"import torch+oink {t_import * 1e3:.0f} ms; first call N=4096 {times[0]:.1f} ms (kernel modules imported "
      f"there); first call N=5120 {times[1]:.1f} ms; compiles in this process: {CACHE.compiles}")
"""


def run(label: str, env: dict) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    text = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
    print(f"{label:38s} {text}", flush=True)


def main():
    with tempfile.TemporaryDirectory() as cache:
        base = {k: v for k, v in os.environ.items() if k != "OINK_CACHE_DIR"}
        run("disk cache off", dict(base, OINK_CACHE_DIR="0"))
        on = dict(base, OINK_CACHE_DIR=cache)
        run("disk cache on, empty (fills it)", on)
        run("disk cache on, warm", on)
        run("disk cache on, warm (again)", on)


if __name__ == "__main__":
    main()
