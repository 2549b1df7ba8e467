"""What the Markdown summary compares: whose rows are "ours" (``ours``: Oink's, a user's own kernel's, or the
gated providers'), and ours against the others per shape (``speedups``, ``memory_ratios``, ``best_peer_table``).
Only GPU rows are compared: a CPU's are reference timings (``report.CPU_ROWS``)."""
from __future__ import annotations

import math

from .registry import ALL_PROVIDERS

NOT_PEERS = ("oink-unfused", "torch")  # Oink's unfused compositions, and the eager reference no one compares with
BIG_BYTES = 256 * 2**20  # shapes moving this much are held to the copy ceiling


def geomean(values):
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def ours(rows, gated=None) -> tuple:
    """The providers whose rows the summary sets against the others': ``gated`` (``--oink-gate-providers`` where
    given: what the user judges is what they call theirs), else Oink and every provider the plugin does not
    register (a user's kernel timed by ``oink_measure``, ``mine`` unless named), so a user's rows are compared
    with the peers' whatever they are called."""
    if gated:
        return tuple(gated)
    return ("oink", *sorted({r.provider for r in rows} - set(ALL_PROVIDERS)))


def _compared(rows) -> dict:
    """{row key: row} of the timed GPU rows (a CPU's rows are reference timings)."""
    return {r.key: r for r in rows if r.status == "ok" and r.median_s and r.device != "cpu"}


def speedups(rows, mine=("oink",)) -> dict:
    """{op: {one of ours: {other provider: [its time / ours, per shape]}}} over rows where both are ok, off the CPU."""
    by_key = _compared(rows)
    out: dict = {}
    for (op, prov, M, N, dt), r in by_key.items():
        if prov in mine:
            continue
        for p in mine:
            o = by_key.get((op, p, M, N, dt))
            if o:
                out.setdefault(op, {}).setdefault(p, {}).setdefault(prov, []).append(r.median_s / o.median_s)
    return out


def memory_ratios(rows, mine=("oink",)) -> dict:
    """{one of ours: {other provider: [our peak memory / its, per shape]}} over shapes where both measured one."""
    peak = {r.key: r.peak_mem_bytes for r in rows if r.status == "ok" and r.peak_mem_bytes}
    out: dict = {}
    for (op, prov, M, N, dt), b in peak.items():
        for p in mine:
            o = peak.get((op, p, M, N, dt))
            if prov not in mine and o:
                out.setdefault(p, {}).setdefault(prov, []).append(o / b)
    return out


def best_peer_table(rows, mine=("oink",)) -> list[str]:
    """Per op and provider of ours: its time over the fastest peer's (every provider but ours and NOT_PEERS, gate
    passed) per shape, as a geomean with the worst shape and how many exceed 1.05; the shapes no peer ran (a
    refusal is not a win: counted apart); and the shapes moving >= 256 MB under 0.92 of the copy ceiling. Lines
    of Markdown, [] without GPU rows of ours (a CPU's are reference timings: CPU_ROWS)."""
    ok = list(_compared(rows).values())
    present = [p for p in mine if any(r.provider == p for r in ok)]
    lines = []
    for p in present:
        for op in sorted({r.op for r in ok if r.provider == p}):
            lines.append(_peer_line(ok, op, p, mine))
    if not lines:
        return []
    who = "Oink" if present == ["oink"] else " and ".join(present)
    return [f"## {who} against the best peer", "",
            f"{who}'s time / the fastest peer's per shape (< 1: {who} faster; peers: every provider but "
            f"{', '.join(dict.fromkeys((*mine, *NOT_PEERS)))}); shapes moving >= 256 MB below 0.92 of the copy "
            "ceiling listed.", "",
            "| op | shapes with a peer | geomean | worst shape | shapes > 1.05 | shapes no peer ran | shapes >= 256 MB "
            "| of them < 0.92 of copy |", "|---|---|---|---|---|---|---|---|"] + lines + [""]


def _peer_line(ok, op, p, mine) -> str:
    """best_peer_table's line of one op for provider ``p`` of ours (named beside the op unless it is Oink)."""
    ratios, alone, slow_big, big = [], 0, [], 0
    for o in (r for r in ok if r.op == op and r.provider == p):
        peers = [r for r in ok if r.key[0] == op and r.key[2:] == o.key[2:] and r.provider not in mine
                 and r.provider not in NOT_PEERS]
        if peers:
            best = min(peers, key=lambda r: r.median_s)
            ratios.append((o.median_s / best.median_s, f"{o.M}x{o.N} vs {best.provider}"))
        else:
            alone += 1
        if o.bytes >= BIG_BYTES:
            big += 1
            if o.roofline_frac is not None and o.roofline_frac < 0.92:
                slow_big.append(f"{o.M}x{o.N} {o.roofline_frac:.2f}")
    if ratios:
        worst = max(ratios)
        over = sum(1 for r, _ in ratios if r > 1.05)
        verdict = f"{geomean([r for r, _ in ratios]):.3f} | {worst[0]:.3f} ({worst[1]}) | {over}"
    else:
        verdict = "- | - | -"
    name = op if p == "oink" else f"{op} ({p})"
    return f"| {name} | {len(ratios)} | {verdict} | {alone} | {big} | {', '.join(slow_big) or '-'} |"
