"""CrossEntropy over the last dim in CuTeDSL: forward, backward, and fused forward+backward.

One pass over the logits each; a row stays in registers between its load and its store.
- forward: m = max(x); lse = m + log(sum(exp(x - m))); loss = lse - x[target] (0 if ignored)
- backward: dx = dloss[row] * (exp(x - lse) - onehot(target)) (0 on ignored rows); no reduction
- fused: the forward's two reductions, then the backward from the lse just computed (no lse
  round trip through memory); writes loss and dx.
Columns past N load as -inf (exp gives 0). Rows whose starts are not 16-byte aligned (N not a
multiple of the 128-bit vector: GPT-2's 50257) are read as an aligned window of vectors around
the row, its columns outside the row set to -inf ("shifted" rows), instead of one element an
access; dlogits are stored through the same window where dx's rows lie at the logits' offsets
(element accesses where they do not). x[target] for the
loss is one scalar load by the row's leader thread: the row was just read, so it hits cache. A
target outside [0, N) that is not ignore_index (the host check is skipped under CUDA-graph
capture) gives a NaN loss and NaN dlogits for its row, never an out-of-bounds read. ``dx`` may alias ``x`` (in-place
backward): every element is read before it is written, by the same thread.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr, memo
from .launch_table import pick
from .reduction import LOG2E, MAX_N, RowKernelBase, RowLaunch, pick_row_launch

MODES = ("forward", "backward", "fwd_bwd")


def cross_entropy_launch(N: int, x_bits: int, arch: str, mode: str = "forward", shifted: bool = False) -> RowLaunch:
    """Launch heuristic for the cross-entropy family (the one place it is chosen). The forward only
    reads: a row wider than one CTA of 256 threads at 8 units a thread goes to CTAs of 256 threads
    over a cluster of up to 8, where more, smaller CTAs a SM keep more rows loading while others
    reduce (4096 x 32000 bf16 on H100: 86 us over 2 CTAs of 256 against 112 us on one of 1024;
    128256: 349 us over 8 CTAs of 256 against 427 over 4 of 1024). Past 8 CTAs of 256 (131072 bf16)
    a 16-bit sm_90a forward takes a cluster of 16 (a non-portable size, as Quack's; 4096 x 201088: 787
    us against 903 over 4 CTAs of 1024, 256000: 772 against 976); elsewhere CTAs of up to 1024
    threads, spilling a little: a cluster of 8 cost it more (512 x 151936: 83 us over 4 CTAs, 133
    us over 8; the table has better for 151936). The modes that write dlogits lose more to a
    spill: 5 units a thread, then a larger cluster (128256: 129 -> 97 us over 4 CTAs instead of 2).
    A ``shifted`` launch (rows off 16-byte boundaries; N is its window) keeps the forward on one CTA
    of up to 1024 threads as long as it can (4096 x 50257: 167 us on one CTA of 1024, 351 us over 4
    of 256); the dlogits modes' is their usual one."""
    if mode == "forward" and not shifted:
        small = pick_row_launch(N, x_bits, units_per_thread=8, max_units_per_thread=8, max_threads=256)
        units = N // small.vec
        if 256 * 8 < units <= small.threads_per_row * small.cluster_n * 8:
            return small
        if arch == "sm_90a" and x_bits == 16 and 256 * 8 * 8 < units <= 256 * 16 * 8:
            return dataclasses.replace(small, cluster_n=16)
    return pick_row_launch(N, x_bits, max_units_per_thread=8 if mode == "forward" else 5)


