"""Resource usage of compiled kernels: registers per thread, local memory per thread (spills +
stack), static shared memory, and theoretical occupancy at the kernel's block size, read through
the CUDA driver (a GPU); registers and local frame also straight from the cubin's ELF notes
(``cubin_resources``, no GPU: how CI checks that a launch shape does not spill). Needs kernels
compiled with OINK_KEEP_CUBIN=1."""
from __future__ import annotations

import struct

from .compile import BLOCK_THREADS, CACHE, COMPILED, driver_checked
from .cross_entropy import CrossEntropyKey, compiled_cross_entropy
from .rmsnorm import compiled_forward
from .rmsnorm_rules import ForwardKey
from .rmsnorm_bwd import compiled_backward
from .rmsnorm_bwd_rules import BackwardKey
from .softmax import compiled_softmax
from .softmax_rules import SoftmaxKey

# EIATTR codes of the cubin's .nv.info notes (format 4: a u16 size, then a u32 symbol and a u32 value)
_EIATTR = {0x2F: "registers", 0x11: "frame_bytes"}


def cubin_resources(cubin: bytes) -> dict:
    """{"registers", "frame_bytes"} of the cubin's kernels (the most over them): a frame above zero
    is local memory, which for these kernels (no calls, no stack arrays) means spilled registers."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = heads[shstrndx][4]
    out = {"registers": 0, "frame_bytes": 0}
    for name, _type, _flags, _addr, off, size in heads:
        if not cubin[names_at + name:].startswith(b".nv.info"):
            continue
        i = off
        while i + 4 <= off + size:
            fmt, attr, n = cubin[i], cubin[i + 1], struct.unpack_from("<H", cubin, i + 2)[0]
            if fmt != 4:  # formats 1-3 carry no size: a 4-byte entry
                i += 4
                continue
            if attr in _EIATTR and n >= 8:
                key = _EIATTR[attr]
                out[key] = max(out[key], struct.unpack_from("<I", cubin, i + 8)[0])
            i += 4 + n
    return out


# family -> compile(dtype, N, arch): the row kernels the public ops launch, with same-dtype
# parameters (and an fp32 weight for ``rmsnorm_fwd_w32``)
ROW_FAMILIES = {
    "rmsnorm_fwd": lambda d, N, a: compiled_forward(ForwardKey(d, N, a, w_dtype=d)),
    "rmsnorm_fwd_w32": lambda d, N, a: compiled_forward(ForwardKey(d, N, a, w_dtype="float32")),
    "rmsnorm_fwd_res": lambda d, N, a: compiled_forward(ForwardKey(d, N, a, w_dtype=d, res_dtype=d, res_out_dtype=d)),
    "layernorm_fwd": lambda d, N, a: compiled_forward(ForwardKey(d, N, a, w_dtype=d, b_dtype=d, layernorm=True)),
    "rmsnorm_bwd": lambda d, N, a: compiled_backward(BackwardKey(d, N, a, dout_dtype=d, w_dtype=d)),
    "layernorm_bwd": lambda d, N, a: compiled_backward(BackwardKey(d, N, a, dout_dtype=d, w_dtype=d, has_db=True,
                                                                   layernorm=True)),
    "softmax_fwd": lambda d, N, a: compiled_softmax(SoftmaxKey("forward", d, N, a)),
    "softmax_bwd": lambda d, N, a: compiled_softmax(SoftmaxKey("backward", d, N, a)),
    "softmax_fwd_bwd": lambda d, N, a: compiled_softmax(SoftmaxKey("fwd_bwd", d, N, a)),
    "ce_fwd": lambda d, N, a: compiled_cross_entropy(CrossEntropyKey("forward", d, "int64", N, a)),
    "ce_bwd": lambda d, N, a: compiled_cross_entropy(CrossEntropyKey("backward", d, "int64", N, a)),
    "ce_fwd_bwd": lambda d, N, a: compiled_cross_entropy(CrossEntropyKey("fwd_bwd", d, "int64", N, a)),
}


def launch_resources(family: str, dtype: str, N: int, arch: str) -> tuple:
    """(launch shapes used, ``cubin_resources``) of ``family``'s kernel at (dtype, N, arch) as the
    heuristic or the launch table picks it, compiled on the spot (no GPU); needs OINK_KEEP_CUBIN=1."""
    CACHE.clear_used()
    fn = ROW_FAMILIES[family](dtype, N, arch)
    return sorted(CACHE.used_launches()), compiled_resources(fn)


def compiled_resources(fn) -> dict:
    """``cubin_resources`` of a compiled function of the cache (compiled with OINK_KEEP_CUBIN=1)."""
    cubin = COMPILED.get(id(fn), fn).artifacts.CUBIN
    if not cubin:
        raise RuntimeError("no cubin kept: compile with OINK_KEEP_CUBIN=1")
    return cubin_resources(cubin)


def function_resources(fn, device_index: int = 0) -> list[dict]:
    import torch
    from cuda.bindings import driver as drv

    threads = BLOCK_THREADS.get(id(fn), 128)
    fn = COMPILED.get(id(fn), fn)  # a TVM-FFI launcher's compiled object holds the artifacts
    cubin = fn.artifacts.CUBIN
    if not cubin:
        raise RuntimeError("no cubin kept: compile with OINK_KEEP_CUBIN=1")
    torch.cuda.init()  # the primary context current on this thread
    module = driver_checked(drv.cuModuleLoadData(cubin))
    props = torch.cuda.get_device_properties(device_index)
    A = drv.CUfunction_attribute
    out = []
    try:
        for name in fn.kernel_info:
            func = driver_checked(drv.cuModuleGetFunction(module, name.encode()))
            blocks = driver_checked(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, 0))
            out.append({
                "kernel": name[:80],
                "registers": driver_checked(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, func)),
                "spill_bytes": driver_checked(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, func)),
                "static_smem": driver_checked(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func)),
                "block_threads": threads,
                "occupancy": round(blocks * threads / props.max_threads_per_multi_processor, 3),
            })
    finally:
        drv.cuModuleUnload(module)
    return out


def recent_kernel_profile(device_index: int = 0) -> dict:
    """Profile of the kernels looked up since CACHE.clear_used() (the ones a call just used)."""
    kernels = []
    for key, fn in CACHE.used_functions().items():
        for res in function_resources(fn, device_index):
            kernels.append(dict(res, key=str(key[0])))
    if not kernels:
        return {}
    worst = max(kernels, key=lambda k: k["registers"])
    return {"registers": worst["registers"], "spill_bytes": max(k["spill_bytes"] for k in kernels),
            "static_smem": max(k["static_smem"] for k in kernels), "occupancy": min(k["occupancy"] for k in kernels),
            "kernels": kernels}
