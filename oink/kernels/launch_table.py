"""Tuned launch shapes per arch and card, kept as data (``launch_table.json``), over each family's rule.

A launch heuristic (each family's rule, ``row_rules.cluster_rows`` for wide rows) computes its own
choice, then asks ``pick(key, arch, default)``: an entry of (arch, key) whose width range ("n": [lo, hi])
holds N and whose "card" is the GPU in use (``use_card``; an entry without one serves any card) wins,
the rule's choice elsewhere. An entry was measured at one width ("at"); at another width of its range its
launch keeps its cluster and rows a CTA and takes the whole-warp tiling of the row's share whose accesses
a thread are nearest the measured ones ("iters"), or the rule's choice where no such tiling exists.
A card with no entries (one the table was never searched on), and the CPU, get the rules.
``scripts/tune_launch.py`` and ``python -m oink.tune`` fill the table: on a GPU they try ``candidates``
for each key an op looks up, gate each against the op's reference, time it, and keep the fastest that
passed. ``python -m oink.tune`` writes a user's overlay (``overlay_path``), read before the shipped table.
The library keeps no trial: the tuner installs its own (``TRIAL``, ``oink.tune.trial``) while it runs.
No torch here; ``RowLaunch`` is the only kernel type used.
"""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from .. import config
from .row_rules import WARP, RowLaunch, share_tilings

TABLE_PATH = Path(__file__).with_name("launch_table.json")

# keys whose kernels run a persistent grid, which an entry may size ("grid"): the norm backward's
PERSISTENT = ("rmsnorm_bwd/", "layernorm_bwd/")
STAGINGS = ("early", "late")
# keys whose kernels may stage their rows in shared memory, which an entry may ask for ("stage"): the norm forward's
STAGEABLE = ("rmsnorm_fwd/", "layernorm_fwd/")

# The tuner's trial while it runs an op (``oink.tune.trial``), else None. Its dicts, keyed (key, arch, N):
# ``launches`` (threads_per_row, num_threads, cluster_n) forced over the table; ``grids`` a persistent grid's
# size (threads a SM; 0: the family's default); ``stages`` the forward's staging (False: none; "early" /
# "late"); and ``seen``, which every lookup fills with the rule's RowLaunch (the keys an op looks up).
# Read where a launch is chosen (memoized), never per launch.
TRIAL = None


# the GPU the launches are chosen for (its name, as CUDA gives it): set by the dispatch for the device a
# call runs on; None (the CPU, compile checks): only entries without a card apply
CARD: str | None = None
# an entry serves widths within this factor of the one it was measured at, unless it says otherwise
RANGE = 17 / 16


def use_card(name: str | None) -> None:
    """Choose launches for GPU ``name`` from now on; a change drops the launches chosen for another."""
    global CARD
    if name != CARD:
        CARD = name
        config.reload()


def overlay_path() -> Path | None:
    """Where ``python -m oink.tune`` writes the user's tuned entries: beside the compiled kernels'
    cache (OINK_CACHE_DIR); None where that cache is off."""
    d = config.get().cache_dir
    return Path(d) / "launch_table.json" if d else None


