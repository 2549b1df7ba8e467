"""RMSNorm forward and fused add+RMSNorm in place on the GPU: Oink vs Quack, Liger and
torch.compile, all measured in this one run, with the device-copy ceiling of the same run.
Every provider's output is checked against the fp32 reference before it is timed.

    python scripts/bench_rmsnorm.py [--quick]   -> Markdown tables on stdout
"""
from __future__ import annotations

import math
import sys

import torch

from pytest_oink.timing import Rotation, measure_roofline, median, time_cuda_graph

import oink
from oink import reference as R

EPS = 1e-6
L2_BYTES = 50 * 2**20


def graph_time(fn, reps=10):
    """Median ms per call: ``reps`` calls captured in one CUDA graph, replays timed with events
    (pytest_oink's timer, so scripts and suites measure alike)."""
    return median(time_cuda_graph(lambda _: fn(), Rotation([None]), calls_per_replay=reps).samples) * 1e3


def copy_tbs():
    return measure_roofline(torch.device("cuda")).copy_tbs


def rotating(make, bytes_per_set):
    """Enough input sets that the working set is > 3x L2 (cold-cache timing for small shapes)."""
    k = max(1, math.ceil(3 * L2_BYTES / bytes_per_set))
    sets = [make() for _ in range(k)]
    state = {"i": 0}

    def next_set():
        i = state["i"]
        state["i"] = (i + 1) % k
        return sets[i]

    return next_set, k


def peers():
    out = {}
    try:
        from quack.rmsnorm import rmsnorm_bwd, rmsnorm_fwd

        out["quack"] = rmsnorm_fwd
        out["quack_bwd"] = rmsnorm_bwd
    except Exception as e:  # noqa: BLE001
        print(f"quack unavailable: {e}", file=sys.stderr)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out["liger"] = LigerRMSNormFunction
    except Exception as e:  # noqa: BLE001
        print(f"liger unavailable: {e}", file=sys.stderr)
    return out


