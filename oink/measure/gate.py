"""The correctness gate: an op's outputs (Oink's or a peer's) against its fp32 reference, on 3 independently
seeded inputs, with error stats; and the bench specs it gates (``OpSpec``: an op's inputs, reference, bytes
moved and tolerance families), built from Oink's bench entries (``spec_of``, ``oink.reference.BENCH``).

A failure reports max abs error, relative L2 error, p99 abs error and the first mismatching index;
NaN/Inf mismatches are reported on their own, and a NaN never passes. The pytest plugin's rows
(``pytest_oink.bench_runner``) and the tuner's trials (``oink.tune``) pass this one gate; pytest_oink
re-exports what it uses from here. Imports of torch happen inside functions only.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import asdict, dataclass
from typing import Callable

from .tolerances import FAMILIES, tolerance


@dataclass(frozen=True)
class Case:
    """One shape of an op in a suite (``pytest_oink.suites``; the tuner's are of the suite "tune")."""
    suite: str
    op: str
    M: int
    N: int
    dtype: str
    seed: int | None = None  # the --oink-seed a random suite's shapes were drawn from

    @property
    def id(self) -> str:
        return f"{self.op}-{self.M}x{self.N}-{self.dtype}"


class Unavailable(Exception):
    """The provider can't run this op here (the message says why)."""


@dataclass(frozen=True)
class OpSpec:
    family: str | tuple  # tolerance family, or one per output
    make_inputs: Callable  # (M, N, dtype, device, gen) -> dict of reference kwargs
    reference: Callable  # args -> tuple of outputs (fp32 arithmetic)
    nbytes: Callable  # (M, N, elem_size) -> bytes moved
    mutates: tuple = ()  # in-place ops: names of the args that are the outputs
    gate_view: Callable | None = None  # outputs -> what the gate compares (both sides), if not the outputs
    oink: Callable = None  # (oink module, args) -> outputs: the op through Oink's public API
    block: int = 1  # N must be a multiple of it (the FP4 blocks, FP8 groups)
    only_in: tuple = ()  # the suites that run it (empty: every suite)
    # whether the provider "oink" (or a user's own kernel, for a spec of the user's) promises batch invariance for
    # it, or (N, torch dtype) -> that promise at a width (oink.batch_invariant): with --oink-batch-invariance such
    # a row that breaks a promise fails; a peer's verdict, and one not promised, is reported
    batch_invariant: bool | Callable = False

    def __post_init__(self):
        # a misspelt family would silently gate with the dtype's default bounds
        for family in self.family if isinstance(self.family, tuple) else (self.family,):
            if family not in FAMILIES:
                raise ValueError(f"OpSpec: unknown tolerance family {family!r}; known: {', '.join(FAMILIES)}")


def _fp4_code_steps(outputs):
    """(q, sf) -> (signed E2M1 magnitude index per element, scale byte as a number): one step
    of either is 1.0 (E4M3 bytes of positive scales are ordered), and -0/+0 codes compare equal.
    The fused ops compute v in another order than the reference, and the unfused peer rounds y
    to x's dtype before quantizing, so the gate holds both to one step; the GPU tests hold the
    fused kernels to exact scales and >= 99.9% exact codes."""
    import torch

    q, sf = outputs[0], outputs[1]
    codes = torch.stack([q & 0xF, q >> 4], -1).reshape(q.shape[0], -1).float()
    signed = torch.where(codes >= 8, -(codes - 8), codes)
    return signed, sf.view(torch.uint8).float()


def _mx_block_ratios(outputs):
    """(q, sf) -> (each signed E2M1 value over its block's largest magnitude, scale byte). Fused
    MXFP4 ops may pick the next power-of-two scale where their fp32 amax and the reference's fall
    on either side of a power of two (often, for a peer that rounds v to bf16 first), which moves
    every code of the block; the ratio moves little (see the tolerance table), and the scale byte
    by one. The GPU tests hold the fused kernels to one code step where the scales agree."""
    import torch

    from oink.reference.nvfp4 import E2M1_VALUES

    q, sf = outputs[0], outputs[1]
    codes = torch.stack([q & 0xF, q >> 4], -1).reshape(q.shape[0], -1).long()
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=q.device)
    vals = table[codes].reshape(q.shape[0], -1, 32)
    top = vals.abs().amax(-1, keepdim=True)
    ratio = torch.where(top > 0, vals / top.clamp_min(0.5), torch.zeros_like(vals))
    return ratio.reshape(q.shape[0], -1), sf.view(torch.uint8).float()


