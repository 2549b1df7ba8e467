"""Registers and spills of the row kernels' chosen launch shapes, compiled on the CPU (no GPU).

A launch that spills (a local frame above zero) runs at a fraction of the copy ceiling; this scan
shows, per kernel family, dtype and width, the launch the heuristic or the table picks, its
registers per thread and its local frame, so a heuristic change is checked before a GPU run.
Exit status 1 if anything spills.

    python3 scripts/spill_scan.py [--arch sm_90a] [--families rmsnorm_bwd,...] [--dtypes bfloat16,float32]
        [--widths 12288,65536] [--spills-only]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["OINK_KEEP_CUBIN"] = "1"  # the cubin stays on the compiled function

from oink.kernels.profile import ROW_FAMILIES, launch_resources  # noqa: E402  (after OINK_KEEP_CUBIN is set: oink reads it on import)
from pytest_oink.suites import SWEEP_VOCABS, SWEEP_WIDTHS  # noqa: E402  (after OINK_KEEP_CUBIN is set: oink reads it on import)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--families", default=",".join(ROW_FAMILIES))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--widths", default="", help="default: the sweep suite's widths (vocabularies for ce_*)")
    ap.add_argument("--spills-only", action="store_true")
    a = ap.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",") if w]
    spills, start = 0, time.time()
    print("family dtype N (threads_per_row, num_threads, cluster_n) registers frame_bytes")
    for fam in a.families.split(","):
        for dtype in a.dtypes.split(","):
            for N in widths or (SWEEP_VOCABS if fam.startswith("ce_") else SWEEP_WIDTHS):
                launch, res = launch_resources(fam, dtype, N, a.arch)
                spills += res["frame_bytes"] > 0
                if res["frame_bytes"] or not a.spills_only:
                    print(fam, dtype, N, *launch, res["registers"], res["frame_bytes"],
                          "SPILLS" if res["frame_bytes"] else "", flush=True)
    print(f"{spills} spilling, {time.time() - start:.0f} s", file=sys.stderr)
    return 1 if spills else 0


if __name__ == "__main__":
    sys.exit(main())
