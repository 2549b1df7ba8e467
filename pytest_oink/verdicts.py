"""Per-row verdicts of the regression gate (issue #34 item 1): FASTER / SAME / SLOWER / UNSURE
from both runs' raw samples, by a bootstrap interval of the ratio of medians held against the
threshold. A baseline without samples falls back to the spread rule (a change beyond the
threshold and beyond NOISE_SIGMAS spreads). Pure Python: no torch, no scipy."""
from __future__ import annotations

import functools
import random
from typing import NamedTuple

from .timing import median, relative_spread

CONFIDENCE = 0.95
RESAMPLES = 2000  # percentile-interval ends move by well under 1% of the ratio past this many
MIN_SAMPLES = 5  # fewer per side and the resampled medians take too few values for an interval
NOISE_SIGMAS = 3.0  # spread rule: a change smaller than this many spreads (of either run) is noise
RETIME_ROUNDS = 3  # an UNSURE row is timed at most this many more rounds, then judged as it stands


class Verdict(NamedTuple):
    name: str  # FASTER, SAME, SLOWER or UNSURE
    ratio: float  # this run's median over the baseline's
    interval: tuple | None  # the ratio's bootstrap CONFIDENCE interval; None: the spread rule decided
    floor: float = 0.0  # the spread rule's noise floor (relative), where it applied
    note: str = ""  # why the samples' verdict was not taken (a throttled row)

    def describe(self, threshold: float) -> str:
        """'SLOWER, x1.12 [1.09, 1.15]' (or the spread rule's reason where there were no samples)."""
        text = f"{self.name}, x{ratio_text(self.ratio)}"
        note = f" ({self.note})" if self.note else ""
        if self.interval is not None:
            return text + f" [{ratio_text(self.interval[0])}, {ratio_text(self.interval[1])}]" + note
        floor = f", noise floor {self.floor * 100:.1f}%" if self.floor > threshold else ""
        return text + f" (spread rule: the baseline kept no samples{floor})" + note


def ratio_text(x: float, digits: int = 2) -> str:
    """A ratio as text: ``digits`` decimals between 0.01 and 100, three significant digits outside."""
    return f"{x:.{digits}f}" if 0.01 <= x < 100 else f"{x:.3g}"


def ratio_interval(new, old, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0):
    """(median(new) / median(old), low, high): a percentile bootstrap interval of the ratio of
    medians, both sides resampled with replacement. Seeded: the same samples give the same verdict
    (and are resampled once a session: a row's verdict is asked again when the session ends)."""
    return _interval(tuple(new), tuple(old), confidence, resamples, seed)


@functools.lru_cache(maxsize=4096)
def _interval(new: tuple, old: tuple, confidence: float, resamples: int, seed: int):
    rng = random.Random(seed)
    ratios = sorted(median(rng.choices(new, k=len(new))) / median(rng.choices(old, k=len(old)))
                    for _ in range(resamples))
    tail = (1 - confidence) / 2
    low, high = ratios[int(tail * resamples)], ratios[min(resamples - 1, int((1 - tail) * resamples))]
    return median(new) / median(old), low, high


def usable(samples) -> bool:
    return len(samples) >= MIN_SAMPLES and min(samples) > 0


def from_samples(new, old, threshold: float) -> Verdict:
    """SLOWER when the whole interval lies above 1 + threshold (the change is real and beyond the
    threshold), FASTER when it lies below 1 - threshold, SAME when it lies within both bounds,
    UNSURE otherwise (too noisy to tell, or a real change smaller than the threshold may be hiding)."""
    ratio, low, high = ratio_interval(list(new), list(old))
    if low > 1 + threshold:
        name = "SLOWER"
    elif high < 1 - threshold:
        name = "FASTER"
    elif low >= 1 - threshold and high <= 1 + threshold:
        name = "SAME"
    else:
        name = "UNSURE"
    return Verdict(name, ratio, (low, high))


def from_spread(new_median: float, new_spread: float | None, old_median: float, old_spread: float,
                threshold: float) -> Verdict:
    """The rule for baselines without samples: SLOWER (FASTER) when the median moved beyond the
    threshold and beyond NOISE_SIGMAS x the larger relative spread of the two runs; SAME otherwise.
    The floor bounds the ratio on a log scale (above 1 + floor, below 1 / (1 + floor)): a floor
    of 100% or more must not make FASTER unreachable."""
    ratio = new_median / old_median
    floor = NOISE_SIGMAS * max(new_spread or 0.0, old_spread or 0.0)
    if ratio > 1 + max(threshold, floor):
        name = "SLOWER"
    elif ratio < min(1 - threshold, 1 / (1 + floor)):
        name = "FASTER"
    else:
        name = "SAME"
    return Verdict(name, ratio, None, floor)


