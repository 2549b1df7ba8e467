"""Compiled kernels kept on disk across processes: a TVM-FFI compiled function is exported as an
object file (``export_to_c``) and loaded back in a fresh process with ``cute.runtime.load_module``
instead of being compiled again.

On by default in ``~/.cache/oink/kernels`` (``OINK_CACHE_DIR`` names another directory, ``0`` turns
it off; see ``oink.config``). An entry's name hashes the compile key (op,
dtypes, N, flags, arch, launch), the source of every kernel module and the CuTeDSL and TVM-FFI
versions, so a changed kernel or library never loads an old entry. An entry that fails to load is
deleted and rebuilt; entries are written to a temporary name and renamed, so concurrent processes
(pytest-xdist) never read a partial file.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Hashable

from .. import config

log = logging.getLogger("oink.disk_cache")


def directory() -> Path | None:
    """Where entries live, or None when the disk cache is off (also under OINK_KEEP_CUBIN, whose
    profiles read cubins a loaded function does not carry, and without TVM-FFI)."""
    cfg = config.get()
    if not cfg.cache_dir or cfg.keep_cubin or not cfg.tvm_ffi:
        return None
    return Path(cfg.cache_dir)


@functools.lru_cache(maxsize=None)
def fingerprint() -> str:
    """The kernel sources and the library versions every entry depends on."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            h.update(f"{dist}=={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(dist.encode())
    return h.hexdigest()


def entry_name(key: Hashable) -> str:
    """A C symbol (also the file's stem) for ``key`` (its repr is deterministic: strings, numbers,
    flags and frozen dataclasses)."""
    return "oink_" + hashlib.sha256((fingerprint() + repr(key)).encode()).hexdigest()[:32]


def load(key: Hashable) -> Callable | None:
    root = directory()
    if root is None:
        return None
    name = entry_name(key)
    path = root / f"{name}.o"
    if not path.exists():
        return None
    try:
        import cutlass.cute as cute

        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
    except Exception as e:  # noqa: BLE001 - a bad entry is rebuilt, never used
        log.warning("disk cache: %s failed to load (%s); rebuilding it", path, e)
        path.unlink(missing_ok=True)
        return None


def store(key: Hashable, compiled) -> None:
    """Export ``compiled`` (a TVM-FFI ``JitCompiledFunction``) under ``key``'s name."""
    root = directory()
    export = getattr(compiled, "export_to_c", None)
    if root is None or export is None:
        return
    name, tmp = entry_name(key), None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".o", dir=root)
        os.close(fd)
        export(tmp, function_name=name)
        os.replace(tmp, root / f"{name}.o")  # atomic: readers see the old entry or the whole new one
    except Exception as e:  # noqa: BLE001 - the in-memory function is still good
        log.warning("disk cache: could not store %s (%s)", name, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