def _fp8_code_steps(outputs):
    """(q, scales) -> (signed e4m3 ordinal per element, scales): one ordinal step is one code
    step (positive e4m3 bytes are ordered), -0 and +0 compare equal. Fused ops round v in another
    order than the reference, so the gate holds codes to one step and scales to the tolerance
    table's; the GPU tests hold the plain quantizers to bit-exact codes and scales."""
    import torch

    b = outputs[0].view(torch.uint8).reshape(outputs[0].shape[0], -1).int()
    signed = torch.where(b >= 128, -(b - 128), b).float()
    return signed, outputs[1].float()


def reference_module():
    """``oink.reference``, found when called (an --oink-against worker's is the other tree's)."""
    return importlib.import_module("oink.reference")


# the views a bench entry's gate may compare instead of the outputs (``Bench.gate_view``)
GATE_VIEWS = {"fp4_code_steps": _fp4_code_steps, "mx_block_ratios": _mx_block_ratios,
              "fp8_code_steps": _fp8_code_steps}


def spec_of(b) -> OpSpec:
    """An Oink op's spec from its bench entry (``oink.reference.bench.Bench``): the reference is the entry's
    call on ``oink.reference``, the Oink call the same on ``oink`` (or the entry's own), each module found
    when called (an --oink-against worker's are the other tree's)."""
    view = None
    if b.gate_view is not None:
        if b.gate_view not in GATE_VIEWS:
            raise ValueError(f"unknown gate view {b.gate_view!r}; known: {', '.join(GATE_VIEWS)}")
        view = GATE_VIEWS[b.gate_view]
    return OpSpec(b.family, b.inputs, lambda a: b.call(reference_module(), a), b.nbytes, mutates=b.mutates,
                  gate_view=view, oink=b.oink or b.call, block=b.block, only_in=b.only_in,
                  batch_invariant=_aligned_rows)


def _aligned_rows(N: int, dtype) -> bool:
    """Oink's promise of batch invariance at a width (``oink.batch_invariant``'s rule)."""
    from oink.declare import aligned_rows

    return aligned_rows(N, dtype)


@dataclass
class GateStats:
    max_abs: float
    rel_l2: float
    p99_abs: float
    first_mismatch: tuple | None
    nonfinite_mismatches: int
    mismatches: int
    numel: int
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return self.mismatches == 0 and self.nonfinite_mismatches == 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["first_mismatch"] = list(self.first_mismatch) if self.first_mismatch is not None else None
        d["passed"] = self.passed
        return d

    def report(self, what: str = "output") -> str:
        lines = [f"{what}: {self.mismatches} of {self.numel} elements outside atol={self.atol:g}, rtol={self.rtol:g}"]
        if self.nonfinite_mismatches:
            lines.append(f"  NaN/Inf mismatches: {self.nonfinite_mismatches}")
        lines.append(f"  max abs err {self.max_abs:.4g}; rel L2 err {self.rel_l2:.4g}; p99 abs err {self.p99_abs:.4g}")
        if self.first_mismatch is not None:
            lines.append(f"  first mismatch at index {self.first_mismatch}")
        return "\n".join(lines)


def compare(actual, expected, atol: float, rtol: float) -> GateStats:
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    fin_a, fin_e = torch.isfinite(a), torch.isfinite(e)
    # an infinity passes only against the same infinity; a NaN never passes
    nonfinite_bad = (~fin_a | ~fin_e) & ~(a == e)
    both = fin_a & fin_e
    diff = torch.where(both, (a - e).abs(), torch.zeros_like(a))
    bad = (both & (diff > atol + rtol * e.abs())) | nonfinite_bad
    n = a.numel()
    idx = None
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    denom = float(torch.linalg.vector_norm(torch.where(both, e, torch.zeros_like(e))))
    num = float(torch.linalg.vector_norm(diff))
    p99 = float(torch.quantile(diff.reshape(-1)[: 2**24].float(), 0.99)) if n else 0.0
    return GateStats(
        max_abs=float(diff.max()) if n else 0.0,
        rel_l2=num / denom if denom > 0 else num,
        p99_abs=p99,
        first_mismatch=idx,
        nonfinite_mismatches=int(nonfinite_bad.sum()),
        mismatches=int(bad.sum()),
        numel=n,
        atol=atol,
        rtol=rtol,
    )


GATE_SEEDS = (1, 2, 3)
# The gate checks at most this many elements per input: huge shapes are gated on their first
# rows (same compiled kernel: M is a runtime argument), keeping fp32 references within memory
# and the suites' gate time small next to their timing.
GATE_MAX_ELEMS = 2**25
# The reference outputs of the case being gated, per seed: every provider of a case is compared
# with the same ones (the eager reference of the FP4 ops is slow: computed once, not per provider).
_EXPECTED: dict = {}


