"""The one registry of benchmark shape suites. No torch here; the ops are the bench specs' (providers.SPECS)."""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class Case:
    suite: str
    op: str
    M: int
    N: int
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.op}-{self.M}x{self.N}-{self.dtype}"


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


DEDICATED = ("fp8",)  # suites that run only the ops whose spec names them (OpSpec.only_in)
HOST_TIMED = ("launch",)  # suites timed as eager calls on the host (bench_runner), not as kernels
SUITES = {
    "quack": lambda op: _quack_shapes(),
    "nvfp4": _nvfp4_shapes,
    "dsv3": _dsv3_shapes,
    "fp8": _fp8_shapes,
    "sweep": _sweep_shapes,
    "launch": lambda op: [(1, 4096), (128, 4096)],
    "smoke": lambda op: [(4, 128), (64, 1024)],
}
# what each suite is, and whether it is sized for a GPU (skipped on a CPU unless asked)
ABOUT = {
    "quack": ("Quack's benchmark shapes: N = 4096, M = batch x seq up to 2^31 / N", True),
    "dsv3": ("DeepSeek-V3 widths 6144-8192 (vocabularies 3072-12288 for cross-entropy), M 4096-65536", True),
    "nvfp4": ("the FP4 study's decode shapes, then M x N at scale (widths 2048-14336)", True),
    "launch": ("host cost of one eager call (M = 1 and 128, N = 4096): 400 calls, then one sync", False),
    "sweep": ("real models' widths 512-262144 and vocabularies 32000-256000 at decode and training rows", True),
    "fp8": ("the FP8 quantizers and fused ops: widths 4096-18432, rows 128-16384", True),
    "smoke": ("two tiny shapes a CPU runs in about a minute (reference timing, labelled)", False),
}

# how long a suite took where it was measured (bench/RESULTS.md, "Suite runs"); None: not yet timed
DURATION = {
    "quack": "200 s on one H100 with every peer installed, compiles included",
    "dsv3": "219 s on one H100 with every peer installed, compiles included",
    "launch": "112 s on one H100 with every peer installed",
    "fp8": "73 s on one H100 for its M >= 4096 rows (oink, oink-unfused, torch.compile)",
    "smoke": "about a minute on a 2-core CPU",
    "nvfp4": None,
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
            shapes.append((int(m), int(n)))
        except ValueError:
            raise ValueError(f"--oink-configs: {part!r} is not MxN") from None
    if not shapes:
        raise ValueError("--oink-configs: no shapes given")
    return shapes


def bench_ops() -> tuple[str, ...]:
    """The ops the benchmark knows how to drive: one spec each in providers.SPECS."""
    from .providers import SPECS

    return tuple(SPECS)


def expand(suite: str, ops=None, configs=None, dtype: str = "bfloat16") -> list[Case]:
    from .providers import SPECS

    if suite not in SUITES:
        raise ValueError(f"--oink-suite={suite!r}: known suites are {', '.join(SUITES)}")
    unknown = [op for op in (ops or []) if op not in SPECS]
    if unknown:
        raise ValueError(f"--oink-ops: unknown {unknown}; known: {', '.join(SPECS)}")
    cases = []
    for op in ops or SPECS:
        shapes = parse_configs(configs) if configs else SUITES[suite](op)
        for M, N in shapes:
            if N % SPECS[op].block:  # FP4 blocks and FP8 groups must tile the row
                continue
            if suite not in SPECS[op].only_in and (SPECS[op].only_in or suite in DEDICATED):
                continue
            cases.append(Case(suite, op, M, N, dtype))
    return cases
