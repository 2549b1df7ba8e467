"""One declaration per op: ``@declare(schema, ...)`` over the op's validation function.

The decorated function's signature is the public one (``oink.<name>``, the reference's), its
docstring the public docs, its body the metadata checks (run on FakeTensors too). From it come:

- ``torch.ops.oink.<op>``: defined from ``schema`` on one ``torch.library.Library`` with a
  CompositeExplicitAutograd kernel (one Python hop: several times cheaper than ``custom_op``),
  a fake built from ``fake``, and autograd where the op registers it;
- the public function ``oink.<name>``: in eager mode it validates once and goes straight to
  ``dispatch.run`` (kernel or reference); under torch.compile, inside a dispatch mode or a
  functorch transform, with tensor subclasses, or when a differentiable op must record a graph, it
  calls the custom op instead;
- the dispatch route (``kernels``: a function importing and returning the kernel module whose
  CHECKS/PLANS serve it, called on the first dispatch to a supported GPU) and ``oink.explain``.

Optional outputs: the custom op can't return None, so an output not asked for is an empty tensor
of the first input's dtype (the fake follows the same rule); ``to_public`` turns the op's outputs
back into the public ones (None where not asked for).
"""
from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from . import config, dispatch, reference
from .checks import no_internal_overlap, writable
from .kernels.row_rules import MAX_N

LIB = torch.library.Library("oink", "DEF")
PUBLIC: dict[str, "Op"] = {}  # name -> op, for every public oink.<name>
OPS: dict[str, "Op"] = {}  # torch.ops.oink.<op_name> -> its declaration

_PARAMETER = torch.nn.Parameter
# torch's own calls, bound once: every eager call makes them
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_transforms = torch._C._are_functorch_transforms_active
_increment_version = torch._C._increment_version  # what torch.autograd.graph.increment_version calls
# a set: one hash lookup per value (a tuple compares a value's type with each in turn: with all six for
# a tensor or None)
_KEY_SCALARS = frozenset((bool, int, float, str, torch.dtype, type(None)))
# a bool's key: True == 1 == 1.0 (and hashes alike), but the checks take a bool and a number apart
_BOOL_KEYS = {True: object(), False: object()}


def _layout_key(values, grad: bool = False):
    """What the metadata checks and the route read of the arguments: each tensor's dtype, shape,
    strides, device and 16-byte alignment, each scalar's value; None if an argument is neither (or
    has no strides). False where an eager call must take the custom op instead: a tensor subclass,
    or with ``grad`` a tensor that requires grad. One pass: this runs on every call, so a value that
    leaves no key only clears ``keyed`` (the pass goes on, looking for a reason to return False)."""
    key = []
    add = key.append
    keyed = True
    for v in values:
        t = type(v)
        if t in _KEY_SCALARS:  # before isinstance, which costs more
            add(_BOOL_KEYS[v] if t is bool else v)
        elif t is Tensor or t is _PARAMETER:
            if grad and v.requires_grad:
                return False
            try:
                add((v.dtype, v.shape, v.stride(), v.device, v.data_ptr() & 15))
            except RuntimeError:  # no strides or storage (sparse, nested): checked on every call
                keyed = False
        elif isinstance(v, Tensor):
            return False
        else:
            keyed = False
    return tuple(key) if keyed else None


def _eager_key(values, differentiable: bool = False):
    """The layout key of a call that may skip the dispatcher (plain tensors, no compile, dispatch
    mode or functorch transform, and for a differentiable op no autograd graph to record), or
    False where it must take the custom op."""
    if torch.compiler.is_compiling() or _dispatch_modes():
        return False
    if _functorch_transforms():
        return False
    return _layout_key(values, differentiable and torch.is_grad_enabled())


def _needs_graph(values) -> bool:
    return torch.is_grad_enabled() and any(isinstance(v, Tensor) and v.requires_grad for v in values)