# The same code timed on a CPU in two processes (an --oink-against worker and this session) on a loaded 2-core
# machine was up to x1.67 apart over 2 rounds each, every round alike, either way (allocator, cache and core
# state of each process), and x0.50 in one round: a CPU row is SLOWER (FASTER) only beyond twice (half) the
# other's time, whatever the threshold, and only where every round of this run is, against every round of the other.
# Against a baseline file (recorded in another run, under another moment's load) identical code read x2.04 and
# x2.12 in 2 of 20 runs while 2 busy loops loaded the CPU (scripts/check_timer.py --cpu-gate --mode=baseline):
# such a CPU row is SLOWER (FASTER) only beyond three times (a third of) the other's time.
CPU_FLOOR = 1.0
CPU_FILE_FLOOR = 2.0
CPU_ROUNDS = 2  # this run's rounds at least before a CPU row's verdict (one round's range is no interval)


def rounds_of(samples, size: int) -> list:
    """The medians of ``samples``' rounds, ``size`` samples each (a CPU row's rounds are timing.CPU_SAMPLES long)."""
    return [median(samples[i:i + size]) for i in range(0, len(samples) - size + 1, size)]


def from_cpu_rounds(new, old, threshold: float, floor: float = CPU_FLOOR) -> Verdict:
    """A CPU row (timing.time_cpu's rounds): the interval is the range of every round of this run over every
    round of the other, the samples within a round being alike but not the rounds (the machine's load moves
    between them). SLOWER beyond 1 + max(threshold, floor), FASTER below min(1 - threshold, 1 / (1 + floor)),
    SAME within the threshold, each with this run's CPU_ROUNDS rounds at least; else UNSURE. ``floor``:
    CPU_FLOOR where the other side was timed in this run (--oink-against), CPU_FILE_FLOOR for a baseline file."""
    from .timing import CPU_SAMPLES

    mine, theirs = rounds_of(list(new), CPU_SAMPLES), rounds_of(list(old), CPU_SAMPLES)
    if not mine or not theirs:  # fewer samples than a round: not timed by time_cpu
        return from_samples(new, old, threshold)
    ratios = [a / b for a in mine for b in theirs]
    low, high, ratio = min(ratios), max(ratios), median(new) / median(old)
    enough = len(mine) >= CPU_ROUNDS
    if enough and low > 1 + max(threshold, floor):
        name = "SLOWER"
    elif enough and high < min(1 - threshold, 1 / (1 + floor)):
        name = "FASTER"
    elif enough and low >= 1 - threshold and high <= 1 + threshold:
        name = "SAME"
    else:
        name = "UNSURE"
    note = f"CPU: {len(mine)} x {len(theirs)} rounds' range, a change beyond {floor:.0%} only"
    return Verdict(name, ratio, (low, high), floor, note)


def judge(new_samples, new_median: float, new_spread: float | None, entry, threshold: float,
          cpu: bool = False) -> Verdict:
    """A row against its baseline entry (report.BaselineEntry): from samples where both sides kept
    enough (a CPU row's, ``cpu``, round by round), else by the spread rule."""
    if usable(new_samples) and usable(entry.samples):
        if cpu:
            floor = CPU_FLOOR if entry.this_run else CPU_FILE_FLOOR
            return from_cpu_rounds(new_samples, entry.samples, threshold, floor)
        return from_samples(new_samples, entry.samples, threshold)
    if usable(new_samples):
        new_median, new_spread = median(new_samples), relative_spread(new_samples)
    return from_spread(new_median, new_spread, entry.median_s, entry.spread, threshold)


def held_down(verdict: Verdict, new_throttled: bool, old_throttled: bool) -> Verdict:
    """A verdict that a throttled side would decide reads UNSURE: a row timed while its GPU was held
    down is never SLOWER (its time measures the card's clocks, not the code), nor FASTER than a
    baseline row that was."""
    if verdict.name == "SLOWER" and new_throttled:
        return verdict._replace(name="UNSURE", note="throttled: timed while the GPU was held down, would read SLOWER")
    if verdict.name == "FASTER" and old_throttled:
        return verdict._replace(name="UNSURE", note="throttled baseline: its row was timed while the GPU was held "
                                                    "down, would read FASTER")
    return verdict


def retime_while_unsure(samples, verdict_of, time_once, rounds: int = RETIME_ROUNDS):
    """(samples, rounds re-timed): while ``verdict_of(samples)`` is UNSURE, another round of
    ``time_once()`` is appended, at most ``rounds`` times (a row that stays unsure is judged as it
    stands: the session fails on SLOWER only)."""
    samples, done = list(samples), 0
    while done < rounds and time_once is not None:
        verdict = verdict_of(samples)
        if verdict is None or verdict.name != "UNSURE":
            break
        samples += list(time_once())
        done += 1
    return samples, done
