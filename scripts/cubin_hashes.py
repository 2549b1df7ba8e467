"""Hashes of the cubins of a compile matrix, both archs, on the CPU (no GPU): whether a change to the
code around the kernels (comments, docstrings, host-side settings) left every kernel byte-identical.

Every row kernel family the public ops launch (``oink.kernels.profile.ROW_FAMILIES``) at two widths and
two dtypes, the staged and late-parameter forwards, the few-row softmax, FP4 and FP8 kernels, the split
norm backward, the partials' sum and rowsumsq, cross-entropy kernels with the key's other fields (target
dtype, lse, window, options, in place), for sm_90a and sm_100a (146 kernels, about 2 min on 2 cores).
Compare a tree before a change with the working tree:

    git archive HEAD oink pytest_oink | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python3 scripts/cubin_hashes.py /tmp/before.json
    PYTHONPATH=. python3 scripts/cubin_hashes.py /tmp/after.json
    python3 scripts/cubin_hashes.py --compare /tmp/before.json /tmp/after.json   # exit 1 if any differs

``--only ce_`` limits the row families (and the flagged cross-entropy kernels) to those whose name starts so
(and skips the others).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ["OINK_KEEP_CUBIN"] = "1"  # before oink reads its config: the cubin stays on each compiled function
os.environ["OINK_CACHE_DIR"] = "0"  # compile every kernel here, never load one


def compare(before: str, after: str) -> int:
    a, b = json.loads(open(before).read()), json.loads(open(after).read())
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    for k in differ:
        print(f"differs: {k}: {a.get(k)} -> {b.get(k)}")
    print(f"{len(a)} kernels before, {len(b)} after, {len(differ)} differ")
    return 1 if differ else 0


def jobs(arch: str, only: str):
    from oink.kernels import cross_entropy, fp8, nvfp4, partial_sum, rmsnorm_bwd, softmax
    from oink.kernels.profile import ROW_FAMILIES
    from oink.kernels.rowsumsq import compiled_rowsumsq

    def keyed(module, key: str, fn: str, *args, old: tuple, **fields):
        """``module.fn(module.key(*args, **fields))``, or in a tree from before #33's compile keys (--compare
        reads older ones too) ``module.fn(*old)``."""
        if hasattr(module, key):
            return getattr(module, fn)(getattr(module, key)(*args, **fields))
        return getattr(module, fn)(*old)

    def fp4(mode, N, swizzled, mx=False):
        return keyed(nvfp4, "Fp4Key", "compiled_fp4", mode, "bfloat16", N, arch, swizzled=swizzled, mx=mx,
                     old=(mode, "bfloat16", N, arch, swizzled, mx))

    def add_rmsnorm_fp4(N, swizzled, store_y, mx=False):
        b = "bfloat16"
        return keyed(nvfp4, "AddRMSNormFp4Key", "compiled_add_rmsnorm_fp4", b, N, arch, res_dtype=b, w_dtype=b,
                     swizzled=swizzled, store_y=store_y, mx=mx, old=(b, b, b, N, arch, swizzled, store_y, mx))

    def quant_fp8(kind, N, mode, g, cm, ue):
        return keyed(fp8, "Fp8Key", "compiled_fp8", kind, "bfloat16", N, arch, mode=mode, group_size=g,
                     column_major=cm, ue8m0=ue, old=(kind, "bfloat16", N, arch, mode, g, cm, ue, False))

    def rmsnorm_fp8(res, N, mode, g, store_y):
        b = "bfloat16"
        return keyed(fp8, "RMSNormFp8Key", "compiled_rmsnorm_fp8", b, N, arch, w_dtype=b, res_dtype=res, mode=mode,
                     group_size=g, store_y=store_y, old=(b, res, b, N, arch, mode, g, False, False, False, store_y))

    def ce(mode, dtype, target, N, store_lse=True, window=True, options=None, inplace=False):
        options = options or cross_entropy.PLAIN
        return keyed(cross_entropy, "CrossEntropyKey", "compiled_cross_entropy", mode, dtype, target, N, arch,
                     store_lse=store_lse, window=window, options=options, inplace=inplace,
                     old=(mode, dtype, target, N, arch, store_lse, window, options, inplace))

    def split(x: str, has_db: bool, layernorm: bool):
        return keyed(rmsnorm_bwd, "BackwardKey", "compiled_split_backward", x, 262144, arch, dout_dtype=x, w_dtype=x,
                     has_db=has_db, layernorm=layernorm, old=(x, 262144, arch, x, x, None, has_db, layernorm))

    for fam, f in ROW_FAMILIES.items():
        if fam.startswith(only):
            for d in ("bfloat16", "float32"):
                for N in (32000, 128256) if fam.startswith("ce_") else (7168, 65536):
                    yield f"{fam}/{d}/{N}", lambda f=f, d=d, N=N: f(d, N, arch)
    every, softcap = cross_entropy.CEOptions(0.1, 1e-4, 30.0), cross_entropy.CEOptions(softcap=30.0)
    flagged = {  # the cross-entropy key's other fields
        "ce_fwd/int32/no_lse/4096": lambda: ce("forward", "bfloat16", "int32", 4096, store_lse=False),
        # the forward's options: a softcap alone (register-held and streamed rows: capped_sum), and all three
        "ce_fwd/softcap/32000": lambda: ce("forward", "bfloat16", "int64", 32000, options=softcap),
        "ce_fwd/softcap/262144": lambda: ce("forward", "bfloat16", "int64", 262144, options=softcap),
        "ce_fwd/options/50257": lambda: ce("forward", "bfloat16", "int64", 50257, options=every),
        "ce_bwd/no_window/50257": lambda: ce("backward", "bfloat16", "int64", 50257, window=False),
        "ce_fwd_bwd/options/50257": lambda: ce("fwd_bwd", "bfloat16", "int64", 50257, options=every),
        "ce_bwd/in_place/128256": lambda: ce("backward", "float32", "int64", 128256, inplace=True),
        "ce_fwd_bwd/in_place/options/32000": lambda: ce("fwd_bwd", "bfloat16", "int64", 32000, options=every,
                                                        inplace=True),
    }
    yield from ((name, job) for name, job in flagged.items() if name.startswith(only))
    if only:
        return
    fwd = ROW_FAMILIES
    yield "rmsnorm_fwd_w32/bfloat16/262144", lambda: fwd["rmsnorm_fwd_w32"]("bfloat16", 262144, arch)  # staged entry
    yield "layernorm_fwd/bfloat16/16384", lambda: fwd["layernorm_fwd"]("bfloat16", 16384, arch)  # late parameters
    yield "softmax_few/131072", lambda: keyed(softmax, "SoftmaxKey", "compiled_softmax", "forward", "bfloat16", 131072,
                                              arch, few=True, old=("forward", "bfloat16", 131072, arch, True))
    yield "fp4/quantize", lambda: fp4("quantize", 7168, False)
    yield "fp4/silu_mul", lambda: fp4("silu_mul", 7168, True)
    yield "mxfp4/quantize", lambda: fp4("quantize", 7168, False, True)
    yield "fp4/add_rmsnorm", lambda: add_rmsnorm_fp4(7168, False, True)
    yield "mxfp4/add_rmsnorm", lambda: add_rmsnorm_fp4(14336, True, False, True)
    yield "fp8/token", lambda: quant_fp8("quantize", 7168, "token", 0, False, False)
    yield "fp8/group", lambda: quant_fp8("quantize", 7168, "group", 128, True, True)
    yield "fp8/silu_mul", lambda: quant_fp8("silu_mul", 18432, "group", 128, False, False)
    yield "fp8/rmsnorm", lambda: rmsnorm_fp8(None, 7168, "token", 0, True)
    yield "fp8/add_rmsnorm", lambda: rmsnorm_fp8("bfloat16", 131072, "group", 128, False)
    yield "split_bwd/rmsnorm", lambda: split("bfloat16", False, False)
    yield "split_bwd/layernorm", lambda: split("float32", True, True)
    yield "partial_sum", lambda: partial_sum.compiled_partial_sum(7168, 2, "bfloat16", arch)
    yield "rowsumsq", lambda: compiled_rowsumsq("bfloat16", 8192, arch)


def digest(fn):
    """sha256 (16 hex digits) of a compiled function's cubin; a list for a tuple of them (the split backward)."""
    from oink.kernels.compile import COMPILED

    if isinstance(fn, (tuple, list)):
        return [digest(f) for f in fn if callable(f) or isinstance(f, (tuple, list))]
    return hashlib.sha256(COMPILED.get(id(fn), fn).artifacts.CUBIN).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="the JSON to write: {arch/kernel: hash}")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--only", default="", help="row families whose name starts so, and nothing else")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not a.out:
        ap.error("name the JSON to write, or --compare two")
    import oink

    print(f"oink from {os.path.dirname(oink.__file__)}", file=sys.stderr)
    out, failed = {}, 0
    for arch in ("sm_90a", "sm_100a"):
        for name, job in jobs(arch, a.only):
            try:
                out[f"{arch}/{name}"] = digest(job())
            except Exception as e:  # noqa: BLE001  (a kernel that no longer compiles is a difference, said)
                out[f"{arch}/{name}"] = f"error {type(e).__name__}: {e}"[:200]
                failed += 1
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"{len(out)} kernels, {failed} failed to compile", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
