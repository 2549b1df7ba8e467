"""The one registry of benchmark shape suites. No torch here; the ops are the bench specs' (providers.SPECS)."""
from __future__ import annotations

import math
import random

from oink.measure.gate import Case  # noqa: F401  (a suite's case: the gate's and the tuner's too)

from .training import TRAINING_MODELS


def row_title(r) -> str:
    """A row's name in the summaries (report's, clocks'): its case's op, shape and dtype, and its provider."""
    return f"{r.op} {r.M}x{r.N} {r.dtype} {r.provider}"


def _quack_shapes():
    # Quack's suite: N=4096, M = batch*seq, M*N <= 2^31
    return sorted({(b * s, 4096) for b in (1, 4, 8, 16, 32) for s in (8192, 16384, 32768, 65536, 131072)
                   if b * s * 4096 <= 2**31})


def _dsv3_shapes(op: str):
    if op.startswith("cross_entropy"):
        return [(M, N) for M in (4096, 16384, 65536) for N in (3072, 6144, 8192, 12288)]
    return [(M, N) for M in (4096, 16384, 65536) for N in (6144, 7168, 8192)]


def _nvfp4_shapes(op: str):
    # the optimizer study's shapes (8x256x7168 is 2048 rows), then M x N at scale
    study = [(128, 2048), (128, 4096), (128, 8192), (128, 14336), (2048, 7168)]
    return study + [(M, N) for M in (4096, 16384, 65536) for N in (2048, 4096, 7168, 8192, 14336)]


def _fp8_shapes(op: str):
    # DSv3 and Llama-70B/405B widths (silu-mul inputs are 2 x N), decode and prefill rows
    return [(M, N) for M in (128, 4096, 16384) for N in (4096, 7168, 8192, 16384, 18432)]


SWEEP_WIDTHS = (512, 1536, 2048, 2880, 3072, 4096, 5120, 6144, 7168, 8192, 12288, 14336, 16384, 18432, 28672, 65536,
                131072, 262144)
SWEEP_VOCABS = (32000, 32064, 50257, 128256, 151936, 152064, 201088, 256000)


