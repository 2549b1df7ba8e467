"""The registry of (op, provider) -> builder (``provider``, ``PROVIDERS``, ``LABELS``) and the helpers builders
share (a peer's builders recorded for registration: ``Peer``; a peer's module, the GPU-only refusal, torch.compile
with dynamic rows). ``pytest_oink.providers`` registers Oink's and torch's builders for the bench entries' ops and
calls ``pytest_oink.peers.register`` (one module a peer library) and ``pytest_oink.training.register``; all import
from here, none imports another's builders. No torch at import."""
from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from oink.measure.gate import Unavailable

PROVIDERS: dict[tuple[str, str], Callable] = {}
LABELS: dict[tuple[str, str], str] = {}  # (op, provider) -> note shown in reports
# every provider the plugin registers, in the order listings name them (a user's oink_measure rows may name others)
ALL_PROVIDERS = ("oink", "oink-unfused", "quack", "liger", "flashinfer", "flashinfer-cuda", "vllm", "torch",
                 "torch.compile")
EPS = 1e-6  # the bench entries' eps (oink/reference/bench.py), which the peers' calls pass


def provider(op: str, name: str, label: str = ""):
    def deco(builder):
        PROVIDERS[(op, name)] = builder
        if label:
            LABELS[(op, name)] = label
        return builder

    return deco


class Peer:
    """A provider's builders (a peer library's, or Oink's unfused compositions), recorded beside their code by
    ``serves`` and put in the registry by ``register`` (``pytest_oink.peers.register``, once)."""

    def __init__(self, name: str):
        self.name = name
        self.builders: list[tuple[str, str, str, Callable]] = []  # (op, provider, label, builder)

    def serves(self, op: str, label: str = "", name: str | None = None):
        """A decorator: the builder serves ``op`` as provider ``name`` (default: the peer's)."""
        def record(builder):
            self.builders.append((op, name or self.name, label, builder))
            return builder

        return record

    def register(self) -> None:
        for op, name, label, builder in self.builders:
            provider(op, name, label)(builder)


def peer(module: str, pip_name: str):
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise Unavailable(f"{pip_name} not installed")
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (a peer that fails to import is unavailable, with its reason)
        raise Unavailable(f"{pip_name} failed to import: {e}") from None


def needs_cuda(device):
    if device.type != "cuda":
        raise Unavailable("GPU-only provider; no CUDA device")


# inputs whose first dim is never the rows (N; a static scale's 1; qk_norm_rope's per-head weights and its cache)
PARAMS = ("weight", "bias", "scale", "q_weight", "k_weight", "cos_sin_cache")


def torch_compile(fn):
    """``torch.compile(fn)``, torch's own deprecation warnings of Inductor's first import muted: Inductor imports
    torch.utils.mkldnn, whose ScriptModules use ``torch.jit.script_method``, which torch deprecates (14
    warnings in a session's summary, none of them of our code or the user's). Only that message, only there."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated",
                                category=DeprecationWarning)
        import torch._inductor.compile_fx  # noqa: F401  (what torch.compile imports first: its warnings here)
    return torch.compile(fn)


def compiled(fn, *first):
    """torch.compile of ``fn(*first, args)`` with the rows dimension marked dynamic on first sight (torch's
    ``maybe_mark_dynamic``: Inductor may still specialize it): one compile serves every M, as the
    automatic-dynamic recompile of torch's default would from the second M on, without compiling a
    static kernel first. N stays static."""
    import torch

    fn_compiled = torch_compile(fn)
    mark = torch._dynamo.maybe_mark_dynamic

    def run(a):
        x = next(v for v in a.values() if isinstance(v, torch.Tensor))
        rows = x.shape[0] if x.dim() > 1 else None
        for name, v in a.items():
            if (rows is not None and isinstance(v, torch.Tensor) and name not in PARAMS and v.dim()
                    and v.shape[0] == rows and not hasattr(v, "_dynamo_weak_dynamic_indices")):
                mark(v, 0)
        return fn_compiled(*first, a)

    return run