def _clone(args):
    import torch

    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def inputs(spec, case, dtype, device, seed):
    """The op's keyword arguments for ``case`` (its M x N) drawn from ``seed``."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return spec.make_inputs(case.M, case.N, dtype, device, gen)


def _first_line(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text.splitlines()[0][:300]


def provider_compile_failed(e: Exception) -> bool:
    """A torch.compile backend that cannot compile the reference (e.g. Inductor on CPU has no type for
    float8_e8m0fnu): the provider is unavailable here, not wrong."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._inductor.exc import InductorError
    except ImportError:  # another torch layout: judge by name
        return type(e).__name__ in ("BackendCompilerFailed", "InductorError")
    return isinstance(e, (BackendCompilerFailed, InductorError))


def out_of_memory(e: Exception) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError)


def refusal(error_line: str) -> str:
    """An out-of-memory error (its first line) as the reason a row was not run, the memory it held
    freed first: a provider that needs more memory than the device has at a shape refuses it, it
    does not fail. Called outside the ``except`` block, so the error's frames are gone."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return f"out of memory at this shape ({error_line[:200]})"


def refusing_out_of_memory(call, what: str = ""):
    """``call()``; out of memory in it raises Unavailable (a refusal, ``what`` before its reason), raised after
    the ``except`` block so that the error's frames, and the tensors they hold, are gone first."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001  (re-raised unless it is an out-of-memory refusal)
        if not out_of_memory(e):
            raise
        oom = _first_line(e)
    raise Unavailable(what + refusal(oom))


def _outputs(out) -> tuple:
    """A callable's outputs as a tuple: a single tensor returned bare is one output (``len`` of a
    tensor would count its rows)."""
    import torch

    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def gate(spec, run, case, dtype, device) -> dict:
    """Worst error stats over the seeds; ``passed`` False if any output of any seed fails or the
    provider raises (the exception is the report)."""
    rows = max(1, min(case.M, GATE_MAX_ELEMS // max(case.N, 1)))
    if 8 < rows < case.M:
        rows -= rows % 8  # capped: whole 8-row groups, as the suites' M are (peers' matmul paths need them)
    case = dataclasses.replace(case, M=rows)
    worst = {"passed": True, "max_abs": 0.0, "rel_l2": 0.0, "p99_abs": 0.0, "rows_checked": rows}
    for seed in GATE_SEEDS:
        args = inputs(spec, case, dtype, device, seed)
        key = (id(spec), case.op, case.M, case.N, str(dtype), str(device), seed)
        held = _EXPECTED.get(key)
        if held is not None and held[0] is spec:  # the spec is held too, so its id is not reused
            expected = held[1]
        else:
            if seed == GATE_SEEDS[0]:
                _EXPECTED.clear()  # one case's outputs at a time
            # no reference, no gate: the row is not run
            expected = refusing_out_of_memory(lambda: spec.reference(_clone(args)), "the reference: ")
            _EXPECTED[key] = (spec, expected)
        oom = None
        try:
            actual = run(_clone(args))
        except Unavailable:  # a provider that finds it can't serve these inputs says so
            raise
        except Exception as e:  # noqa: BLE001  (a crashing provider is a failed row, not a crashed session)
            if provider_compile_failed(e):
                raise Unavailable(f"torch.compile could not compile it here: {_first_line(e)}") from None
            if not out_of_memory(e):
                worst["passed"] = False
                worst["report"] = f"seed {seed}: raised {type(e).__name__}: {e}"
                return worst
            oom = _first_line(e)
        if oom is not None:  # raised here, its frames (and their tensors) gone with the exception
            raise Unavailable(refusal(oom))
        actual, expected = _outputs(actual), _outputs(expected)
        if len(actual) != len(expected):
            worst["passed"] = False
            worst["report"] = f"seed {seed}: {len(actual)} outputs, expected {len(expected)}"
            return worst
        if spec.gate_view is not None:
            actual, expected = spec.gate_view(actual), spec.gate_view(expected)
        families = spec.family if isinstance(spec.family, tuple) else (spec.family,) * len(expected)
        for i, (a, e) in enumerate(zip(actual, expected)):
            if tuple(a.shape) != tuple(e.shape):
                worst["passed"] = False
                worst["report"] = f"seed {seed}: output {i} has shape {tuple(a.shape)}; expected {tuple(e.shape)}"
                return worst
            atol, rtol = tolerance(families[i], e.dtype)
            if families[i] == "weight_grad":  # sums over rows: absolute error grows with the magnitude
                atol *= max(1.0, float(e.float().abs().max()))
            st = compare(a, e, atol, rtol)
            for k in ("max_abs", "rel_l2", "p99_abs"):
                worst[k] = max(worst[k], getattr(st, k))
            if not st.passed:
                worst["passed"] = False
                worst["report"] = st.report(f"seed {seed}, output {i}")
                return worst
    return worst
