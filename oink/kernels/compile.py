"""CuTeDSL compile infrastructure: arch choice, fake (tensor-free) arguments, compile cache.

Kernels are compiled against raw pointers plus a symbolic row count, so one compiled
function serves every M and every row stride; N and the dtypes are compile-time constants.
That is also what lets CI compile every variant on a CPU with no tensors at all.

Launch: every compiled function is called the same way, positional, with pointers as integer
addresses (``tensor.data_ptr()``) and the stream as the raw integer (``current_stream``, ``stream_of``). With
apache-tvm-ffi installed (``OINK_TVM_FFI=0`` turns it off) kernels are compiled with
``--enable-tvm-ffi`` and that call goes straight to the compiled ``tvm_ffi.Function``, with no
per-argument Python marshalling. Without it, ``compile_kernel`` wraps CuTeDSL's generic executor in a
function that turns each address into the ``cute.runtime`` pointer of the compiled argument's type and
the stream into a ``CUstream`` (``_typed_launcher``).
"""
from __future__ import annotations

import functools
import threading
from typing import Callable, Hashable

import cutlass
import cutlass.cute as cute

from .. import config
from . import disk_cache
from ..arch import SUPPORTED_ARCHS

# torch dtype name -> CuTe numeric type, kept as strings so this module needs no torch.
_CUTE_DTYPES = {
    "float32": cutlass.Float32,
    "float16": cutlass.Float16,
    "bfloat16": cutlass.BFloat16,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
    "uint8": cutlass.Uint8,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
}


def cute_dtype(name: str):
    """CuTe numeric type for a torch dtype name such as ``"bfloat16"``."""
    name = str(name).removeprefix("torch.")
    try:
        return _CUTE_DTYPES[name]
    except KeyError:
        raise TypeError(f"no CuTe dtype for {name!r}") from None


def gmem_ptr(dtype, align: int = 16):
    """A fake global-memory pointer for tensor-free compilation."""
    return cute.runtime.make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


def runtime_ptr(dtype, address: int, align: int = 16):
    """A ``cute.runtime`` global-memory pointer for a launch through CuTeDSL's generic executor
    (address from ``tensor.data_ptr()``)."""
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream():
    return cute.runtime.make_fake_stream()


class CompileCache:
    """In-memory cache of compiled kernels keyed on (op, dtypes, N, flags, arch).

    M is never part of the key: kernels take it as a runtime argument.
    """

    def __init__(self) -> None:
        self._fns: dict[Hashable, Callable] = {}
        self._lock = threading.Lock()
        self.compiles = 0  # how many real compilations ran (tests check M never adds one)
        # keys looked up since the last clear_used() (profiling, the tuner, tests): a lookup is made once a
        # launch choice, by the memoized compile functions, never per launch
        self.used: list[Hashable] = []

    def get(self, key: Hashable, build: Callable[[], Callable]) -> Callable:
        cfg = config.get()
        key = (key, cfg.tvm_ffi, cfg.pdl)  # a function is called the way it was compiled
        if cfg.keep_cubin:  # and one compiled without its cubin can't be profiled
            key += ("cubin",)
        fn = self._fns.get(key)
        if fn is None:
            with self._lock:
                fn = self._fns.get(key)
                if fn is None:
                    fn = disk_cache.load(key)
                    if fn is None:
                        fn = build()
                        self.compiles += 1
                        disk_cache.store(key, COMPILED.get(id(fn), fn))
                    self._fns[key] = fn
        if len(self.used) < 64:
            self.used.append(key)
        return fn

    def clear_used(self) -> None:
        """Start ``used`` afresh, with the memoized launch choices and the ops' prepared launches dropped
        (``config.ON_RELOAD``): what runs next looks its kernels up again (from memory, no compile)."""
        self.used.clear()
        for clear in config.ON_RELOAD:
            clear()

    def used_launches(self) -> set:
        """(threads_per_row, num_threads, cluster_n) of the launch shapes in the keys used since
        ``clear_used()``: which tiling actually ran (the launch-table search and its tests)."""
        found, todo = set(), list(self.used)
        while todo:
            part = todo.pop()
            if isinstance(part, tuple):
                todo.extend(part)
            elif hasattr(part, "threads_per_row") and hasattr(part, "cluster_n"):
                found.add((part.threads_per_row, part.num_threads, part.cluster_n))
        return found

    def used_functions(self) -> dict:
        return {k: self._fns[k] for k in dict.fromkeys(self.used) if k in self._fns}

    def __len__(self) -> int:
        return len(self._fns)

    def clear(self) -> None:
        with self._lock:
            self._fns.clear()
        for clear in config.ON_RELOAD:  # memoized lookups must not return the dropped functions
            clear()


