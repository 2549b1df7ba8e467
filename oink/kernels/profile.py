"""Resource usage of compiled kernels, read from the cubin through the CUDA driver: registers
per thread, local memory per thread (spills + stack), static shared memory, and theoretical
occupancy at the kernel's block size. Needs kernels compiled with OINK_KEEP_CUBIN=1 and a GPU."""
from __future__ import annotations

from .compile import BLOCK_THREADS, CACHE, COMPILED


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def function_resources(fn, device_index: int = 0) -> list[dict]:
    import torch
    from cuda.bindings import driver as drv

    threads = BLOCK_THREADS.get(id(fn), 128)
    fn = COMPILED.get(id(fn), fn)  # a TVM-FFI launcher's compiled object holds the artifacts
    cubin = fn.artifacts.CUBIN
    if not cubin:
        raise RuntimeError("no cubin kept: compile with OINK_KEEP_CUBIN=1")
    torch.cuda.init()  # the primary context current on this thread
    module = _check(drv.cuModuleLoadData(cubin))
    props = torch.cuda.get_device_properties(device_index)
    A = drv.CUfunction_attribute
    out = []
    try:
        for name in fn.kernel_info:
            func = _check(drv.cuModuleGetFunction(module, name.encode()))
            blocks = _check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, threads, 0))
            out.append({
                "kernel": name[:80],
                "registers": _check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, func)),
                "spill_bytes": _check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, func)),
                "static_smem": _check(drv.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func)),
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
