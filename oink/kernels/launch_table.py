"""Tuned launch shapes per arch, kept as data (``launch_table.json``).

A launch heuristic computes its own choice, then asks ``pick(key, arch, default)``: the table's
entry for (arch, key, N) wins where there is one, the heuristic's answer elsewhere (every width the
search did not measure, and every arch no GPU of which was lent: sm_100a has no entries).
``scripts/tune_launch.py`` fills the table: on a GPU it tries ``candidates`` for each key an op
looks up, gates each against the op's reference, times it, and keeps the fastest that passed.
No torch here; ``RowLaunch`` is the only kernel type used.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .. import config
from .reduction import WARP, RowLaunch

TABLE_PATH = Path(__file__).with_name("launch_table.json")

# (key, arch, N) -> (threads_per_row, num_threads, cluster_n): the search tool's trial, in process
OVERRIDES: dict = {}
# (key, arch, N) -> a persistent grid's size (resident threads a SM it is sized for; 0: the family's
# default) tried with the key's launch: the search tool's trial
GRID_OVERRIDES: dict = {}
# keys whose kernels run a persistent grid, which an entry may size ("grid"): the norm backward's
PERSISTENT = ("rmsnorm_bwd/", "layernorm_bwd/")
# (key, arch, N) -> the forward's staging (False: none; "early" / "late": rows staged in shared memory,
# parameters loaded before / after the reduction): the search tool's trial
STAGE_OVERRIDES: dict = {}
STAGINGS = ("early", "late")
# keys whose kernels may stage their rows in shared memory, which an entry may ask for ("stage"): the norm forward's
STAGEABLE = ("rmsnorm_fwd/", "layernorm_fwd/")
# (key, arch, N) -> the heuristic's RowLaunch, for every lookup since the last clear (the search
# tool runs an op once to learn which keys and widths it uses)
SEEN: dict = {}


@functools.cache
def table() -> dict:
    """{arch: {key: {N: entry}}}; an entry's "launch" is [threads_per_row, num_threads, cluster_n], a
    persistent kernel's entry may add "grid": the threads a SM its grid is sized for, and a norm forward's
    "stage": "early" or "late", its rows staged in shared memory (``staged``)."""
    if not TABLE_PATH.exists():
        return {}
    data = json.loads(TABLE_PATH.read_text())
    return {arch: {key: {int(n): e for n, e in by_n.items()} for key, by_n in keys.items()}
            for arch, keys in data.get("tables", {}).items()}


# A call of at most this many rows looks up its key's "/few" entry first: a few rows fill the GPU
# only when each row's CTAs are many and short (H100, 32 x 131072 bf16 RMSNorm: 16 CTAs of 128
# threads a row, 1.4x faster than the 4 of 1024 tuned at 4096 rows); without one, the key's choice.
FEW_ROWS = 32


def few_rows(M: int) -> bool:
    return M <= FEW_ROWS


def pick(key: str, arch: str, default: RowLaunch, knob: int | None = None, few: bool = False) -> RowLaunch:
    """The launch for ``key`` at ``default.N``: a trial override, the table's entry, or ``default``
    (also where a sweep knob such as OINK_FP4_UPT is set: ``knob``, which ``default`` obeys). With
    ``few`` (``few_rows(M)``) the key is ``key + "/few"``, whose default is ``key``'s choice."""
    if few:
        default, key = _resolved(key, arch, default, knob), f"{key}/few"
    SEEN[(key, arch, default.N)] = default
    return _resolved(key, arch, default, knob)


def _resolved(key: str, arch: str, default: RowLaunch, knob) -> RowLaunch:
    N = default.N
    shape = OVERRIDES.get((key, arch, N))
    if shape is None and not knob:
        entry = table().get(arch, {}).get(key, {}).get(N)
        shape = entry["launch"] if entry else None
    if shape is None:
        return default
    tpr, nt, cluster_n = shape
    return RowLaunch(N=N, vec=default.vec, threads_per_row=tpr, num_threads=nt, cluster_n=cluster_n)


