"""The one dispatch path: for an op and its tensors, run the CuTeDSL kernel or the reference.

Rules, in order: ``OINK_FORCE_REFERENCE=1`` forces the reference; non-CUDA tensors use the
reference; a GPU that is not SM90/SM100 uses the reference; an op with no kernel yet uses the
reference; the op's kernel may decline (dtype, width, layout) with a reason. Every decision
carries its reason: ``oink.explain(op, *args)`` (in ``oink.declare``) returns it and the
``oink.dispatch`` logger prints it at DEBUG level.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Callable

import torch

from . import config, reference
from .arch import arch_for_capability

log = logging.getLogger("oink.dispatch")


@dataclass(frozen=True)
class Route:
    op: str
    backend: str  # "kernel" or "reference"
    reason: str
    arch: str | None = None
    # the kernel's launch prepared for one argument layout (``prepare``), or None
    plan: Callable | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.op}: {self.backend} ({self.reason})"


# op -> a function returning the kernel module serving it: the table the declarations fill (``kernels=``
# of each op's declaration, ``oink.declare``; Oink's are in ``oink.ops``, which imports the module there)
# and the routes read. Dispatch never imports the declarations: a caller that launches by op name before
# calling any op (``launch``, ``prepare``: tests, tools) imports ``oink.ops`` first. A kernel module
# (imported only on a supported GPU, since it imports cutlass) exposes CHECKS[op](args, arch) -> None |
# reason, and PLANS[op](arch, args) -> the launch prepared for the layout of ``args`` (dtypes, shapes,
# strides, alignment, scalar values): a function of the arguments (any of that layout) returning the
# op's outputs. It is the only launch.
KERNEL_MODULES: dict[str, Callable[[], ModuleType]] = {}


def _kernel_module(op: str) -> ModuleType | None:
    load = KERNEL_MODULES.get(op)
    return None if load is None else load()


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> tuple[str | None, str]:
    """(CuTeDSL target or None, "major.minor") of CUDA device ``index``."""
    major, minor = torch.cuda.get_device_capability(index)
    arch = arch_for_capability(major, minor)
    if arch is not None:
        _use_card(torch.cuda.get_device_name(index))
    return arch, f"{major}.{minor}"


def _use_card(name: str) -> None:
    """Launch-table entries are chosen for one card a process: the first supported GPU routed to (a
    second model of card beside it runs the first's entries, or the rules, and says so once)."""
    from .kernels import launch_table

    if launch_table.CARD not in (None, name):
        log.warning("launch table: entries chosen for %s, not for %s in this process", launch_table.CARD, name)
        return
    launch_table.use_card(name)


def route(op: str, args: dict) -> Route:
    if config.get().force_reference:
        r = Route(op, "reference", "forced by OINK_FORCE_REFERENCE")
    else:
        device = next((v.device for v in args.values() if isinstance(v, torch.Tensor)), None)
        r = _route_device(op, device if device is not None else torch.device("cpu"), args)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s", r)
    return r


@functools.lru_cache(maxsize=None)
def _off_gpu(op: str, device_type: str) -> Route:
    return Route(op, "reference", f"{device_type} tensors: kernels run on CUDA only")


def _route_device(op: str, device: torch.device, args: dict) -> Route:
    """``args``: the op's arguments by name (tensors and scalars; the kernel checks read both)."""
    if device.type != "cuda":
        return _off_gpu(op, device.type)
    arch, cap = device_arch(device.index if device.index is not None else torch.cuda.current_device())
    if arch is None:
        return Route(op, "reference", f"compute capability {cap}: kernels target sm_90a and sm_100a")
    module = _kernel_module(op)
    if module is None:
        return Route(op, "reference", f"no CuTeDSL kernel for {op} yet", arch)
    why = module.CHECKS[op](args, arch)
    if why:
        return Route(op, "reference", why, arch)
    return Route(op, "kernel", f"CuTeDSL {arch}", arch)


def prepare(op: str, arch: str, args: dict) -> Callable:
    """``op``'s kernel launch on ``arch`` prepared for the layout of ``args`` (its compiled functions,
    grid, copies and output layouts chosen once): call it with ``args`` or any of the same layout."""
    module = _kernel_module(op)
    if module is None:
        raise LookupError(f"no kernel module for {op!r}: no declaration names one"
                          + ("" if KERNEL_MODULES else " (none imported yet: import oink.ops first)"))
    return module.PLANS[op](arch, args)


def launch(op: str, arch: str, **args):
    """Run ``op``'s kernel on ``arch`` once, with no checks and no route (tests, tools): the launch
    ``prepare`` makes for ``args``, called with them."""
    return prepare(op, arch, args)(args)


def with_plan(r: Route, args: dict) -> Route:
    """``r`` with its kernel launch prepared for ``args``' layout: a caller that reuses the route for
    arguments of the same layout (``oink.declare``) launches with no preparation."""
    if r.backend != "kernel":
        return r
    return replace(r, plan=prepare(r.op, r.arch, args))


def run(r: Route, args: dict):
    """Run ``r.op`` on route ``r`` (``args``: the reference's keyword arguments)."""
    if r.plan is not None:
        return r.plan(args)
    if r.backend == "kernel":
        return prepare(r.op, r.arch, args)(args)
    return getattr(reference, r.op)(**args)


def call(op: str, **args):
    """Run ``op`` on the route chosen for ``args``."""
    return run(route(op, args), args)
