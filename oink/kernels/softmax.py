"""Softmax over the last dim in CuTeDSL: forward, backward, and fused forward+backward.

One pass over memory each: a row stays in registers between its load and its store.
- forward: m = max(x); e = exp(x - m); y = e / sum(e)   (one read of x; m and sum(e) in two
  reduction rounds, or one where they merge online: ``online_reduction``)
- backward: dx = y * (dy - sum(dy * y))
- fused forward+backward: dx from x and dy with y kept in fp32 registers, never written.
Columns past N (uneven widths) load as -inf for x (exp gives 0) and 0 for dy and y. A forward's rows that
start off 16-byte boundaries, whose width allows accesses of at most 4 bytes, move through aligned windows
of 16-byte accesses (``softmax_window``, ``RowKernelBase.window``).
"""
from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .reduction import RowKernelBase, add
from .row_rules import MAX_N, RowLaunch
from .softmax_rules import MODES, SoftmaxKey, online_reduction, softmax_launch_of


class Softmax(RowKernelBase):
    """Softmax forward, backward, and the backward from x (the forward recomputed)."""

    def __init__(self, launch: RowLaunch, dtype, mode: str, online: bool = True, n: int | None = None):
        """``online``: the row's max and sum of exp in one reduction round (``row_max_sum``), not two;
        ``n``: the row's width where ``launch.N`` is its window's (a forward of rows off 16-byte boundaries,
        read and written through aligned windows: ``RowKernelBase.window``)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        super().__init__(launch, num_reductions={"forward": 2, "backward": 1, "fwd_bwd": 3}[mode], n=n)
        self.x_dtype = dtype
        self.mode = mode
        self.online = online
        if self.shifted and mode != "forward":
            raise ValueError(f"shifted rows: the forward only; got {mode}")

    @cute.jit
    def __call__(self, pa: cute.Pointer, pb: cute.Pointer, pout: cute.Pointer, M: Int32, lda: Int64, ldb: Int64,
                 ldout: Int64, stream: cuda.CUstream):
        """forward: a = x (b unused); backward: a = y, b = dy; fwd_bwd: a = x, b = dy. Shifted rows: x's and
        the output's rows at the same offsets (the host's condition)."""
        if const_expr(self.shifted):  # rows start anywhere: accessed only through their windows
            mA = self.shifted_matrix(pa, M, lda)
            mO = self.shifted_matrix(pout, M, ldout)
            mB = mA
        else:
            mA = self.matrix(pa, M, lda)
            mB = self.matrix(pb, M, ldb)
            mO = self.matrix(pout, M, ldout)
        self.launch_rows(self.kernel(mA, mB, mO, self.tiled_copy(self.x_dtype)), M, stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mO: cute.Tensor, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mA, mode=[0])
        shift = Int32(0)
        if const_expr(self.shifted):  # each thread's row through its window
            row = bidx * L.rows_per_cta + cute.arch.thread_idx()[0] // L.threads_per_row
            tXcX, tXgA, shift = self.row_window(mA, row, M, part)
            tXgO = self.row_window(mO, row, M, part)[1]
        else:
            tXcX = part(cute.make_identity_tensor(mA.shape), bidx)
            row = tXcX[0][0]
            tXgA, tXgO = part(mA, bidx), part(mO, bidx)
        rA = cute.make_rmem_tensor_like(tXgA)
        rA.fill(-math.inf if const_expr(self.mode != "backward") else 0.0)
        rB = cute.make_rmem_tensor_like(tXgA)
        rB.fill(0.0)
        tXgB = None
        if const_expr(self.mode != "forward"):
            tXgB = part(mB, bidx)
        # unbranched where timed so: the aligned forward (shifted rows keep the test, not timed apart from their
        # window's load form; the backward modes' two rows spilled on sm_100a)
        if const_expr(self.rows_in_grid and self.mode == "forward" and not self.shifted):
            self.load_inputs(tXgA, rA, tXgB, rB, tXcX, shift)
        elif row < M:
            self.load_inputs(tXgA, rA, tXgB, rB, tXcX, shift)
        self.wait_cluster()
        a = rA.load().to(Float32)
        if const_expr(self.mode == "backward"):
            y = a
        elif const_expr(self.online):
            m, s, e = self.row_max_sum(a, buf, mbar, with_exp=True)
            y = e * cute.arch.rcp_approx(s)
        else:
            m, e, s = self.row_exp_sum(a, buf, mbar)
            y = e * cute.arch.rcp_approx(s)
        if const_expr(self.mode == "forward"):
            out = y
        else:
            g = rB.load().to(Float32)
            dot = (g * y).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
            dot = self.row_allreduce(dot, add, Float32(0.0), buf, mbar, 0 if const_expr(self.mode == "backward") else 2)
            out = y * (g - dot)
        rO = cute.make_rmem_tensor_like(rA, self.x_dtype)
        rO.store(out.to(self.x_dtype))
        if row < M:
            if const_expr(self.shifted):
                self.store_window(rO, tXgO, tXcX, shift)
            else:
                self.copy_row(rO, tXgO, tXcX, self.x_dtype)
        self.launch_dependents()

    @cute.jit
    def load_inputs(self, tXgA: cute.Tensor, rA: cute.Tensor, tXgB: Optional[cute.Tensor], rB: cute.Tensor,
                    tXcX: cute.Tensor, shift):
        """Load this thread's slices of its row of a (and of b, where the mode reads it)."""
        if const_expr(self.shifted):
            self.load_window(tXgA, rA, tXcX, shift, -math.inf, each=self.launch.iters >= 8)
        else:
            self.copy_row(tXgA, rA, tXcX, self.x_dtype)
        if const_expr(tXgB is not None):
            self.copy_row(tXgB, rB, tXcX, self.x_dtype)


@memo
def compiled_softmax(k: SoftmaxKey):
    """Compile (or fetch) the softmax kernel for ``k``."""
    mode, dtype, N, arch = k.mode, k.dtype, k.N, k.arch
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the softmax kernels handle 1 <= N <= {MAX_N}")
    dt = cute_dtype(dtype)
    launch = softmax_launch_of(k)
    online = config.get().softmax_online
    if online is None:
        online = online_reduction(launch, mode)
    online = online and mode != "backward"

    def build():
        one = Int64(launch.vec)
        return compile_kernel(Softmax(launch, dt, mode, online, n=N), gmem_ptr(dt), gmem_ptr(dt), gmem_ptr(dt),
                              Int32(1), one, one, one, fake_stream(), arch=arch)

    return CACHE.get(("softmax", mode, dtype, N, arch, launch, online), build)
