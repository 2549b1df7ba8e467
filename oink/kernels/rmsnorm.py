"""RMSNorm family in CuTeDSL: forward (optional weight, bias, residual, rstd), the fused
add + RMSNorm in place (the forward kernel with its outputs aliased onto x and residual), and
the LayerNorm forward (the same kernel with the row mean subtracted first, and corrected by the
sum of the centred values).

One pass over memory: each thread loads its slice of a row into registers (128-bit accesses),
the row's sum of squares is all-reduced (warp, block, cluster), and the results are stored from
the same registers. In place is safe because every element is read before the reduction's
barrier and written after it, by the same thread.
"""
from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .. import config
from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .launch_table import staged
from .memo import memo
from .reduction import RowKernelBase, add
from .rmsnorm_rules import (FORWARD_KINDS, ForwardKey, forward_launch_of, late_params, stage_rows, staged_min_ctas,
                            staged_rows, widest_bits)
from .row_rules import MAX_N, WARP, RowLaunch

# LayerNorm's one-round moments (``RMSNormForward.pivot_moments``) hold while mean(x - pivot)^2 <= this times the
# variance: the variance then keeps all but ~log2(17) bits of its fp32 sums' precision (16-bit outputs)
PIVOT_LIMIT = 16


class RMSNormForward(RowKernelBase):
    """RMSNorm forward; with ``layernorm`` it subtracts the row mean first (LayerNorm), in two
    reduction rounds: the mean, then the sum of the centred values (a correction to the mean) with
    the sum of their squares."""

    def __init__(self, launch: RowLaunch, x_dtype, w_dtype, b_dtype, res_dtype, out_dtype, res_out_dtype,
                 store_rstd: bool, layernorm: bool = False, weight_offset: float = 0.0, heads: int = 1,
                 late_params: bool = False, stage: bool = False, n: int | None = None):
        """``n``: the row's width where ``launch.N`` is its window's (RMSNorm rows off 16-byte boundaries, every
        row tensor's rows at x's offsets, read and written through aligned windows: ``RowKernelBase.window``;
        the parameters gathered a value at a time, ``load_shifted``; which calls take them: ``forward_window``)."""
        super().__init__(launch, num_reductions=4 if layernorm else 1, n=n)
        self.x_dtype, self.w_dtype, self.b_dtype = x_dtype, w_dtype, b_dtype
        self.res_dtype, self.out_dtype, self.res_out_dtype = res_dtype, out_dtype, res_out_dtype
        self.store_rstd = store_rstd
        self.layernorm = layernorm
        self.weight_offset = weight_offset  # y = x_hat * (w + offset): Gemma's (1 + w) is 1.0
        self.heads = heads  # per-head weight/bias [H, D]: row r (of [..., H, D] rows) takes head r % H
        # weight and bias loaded after the reduction, and x converted to fp32 again where it is used,
        # so that neither is held in registers across the reduction's barriers
        self.late_params = late_params
        # x (and the residual) copied into shared memory (cp.async) and read from there again after the
        # reduction, so that no register holds them across its barriers (``stage_rows``)
        self.stage = stage
        # the norm of the residual sum in fp32 rather than of the sum stored (vLLM's dynamic FP8 norms); never
        # with ``late_params`` or ``stage``, which read the stored sum again
        self.raw_sum = False
        self.pivot_setting = config.get().ln_pivot  # (the compile cache keys on it: ``compiled_forward``)
        if self.shifted and (heads > 1 or stage):
            raise ValueError(f"shifted rows: one head, unstaged; got {launch}")

    @cute.jit
    def weight_values(self, rW: cute.Tensor):
        """The weight registers in fp32, offset added (a compile-time constant, added only if nonzero)."""
        w = rW.load().to(Float32)
        if const_expr(self.weight_offset != 0.0):
            w = w + Float32(self.weight_offset)
        return w

    def broadcast_rows(self, ptr):
        """A per-column vector seen as a (rows_per_cta, N) matrix with row stride 0; per head, H such
        matrices (H, rows_per_cta, N) that ``head_rows`` picks from."""
        L = self.launch
        if const_expr(self.heads > 1):
            return cute.make_tensor(ptr, cute.make_layout((self.heads, L.rows_per_cta, L.N), stride=(L.N, 0, 1)))
        return cute.make_tensor(ptr, cute.make_layout((L.rows_per_cta, L.N), stride=(0, 1)))

    def head_rows(self, mP: cute.Tensor, row):
        """The (rows_per_cta, N) broadcast view of a per-column parameter for ``row``'s head."""
        if const_expr(self.heads > 1):
            return mP[row % self.heads, None, None]
        return mP

    @cute.jit
    def __call__(self, px: cute.Pointer, pw: Optional[cute.Pointer], pb: Optional[cute.Pointer],
                 pres: Optional[cute.Pointer], pout: cute.Pointer, pres_out: Optional[cute.Pointer],
                 prstd: Optional[cute.Pointer], pmean: Optional[cute.Pointer], M: Int32, ldx: Int64,
                 ldres: Int64, ldout: Int64, ldres_out: Int64, eps: Float32, stream: cuda.CUstream):
        matrix = self.shifted_matrix if const_expr(self.shifted) else self.matrix  # (windows: rows start anywhere)
        mX = matrix(px, M, ldx)
        mO = matrix(pout, M, ldout)
        mRes = matrix(pres, M, ldres) if const_expr(pres is not None) else None
        mResO = matrix(pres_out, M, ldres_out) if const_expr(pres_out is not None) else None
        mW = self.broadcast_rows(pw) if const_expr(pw is not None) else None
        mB = self.broadcast_rows(pb) if const_expr(pb is not None) else None
        mRstd = cute.make_tensor(prstd, cute.make_layout((M,))) if const_expr(prstd is not None) else None
        mMean = cute.make_tensor(pmean, cute.make_layout((M,))) if const_expr(pmean is not None) else None
        self.launch_rows(self.kernel(mX, mW, mB, mRes, mO, mResO, mRstd, mMean, eps, self.tiled_copy(self.x_dtype)),
                         M, stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
               mRes: Optional[cute.Tensor], mO: cute.Tensor, mResO: Optional[cute.Tensor],
               mRstd: Optional[cute.Tensor], mMean: Optional[cute.Tensor], eps: Float32, tc: cute.TiledCopy):
        L = self.launch
        bidx, cy, buf, mbar, part = self.cta_setup(tc)
        M = cute.size(mX, mode=[0])
        shift = None
        if const_expr(self.shifted):  # each thread's row through its window
            row = bidx * L.rows_per_cta + cute.arch.thread_idx()[0] // L.threads_per_row
            tXcX, _, shift = self.row_window(mX, row, M, part)
            view = lambda m: self.row_window(m, row, M, part)[1]  # noqa: E731  (a closure over this scope)
        else:
            tXcX = part(cute.make_identity_tensor(mX.shape), bidx)
            row = tXcX[0][0]
            view = lambda m: part(m, bidx)  # noqa: E731  (a closure over this scope)
        y, rX, rstd, mean = self.normalize(mX, mW, mB, mRes, mResO, eps, view, buf, mbar, part, tXcX, row, M, shift)
        rO = cute.make_rmem_tensor_like(rX, self.out_dtype)
        rO.store(y.to(self.out_dtype))
        if row < M:
            self.store_slice(rO, view(mO), tXcX, self.out_dtype, shift)
        if const_expr(mRstd is not None or mMean is not None):
            # one thread per row (column 0, first CTA of the cluster) writes the row statistics
            leader = tXcX[0][1] == 0
            if const_expr(L.cluster_n > 1):
                leader = leader and cy == 0
            if leader and row < M:
                if const_expr(mRstd is not None):
                    mRstd[row] = rstd
                if const_expr(mMean is not None):
                    mMean[row] = mean
        self.launch_dependents()

    @cute.jit
    def normalize(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
                  mRes: Optional[cute.Tensor], mResO: Optional[cute.Tensor], eps: Float32, view, buf, mbar,
                  part, tXcX: cute.Tensor, row: Int32, M: Int32, shift):
        """Load this thread's slice of its row (and residual, weight, bias), store the residual
        sum, reduce, and return (y in fp32, the x registers, rstd, mean); traced into the kernel.
        ``view(m)``: this thread's slice of a row tensor; ``shift``: a shifted row's first column in its
        window (None for aligned rows)."""
        h, rX, rRes, rResO, smem_rows, src, rW, rB = self.norm_inputs(mX, mW, mB, mRes, mResO, view, part, tXcX,
                                                                        row, M, shift)
        mean = Float32(0.0)
        if const_expr(self.layernorm):
            again = lambda: self.reload(src, rX, rRes, rResO, smem_rows, tXcX)  # noqa: E731  (a closure over this scope)
            inside = lambda v: self.row_columns(v, rX, tXcX, shift)  # noqa: E731  (a closure over this scope)
            if const_expr(self.pivoted):
                h, mean, var = self.pivot_moments(h, again, inside, self.pivot(mX, row, M), buf, mbar)
            else:
                h, mean, var = self.centred_moments(h, again, inside, buf, mbar)
        else:
            ss = (h * h).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
            var = self.row_allreduce(ss, add, Float32(0.0), buf, mbar, 0) / self.n
        rstd = cute.math.rsqrt(var + eps, fastmath=False)

        if const_expr(self.late_params):
            rW, rB = self.load_params(mW, mB, part, tXcX, row, shift)
        if const_expr((self.late_params or self.stage) and not self.layernorm):
            h = self.reload(src, rX, rRes, rResO, smem_rows, tXcX)
        y = h * rstd
        if const_expr(mW is not None):
            y = y * self.weight_values(rW)
        if const_expr(mB is not None):
            y = y + rB.load().to(Float32)
        return y, rX, rstd, mean

    @cute.jit
    def norm_inputs(self, mX: cute.Tensor, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor],
                    mRes: Optional[cute.Tensor], mResO: Optional[cute.Tensor], view, part, tXcX: cute.Tensor,
                    row: Int32, M: Int32, shift):
        """``normalize``'s loads, up to its reduction: this thread's slice of its row (and residual) in fp32 h, the
        residual sum stored, the weight and bias (None where loaded late), the cluster waited for. -> (h, the x
        registers, the residual's and its sum's, the staged rows, what ``reload`` converts again, rW, rB)."""
        tXgX = view(mX)

        # Loads: rows past M load nothing (their values stay 0, or staged, undefined; never stored).
        rX = cute.make_rmem_tensor_like(tXgX)
        rRes, tXgRes = None, None
        if const_expr(mRes is not None):
            tXgRes = view(mRes)
            rRes = cute.make_rmem_tensor_like(tXgRes)
        smem_rows = None
        if const_expr(self.stage):
            smem_rows = self.stage_loads(tXgX, tXgRes, part, tXcX, row, M)
        else:
            rX.fill(0)
            if const_expr(mRes is not None):
                rRes.fill(0)
            if const_expr(self.unbranched):
                self.load_inputs(tXgX, rX, tXgRes, rRes, tXcX, shift)
            elif row < M:
                self.load_inputs(tXgX, rX, tXgRes, rRes, tXcX, shift)
        rW, rB = None, None
        if const_expr(not self.late_params):
            rW, rB = self.load_params(mW, mB, part, tXcX, row, shift)

        rResO = None
        if const_expr(mRes is not None):
            rResO = cute.make_rmem_tensor_like(rRes, self.res_out_dtype)
        h = self.row_values(rX, rRes, rResO, smem_rows, tXcX)
        if const_expr(mResO is not None):
            tXgResO = view(mResO)
            if row < M:
                self.store_slice(rResO, tXgResO, tXcX, self.res_out_dtype, shift)
        # what the values are computed from again after a reduction round (``reload``)
        src = rX if const_expr(mRes is None) else rResO
        if const_expr(self.stage):
            src = None

        self.wait_cluster()
        return h, rX, rRes, rResO, smem_rows, src, rW, rB

    @property
    def pivoted(self) -> bool:
        """Whether LayerNorm's moments take one reduction round about a pivot (``pivot_moments``), not two
        (``centred_moments``): 16-bit x, and a launch whose threads of one barrier or shuffle all take the
        fallback round or none: one row a CTA (a cluster's CTAs share their row), or rows inside warps (a
        warp vote). Several rows over several warps a CTA (a CTA-wide vote: a barrier more) keep two rounds;
        so does fp32 x (its 1e-5 bound leaves no room for the pivot's cancellation), and so do rows of
        narrower accesses than 16 bytes whose values are read again after the round (late parameters, staged):
        there ptxas gave the one round 17-28 registers more a thread, a CTA a SM fewer, which cost more than the
        round saves (timings: docs/tuning.md)."""
        L = self.launch
        uniform = L.rows_per_cta == 1 or L.threads_per_row <= WARP
        if self.pivot_setting is not None:  # the ``ln_pivot`` development setting
            return self.layernorm and uniform and self.pivot_setting
        again = (self.late_params or self.stage) and L.vec * self.x_dtype.width < 128
        return self.layernorm and self.x_dtype.width == 16 and not again and uniform

    @cute.jit
    def pivot(self, mX: cute.Tensor, row, M):
        """The row's first value in fp32; 0 past M, or where it is not finite (a pivot of +inf would make the
        mean of a row holding +inf NaN, the reference's +inf)."""
        p = Float32(0.0)
        if row < M:
            v = mX[row, 0].to(Float32)
            if v - v == Float32(0.0):
                p = v
        return p

    @cute.jit
    def row_columns(self, vals, like: cute.Tensor, tXcX: cute.Tensor, shift):
        """``vals`` with the register columns outside the row (padding, a window's other rows) set to 0."""
        if const_expr(self.shifted):
            return cute.where(self.window_columns(like, tXcX, shift), vals, cute.full_like(vals, 0.0))
        if const_expr(not self.launch.even_n):
            return self.zero_padding(vals, like, tXcX)
        return vals

    def row_sums(self, c, buf, mbar, slot_a, slot_b):
        """(the sum of c, the sum of c^2) over the row, in one reduction round (slots ``slot_a``, ``slot_b``); c zero
        outside the row."""
        s1 = c.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        s2 = (c * c).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        return self.row_allreduce_pair(s1, s2, add, Float32(0.0), buf, mbar, slot_a, slot_b)

    @cute.jit
    def centred_moments(self, h, again, inside, buf, mbar):
        """(the centred values, mean, variance) in two reduction rounds: the mean, then the sums of the
        centred values and of their squares. ``again()``: the values once more (late parameters, staged rows);
        ``inside(v)``: v zero outside the row."""
        mean = self.row_allreduce(h.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0),
                                  add, Float32(0.0), buf, mbar, 0) / self.n
        if const_expr(self.late_params or self.stage):
            h = again()  # rather than held in fp32 across the round
        # columns outside the row hold 0 - mean after centring: zeroed before the squares (subtracting
        # pad * mean^2 afterwards cancels catastrophically when |mean| >> the row's spread)
        h = inside(h - mean)
        # The fp32 row sum leaves the mean a few ulps of |mean| off, which the spread then divides:
        # the sum of the centred values (nearly exact) corrects it, in the squares' barrier round.
        dsum, ss = self.row_sums(h, buf, mbar, 1, 2)
        corr = dsum / self.n
        mean = mean + corr
        if const_expr(self.late_params or self.stage):
            h = again() - mean  # columns outside the row are not stored
        else:
            h = h - corr
        # the clamp keeps a NaN (a row holding NaN or +-inf has no variance)
        return h, mean, cute.arch.fmax(ss / self.n - corr * corr, Float32(0.0), nan=True)

    @cute.jit
    def pivot_moments(self, h, again, inside, p, buf, mbar):
        """``centred_moments`` in one round where the pivot ``p`` (the row's first value) lies near the mean:
        the sums of d = x - p and of d^2; mean = p + mean(d), variance = mean(d^2) - mean(d)^2. That difference
        loses the variance's low bits as mean(d)^2 / variance grows: past ``PIVOT_LIMIT`` (a pivot more than 4
        standard deviations out, an outlier) the row takes a second round, ``centred_moments``' about that mean
        (the pivot's rounding, ~an ulp of |p|, then corrected)."""
        L = self.launch
        s1, s2 = self.row_sums(inside(h - p), buf, mbar, 0, 1)
        dbar = s1 / self.n
        var = s2 / self.n - dbar * dbar
        mean = p + dbar
        far = dbar * dbar > var * Float32(PIVOT_LIMIT)
        if const_expr(L.rows_per_cta > 1):  # rows inside warps: the warp's rows take the second round or none
            far = cute.arch.vote_any_sync(far)
        if far:
            c = inside((again() if const_expr(self.late_params or self.stage) else h) - mean)
            dsum, ss = self.row_sums(c, buf, mbar, 2, 3)
            corr = dsum / self.n
            mean = mean + corr
            var = ss / self.n - corr * corr
        if const_expr(self.late_params or self.stage):
            h = again()  # columns outside the row are not stored
        return h - mean, mean, cute.arch.fmax(var, Float32(0.0), nan=True)

    @cute.jit
    def stage_loads(self, tXgX: cute.Tensor, tXgRes, part, tXcX: cute.Tensor, row: Int32, M: Int32):
        """Copy this thread's slice of x (and the residual) into shared memory (cp.async, waited for:
        each thread reads back only what it copied; vectors past N are not copied, and ``row_values``
        reads them as 0). -> (x's, residual's or None) slices there."""
        L = self.launch
        smem = cutlass.memory.SmemAllocator()
        tile = cute.make_ordered_layout((L.rows_per_cta, L.cols_per_cta), order=(1, 0))
        tXsX = part(smem.allocate_tensor(self.x_dtype, tile, byte_alignment=16), None)
        tXsRes = None
        if const_expr(tXgRes is not None):
            tXsRes = part(smem.allocate_tensor(self.res_dtype, tile, byte_alignment=16), None)
        if row < M:
            self.copy_row(tXgX, tXsX, tXcX, self.x_dtype, cute.nvgpu.cpasync.CopyG2SOp())
            if const_expr(tXgRes is not None):
                self.copy_row(tXgRes, tXsRes, tXcX, self.res_dtype, cute.nvgpu.cpasync.CopyG2SOp())
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        return tXsX, tXsRes

    @cute.jit
    def row_values(self, rX: cute.Tensor, rRes, rResO, smem_rows, tXcX: cute.Tensor):
        """This thread's row values in fp32: x, or x + residual rounded to the residual output's dtype
        (the stored sum, kept in ``rResO``; the norm is of that rounded value, or with ``raw_sum`` of the fp32 sum);
        read from ``smem_rows`` (``stage_loads``) where staged, the vectors past N (never copied there) as 0."""
        if const_expr(smem_rows is not None):
            cute.autovec_copy(smem_rows[0], rX)
            if const_expr(rRes is not None):
                cute.autovec_copy(smem_rows[1], rRes)
        h = rX.load().to(Float32)
        if const_expr(rRes is not None):
            total = h + rRes.load().to(Float32)
            rResO.store(total.to(self.res_out_dtype))
            h = total if const_expr(self.raw_sum) else rResO.load().to(Float32)
        if const_expr(smem_rows is not None and not self.launch.even_n):
            h = self.zero_padding(h, rX, tXcX)
        return h

    @cute.jit
    def reload(self, src, rX: cute.Tensor, rRes, rResO, smem_rows, tXcX: cute.Tensor):
        """The row values in fp32 again after a reduction round: converted again from the registers
        they were computed from (``src``), or read again from shared memory (``smem_rows``)."""
        if const_expr(smem_rows is not None):
            return self.row_values(rX, rRes, rResO, smem_rows, tXcX)
        return src.load().to(Float32)

    @cute.jit
    def load_params(self, mW: Optional[cute.Tensor], mB: Optional[cute.Tensor], part, tXcX: cute.Tensor, row,
                    shift=None):
        """This thread's slice of the weight and bias (row's head) in registers (None where absent); for a
        shifted row (``shift``: its first column in its window) at its window's columns (``load_shifted``)."""
        return (self.load_param(mW, part, tXcX, row, shift, self.w_dtype),
                self.load_param(mB, part, tXcX, row, shift, self.b_dtype))

    @cute.jit
    def load_param(self, mP: Optional[cute.Tensor], part, tXcX: cute.Tensor, row, shift, dtype: cutlass.Constexpr):
        """``load_params`` of one parameter."""
        if const_expr(mP is None):
            return None
        if const_expr(self.shifted):
            return self.load_shifted(mP, part, tXcX, shift, dtype)
        tXgP = part(self.head_rows(mP, row), 0)
        rP = cute.make_rmem_tensor_like(tXgP)
        if const_expr(not self.clamped):
            self.copy_row(tXgP, rP, tXcX, dtype)
        else:  # the values past N multiply x's zeros, their outputs never stored
            self.load_clamped(tXgP, rP, tXcX, dtype)
        return rP

    @cute.jit
    def load_shifted(self, mP: cute.Tensor, part, tXcX: cute.Tensor, shift, dtype: cutlass.Constexpr):
        """A per-column parameter at a shifted row's window columns: column j of the window is the
        parameter's j - shift, gathered a value at a time (the parameter is read by every row: from cache);
        0 outside the row."""
        L = self.launch
        base = cute.make_ptr(dtype, (mP.iterator - shift).toint(), cute.AddressSpace.gmem,
                             assumed_align=dtype.width // 8)
        tXgP = part(cute.make_tensor(base, cute.make_layout((L.rows_per_cta, L.N), stride=(0, 1))), 0)
        rP = cute.make_rmem_tensor_like(tXgP)
        rP.fill(0)
        for i in cutlass.range_constexpr(cute.size(rP)):
            if tXcX[i][1] >= shift and tXcX[i][1] < shift + self.n:
                rP[i] = tXgP[i]
        return rP

    @property
    def unbranched(self) -> bool:
        """x's loads unbranched (``rows_in_grid``) where a thread holds 16-bit values of one row, no residual
        and no wider parameter: with fp32 rows, a residual or an fp32 weight ptxas then spilled a few bytes."""
        return self.rows_in_grid and self.x_dtype.width == 16 and self.res_dtype is None and all(
            d is None or d.width <= 16 for d in (self.w_dtype, self.b_dtype))

    @cute.jit
    def load_inputs(self, tXgX: cute.Tensor, rX: cute.Tensor, tXgRes: Optional[cute.Tensor],
                    rRes: Optional[cute.Tensor], tXcX: cute.Tensor, shift):
        """Load this thread's slices of its row of x (and of the residual)."""
        self.load_slice(tXgX, rX, tXcX, self.x_dtype, shift)
        if const_expr(rRes is not None):
            self.load_slice(tXgRes, rRes, tXcX, self.res_dtype, shift)

    @cute.jit
    def load_slice(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr, shift):
        """Load this thread's slice of a row: ``copy_row``, or a shifted row's through its window (columns
        outside the row 0)."""
        if const_expr(self.shifted):
            self.load_window(src, dst, tXcX, shift, 0.0, dtype)
        elif const_expr(not self.clamped):
            self.copy_row(src, dst, tXcX, dtype)
        else:
            self.load_clamped(src, dst, tXcX, dtype)
            dst.store(cute.where(self.inside_vectors(dst, tXcX), dst.load(), cute.full_like(dst.load(), 0.0)))

    @property
    def clamped(self) -> bool:
        """Whether an uneven row (``launch.even_n`` false) of 16-byte accesses loads ``load_clamped``'s way; rows of
        narrower accesses keep the predicated loads (clamped, LayerNorm's 4750-column rows spilled on sm_100a)."""
        return not self.launch.even_n and self.launch.vec * self.x_dtype.width == 128

    @cute.jit
    def load_clamped(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr):
        """This thread's slice of an uneven row (``launch.even_n`` false), a vector past N read from the row's last
        vector instead (in bounds): the loads go out unpredicated, all at once. Predicated, ptxas unpacked each
        vector's values under its load's predicate, ran out of predicates past 6 vectors a thread (x and the
        weight), and waited for a load's data before the next vectors' loads (a round trip)."""
        L = self.launch
        atom = self.atom(dtype)
        for i in cutlass.range_constexpr(cute.size(src, mode=[2])):
            s_i = src[None, None, i]
            back = cutlass.min(Int32(L.N - L.vec) - tXcX[(0, 0), 0, i][1], Int32(0))
            at = cute.make_ptr(dtype, (s_i.iterator + back).toint(), cute.AddressSpace.gmem, assumed_align=16)
            cute.copy(atom, cute.make_tensor(at, s_i.layout), dst[None, None, i])

    @cute.jit
    def store_slice(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, dtype: cutlass.Constexpr, shift):
        """Store this thread's slice of a row: ``copy_row``, or a shifted row's through its window."""
        if const_expr(self.shifted):
            self.store_window(src, dst, tXcX, shift, dtype)
        else:
            self.copy_row(src, dst, tXcX, dtype)


def _cute(name):
    return None if name is None else cute_dtype(name)




@memo
def compiled_forward(k: ForwardKey):
    """Compile (or fetch) the forward for ``k``."""
    x_dtype, N, arch, w_dtype, b_dtype = k.x_dtype, k.N, k.arch, k.w_dtype, k.b_dtype
    res_dtype, res_out_dtype, store_rstd, layernorm = k.res_dtype, k.res_out_dtype, k.store_rstd, k.layernorm
    store_mean, out_dtype, weight_offset, heads, few = k.store_mean, k.out_dtype, k.weight_offset, k.heads, k.few
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the RMSNorm kernel handles 1 <= N <= {MAX_N}")
    xd = cute_dtype(x_dtype)
    out_dtype = out_dtype or x_dtype
    wide = widest_bits(w_dtype, res_dtype, res_out_dtype)
    table_key, launch = forward_launch_of(k)
    # None, or where a staged launch loads its parameters: a trial's or a table entry's staging, else the staged rule's
    ruled = launch == staged_rows(k)
    tuned = staged(table_key, arch, launch.N, config.get().fwd_upt, few, "late" if ruled else None)
    stage = stage_rows(launch, xd.width, cute_dtype(res_dtype).width if res_dtype else 0,
                       tuned is not None) and launch.N == N  # (never through windows)
    late = config.get().fwd_late
    if late is None:
        late = tuned == "late" if stage and tuned else late_params(launch, layernorm, wide > xd.width,
                                                                  launch.vec * xd.width < 128)
    # a register cap: a sweep's setting, else the staged rule's where its kernel runs as the rule has it
    ctas = config.get().fwd_ctas or (staged_min_ctas(launch) if ruled and stage and late else 0)
    pivot = config.get().ln_pivot if layernorm else None
    key = (FORWARD_KINDS[layernorm], x_dtype, w_dtype, b_dtype, res_dtype, res_out_dtype,
           out_dtype, store_rstd, store_mean, float(weight_offset), heads, N, arch, launch,
           *((("ctas", ctas),) if ctas else ()), *((("pivot", pivot),) if pivot is not None else ()),
           late, stage)  # the stage flag last (``ran_staged``)

    def build():
        dts = [_cute(d) for d in (w_dtype, b_dtype, res_dtype, res_out_dtype, out_dtype)]
        kernel = RMSNormForward(launch, xd, *dts[:3], dts[4], dts[3], store_rstd, layernorm, float(weight_offset),
                                heads, late, stage, n=N)
        kernel.min_ctas = ctas
        ptr = lambda dt: None if dt is None else gmem_ptr(dt)  # noqa: E731  (a closure over this scope)
        one = Int64(launch.vec)
        return compile_kernel(
            kernel, gmem_ptr(xd), ptr(dts[0]), ptr(dts[1]), ptr(dts[2]), gmem_ptr(dts[4]), ptr(dts[3]),
            gmem_ptr(Float32, 4) if store_rstd else None, gmem_ptr(Float32, 4) if store_mean else None,
            Int32(1), one, one, one, one, Float32(1e-6),
            fake_stream(), arch=arch)

    return CACHE.get(key, build)
