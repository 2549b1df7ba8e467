"""The builders of Oink, torch eager, torch.compile and the peers for each op (registered in
``registry``: (op, provider) -> a callable builder), and the per-op benchmark specs.

A spec makes inputs (keyword arguments of the op's reference signature), computes the fp32
reference outputs, and counts the bytes the op must move. Oink's ops declare theirs beside their
references (``oink.reference.BENCH``: each family module's entries, ``oink/reference/bench.py``):
``SPECS`` is built from them on first use (they import torch), with the training suite's. A
provider's builder returns a callable ``run(args) -> outputs`` (outputs in the order the reference
gives them), or raises ``Unavailable`` with the reason (peer not installed, op or arch not
supported); Oink, torch eager and torch.compile serve every such op (their builders are here), the peers
(``pytest_oink.peers``, one module a library, registered with the specs) the ops they have. Peers that do out
of place what Oink does in place are timed with the copies that make the semantics equal, and their label says
so. Imports of torch and peers happen inside builders only.
"""
from __future__ import annotations

import importlib

from oink.measure.gate import GATE_VIEWS, OpSpec, Unavailable, spec_of
from oink.measure.gate import reference_module as _R

from . import peers, training
from .registry import ALL_PROVIDERS, EPS, LABELS, PROVIDERS, provider
from .registry import compiled as _compiled
from .registry import torch_compile

# with SPECS (a module attribute built on first use): the spec type, the gate's views and the registry, for the
# plugin and the tests (the tuner builds its specs with oink.measure.gate too)
__all__ = ["ALL_PROVIDERS", "EPS", "GATE_VIEWS", "LABELS", "OpSpec", "PROVIDERS", "Unavailable", "build",
           "provider", "providers_for", "spec_of", "specs"]


def specs() -> dict:
    """``SPECS``: each bench entry's spec, then the training suite's, built once (importing the entries,
    which import torch); Oink, torch eager and torch.compile registered as each op's providers, and the peers'."""
    built = globals().get("SPECS")
    if built is None:
        from oink.reference import BENCH

        _ENTRIES.update(BENCH)
        peers.register()
        built = {op: spec_of(b) for op, b in BENCH.items()}
        for op in built:
            for name, builder in (("oink", _oink_builder), ("torch", _torch_builder),
                                  ("torch.compile", _compile_builder)):
                PROVIDERS.setdefault((op, name), builder(op))  # one registered before stays
        built.update(training.register())  # the training suite's providers too
        globals()["SPECS"] = built
    return built


_ENTRIES: dict = {}  # op -> its bench entry (torch.compile compiles the entry's own call: see _compile_builder)


def __getattr__(name: str):
    if name == "SPECS":  # built on first use (see specs)
        return specs()
    if name == "MX_FUSED_GATE":  # the fused MXFP4 entries' families: (code ratios, scale bytes)
        return importlib.import_module("oink.reference.nvfp4").MX_FUSED_GATE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------ providers
def _oink_builder(op: str):
    def build(device):
        import oink

        call = specs()[op].oink
        return lambda a: call(oink, a)

    return build


# torch eager and torch.compile run the op's reference (the PyTorch a user would write: its row sums torch's own,
# not the fixed tree the references keep for batch-invariant fallbacks, oink.reference.sums)
def _torch_builder(op: str):
    def build(device):
        from oink.reference.sums import with_torch_reductions

        return with_torch_reductions(specs()[op].reference)

    return build


def _compile_builder(op: str):
    def build(device):
        if specs()[op].mutates == ("x", "residual") and device.type != "cuda":
            return _compiled_out_of_place_with_copies()
        # the entry's call compiled, on oink.reference: the spec's reference is one lambda for every op (and a
        # partial, a wrapper of torch's), where torch.compile's cache of one function recompiles 8 times, then
        # runs it eagerly
        from oink.reference.sums import with_torch_reductions

        return with_torch_reductions(_compiled(_ENTRIES[op].call, _R()))

    return build


def _compiled_out_of_place_with_copies():
    """Inductor on CPU fails to compile the in-place reference (KeyError in its loop body,
    torch 2.13); the functional form plus the two copies has the same semantics."""
    def functional(x, r, w):
        h = (x.float() + r.float()).to(r.dtype)
        return _R().rmsnorm_forward(h, w, eps=EPS)[0], h

    f = torch_compile(functional)

    def run(a):
        y, h = f(a["x"], a["residual"], a["weight"])
        a["x"].copy_(y)
        a["residual"].copy_(h)
        return a["x"], a["residual"]

    run.label = "on CPU: compiled out of place + 2 copies"  # this device's rows only (see run_case)
    return run


def providers_for(op: str, wanted=None) -> list[str]:
    specs()
    names = [p for p in ALL_PROVIDERS if (op, p) in PROVIDERS]
    return [p for p in names if wanted is None or p in wanted]


def build(op: str, name: str, device):
    specs()
    try:
        builder = PROVIDERS[(op, name)]
    except KeyError:
        raise Unavailable(f"no provider {name!r} for {op}") from None
    return builder(device)

