"""The one place the ``OINK_*`` environment knobs are read: once, at import, into ``CONFIG``.
Hot paths read ``config.get()``; sweeps that change the environment in-process call ``reload()``.
No torch or cutlass here."""
from __future__ import annotations

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


def _int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def _flag(name: str) -> bool | None:
    """An A/B switch: None where unset (the heuristic decides), else whether it is not "0"."""
    value = os.environ.get(name, "").strip()
    return None if not value else value != "0"


@dataclass(frozen=True)
class Config:
    force_reference: bool  # OINK_FORCE_REFERENCE: the reference everywhere
    arch: str | None  # OINK_ARCH: compile target override
    keep_cubin: bool  # OINK_KEEP_CUBIN: keep cubins on compiled functions (kernel profiles)
    fwd_upt: int | None  # OINK_FWD_UPT: norm forward units a thread (sweeps)
    fwd_late: bool | None  # OINK_FWD_LATE=0/1: norm forward loads weight/bias after the reduction (A/B)
    fwd_stage: bool | None  # OINK_FWD_STAGE=0/1: norm forward stages x (and residual) in shared memory (A/B)
    fp4_upt: int | None  # OINK_FP4_UPT: FP4 scale blocks a thread (sweeps)
    bwd_upt: int | None  # OINK_BWD_UPT / _TPSM / _DEPTH: norm backward knobs (sweeps)
    bwd_tpsm: int | None
    bwd_depth: int | None
    bwd_split: bool | None  # OINK_BWD_SPLIT=0/1: the norm backward's split kernels off/on (A/B)
    bwd_partial_sum: str  # OINK_BWD_PARTIAL_SUM: "kernel" or "torch" (A/B)
    # OINK_PDL=0: no programmatic dependent launch. On (SM90+): a row kernel may be launched while the
    # kernel before it in the stream finishes, and waits (griddepcontrol.wait) before its first read;
    # it lets the next one launch once its stores are issued (as FlashInfer's norms do by default)
    pdl: bool
    softmax_online: bool | None  # OINK_SOFTMAX_ONLINE=0/1: the softmax's max and sum in one reduction round (A/B)
    ce_stream: bool | None  # OINK_CE_STREAM=0/1: the cross-entropy kernels stream their rows (A/B; default: wide forwards)
    bwd_exact: bool  # OINK_BWD_EXACT=0: power-of-two threads per row only (A/B)
    tvm_ffi: bool  # OINK_TVM_FFI=0: launch through CuTeDSL's generic executor (default: TVM-FFI if installed)
    cache_dir: str | None  # OINK_CACHE_DIR: compiled kernels kept on disk there (see _cache_dir)
    # OINK_CHECK_VALUES=1: where a kernel serves the call, also run the checks that read values on the
    # host (the cross-entropy target range: one sync a call, costlier than the rest of the call). Off by
    # default: the kernels give a bad target's row a NaN loss and NaN dlogits; the reference raises.
    check_values: bool


def _from_env() -> Config:
    env = os.environ.get
    return Config(
        force_reference=truthy(env("OINK_FORCE_REFERENCE")), arch=env("OINK_ARCH") or None,
        keep_cubin=truthy(env("OINK_KEEP_CUBIN")), fwd_upt=_int("OINK_FWD_UPT"),
        fwd_late=_flag("OINK_FWD_LATE"), fwd_stage=_flag("OINK_FWD_STAGE"), fp4_upt=_int("OINK_FP4_UPT"),
        bwd_upt=_int("OINK_BWD_UPT"), bwd_tpsm=_int("OINK_BWD_TPSM"), bwd_depth=_int("OINK_BWD_DEPTH"),
        bwd_split=_flag("OINK_BWD_SPLIT"),
        bwd_partial_sum=env("OINK_BWD_PARTIAL_SUM", "kernel"), pdl=env("OINK_PDL", "1") != "0",
        bwd_exact=env("OINK_BWD_EXACT", "1") != "0", softmax_online=_flag("OINK_SOFTMAX_ONLINE"),
        ce_stream=_flag("OINK_CE_STREAM"),
        tvm_ffi=env("OINK_TVM_FFI", "1") != "0" and importlib.util.find_spec("tvm_ffi") is not None,
        cache_dir=_cache_dir(), check_values=truthy(env("OINK_CHECK_VALUES")))


CONFIG = _from_env()


def get() -> Config:
    return CONFIG


# what caches results derived from the config (launch choices, routes) registers its clear here
ON_RELOAD: list = []


def reload() -> Config:
    """Read the environment again (after a sweep changes a knob in this process)."""
    global CONFIG
    CONFIG = _from_env()
    for clear in ON_RELOAD:
        clear()
    return CONFIG