class CrossEntropy(RowKernelBase):
    """Loss and lse (forward), dlogits (backward), or both in one pass (fwd_bwd)."""

    def __init__(self, launch: RowLaunch, dtype, target_dtype, mode: str, n: int | None = None):
        """``n``: the row's width where ``launch.N`` is the window of a shifted-rows forward."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        super().__init__(launch, num_reductions=0 if mode == "backward" else 2)
        self.x_dtype = dtype
        self.mode = mode
        self.target_dtype = target_dtype
        self.n = launch.N if n is None else n
        self.shifted = self.n != launch.N
        if self.shifted and (launch.rows_per_cta != 1 or launch.N < self.n + launch.vec - 1):
            raise ValueError(f"shifted rows: one row a CTA, a window of >= n + vec - 1; got {launch}")

    @cute.jit
    def __call__(self, px: cute.Pointer, ptarget: cute.Pointer, pdloss: Optional[cute.Pointer],
                 plse_in: Optional[cute.Pointer], ploss: Optional[cute.Pointer], plse_out: Optional[cute.Pointer],
                 pdx: Optional[cute.Pointer], M: Int32, ldx: Int64, lddx: Int64, ignore_index: Int32,
                 stream: cuda.CUstream):
        vector = lambda p: cute.make_tensor(p, cute.make_layout((M,))) if const_expr(p is not None) else None  # noqa: E731
        if const_expr(self.shifted):  # rows start anywhere: only scalar accesses through these views
            mX = cute.make_tensor(px, cute.make_layout((M, self.n), stride=(ldx, 1)))
            mDx = cute.make_tensor(pdx, cute.make_layout((M, self.n), stride=(lddx, 1))) if const_expr(
                pdx is not None) else None
        else:
            mX = self.matrix(px, M, ldx)
            mDx = self.matrix(pdx, M, lddx) if const_expr(pdx is not None) else None
        self.launch_rows(self.kernel(mX, vector(ptarget), vector(pdloss), vector(plse_in), vector(ploss),
                                     vector(plse_out), mDx, ignore_index, self.tiled_copy(self.x_dtype)), M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mDloss: Optional[cute.Tensor],
               mLseIn: Optional[cute.Tensor], mLoss: Optional[cute.Tensor], mLseOut: Optional[cute.Tensor],
               mDx: Optional[cute.Tensor], ignore_index: Int32, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        if const_expr(self.shifted):
            tXcX, tXgX, shift = self.row_window(mX, bidx, M, part)
            row = bidx
        else:
            tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
            row = tXcX[0][0]
            tXgX = part(mX, bidx)
            shift = 0  # the row's first column in the thread's coordinates
        rX = cute.make_rmem_tensor_like(tXgX)
        rX.fill(-math.inf)
        target = Int32(0)
        if row < M:
            self.copy_row(tXgX, rX, tXcX, self.x_dtype)
            target = Int32(mTarget[row])
            if const_expr(self.shifted):  # the window's columns outside the row: the rows beside it
                for i in cutlass.range_constexpr(cute.size(rX)):
                    col = tXcX[i][1]
                    if col < shift or col >= shift + self.n:
                        rX[i] = rX.element_type(-math.inf)
        valid = target != ignore_index
        bad = valid and (target < 0 or target >= self.n)
        self.wait_cluster()
        x = rX.load().to(Float32)

        if const_expr(self.mode == "backward"):
            lse = Float32(0.0)
            if row < M:
                lse = mLseIn[row]
        else:
            m, s = self.row_max_sum(x, buf, mbar)
            lse = m + cute.math.log(s, fastmath=False)
            # the row's leader (column 0, first CTA of the cluster) writes the row's loss and lse; it
            # loads the target's logit only now (loaded before the reduction, 1-6% slower on H100)
            leader = tXcX[0][1] == 0
            if const_expr(L.cluster_n > 1):
                leader = leader and cy == 0
            if leader and row < M:
                loss = Float32(0.0)
                if bad:
                    loss = Float32(math.nan)
                elif valid:
                    loss = lse - Float32(mX[row, target])
                mLoss[row] = loss
                if const_expr(mLseOut is not None):
                    mLseOut[row] = lse

        if const_expr(self.mode != "forward"):
            scale = Float32(0.0)
            if row < M and valid:
                scale = mDloss[row]
            if bad:
                scale = Float32(math.nan)
            rD = cute.make_rmem_tensor_like(rX, Float32)
            rD.store(cute.math.exp2((x - lse) * LOG2E, fastmath=True) * scale)
            for i in cutlass.range_constexpr(cute.size(rD)):
                if tXcX[i][1] == target + shift:  # ignored rows have scale 0, so no column needs the guard
                    rD[i] = rD[i] - scale
            rO = cute.make_rmem_tensor_like(rX, self.x_dtype)
            rO.store(rD.load().to(self.x_dtype))
            if row < M:
                if const_expr(self.shifted):  # dx's rows lie at x's offsets (the host's condition)
                    self.store_window(rO, self.row_window(mDx, bidx, M, part)[1], tXcX, shift)
                else:
                    self.copy_row(rO, part(mDx, bidx), tXcX, self.x_dtype)
        self.launch_dependents()

    @cute.jit
    def row_window(self, mX: cute.Tensor, row, M, part):
        """A shifted row's aligned window: (column coordinates in the window, this thread's slice of
        it, the row's first column in it). The window starts at the 16-byte boundary at or before
        the row (the base is 16-byte aligned) and every one of its vectors holds a column of the
        row, so no read leaves the memory the tensor's rows lie in."""
        L = self.launch
        start = Int64(0)
        if row < M:
            start = cute.crd2idx((row, 0), mX.layout)
        shift = Int32(start % L.vec)
        base = cute.make_ptr(self.x_dtype, (mX.iterator + (start - shift)).toint(), cute.AddressSpace.gmem,
                             assumed_align=16)
        window = cute.make_tensor(base, cute.make_layout((1, L.N), stride=(L.N, 1)))
        return part(cute.make_identity_tensor(window.shape), 0), part(window, 0), shift

    @cute.jit
    def store_window(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, shift):
        """Store a shifted row through its aligned window: whole vectors inside the row, the row's
        columns of its two edge vectors one at a time (their other columns are the rows beside it,
        which other CTAs write), nothing past the window."""
        L = self.launch
        atom = self.atom(self.x_dtype)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            first = tXcX[(0, 0), 0, i][1]
            if first >= shift and first + L.vec <= shift + self.n:
                cute.copy(atom, src[None, None, i], dst[None, None, i])
            elif first < L.N:
                s_i, d_i, c_i = src[None, None, i], dst[None, None, i], tXcX[None, None, i]
                for j in cutlass.range_constexpr(cute.size(s_i)):
                    if c_i[j][1] >= shift and c_i[j][1] < shift + self.n:
                        d_i[j] = s_i[j]