def grid(key: str, arch: str, N: int, knob: int | None = None, few: bool = False) -> int | None:
    """The persistent grid size (threads a SM) tuned with ``key``'s launch at N: a trial override,
    the entry's "grid", else None (the family's default). It belongs to the entry's launch, so it
    follows ``pick``: a knob that makes ``pick`` ignore the table ignores it too, and ``few`` looks
    at the "/few" entry first (a call of so few rows hardly fills any grid)."""
    return _launch_option("grid", GRID_OVERRIDES, key, arch, N, knob, few)


def staged(key: str, arch: str, N: int, knob: int | None = None, few: bool = False) -> str | None:
    """How ``key``'s launch at N stages its rows in shared memory: "early" or "late" (the parameters'
    loads before or after the reduction), or None (not staged): a trial override, else the entry's
    "stage" (it belongs to the entry's launch, so it follows ``pick`` as ``grid`` does), else None."""
    return _launch_option("stage", STAGE_OVERRIDES, key, arch, N, knob, few)


def _launch_option(field: str, overrides: dict, key: str, arch: str, N: int, knob, few: bool):
    """An entry's ``field``, which belongs to its launch: a trial's value in ``overrides`` (a falsy one:
    None), None where a trial of a launch or a knob makes ``pick`` ignore the entry, else the entry's
    (the "/few" entry first with ``few``), else None."""
    for k in ((f"{key}/few", key) if few else (key,)):
        if (k, arch, N) in overrides:
            return overrides[(k, arch, N)] or None
        if (k, arch, N) in OVERRIDES or knob:
            return None
        entry = table().get(arch, {}).get(k, {}).get(N)
        if entry:
            return entry.get(field)
    return None


def candidates(default: RowLaunch, max_iters: int = 8, lanes: int = 1, clusters=(1,)) -> list[RowLaunch]:
    """Launch shapes worth trying for ``default``'s width and vector: threads per row a power of two
    or a whole number of warps that tiles the row exactly, at most ``max_iters`` accesses a thread,
    over each cluster size in ``clusters``; a row narrower than 128 threads shares its CTA with others
    (128 or 256 threads); threads per row a multiple of ``lanes`` (the FP8 group's aligned lanes).
    The heuristic's own choice is always among them."""
    N, vec = default.N, default.vec
    units = N // vec
    out = {default}
    for cluster_n in clusters:
        per_cta = math.ceil(units / cluster_n)
        tprs = {1 << k for k in range(11)}
        tprs |= {per_cta // it for it in range(1, max_iters + 1)
                 if units % (cluster_n * it) == 0 and (per_cta // it) % WARP == 0}
        for tpr in sorted(tprs):
            if tpr > 1024 or tpr % lanes or math.ceil(per_cta / tpr) > max_iters:
                continue
            if tpr >= 2 * per_cta:  # whole idle accesses in every row
                continue
            for nt in sorted({max(tpr, 128), max(tpr, 256)} if tpr < 128 else {tpr}):
                try:
                    out.add(RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=nt, cluster_n=cluster_n))
                except ValueError:
                    pass
    return sorted(out, key=lambda L: (L.cluster_n, L.threads_per_row, L.num_threads))


def choose(trials, default: RowLaunch, min_gain: float):
    """The search's verdict for one key and width from its ``(launch, seconds or None)`` trials (None:
    failed its gate, raised or did not run): ``(launch to keep or None, heuristic's seconds, best seconds)``.
    A shape is kept only where the fastest passing one beats the heuristic's by more than ``min_gain``;
    where the heuristic's own shape failed, nothing is kept and its seconds are None (the caller says so)."""
    base = next((t for L, t in trials if L == default), None)
    passed = [(t, L) for L, t in trials if t is not None]
    if base is None or not passed:
        return None, base, None
    best_t, best = min(passed, key=lambda p: p[0])
    keep = best if best != default and best_t < base * (1 - min_gain) else None
    return keep, base, best_t


def _clear() -> None:
    table.cache_clear()


config.ON_RELOAD.append(_clear)