def _sweep_shapes(op: str):
    # Real models' widths (vocabularies for cross-entropy) at a decode and a training row count, plus
    # the decode sizes the fused add + RMSNorm targets; M x N kept within 2^28 elements so one case
    # fits any lent GPU, and the widths too wide for 4096 rows at the most rows that fit (2048 x 131072:
    # kernels that hold few such rows well can still fail at many). Not the full product:
    # --oink-configs / --oink-ops narrow it further.
    if op.startswith("cross_entropy"):
        shapes = [(M, V) for V in SWEEP_VOCABS for M in (512, 4096)]
    else:
        shapes = [(M, N) for N in SWEEP_WIDTHS for M in (32, 4096, min(4096, 2**28 // N))]
        shapes += [(M, N) for N in (4096, 5120, 7168, 8192) for M in (1, 128, 512)]
    return sorted({(M, N) for M, N in shapes if M * N <= 2**28})


# The random suite: per op, widths drawn log-uniform from a seed (odd and non-power-of-two widths
# that no fixed suite holds), each at the rows that move RANDOM_MIN_BYTES (a bandwidth-bound size),
# plus decode rows at the narrowest widths.
RANDOM_WIDTHS = (256, 262144)
RANDOM_VOCABS = (3072, 262144)  # cross-entropy's widths are vocabularies
RANDOM_DRAWS = 10
RANDOM_MIN_BYTES = 64 * 2**20
MAX_ELEMS = 2**28  # M x N of one case, so that it fits any lent GPU
DECODE_WIDTHS, DECODE_MAX_N, DECODE_ROWS, DECODE_MAX_M = 3, 16384, 2, 1024
ELEM_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _varied_enough(widths, block: int) -> bool:
    """The draw holds what the suite is for: >= 2 odd widths (where the block allows), >= 2
    multiples of 8 that are not powers of two, at most 2 powers of two, and DECODE_WIDTHS widths
    narrow enough for the decode tier."""
    return (len(widths) == RANDOM_DRAWS
            and (block % 2 == 0 or sum(n % 2 for n in widths) >= 2)
            and sum(n % 8 == 0 and not _pow2(n) for n in widths) >= 2
            and sum(_pow2(n) for n in widths) <= 2
            and sum(n <= DECODE_MAX_N for n in widths) >= DECODE_WIDTHS)


def random_widths(op: str, seed: int, rng: random.Random | None = None) -> list[int]:
    """RANDOM_DRAWS distinct widths, log-uniform over the op's range, multiples of its block (FP4
    blocks, FP8 groups). Draws failing ``_varied_enough`` are drawn again whole, so the widths kept
    stay log-uniform given those properties."""
    from .providers import SPECS

    rng = rng or random.Random(f"oink-random:{seed}:{op}")
    block = SPECS[op].block
    lo, hi = RANDOM_VOCABS if op.startswith("cross_entropy") else RANDOM_WIDTHS
    k_lo, k_hi = math.log(-(-lo // block)), math.log(hi // block)
    for _ in range(10000):
        widths = {block * round(math.exp(rng.uniform(k_lo, k_hi))) for _ in range(RANDOM_DRAWS)}
        if _varied_enough(widths, block):
            return sorted(widths)
    raise RuntimeError(f"random suite: no varied enough widths drawn for {op} (seed {seed})")


def rows_moving(nbytes, N: int, elem_size: int, min_bytes: int = RANDOM_MIN_BYTES) -> int:
    """The fewest rows at width N whose case moves ``min_bytes`` (by the spec's byte count), at
    most MAX_ELEMS // N (kept there when the cap comes first)."""
    lo, hi = 1, max(1, MAX_ELEMS // N)
    if nbytes(hi, N, elem_size) < min_bytes:
        return hi
    while lo < hi:  # bytes grow with M
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if nbytes(mid, N, elem_size) >= min_bytes else (mid + 1, hi)
    return lo


def _random_shapes(op: str, seed: int, dtype: str = "bfloat16"):
    """Deterministic in (seed, op): each op its own widths, and a re-run the same cases."""
    from .providers import SPECS

    rng = random.Random(f"oink-random:{seed}:{op}")
    widths = random_widths(op, seed, rng)
    rows = {N: rows_moving(SPECS[op].nbytes, N, ELEM_SIZE[dtype]) for N in widths}
    shapes = [(M, N) for N, M in rows.items()]
    for N in widths[:DECODE_WIDTHS]:  # the narrowest, all <= DECODE_MAX_N (_varied_enough)
        decode = [M for M in range(1, DECODE_MAX_M + 1) if M != rows[N]]  # never the 64 MB case again
        shapes += [(M, N) for M in rng.sample(decode, DECODE_ROWS)]
    return sorted(shapes)


# The batch-invariance suite: the random suite's widths (drawn from --oink-seed) at one row each, every row also
# checked for batch invariance (bench_runner; its batches are the check's own, pytest_oink.invariance)
def _invariance_shapes(op: str, seed: int, dtype: str = "bfloat16"):
    return [(1, N) for N in random_widths(op, seed)]


# The fused QK norm + rotary embedding's suite: model shapes (qkv's width (Hq + 2 Hk) * D, heads as published:
# oink.reference.rope.MODELS, which the op's inputs read them from) at decode and prefill tokens.
QK_NORM_ROPE_MODELS = {"Qwen3-8B": 6144, "Qwen3-32B": 10240, "Gemma 3 27B": 8192, "Llama 4 Scout": 7168}
QK_NORM_ROPE_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def _qk_norm_rope_shapes(op: str):
    return [(T, N) for N in QK_NORM_ROPE_MODELS.values() for T in QK_NORM_ROPE_TOKENS]


# The training suite: lm heads of real models and their loss (``training.TRAINING_MODELS``: each model's
# tokens a step at its vocabulary).
def _training_shapes(op: str):
    model = TRAINING_MODELS.get(op)
    return [(M, model[1]) for M in model[4]] if model else []


DEDICATED = ("fp8", "training", "qk-norm-rope")  # suites that run only the ops whose spec names them (OpSpec.only_in)
HOST_TIMED = ("launch",)  # suites timed as eager calls on the host (bench_runner), not as kernels
SEEDED = ("random", "invariance")  # suites whose shapes are drawn from --oink-seed: called (op, seed, dtype)
SUITES = {
    "quack": lambda op: _quack_shapes(),
    "nvfp4": _nvfp4_shapes,
    "dsv3": _dsv3_shapes,
    "fp8": _fp8_shapes,
    "sweep": _sweep_shapes,
    "launch": lambda op: [(1, 4096), (128, 4096)],
    "smoke": lambda op: [(4, 128), (64, 1024)],
    "random": _random_shapes,
    "training": _training_shapes,
    "invariance": _invariance_shapes,
    "qk-norm-rope": _qk_norm_rope_shapes,
}
CHECKS_INVARIANCE = ("invariance",)  # suites whose rows are checked for batch invariance without the option
# what each suite is, and whether it is sized for a GPU (skipped on a CPU unless asked)
ABOUT = {
    "quack": ("Quack's benchmark shapes: N = 4096, M = batch x seq up to 2^31 / N", True),
    "dsv3": ("DeepSeek-V3 widths 6144-8192 (vocabularies 3072-12288 for cross-entropy), M 4096-65536", True),
    "nvfp4": ("the FP4 study's decode shapes, then M x N at scale (widths 2048-14336)", True),
    "launch": ("host cost of one eager call (M = 1 and 128, N = 4096): 400 calls, then one sync", False),
    "sweep": ("real models' widths 512-262144 and vocabularies 32000-256000 at decode and training rows", True),
    "fp8": ("the FP8 quantizers and fused ops: widths 4096-18432, rows 128-16384", True),
    "smoke": ("two tiny shapes a CPU runs in about a minute (reference timing, labelled)", False),
    "random": ("random widths 256-262144 drawn from --oink-seed per op (vocabularies 3072-262144 for "
               "cross-entropy; odd and non-power-of-two widths), rows moving >= 64 MB, plus decode rows 1-1024 "
               "at the 3 narrowest", True),
    "invariance": ("batch invariance of every op: the random suite's widths (drawn from --oink-seed), each checked "
                   "bit for bit alone, in batches of 1-4096 rows and as slices of up to 16384 (one timed row each)",
                   True),
    "training": ("lm head + loss, forward and backward (linear cross-entropy): Llama-3, Qwen-2.5 7B/14B, Gemma-2 "
                 "(softcap 30) vocabularies and hidden sizes, M 4096-32768 tokens; time and peak memory", True),
    "qk-norm-rope": ("fused per-head QK RMSNorm + rotary embedding on packed qkv (public and vLLM's in-place op): "
                     "Qwen3 8B/32B, Gemma 3 27B, Llama 4 Scout heads (N = qkv's width), T 1-16384 tokens", True),
}

# how long a suite took where it was measured (bench/RESULTS.md, "Suite runs"); None: not yet timed
DURATION = {
    "quack": "200 s on one H100 with every peer installed, compiles included",
    "dsv3": "219 s on one H100 with every peer installed, compiles included",
    "launch": "112 s on one H100 with every peer installed",
    "fp8": "73 s on one H100 for its M >= 4096 rows (oink, oink-unfused, torch.compile), before the static-scale "
           "entries",
    "smoke": "about a minute on a 2-core CPU",
    "nvfp4": None,
    "random": None,
    "training": None,
    "invariance": None,
    "qk-norm-rope": None,
    "sweep": "7.5 min on one H100 for its 12 norm, softmax and cross-entropy ops with every peer (1663 rows,"
             " before its 2048 x 131072 and 1024 x 262144 shapes)",
}


def duration(suite: str) -> str:
    return f"measured {DURATION[suite]}" if DURATION.get(suite) else "duration not measured yet"


def parse_configs(text: str) -> list[tuple[int, int]]:
    """'4096x7168,128x1024' -> [(4096, 7168), (128, 1024)]."""
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            m, n = part.split("x")
            shape = (int(m), int(n))
        except ValueError:
            raise ValueError(f"--oink-configs: {part!r} is not MxN") from None
        if min(shape) < 1:  # refused here: not as one failed row per (op, provider) at run time
            raise ValueError(f"--oink-configs: {part!r}: M and N must be at least 1")
        shapes.append(shape)
    if not shapes:
        raise ValueError("--oink-configs: no shapes given")
    return shapes


def bench_ops() -> tuple[str, ...]:
    """The ops the benchmark knows how to drive: one spec each in providers.SPECS."""
    from .providers import SPECS

    return tuple(SPECS)


def expand(suite: str, ops=None, configs=None, dtype: str = "bfloat16", seed: int | None = None) -> list[Case]:
    from .providers import SPECS

    if suite not in SUITES:
        raise ValueError(f"--oink-suite={suite!r}: known suites are {', '.join(SUITES)}")
    if suite in SEEDED and seed is None:
        raise ValueError(f"--oink-suite={suite} draws its shapes from a seed: give --oink-seed=N (ini oink_seed)")
    unknown = [op for op in (ops or []) if op not in SPECS]
    if unknown:
        raise ValueError(f"--oink-ops: unknown {unknown}; known: {', '.join(SPECS)}")
    cases = []
    for op in ops or SPECS:
        if suite not in SPECS[op].only_in and (SPECS[op].only_in or suite in DEDICATED):
            continue  # not this suite's op: its shapes are never drawn
        if configs:
            shapes = parse_configs(configs)
        else:
            shapes = SUITES[suite](op, seed, dtype) if suite in SEEDED else SUITES[suite](op)
        for M, N in shapes:
            if N % SPECS[op].block:  # FP4 blocks and FP8 groups must tile the row
                continue
            cases.append(Case(suite, op, M, N, dtype, seed if suite in SEEDED else None))
    return cases