def shifted_window(N: int, x_bits: int) -> int | None:
    """The window width of a shifted-rows forward at width N (N plus up to a vector less one of
    lead, whole vectors), or None where rows start aligned."""
    vec = 128 // x_bits
    return None if N % vec == 0 else -(-(N + vec - 1) // vec) * vec


@memo
def compiled_cross_entropy(mode: str, dtype: str, target_dtype: str, N: int, arch: str, store_lse: bool = True,
                           window: bool = True):
    """Compile (or fetch) one kernel for (mode, dtypes, N, flags, arch); M, strides and
    ignore_index are runtime. ``window=False``: dlogits rows do not lie at the logits' offsets
    (another row stride), so rows off 16-byte boundaries are not moved as aligned windows."""
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the cross-entropy kernels handle 1 <= N <= {MAX_N}")
    dt, tt = cute_dtype(dtype), cute_dtype(target_dtype)
    width = shifted_window(N, dt.width) if window or mode == "forward" else None
    shifted = cross_entropy_launch(width, dt.width, arch, mode, True) if width else None
    if shifted is not None and shifted.rows_per_cta == 1:  # a window needs one row a CTA
        launch = pick(f"cross_entropy/{mode}_shifted/x{dt.width}", arch, shifted)
    else:
        launch = pick(f"cross_entropy/{mode}/x{dt.width}", arch, cross_entropy_launch(N, dt.width, arch, mode))
    store_lse = store_lse and mode != "backward"

    def build():
        one = Int64(launch.vec)
        f32 = gmem_ptr(Float32, 4)
        fwd, bwd = mode != "backward", mode != "forward"
        return compile_kernel(
            CrossEntropy(launch, dt, tt, mode, N), gmem_ptr(dt), gmem_ptr(tt, tt.width // 8),
            f32 if bwd else None, f32 if mode == "backward" else None, f32 if fwd else None,
            f32 if store_lse else None, gmem_ptr(dt) if bwd else None, Int32(1), one, one, Int32(-100),
            fake_stream(), arch=arch)

    return CACHE.get(("cross_entropy", mode, dtype, target_dtype, store_lse, N, arch, launch), build)