def _read(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # a damaged overlay: the shipped table and the rules still serve
        return {}
    return {arch: {key: {int(n): e for n, e in by_n.items()} for key, by_n in keys.items()}
            for arch, keys in data.get("tables", {}).items()}


@functools.cache
def table() -> dict:
    """{arch: {key: {at: entry}}}: the user's overlay over the shipped table (an overlay entry replaces
    the shipped one measured at the same width). An entry's "launch" is [threads_per_row, num_threads,
    cluster_n]; "n" the widths it serves, "card" the GPU it was measured on, "iters" its accesses a thread
    at "at"; a persistent kernel's entry may add "grid": the threads a SM its grid is sized for, and a norm
    forward's "stage": "early" or "late", its rows staged in shared memory (``staged``)."""
    merged = _read(TABLE_PATH)
    for arch, keys in _read(overlay_path()).items():
        for key, by_n in keys.items():
            merged.setdefault(arch, {}).setdefault(key, {}).update(by_n)
    return merged


def span(at: int, entry: dict) -> tuple[int, int]:
    """The widths ``entry`` (measured at ``at``) serves."""
    lo, hi = entry.get("n") or (math.ceil(at / RANGE), math.floor(at * RANGE))
    return lo, hi


def entry(key: str, arch: str, N: int) -> tuple[int, dict] | None:
    """(at, entry) of the entry for ``key`` whose range holds N on the card in use, the nearest
    measured width first; None where there is none."""
    found = None
    for at, e in table().get(arch, {}).get(key, {}).items():
        if e.get("card", CARD) != CARD:
            continue
        lo, hi = span(at, e)
        if lo <= N <= hi and (found is None or abs(math.log(N / at)) < abs(math.log(N / found[0]))):
            found = (at, e)
    return found


def scaled(at: int, e: dict, default: RowLaunch) -> RowLaunch | None:
    """The entry's launch at ``default.N``: as measured at its own width; elsewhere its cluster and rows
    a CTA over the whole-warp tiling of the row's share with the accesses a thread nearest its "iters";
    None where no tiling covers the share exactly (a padded access cost more than the rule's choice)."""
    tpr, nt, cluster_n = e["launch"]
    N, vec = default.N, default.vec
    if N == at:
        return RowLaunch(N=N, vec=vec, threads_per_row=tpr, num_threads=nt, cluster_n=cluster_n)
    units, rows = N // vec, nt // tpr
    if units % cluster_n:
        return None
    want = e.get("iters") or math.ceil(at // vec / (tpr * cluster_n))
    tilings = share_tilings(units // cluster_n, 2 * want, 1024 // rows)
    if not tilings:
        return None
    t = min(tilings, key=lambda f: abs(math.log(f[0] / want)))[1]
    return RowLaunch(N=N, vec=vec, threads_per_row=t, num_threads=t * rows, cluster_n=cluster_n)


# A call of at most this many rows looks up its key's "/few" entry first, which may only pack fewer or more
# rows a CTA (``same_order``); without one, the key's choice.
FEW_ROWS = 32


def same_order(a: RowLaunch, b: RowLaunch) -> bool:
    """Whether a row's values meet in the same order under both launches: the same accesses, threads and
    CTAs a row (rows a CTA may differ). Batch invariance: a launch chosen by the row count may change no
    more than that, or a row's bits would depend on how many rows came with it."""
    return (a.vec, a.threads_per_row, a.cluster_n) == (b.vec, b.threads_per_row, b.cluster_n)


def few_rows(M: int) -> bool:
    return M <= FEW_ROWS


def pick(key: str, arch: str, default: RowLaunch, knob: int | None = None, few: bool = False) -> RowLaunch:
    """The launch for ``key`` at ``default.N``: the tuner's trial, the table's entry, or ``default``
    (also where a sweep's setting such as ``fp4_upt`` is set: ``knob``, which ``default`` obeys). With
    ``few`` (``few_rows(M)``) the key is ``key + "/few"``, whose default is ``key``'s choice, and whose entry
    serves only where it keeps that choice's order (``same_order``)."""
    if few:
        default, key = _resolved(key, arch, default, knob), f"{key}/few"
    if TRIAL is not None:
        TRIAL.seen[(key, arch, default.N)] = default
    chosen = _resolved(key, arch, default, knob)
    return chosen if not few or same_order(chosen, default) else default


def _resolved(key: str, arch: str, default: RowLaunch, knob) -> RowLaunch:
    N = default.N
    shape = TRIAL.launches.get((key, arch, N)) if TRIAL is not None else None
    if shape is not None:
        tpr, nt, cluster_n = shape
        return RowLaunch(N=N, vec=default.vec, threads_per_row=tpr, num_threads=nt, cluster_n=cluster_n)
    found = None if knob else entry(key, arch, N)
    return (found and scaled(*found, default)) or default


def grid(key: str, arch: str, N: int, knob: int | None = None, few: bool = False) -> int | None:
    """The persistent grid size (threads a SM) tuned with ``key``'s launch at N: the tuner's trial,
    the entry's "grid", else None (the family's default). It belongs to the entry's launch, so it
    follows ``pick``: a knob that makes ``pick`` ignore the table ignores it too, and ``few`` looks
    at the "/few" entry first (a call of so few rows hardly fills any grid)."""
    return _launch_option("grid", "grids", key, arch, N, knob, few)


def staged(key: str, arch: str, N: int, knob: int | None = None, few: bool = False,
           rule: str | None = None) -> str | None:
    """How ``key``'s launch at N stages its rows in shared memory: "early" or "late" (the parameters'
    loads before or after the reduction), or None (not staged): the tuner's trial, else the entry's
    "stage" (it belongs to the entry's launch, so it follows ``pick`` as ``grid`` does), else ``rule``
    (the family rule's staging of the launch chosen, which the caller gives where that launch is the rule's)."""
    return _launch_option("stage", "stages", key, arch, N, knob, few, rule)


def _launch_option(field: str, tried: str, key: str, arch: str, N: int, knob, few: bool, rule=None):
    """An entry's ``field``, which belongs to its launch: the trial's value in its dict ``tried`` (a
    falsy one: None), None where a knob makes ``pick`` ignore the entry, ``rule`` where a trial of a launch
    does, else the entry's measured at N (the "/few" entry first with ``few``), else ``rule``."""
    trial = TRIAL
    for k in ((f"{key}/few", key) if few else (key,)):
        if trial is not None and (k, arch, N) in getattr(trial, tried):
            return getattr(trial, tried)[(k, arch, N)] or None
        if knob:
            return None
        if trial is not None and (k, arch, N) in trial.launches:
            return rule
        found = entry(k, arch, N)
        if found:  # tuned with the launch measured at its own width, not the one scaled to another
            return found[1].get(field) if found[0] == N else rule
    return rule


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