class Op:
    """An op as declared: see the module docstring."""

    def __init__(self, check: Callable, schema: str, *, kernels: Callable[[], ModuleType] | None,
                 fake: Callable | None,
                 route: str | None = None, fixed: dict | None = None, to_public: Callable | None = None,
                 check_values: Callable | None = None, public: bool = True, backward: tuple | None = None,
                 autograd: bool = True, eager_unfixed: bool = False, batch_invariant: bool = True):
        self.name = check.__name__
        self.check = check
        self.batch_invariant = batch_invariant  # see ``batch_invariant`` below
        self.signature = inspect.signature(check)
        self.route = route or self.name
        self.fixed = fixed or {}
        # the fixed arguments only feed the op's autograd graph (saved statistics): an eager call, which
        # records none, runs with the public ones and gets the launch's outputs, already public
        self.eager_unfixed = eager_unfixed
        self.to_public = to_public
        self.check_values = check_values
        parsed = torch._C.parse_schema(f"oink::{schema}")
        self.op_name = parsed.name.split("::")[1]
        self.op_params = tuple(a.name for a in parsed.arguments)
        self.n_out = len(parsed.returns)
        self.defaults = {n: p.default for n, p in self.signature.parameters.items()
                         if p.default is not inspect.Parameter.empty}
        unknown = set(self.op_params) - set(self.signature.parameters)
        if unknown:
            raise TypeError(f"{self.name}: schema arguments {sorted(unknown)} are not parameters of the op")
        if kernels is not None:
            dispatch.KERNEL_MODULES[self.route] = functools.cache(kernels)  # imported once, then one call
        LIB.define(schema)
        LIB.impl(self.op_name, self._impl, "CompositeExplicitAutograd")
        if fake is not None:
            torch.library.register_fake(f"oink::{self.op_name}", self._fake(fake), lib=LIB)
        self.op = getattr(getattr(torch.ops.oink, self.op_name), "default")
        OPS[self.op_name] = self
        self.mutated = tuple(a.name for a in parsed.arguments if a.alias_info and a.alias_info.is_write)
        self.differentiable = backward is not None
        qualname = f"oink::{self.op_name}"
        if backward is not None:  # (backward, setup_context) of torch.library.register_autograd
            torch.library.register_autograd(qualname, backward[0], setup_context=backward[1], lib=LIB)
        elif autograd and not self.mutated:
            # outputs that are gradients, statistics or codes: marked non-differentiable, so a call on
            # inputs that require grad compiles (AOTAutograd needs a formula) and never backpropagates
            torch.library.register_autograd(qualname, _refuse_backward, setup_context=_mark_outputs, lib=LIB)
        self._routes: dict = {}  # layout key -> route (see _checked_route)
        config.ON_RELOAD.append(self._routes.clear)
        self.function = None
        if public:
            PUBLIC[self.name] = self
            self.function = _public_function(self)

    # -- torch.ops.oink.<op_name>
    def _bind_op(self, args) -> dict:
        return {**self.defaults, **dict(zip(self.op_params, args))}

    def _checked_route(self, a: dict, args: dict, key) -> dispatch.Route:
        """Check ``a`` and route ``args`` (``a`` with the fixed arguments). The metadata checks and
        the route depend only on the arguments' layouts and values, so they are cached per layout
        (``key``: ``_layout_key``'s, None for none); value checks (which read the data) run on
        every call."""
        r = self._routes.get(key) if key is not None else None
        if r is None:
            self._check_metadata(a)
            r = dispatch.route(self.route, args)
            if key is not None and not dispatch.log.isEnabledFor(logging.DEBUG):  # DEBUG logs every route
                if len(self._routes) >= 4096:
                    self._routes.clear()
                r = self._routes[key] = dispatch.with_plan(r, args)
        if self.check_values is not None and (r.backend != "kernel" or config.CONFIG.check_values):
            self.check_values(**a)
        return r

    def _impl(self, *args):
        a = self._bind_op(args)
        kw = {**a, **self.fixed} if self.fixed else a
        key = _layout_key(a.values())
        r = self._checked_route(a, kw, key if key is not False else None)
        if self.mutated:
            self._check_writable(a)
        out = dispatch.run(r, kw)
        if self.n_out == 0:
            return None
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if self.n_out == 1:
            return outs[0]
        res = [outs[i] if i < len(outs) else None for i in range(self.n_out)]
        if any(t is None for t in res):  # outputs must not alias: one placeholder each
            first = _first_tensor(args)
            res = [first.new_empty(0) if t is None else t for t in res]
        return tuple(res)

    def _check_metadata(self, a: dict) -> None:
        """That no argument written in place has elements sharing memory (first: a broadcast output is refused
        as such, not by a layout check it also fails), then the declared checks; layout only, so cached with the
        route."""
        for n in self.mutated:
            if a[n] is not None and a[n].numel():  # an optional output left out, or nothing to write
                no_internal_overlap(n, a[n])
        self.check(**a)

    def _check_writable(self, a: dict) -> list:
        """Every argument the op writes, before any is written (an op that refuses changes nothing).
        -> those whose version an eager call bumps once written."""
        grad = torch.is_grad_enabled()
        written = []
        for n in self.mutated:
            t = a[n]
            if t is None:  # an optional output left out (``Tensor!?``)
                continue
            # ``writable`` for the only tensors it may refuse or leave untracked (inference ones, or in grad
            # mode ones that require grad); any other is tracked in grad mode, as ``writable`` returns
            if t.is_inference() or (grad and t.requires_grad):
                if writable(n, t, grad):
                    written.append(t)
            elif grad:
                written.append(t)
        return written

    def _fake(self, fake: Callable) -> Callable:
        def checked_fake(*args):
            self._check_metadata(self._bind_op(args))
            return fake(*args)

        return checked_fake

    # -- oink.<name>
    def __call__(self, a: dict):
        key = _eager_key(a.values(), self.differentiable)
        if key is not False:
            if self.eager_unfixed:  # its routes kept apart from the op path's, whose arguments differ
                args, key = a, None if key is None else ("eager", key)
            else:
                args = {**a, **self.fixed} if self.fixed else a
            r = self._checked_route(a, args, key)
            written = self._check_writable(a) if self.mutated else None
            plan = r.plan  # the prepared launch called here, as ``dispatch.run`` would (one call less)
            out = plan(args) if plan is not None else dispatch.run(r, args)
            if written:  # as the op's ADInplaceOrView would
                _increment_version(written)
            if self.eager_unfixed:
                return out  # the launch's outputs for the public arguments are the public ones
        else:
            out = self.op(*[a[n] for n in self.op_params])
        return self.to_public(out, a) if self.to_public is not None else out

    def explain(self, *args, **kwargs) -> str:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()  # the kernel checks read every argument by name, defaults included
        return str(dispatch.route(self.route, {**bound.arguments, **self.fixed}))