CACHE = CompileCache()


# block size of each compiled function, for occupancy in kernel profiles: id(fn) -> threads
BLOCK_THREADS: dict[int, int] = {}
# the compiled object behind each TVM-FFI launcher (its artifacts, for kernel profiles): id -> fn
COMPILED: dict[int, object] = {}


def compile_kernel(kernel_obj, *fake_args, arch: str):
    """``cute.compile`` for an explicit arch, independent of the process's CUTE_DSL_ARCH.
    ``OINK_KEEP_CUBIN=1`` keeps the cubin on the compiled function (kernel profiles read it); the
    files CuTeDSL writes beside it go to ``dump_dir()``."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch {arch!r}: expected one of {SUPPORTED_ARCHS}")
    cfg = config.get()
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if cfg.tvm_ffi else "")
    if cfg.keep_cubin:  # the dumps go to a temp directory, never the working directory
        options += f" --keep-cubin --dump-dir={dump_dir()}"
    kernel_obj.arch = arch  # what the kernel is traced for (``RowKernelBase.rows_in_grid`` reads it)
    fn = cute.compile(kernel_obj, *fake_args, options=options)
    if cfg.tvm_ffi:
        # the bare tvm_ffi.Function (positional only); None where no GPU loaded it (CPU compiles)
        bare = getattr(fn, "__tvm_ffi_object__", None)
        launcher = (bare() if bare else None) or fn
    else:
        launcher = _typed_launcher(fn, fake_args)
    COMPILED[id(launcher)] = fn
    launch = getattr(kernel_obj, "launch", None)
    if launch is not None:
        BLOCK_THREADS[id(launcher)] = launch.num_threads
    return launcher


def _typed_launcher(fn, fake_args) -> Callable:
    """``fn`` (CuTeDSL's generic executor) called as a TVM-FFI function is: each integer address
    becomes the ``cute.runtime`` pointer of the compiled argument's type (dtype, alignment), the raw
    stream a ``CUstream``; None and scalars pass as they are."""
    stream_type = type(fake_stream())

    def conversion(fake):
        if isinstance(fake, cute.Pointer):
            return functools.partial(_typed_ptr, fake.dtype, fake._assumed_align)
        if isinstance(fake, stream_type):
            return lambda raw: cuda_driver().CUstream(raw)
        return None

    convert = tuple(conversion(a) for a in fake_args)

    def launch(*args):
        return fn(*[a if c is None or a is None else c(a) for c, a in zip(convert, args)])

    return launch


def _typed_ptr(dtype, align: int, address: int):
    return runtime_ptr(dtype, address, align)


def dump_dir() -> str:
    """Where ``OINK_KEEP_CUBIN=1`` compiles leave their files: one directory a process, since two
    processes compiling the same kernel (pytest-xdist workers) write files of the same name, and
    one could read back the other's half-written cubin."""
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"oink-kernels-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


def current_stream(device) -> int:
    """The current torch stream of ``device`` as the compiled functions take it: the raw stream."""
    import torch

    raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object built
    return raw_stream(device.index) if raw_stream else torch.cuda.current_stream(device).cuda_stream


def stream_of(device) -> Callable[[], int]:
    """A function returning ``device``'s current raw stream, as the compiled functions take it, bound
    once: the launch plans call it every launch, with no Python frame of its own."""
    import torch

    return functools.partial(torch._C._cuda_getCurrentRawStream, device.index)


@functools.lru_cache(maxsize=None)
def cuda_driver():
    import cuda.bindings.driver as drv

    return drv


def driver_checked(result):
    """The value of a cuda-python driver call from its result tuple (a list where it returns several,
    an empty one where none); raises on a CUDA error."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest
