"""Batch invariance: whether a row's output bits depend only on that row's inputs, never on how many rows
were computed with it.

Engines' deterministic modes (vLLM's ``VLLM_BATCH_INVARIANT``, SGLang's) need it: a token's result must be
bit-identical whether it runs alone, in a decode batch or in a prefill. ``check`` runs any op the plugin can
run (an ``OpSpec`` and a callable: ours, a peer's or a user's own kernel) on one large batch, then on rows
alone, on sub-batches of several sizes (vLLM's 255/256/300 among them) and on slices starting mid-batch, and
compares every row-wise output bit for bit with the large batch's rows. Outputs that are not row-wise (a
dweight summed over the rows, a static scale) are left out, and said so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import registry

# Batch sizes checked: rows alone, decode batches, vLLM's 255 / 256 / 300 (its test compares 255 rows with the
# first 255 of 300), powers of two; each is compared with the same rows of one batch of ``BIG`` rows.
SIZES = (1, 3, 16, 64, 255, 256, 300, 1024, 4096)
BIG = 16384
# the large batch's row tensors stay within this many bytes each (wide rows check fewer rows)
MAX_TENSOR_BYTES = 2**30
# inputs shared by every row, never sliced: the ones torch.compile's rows never mark (registry), and the 1-element
# bounds and scales whose first dim a single row's batch would take for rows
PARAMS = (*registry.PARAMS, "scale_ub", "global_scale")


@dataclass
class Verdict:
    """What ``check`` found: ``held`` unless some row-wise output differs in any bit."""
    op: str
    N: int
    dtype: str
    held: bool = True
    big: int = 0  # rows of the large batch every sub-batch was compared with
    sizes: tuple = ()  # the sub-batch sizes compared
    outputs: tuple = ()  # indices of the outputs compared (row-wise)
    left_out: tuple = ()  # indices of the outputs not compared (not row-wise)
    differing: list = field(default_factory=list)  # (M, first row, output index, elements that differ)

    def report(self) -> str:
        where = f"{self.op} N={self.N} {self.dtype}"
        if self.held:
            return (f"{where}: batch-invariant (rows alone and batches of {', '.join(map(str, self.sizes))} against "
                    f"{self.big} rows; outputs {list(self.outputs)} compared bit for bit"
                    + (f", {list(self.left_out)} not row-wise" if self.left_out else "") + ")")
        lines = [f"{where}: NOT batch-invariant against a batch of {self.big} rows:"]
        lines += [f"  M={m} (rows {start}..{start + m - 1}): output {i}: {count} elements differ"
                  for m, start, i, count in self.differing[:20]]
        if len(self.differing) > 20:
            lines.append(f"  ... {len(self.differing) - 20} more")
        return "\n".join(lines)


def big_rows(N: int, itemsize: int, sizes=SIZES, big: int = BIG) -> int:
    """The large batch's rows at width N: ``big``, fewer where a row tensor would pass ``MAX_TENSOR_BYTES``
    (never fewer than the largest size that still fits, nor than 2 x the smallest)."""
    fits = max(1, MAX_TENSOR_BYTES // max(1, N * max(itemsize, 4)))
    return max(min(big, fits), 2 * min(sizes))


def _bits(t):
    """The tensor's bits as integers of its element size (NaN payloads and -0 kept apart)."""
    import torch

    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    t = t.contiguous()
    return t.view(by_size[t.element_size()]) if t.element_size() in by_size else t.view(torch.uint8)


def _rows_of(args: dict, rows: int) -> list[str]:
    import torch

    return [k for k, v in args.items()
            if isinstance(v, torch.Tensor) and k not in PARAMS and v.dim() and v.shape[0] == rows]


def _take(args: dict, names, start: int, m: int, view: bool = False) -> dict:
    """Rows [start, start + m) of the row tensors: new, dense tensors (a sub-batch as a caller would build
    it), or with ``view`` views into a copy of the whole batch (a slice of an engine's buffer: another
    offset, so another alignment); the shared inputs cloned, so an op writing in place writes its own copy."""
    import torch

    def rows(v):
        return v.clone()[start:start + m] if view else v[start:start + m].clone()

    return {k: (rows(v) if k in names else v.clone()) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}


def _outputs(out) -> tuple:
    import torch

    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def row_wise(full: tuple, part: tuple, big: int, m: int) -> list[int]:
    """Indices of the outputs that are row-wise: M rows in the sub-batch's outputs and ``big`` in the large
    batch's (a sum over rows, such as dweight, has the same shape in both)."""
    import torch

    return [i for i, (f, p) in enumerate(zip(full, part))
            if isinstance(f, torch.Tensor) and isinstance(p, torch.Tensor) and f.dim() and p.dim()
            and f.shape[0] == big and p.shape[0] == m and m != big and f.shape[1:] == p.shape[1:]]


def check(spec, run, N: int, dtype, device, *, sizes=SIZES, big: int = BIG, seed: int = 0,
          op: str = "custom") -> Verdict:
    """Whether ``run`` (the inputs' dict -> outputs, as the gate calls it) is batch-invariant at width N: one
    batch of ``big_rows`` rows from ``spec.make_inputs``, then each size in ``sizes`` (that fits) from row 0 as
    new tensors and from a row in the middle as views into the batch, rows alone (views and new tensors) and
    a batch of new tensors from row 1, each compared bit for bit with the large batch's rows. ``dtype``: a torch
    dtype."""
    import torch

    big = big_rows(N, torch.empty((), dtype=dtype).element_size(), sizes, big)
    gen = torch.Generator(device=device).manual_seed(seed)
    args = spec.make_inputs(big, N, dtype, device, gen)
    names = _rows_of(args, big)
    if not names:
        raise ValueError(f"{op}: no input has {big} rows: nothing to slice (a spec's row tensors have M rows)")
    full = _outputs(run(_take(args, names, 0, big)))
    used = tuple(m for m in sizes if m < big)
    verdict = Verdict(op, N, str(dtype).replace("torch.", ""), big=big, sizes=used)
    cases = [(m, 0, False) for m in used] + [(m, (big - m) // 2 + 1, True) for m in used]
    # rows alone and a batch as new tensors from rows off the start: each row at another offset than in the
    # batch (a kernel splitting a row by its address would show it)
    cases += [(1, big - 1, True), (1, big // 2 + 1, False), (1, big - 1, False), (min(255, big - 1), 1, False)]
    compared, left_out = set(), set()
    for m, start, view in cases:
        part = _outputs(run(_take(args, names, start, m, view)))
        rows = row_wise(full, part, big, m)
        compared.update(rows)
        left_out.update(i for i in range(len(full)) if i not in rows)
        for i in rows:
            a, b = _bits(part[i]), _bits(full[i][start:start + m])
            count = int((a != b).sum())
            if count:
                verdict.held = False
                verdict.differing.append((m, start, i, count))
    verdict.outputs = tuple(sorted(compared))
    verdict.left_out = tuple(sorted(left_out - compared))
    if not compared:
        raise ValueError(f"{op}: no output is row-wise (M rows): nothing to compare")
    return verdict