def absent(x: Tensor) -> Tensor:
    """An optional output not asked for (the custom op's placeholder): empty, x's dtype."""
    return x.new_empty(0)


def _mark_outputs(ctx, inputs, output):
    outs = output if isinstance(output, (tuple, list)) else (output,)
    ctx.mark_non_differentiable(*outs)


def _refuse_backward(ctx, *grads):
    raise RuntimeError("this oink op is not differentiable (its outputs were marked so)")


def _first_tensor(args) -> Tensor:
    return next(a for a in args if isinstance(a, Tensor))


def _public_function(op: Op) -> Callable:
    """A function with the declared signature whose body collects its arguments into a dict for
    ``op`` (generated, so a call costs no ``inspect`` binding)."""
    params, seen_kw = [], False
    for n, p in op.signature.parameters.items():
        if p.kind is p.KEYWORD_ONLY and not seen_kw:
            params.append("*")
            seen_kw = True
        params.append(f"{n}=_defaults[{n!r}]" if n in op.defaults else n)
    body = ", ".join(f"{n!r}: {n}" for n in op.signature.parameters)
    src = f"def {op.name}({', '.join(params)}):\n    return _call({{{body}}})\n"
    scope = {"_defaults": op.defaults, "_call": op.__call__}
    exec(src, scope)  # noqa: S102  (the source is built from a declared signature only)
    fn = scope[op.name]
    fn.__doc__, fn.__module__, fn.__qualname__ = op.check.__doc__, "oink", op.name
    fn.__signature__ = _annotated(op.signature, getattr(reference, op.name, None))
    return fn


