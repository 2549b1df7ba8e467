"""The one place the ``OINK_*`` environment knobs are read: once, at import, into ``CONFIG``.
Hot paths read ``config.get()``; a process that changes the environment calls ``reload()``.

Two kinds of settings: the user's knobs (``ENV_KNOBS``, docs/knobs.md), read from the environment, and
development settings (``DEV_DEFAULTS``: the A/B switches that force one side of a rule, and the
launch dials of sweeps), never read from the environment: tests and the tuner set them with
``override()`` (``python -m oink.tune --set NAME=VALUE``). Their defaults are the rules' own choices.
No torch or cutlass here."""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from dataclasses import dataclass

TRUTHY = ("1", "true", "yes", "on")
FALSY = ("", "0", "false", "no", "off")


def truthy(value) -> bool:
    """The one truthy-string rule (1/true/yes/on, any case, spaces ignored)."""
    return str(value or "").strip().lower() in TRUTHY


def _cache_dir() -> str | None:
    """OINK_CACHE_DIR: where compiled kernels persist across processes; by default
    ``$XDG_CACHE_HOME/oink/kernels`` (``~/.cache/oink/kernels``); a falsy value turns the cache off."""
    value = os.environ.get("OINK_CACHE_DIR")
    if value is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "oink", "kernels")
    return None if value.strip().lower() in FALSY else value


# the environment variables read (docs/knobs.md documents each); OINK_KEEP_CUBIN is the profilers' own
# (the plugin and scripts/spill_scan.py set it), not a user's
ENV_KNOBS = ("OINK_FORCE_REFERENCE", "OINK_ARCH", "OINK_CACHE_DIR", "OINK_CHECK_VALUES", "OINK_PDL", "OINK_TVM_FFI",
             "OINK_KEEP_CUBIN")


@dataclass(frozen=True)
class Config:
    force_reference: bool  # OINK_FORCE_REFERENCE: the reference everywhere
    arch: str | None  # OINK_ARCH: compile target override
    keep_cubin: bool  # OINK_KEEP_CUBIN: keep cubins on compiled functions (kernel profiles)
    # OINK_PDL=0: no programmatic dependent launch. On (SM90+): a row kernel may be launched while the
    # kernel before it in the stream finishes, and waits (griddepcontrol.wait) before its first read;
    # it lets the next one launch once its stores are issued (as FlashInfer's norms do by default)
    pdl: bool
    tvm_ffi: bool  # OINK_TVM_FFI=0: launch through CuTeDSL's generic executor (default: TVM-FFI if installed)
    cache_dir: str | None  # OINK_CACHE_DIR: compiled kernels kept on disk there (see _cache_dir)
    # OINK_CHECK_VALUES=1: where a kernel serves the call, also run the checks that read values on the
    # host (the cross-entropy target range: one sync a call, costlier than the rest of the call). Off by
    # default: the kernels give a bad target's row a NaN loss and NaN dlogits; the reference raises.
    check_values: bool
    # ---- development settings (``override``; DEV_DEFAULTS): None or the default is the rule's choice
    fwd_upt: int | None = None  # norm forward units a thread (a sweep's dial)
    fwd_late: bool | None = None  # norm forward loads weight/bias after the reduction (forced either way)
    fwd_stage: bool | None = None  # norm forward stages x (and residual) in shared memory (forced either way)
    fwd_ctas: int | None = None  # norm forward: CTAs a SM ptxas keeps room for (a cap on registers; a sweep's dial)
    fp4_upt: int | None = None  # FP4 scale blocks a thread (a sweep's dial)
    bwd_upt: int | None = None  # norm backward units a thread, threads a SM its grid is sized for, pipeline
    bwd_tpsm: int | None = None  # depth (sweeps' dials)
    bwd_depth: int | None = None
    bwd_split: bool | None = None  # the norm backward's split kernels (forced either way)
    softmax_online: bool | None = None  # the softmax's max and sum in one reduction round (forced either way)
    ln_pivot: bool | None = None  # LayerNorm forward's moments in one round about a pivot (forced where it can be)
    ce_stream: bool | None = None  # the cross-entropy kernels stream their rows (forced either way)
    lce_overlap: bool | None = None  # linear cross-entropy: dweight's matmul on a side stream (forced either way)
    # rows off 16-byte boundaries read through aligned windows where the rule has one (on), or by element (off);
    # unset, the norms' and softmax's by element (a window's threads split a row by its offset from a 16-byte
    # boundary, its index in the batch: batch invariance), the cross-entropy reductions' through windows
    windows: bool | None = None
    rope_lanes: int | None = None  # QK norm + rotary embedding: lanes a head (32, or 16-byte loads' count; forced)
    # the QK norm + rotary embedding's kernel serves GPU calls (off by default until its GPU tests have run: the
    # reference serves them, batch-invariant too)
    rope_kernel: bool | None = None


DEV_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config) if f.default is not dataclasses.MISSING}
# the development settings in effect (``override``), applied over the environment's knobs by ``reload``
DEV: dict = {}


def _from_env() -> Config:
    env = os.environ.get
    return Config(
        force_reference=truthy(env("OINK_FORCE_REFERENCE")), arch=env("OINK_ARCH") or None,
        keep_cubin=truthy(env("OINK_KEEP_CUBIN")), pdl=env("OINK_PDL", "1") != "0",
        tvm_ffi=env("OINK_TVM_FFI", "1") != "0" and importlib.util.find_spec("tvm_ffi") is not None,
        cache_dir=_cache_dir(), check_values=truthy(env("OINK_CHECK_VALUES")), **DEV)


CONFIG = _from_env()


def get() -> Config:
    return CONFIG


# what caches results derived from the config (launch choices, routes) registers its clear here
ON_RELOAD: list = []


def reload() -> Config:
    """Read the environment again (after a process changes a knob), with the development settings in effect."""
    global CONFIG
    CONFIG = _from_env()
    for clear in ON_RELOAD:
        clear()
    return CONFIG


def dev_settings(**settings) -> dict:
    """``settings`` checked against ``DEV_DEFAULTS``' names (a ValueError names an unknown one)."""
    unknown = sorted(set(settings) - set(DEV_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown development setting(s) {unknown}; known: {', '.join(DEV_DEFAULTS)}")
    return settings


@contextlib.contextmanager
def override(**settings):
    """Development settings (``DEV_DEFAULTS``' names, e.g. ``fwd_stage=True``, ``bwd_depth=3``) in effect
    inside the block, then the ones before it again; the caches derived from the config are cleared
    both times. For tests and the tuner: the library's users have only the environment's knobs."""
    saved = dict(DEV)
    DEV.update(dev_settings(**settings))
    try:
        yield reload()
    finally:
        DEV.clear()
        DEV.update(saved)
        reload()