def ref_fwd(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def ref_fused(x, res, w):
    h = (x.float() + res.float()).to(res.dtype)
    res.copy_(h)
    x.copy_(ref_fwd(h, w))


def gate(name, got, want, atol=2e-2):
    err = (got.float() - want.float()).abs().max().item()
    ok = math.isfinite(err) and err <= atol + 2e-2 * want.float().abs().max().item()
    if not ok:
        print(f"GATE FAILED {name}: max abs err {err}", file=sys.stderr)
    return ok


def bench_forward(M, N, wdtype, P, compiled_fwd, ceiling):
    dt = torch.bfloat16
    x0 = torch.randn(M, N, device="cuda", dtype=dt)
    w = torch.randn(N, device="cuda", dtype=wdtype)
    want = R.rmsnorm_forward(x0, w)[0]
    nxt, _ = rotating(lambda: torch.randn(M, N, device="cuda", dtype=dt), 2 * M * N * 2)
    provs = {"oink": lambda x: oink.rmsnorm_forward(x, w)[0],
             "torch.compile": lambda x: compiled_fwd(x, w)}
    if "quack" in P:
        provs["quack"] = lambda x: P["quack"](x, w, eps=EPS)[0]
    if "liger" in P and wdtype == dt:
        provs["liger"] = lambda x: P["liger"].apply(x, w, EPS, 0.0, "llama", False)
    row = {}
    for name, f in provs.items():
        if not gate(f"fwd {name} {M}x{N}", f(x0), want):
            row[name] = None
            continue
        row[name] = graph_time(lambda: f(nxt()))
    return row, (2 * M * N * 2 + N * w.element_size())


def bench_fused(M, N, P, compiled_fused, ceiling):
    dt = torch.bfloat16
    w = torch.randn(N, device="cuda", dtype=dt)
    x0, r0 = torch.randn(M, N, device="cuda", dtype=dt), torch.randn(M, N, device="cuda", dtype=dt)
    xr, rr = x0.clone(), r0.clone()
    R.fused_add_rmsnorm_(xr, rr, w)
    nxt, _ = rotating(lambda: (torch.randn(M, N, device="cuda", dtype=dt), torch.randn(M, N, device="cuda", dtype=dt)),
                      4 * M * N * 2)

    def quack_copies(x, r):
        out, res_out, _ = P["quack"](x, w, residual=r, eps=EPS)
        x.copy_(out)
        r.copy_(res_out)

    provs = {"oink": lambda x, r: oink.fused_add_rmsnorm_(x, r, w),
             "torch.compile": lambda x, r: compiled_fused(x, r, w)}
    if "quack" in P:
        provs["quack+copies"] = quack_copies
    row = {}
    for name, f in provs.items():
        x, r = x0.clone(), r0.clone()
        f(x, r)
        if not (gate(f"fused {name} x", x, xr) and torch.equal(r, rr)):
            row[name] = None
            continue
        row[name] = graph_time(lambda: f(*nxt()))
    return row, 4 * M * N * 2 + N * 2


def bench_backward(M, N, P, compiled_bwd, ceiling):
    dt = torch.bfloat16
    w = torch.randn(N, device="cuda", dtype=dt)

    def make():
        x = torch.randn(M, N, device="cuda", dtype=dt)
        return x, torch.randn(M, N, device="cuda", dtype=dt), R.rmsnorm_forward(x, w, store_rstd=True)[1]

    x0, g0, rstd0 = make()
    want_dx, want_dw, _, _ = R.rmsnorm_backward(x0, w, g0, rstd0)
    nxt, _ = rotating(make, 3 * M * N * 2)
    provs = {"oink": lambda x, g, r: oink.rmsnorm_backward(x, w, g, r)[:2],
             "torch.compile": lambda x, g, r: compiled_bwd(x, w, g, r)[:2]}
    if "quack_bwd" in P:
        provs["quack"] = lambda x, g, r: P["quack_bwd"](x, w, g, r)[:2]
    row = {}
    for name, f in provs.items():
        dx, dw = f(x0, g0, rstd0)
        if not (gate(f"bwd {name} dx", dx, want_dx) and gate(f"bwd {name} dw", dw, want_dw, atol=0.5)):
            row[name] = None
            continue
        row[name] = graph_time(lambda: f(*nxt()))
    return row, 3 * M * N * 2 + 2 * N * 2 + 4 * M


def table(title, rows, ceiling, bytes_of, providers):
    if not rows:
        return
    print(f"\n### {title}\n")
    hdr = "| M | N | " + " | ".join(f"{p} ms" for p in providers) + " | oink TB/s | oink / copy | " + \
        " | ".join(f"vs {p}" for p in providers if p != "oink") + " |"
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    speedups = {p: [] for p in providers if p != "oink"}
    fracs = []
    for (M, N), row in rows:
        t = row.get("oink")
        tbs = bytes_of[(M, N)] / t / 1e9 if t else float("nan")
        fracs.append(tbs / ceiling)
        cells = [f"{row[p]:.4f}" if row.get(p) else ("FAIL" if p in row else "-") for p in providers]
        sp = []
        for p in speedups:
            if row.get(p) and t:
                speedups[p].append(row[p] / t)
                sp.append(f"{row[p] / t:.2f}x")
            else:
                sp.append("-")
        print(f"| {M} | {N} | " + " | ".join(cells) + f" | {tbs:.2f} | {tbs / ceiling:.2f} | " + " | ".join(sp) + " |")
    gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
    print(f"\ngeomean oink/copy: {gm(fracs):.3f}; geomean speedup: " +
          ", ".join(f"vs {p} {gm(v):.2f}x (min {min(v):.2f}x)" for p, v in speedups.items() if v))


def main():
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ceiling = copy_tbs()
    print(f"device copy ceiling (read+write): {ceiling:.3f} TB/s")
    P = peers()
    compiled_fwd = torch.compile(ref_fwd)
    compiled_fused = torch.compile(ref_fused)
    dsv3 = [(M, N) for M in (4096, 16384, 65536) for N in (6144, 7168, 8192)]
    quack_suite = sorted({(b * s, 4096) for b in (1, 4, 8, 16, 32) for s in (8192, 16384, 32768, 65536, 131072)
                          if b * s * 4096 <= 2**31})
    shapes = dsv3[:3] if quick else dsv3 + quack_suite
    only_bwd = "--bwd" in sys.argv
    for wdtype in (() if only_bwd else (torch.bfloat16, torch.float32)):
        rows, nbytes = [], {}
        for M, N in shapes:
            row, b = bench_forward(M, N, wdtype, P, compiled_fwd, ceiling)
            rows.append(((M, N), row))
            nbytes[(M, N)] = b
        provs = ["oink", "quack", "liger", "torch.compile"] if wdtype == torch.bfloat16 else ["oink", "quack", "torch.compile"]
        table(f"RMSNorm forward, x bf16, weight {str(wdtype)[6:]}", rows, ceiling, nbytes, provs)
    rows, nbytes = [], {}
    for M, N in ([] if only_bwd else shapes):
        row, b = bench_fused(M, N, P, compiled_fused, ceiling)
        rows.append(((M, N), row))
        nbytes[(M, N)] = b
    table("Fused add + RMSNorm in place, bf16", rows, ceiling, nbytes, ["oink", "quack+copies", "torch.compile"])
    compiled_bwd = torch.compile(R.rmsnorm_backward)
    rows, nbytes = [], {}
    for M, N in shapes:
        row, b = bench_backward(M, N, P, compiled_bwd, ceiling)
        rows.append(((M, N), row))
        nbytes[(M, N)] = b
    table("RMSNorm backward (dx, dw), bf16", rows, ceiling, nbytes, ["oink", "quack", "torch.compile"])


if __name__ == "__main__":
    main()