def _annotated(sig: inspect.Signature, ref) -> inspect.Signature:
    """``sig`` with the reference's type annotations (the same parameters, typed once there)."""
    if ref is None:
        return sig
    ref_sig = inspect.signature(ref)
    typed = [p.replace(annotation=ref_sig.parameters[n].annotation) if n in ref_sig.parameters else p
             for n, p in sig.parameters.items()]
    return sig.replace(parameters=typed, return_annotation=ref_sig.return_annotation)


def declare(schema: str, **kw) -> Callable[[Callable], Callable]:
    """Decorator: the op declared by its validation function; see the module docstring. Gives the
    public function (the check function for an op that is not public), with the ``Op`` as ``.op``."""
    def wrap(check: Callable) -> Callable:
        op = Op(check, schema, **kw)
        fn = op.function or check
        fn.op = op
        return fn

    return wrap


def explain(op: str, *args, **kwargs) -> str:
    """Why ``oink.<op>(*args, **kwargs)`` would run the kernel or the reference, without running it.

    Args:
        op: a public op's name (``"rmsnorm_forward"`` ...).
        *args, **kwargs: the call's arguments, as the op takes them.

    Returns:
        One line: the op, the path it takes ("kernel" or "reference") and why.

    Raises:
        ValueError: ``op`` is not a public op.
        TypeError: the arguments do not fit the op's signature.
    """
    if op not in PUBLIC:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(PUBLIC)}")
    return PUBLIC[op].explain(*args, **kwargs)


ROW_BYTES = 16  # a row's bytes must be a multiple of this for the batch-invariance contract (see below)


def aligned_rows(N: int, dtype: torch.dtype) -> bool:
    """Whether rows of N values of ``dtype`` are a multiple of ``ROW_BYTES`` (the widths ``batch_invariant`` covers)."""
    return N * dtype.itemsize % ROW_BYTES == 0


def batch_invariant(op: str, N: int | None = None, dtype: torch.dtype | None = None) -> bool:
    """Whether ``oink.<op>`` (or ``torch.ops.oink.<op>``) promises batch invariance: each row's outputs bit for
    bit the same whatever the batch it runs in (alone, with any number of other rows, anywhere in it), for
    the same row, N, dtypes and arch. The launch never depends on the row count, so the promise holds on the
    kernel path and on the CPU's reference; it covers the row-wise outputs, not sums over the rows (the norm
    backwards' dweight and dbias, a cross-entropy loss reduced by "mean" or "sum").

    Args:
        op: a public op's name or a custom op's (``"rms_norm_static_fp8_quant"``).
        N, dtype: the rows' width and dtype, to ask about them: the promise needs rows of a multiple of 16 bytes
            (every model's hidden size) and at most the kernels' ``MAX_N`` values. Rows of other widths start off
            16-byte boundaries, which some kernels read by the row's address and some calls leave to the
            reference; wider rows go to the reference, whose reductions on a GPU are torch's (split by the
            batch's size).

    Returns:
        True where promised (docs/ops.md, "Batch invariance").

    Raises:
        ValueError: ``op`` is not an op of Oink's.
    """
    found = PUBLIC.get(op) or OPS.get(op)
    if found is None:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted({*PUBLIC, *OPS}))}")
    if N is not None and (N > MAX_N or dtype is not None and not aligned_rows(N, dtype)):
        return False
    return found.batch_invariant
