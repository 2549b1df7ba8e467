"""The CPU regression gate on identical code, run again and again while 2 busy loops load the CPU: every
run must have 0 SLOWER rows. Both ways of gating: --oink-against=HEAD (A/B in one run; the working tree's
oink/ must be HEAD's) and --oink-baseline (a baseline recorded under the same load first).

    python scripts/cpu_gate_under_load.py [runs, default 20] [--mode=against|baseline|both]
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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


def main():
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
    sys.exit(main())
