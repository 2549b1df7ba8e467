"""Time candidate launch rules against the current launches and a peer, at widths no table entry names.

For each op and width: the op runs once to learn the launch keys it looks up; each rule then gives
every key a launch (forced in ``oink.tune.trial``), which is gated against the op's
reference (the benchmark gate) and timed (CUDA-graph replay, inputs cycled past L2). ``current`` is
the library's own choice; ``--peers`` are timed the same way. One JSON line per trial, then a table.
A rule is ``current``, a name of RULES, a setting of SETTING_RULES (``stream`` / ``held``: cross-entropy's
streaming forced; ``stage``, ``early`` / ``late``, ``ctasN``: the norm forward's staging, parameters, register cap;
``pivot`` / ``rounds2``: LayerNorm's one-round moments forced either way; ``tpsmN`` / ``depthN``: the norm
backward's threads a SM and pipeline depth),
``fixed:TxC[xB]`` (T threads a row, a cluster of C, CTAs of B), ``units:U`` (a streamed pass's accesses)
or ``file:PATH``; ``+`` joins them (``held+fixed:64x1x64``).

    python3 scripts/rule_probe.py --ops rmsnorm_forward,softmax_forward --widths 40960,98304 \
        --rules current,small8,mid8 --peers quack --log $OUT/probe.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from oink import config
from oink.kernels import cross_entropy as ce
from oink.kernels.compile import CACHE
from oink.kernels.fp8_rules import whole_warp_launch
from oink.kernels.row_rules import RowLaunch, cluster_rows, pick_row_launch, whole_warp_rows
from oink.tune import keys_of, time_op, trial
from pytest_oink.bench_runner import gate
from pytest_oink.providers import SPECS, build
from pytest_oink.suites import Case
from pytest_oink.timing import measure_roofline


def _quack_like(N, vec):
    cluster = next(c for c, top in ((1, 16384), (2, 32768), (4, 65536), (8, 131072), (16, 1 << 30)) if N <= top)
    return RowLaunch(N=N, vec=vec, threads_per_row=256, num_threads=256, cluster_n=cluster)


def _by_values(N, vec, maxvec=8):
    """The forward rules with their per-thread budgets counted in values, not accesses: a row whose width is
    not a multiple of 8 (``vec`` < ``maxvec`` elements an access) takes as many values a thread as an aligned
    one, in more, narrower accesses, instead of ``maxvec / vec`` times the threads."""
    scale = maxvec // vec
    if N > 16384:
        return cluster_rows(N, vec, 16, 128, 8 * scale)
    return pick_row_launch(N, 128 // maxvec, units_per_thread=4 * scale, max_units_per_thread=4 * scale)


def _values_wide(max_cluster, cta_threads, iters_of):
    """Narrow-access rows counted in values: ``values``' one-CTA rule up to 16384 columns, past it
    ``cluster_rows`` over CTAs of ``cta_threads`` and clusters up to ``max_cluster``, a thread's accesses
    capped at ``iters_of(vec)``."""
    def rule(N, vec):
        if N <= 16384:
            return _by_values(N, vec)
        return cluster_rows(N, vec, max_cluster, cta_threads, iters_of(vec))
    return rule


BITS = [16]  # the probe's dtype in bits (--dtype), for rules that need it


RULES = {
    "values": _by_values,
    "c16t256": _values_wide(16, 256, lambda vec: 32 // vec + 1),
    "c8t256": _values_wide(8, 256, lambda vec: 32 // vec + 1),
    "c16t128": _values_wide(16, 128, lambda vec: 32 // vec + 1),
    "small8": lambda N, vec: cluster_rows(N, vec, 16, 128, 8),
    "mid8": lambda N, vec: cluster_rows(N, vec, 16, 256, 8),
    "small4": lambda N, vec: cluster_rows(N, vec, 16, 128, 4),
    "mid4": lambda N, vec: cluster_rows(N, vec, 16, 256, 4),
    "c8small8": lambda N, vec: cluster_rows(N, vec, 8, 128, 8),
    "c8mid4": lambda N, vec: cluster_rows(N, vec, 8, 256, 4),
    "small16": lambda N, vec: cluster_rows(N, vec, 16, 128, 16),
    "small8p": lambda N, vec: cluster_rows(N, vec, 16, 128, 8, exact=False),
    "mid8p": lambda N, vec: cluster_rows(N, vec, 16, 256, 8, exact=False),
    "quacklike": _quack_like,
    "ln_pow2": lambda N, vec: whole_warp_rows(pick_row_launch(N, BITS[0], max_units_per_thread=4, max_threads=640),
                                              4, 640),  # LayerNorm's forward rule before fewest_warps
    "w32values4": lambda N, vec: pick_row_launch(N, 16, units_per_thread=32 // vec, max_units_per_thread=32 // vec,
                                                 max_threads=512),  # fp32 weight, narrow: 4 units' values
    # one CTA, half ``values``' budget: 16 values a thread (LayerNorm 942 x 17812, 2-element accesses: 64 x 8 ran
    # 0.84 of the access-counted 128 x 4, H200); None past 16384 (the rule's launch)
    "values16": lambda N, vec: pick_row_launch(N, 16, units_per_thread=16 // vec, max_units_per_thread=16 // vec)
    if N <= 16384 else None,
    "wholewarps": whole_warp_launch,  # the FP8 kernels' rule, for the other families
    "wholewarps4": lambda N, vec: whole_warp_launch(N, vec, iters=4),
}


# rules that are a development setting the op reads (oink.config.DEV), its launches its own
SETTING_RULES = {"stream": {"ce_stream": True}, "held": {"ce_stream": False}, "online": {"softmax_online": True},
                 "early": {"fwd_late": False}, "late": {"fwd_late": True}, "stage": {"fwd_stage": True},
                 "pivot": {"ln_pivot": True}, "rounds2": {"ln_pivot": False},
                 **{f"ctas{n}": {"fwd_ctas": n} for n in (2, 3, 4, 5, 6)},
                 **{f"tpsm{n}": {"bwd_tpsm": n} for n in (128, 256, 384, 512, 768, 1024, 1536, 2048)},
                 **{f"depth{n}": {"bwd_depth": n} for n in (1, 2, 3)}}


def _set_rules(names) -> None:
    """Only the development settings of ``names`` (SETTING_RULES) in effect; the library re-reads them."""
    config.DEV.clear()
    for name in names:
        config.DEV.update(config.dev_settings(**SETTING_RULES[name]))
    config.reload()


def rows_for(spec, N, itemsize, target=256 << 20) -> int:
    M = 1
    while spec.nbytes(M, N, itemsize) < target and M * N < 2**28:
        M *= 2
    return max(33, M)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", required=True)
    ap.add_argument("--widths", required=True)
    ap.add_argument("--rules", default="current," + ",".join(RULES))
    ap.add_argument("--peers", default="quack")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=0, help="rows (default: the case moves ~256 MB)")
    ap.add_argument("--log", default=None)
    a = ap.parse_args(argv)
    device, dtype = torch.device("cuda"), getattr(torch, a.dtype)
    BITS[0] = dtype.itemsize * 8
    roof = measure_roofline(device)
    card = torch.cuda.get_device_name()
    print(f"# {card}: copy {roof.copy_tbs:.2f} TB/s", flush=True)
    log = open(a.log, "a") if a.log else None
    table = []
    stream_units = ce.STREAM_UNITS
    for op in a.ops.split(","):
        spec, run = SPECS[op], build(op, "oink", device)
        peers = {}
        for p in a.peers.split(","):
            try:
                peers[p] = build(op, p, device) if p else None
            except Exception as e:  # noqa: BLE001  (a peer not installed or not offering the op)
                print(f"# {op}: no {p} ({e})", flush=True)
        for N in (int(n) for n in a.widths.split(",")):
            M = a.rows or rows_for(spec, N, dtype.itemsize)
            case = Case("probe", op, M, N, a.dtype)
            keys = keys_of(spec, run, M, N, dtype, device)
            row = {"op": op, "N": N, "M": M, "card": card, "copy_tbs": roof.copy_tbs}
            for rule in a.rules.split(","):
                ce.STREAM_UNITS = stream_units
                _set_rules(())
                parts = rule.split("+")  # e.g. stream+fixed:256x2: a setting, then launches on its keys
                settings = [p for p in parts if p in SETTING_RULES]
                _set_rules(settings)
                rkeys = keys_of(spec, run, M, N, dtype, device) if settings else keys
                shapes, forced = {}, {}  # forced: (key, arch, width) -> the rule's launch
                for part in (p for p in parts if p not in SETTING_RULES):
                    if part.startswith("file:"):  # launches saved by another tree: {"key|arch|N": shape}
                        saved = json.loads(Path(part[5:]).read_text())
                        for (key, arch, width) in rkeys:
                            if f"{key}|{arch}|{width}" in saved:
                                forced[(key, arch, width)] = tuple(saved[f"{key}|{arch}|{width}"])
                    elif part.startswith("fixed:"):  # fixed:TxC[xB]: T threads a row, a cluster of C, CTAs of B
                        tpr, cl, *cta = (int(v) for v in part[6:].split("x"))
                        for (key, arch, width) in rkeys:
                            forced[(key, arch, width)] = (tpr, cta[0] if cta else max(128, tpr), cl)
                    elif part.startswith("units:"):  # units:U: a streamed cross-entropy pass loads U accesses
                        ce.STREAM_UNITS = int(part[6:])
                    elif part != "current":
                        for (key, arch, width), default in rkeys.items():
                            L = RULES[part](width, default.vec) or default  # None: the rule has no launch
                            shapes[key] = forced[(key, arch, width)] = (
                                L.threads_per_row, L.num_threads, L.cluster_n)
                with trial(forced):
                    CACHE.clear_used()
                    try:
                        g = gate(spec, run, case, dtype, device)
                        ok = g["passed"]
                        us = time_op(spec, run, case, dtype, device) * 1e6 if ok else None
                        why = "" if ok else g.get("report", "gate failed")[:200]
                    except Exception as e:  # noqa: BLE001  (any failure of a probed launch is its row's result)
                        ok, us, why = False, None, f"{type(e).__name__}: {e}"[:200]
                    ran = sorted(CACHE.used_launches())
                frac = spec.nbytes(M, N, dtype.itemsize) / (us * 1e-6) / (roof.copy_tbs * 1e12) if us else None
                line = {**row, "rule": rule, "passed": ok, "us": us, "copy": frac, "ran": ran, "why": why}
                row[rule] = us
                print(json.dumps(line), flush=True)
                if log:
                    log.write(json.dumps(line) + "\n")
                    log.flush()
            ce.STREAM_UNITS = stream_units
            _set_rules(())
            for p, prun in peers.items():
                try:
                    g = gate(spec, prun, case, dtype, device)
                    us = time_op(spec, prun, case, dtype, device) * 1e6 if g["passed"] else None
                except Exception as e:  # noqa: BLE001  (any failure of a probed launch is its row's result)
                    us = None
                    print(f"# {op} {N}: {p} raised {type(e).__name__}: {str(e)[:120]}", flush=True)
                row[p] = us
                line = {"op": op, "N": N, "M": M, "card": card, "rule": p, "us": us}
                if log:
                    log.write(json.dumps(line) + "\n")
                    log.flush()
            table.append(row)
    cols = a.rules.split(",") + [p for p in a.peers.split(",") if p]
    print("op N M " + " ".join(cols) + "   (us; copy fraction of 'current' and best)")
    for r in table:
        ts = [r.get(c) for c in cols]
        print(r["op"], r["N"], r["M"], " ".join(f"{t:.1f}" if t else "-" for t in ts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
