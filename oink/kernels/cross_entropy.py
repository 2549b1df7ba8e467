"""CrossEntropy over the last dim in CuTeDSL: forward, backward, and fused forward+backward.

One pass over the logits each; a row stays in registers between its load and its store, except in
the forward of wide rows, which streams: each thread folds its columns a few vectors at a time into
a running (max, sum of exp) pair and keeps no row (``stream_rows``; the dlogits modes can stream
too, reading the row a second time to store dx).
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
backward): every element is read before it is written, by the same thread. The options' and the +inf
limit's per-value forms are the mixin ``cross_entropy_forms.CrossEntropyForms``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from .compile import CACHE, compile_kernel, cute_dtype, fake_stream, gmem_ptr
from .memo import memo
from .launch_table import pick
from .cross_entropy_forms import CrossEntropyForms
from .cross_entropy_rules import (PLAIN, SOFTCAP_LEAN_MAX, CEOptions, backward_min_ctas, cross_entropy_launch,
                                  option_launch, softcap_form, stream_launch, stream_rows)
from .reduction import LOG2E, RowKernelBase, add
from .row_rules import MAX_N, RowLaunch, shifted_window

MODES = ("forward", "backward", "fwd_bwd")


# A streamed forward row: each pass loads this many 128-bit units a thread and folds them into the
# thread's running (max, sum of exp) pair, so registers bound neither the row's width nor the CTAs a
# SM: small CTAs, many of them a SM, keep more loads in flight than one holding the row
STREAM_UNITS = 4


class CrossEntropy(CrossEntropyForms, RowKernelBase):
    """Loss and lse (forward), dlogits (backward), or both in one pass (fwd_bwd).

    The options apply in registers to the values loaded: ``softcap`` c maps each logit to c * tanh(x / c)
    (``capped_one``) and the row's padding back to -inf;
    label smoothing adds the row's sum of logits to the one reduction round (slot 2); the z-loss is
    per-row arithmetic. Rows holding +inf logits take the limit (``oink.reference.cross_entropy``):
    where a register-held row's max (or the backward's lse) is +inf, each warp counts the row's +inf
    logits by reading it again (the reductions themselves are the plain ones; in a streamed row only a
    thread whose max is +inf reads its tiles again, ``stream_count_posinf``), the lse is +inf, the loss
    log k at a +inf target, and the dlogits are 1/k on the k +inf logits."""

    def __init__(self, launch: RowLaunch, dtype, target_dtype, mode: str, n: int | None = None,
                 stream: bool = False, options: CEOptions = PLAIN, inplace: bool = False):
        """``n``: the row's width where ``launch.N`` is the window of a shifted-rows forward;
        ``stream``: CTAs that pass over their columns ``STREAM_UNITS`` units at a time; ``inplace``:
        dlogits stored over the logits, so no thread reads the row from memory once another may
        have stored into it (the fused mode takes the target's logit from the thread holding it)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        if inplace and (mode == "forward" or stream):
            raise ValueError(f"in place: the register-held dlogits modes only; got {mode}, stream={stream}")
        self.inplace = inplace
        self.options = options
        self.posinf = options.softcap is None  # capped logits are finite: no +inf limit to take
        sums = 3 if options.label_smoothing else 2
        super().__init__(launch, num_reductions=0 if mode == "backward" else sums, n=n)
        self.x_dtype = dtype
        self.mode = mode
        self.target_dtype = target_dtype
        self.stream = stream
        # the softcap's dlogits form (``softcap_form``): a fused register-held row with a softcap c <= 40 and no
        # label smoothing holds exp(t - c) (1 - (t / c)^2) a logit from the row's sum to its dlogits (``held_exp``);
        # the backward's and a streamed fused row's dlogits come from the logits as loaded (``capped_exp_slope``)
        form = softcap_form(mode, options, stream)
        self.hold, self.raw = form == "held", form == "raw"
        # a forward with a softcap c <= 40 sums exp(t - c) of the capped values t straight from the logits, at the
        # one shift c (``capped_sum``): no max taken, one tanh and one exp a logit
        self.lean = mode == "forward" and options.softcap is not None and options.softcap <= SOFTCAP_LEAN_MAX
        if stream:
            width, passes = self.stream_tiling()
            self.padded = passes * width * launch.cluster_n != launch.N or self.shifted
        else:
            self.padded = not launch.even_n or self.shifted  # registers holding columns outside the row
        # the columns past the row (padding, -inf) are told apart from the row's only where an option needs it:
        # the plain sums ignore -inf; a capped -inf and the smoothing sum do not (``inside``)
        self.inside_tested = self.padded and (options.softcap is not None or bool(options.label_smoothing))
        if stream and launch.rows_per_cta != 1:
            raise ValueError(f"a streamed row: one row a CTA; got {launch}")
        if self.shifted and launch.rows_per_cta != 1:
            raise ValueError(f"shifted rows: one row a CTA; got {launch}")

    @cute.jit
    def __call__(self, px: cute.Pointer, ptarget: cute.Pointer, pdloss: Optional[cute.Pointer],
                 plse_in: Optional[cute.Pointer], ploss: Optional[cute.Pointer], plse_out: Optional[cute.Pointer],
                 pdx: Optional[cute.Pointer], M: Int32, ldx: Int64, lddx: Int64, ignore_index: Int32,
                 stream: cuda.CUstream):
        vector = lambda p: cute.make_tensor(p, cute.make_layout((M,))) if const_expr(p is not None) else None  # noqa: E731  (a closure over this scope)
        if const_expr(self.shifted):  # rows start anywhere: only scalar accesses through these views
            mX = self.shifted_matrix(px, M, ldx)
            mDx = self.shifted_matrix(pdx, M, lddx) if const_expr(pdx is not None) else None
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
        if const_expr(self.stream):
            self.stream_body(mX, mTarget, mDloss, mLseIn, mLoss, mLseOut, mDx, ignore_index, tc, bidx, cy, buf, mbar,
                             M)
            return
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
        # the backward's lse (where it is tested for +inf) and the fused mode's dloss load with the row: the
        # lse's +inf test would hold the row's loads back, and the fused mode's loss store would keep a later
        # dloss load behind it. The backward's dloss stays late (early, it timed slower on narrow rows), and so
        # does a softcap backward's lse (early, one more live register spilled the widest fp32 rows)
        lse, dloss = Float32(0.0), Float32(0.0)
        if row < M:
            if const_expr(self.shifted):  # the window's columns outside the row: -inf
                self.load_window(tXgX, rX, tXcX, shift, -math.inf)
            else:
                self.copy_row(tXgX, rX, tXcX, self.x_dtype)
            target = Int32(mTarget[row])
            if const_expr(self.mode == "backward" and self.posinf):
                lse = mLseIn[row]
            if const_expr(self.mode == "fwd_bwd"):
                dloss = mDloss[row]
        valid = target != ignore_index
        bad = valid and (target < 0 or target >= self.n)
        self.wait_cluster()
        x = rX.load().to(Float32)
        inside = self.inside(rX, tXcX, shift)
        fold = None
        if const_expr(self.inplace and not self.hold and self.mode != "backward"):
            # in place, the leader loads the target's logit before the reduction round and folds it (capped as
            # the row's values are) into its max: a value of the row, so the round's result is unchanged, and
            # every thread passes that round before it stores dlogits over the row, so after the load. (The
            # thread holding the target's column keeping the logit instead kept the row live through the round:
            # a third more registers a thread.)
            xt, fold = Float32(0.0), Float32(-math.inf)
            if self.is_leader(tXcX, cy) and row < M and valid and not bad:
                xt = Float32(mX[row, target])
                fold = self.capped_one(xt)
        if const_expr(self.hold):
            # the leader loads the target's logit now: the softcap's derivative there rides the reduction
            # round to every thread (no thread compares its columns with the target's before the dlogits), and
            # it writes the loss from it (in place too: the load's value is in the leader's partial, so it is
            # read before any thread of the row is past the round and storing)
            xt, f_t = Float32(0.0), Float32(0.0)
            if self.is_leader(tXcX, cy) and row < M and valid and not bad:
                xt = Float32(mX[row, target])
                f_t = self.capped_exp_slope(xt, Float32(self.options.softcap))[1]
            s_thr, x = self.held_exp(x, rX, inside)  # x: exp(t - c) (1 - (t / c)^2) a logit
        elif const_expr(self.lean):
            s_thr, sx_thr = self.capped_sum(rX, inside)
        elif const_expr(not self.raw):  # (raw: the backward's dlogits from the logits as loaded)
            x = self.capped(x, rX, inside)
        k = Float32(0.0)  # the row's count of +inf logits, where its lse is +inf

        if const_expr(self.mode == "backward"):
            if const_expr(self.posinf):  # (its lse loaded with the row)
                k = self.count_posinf(mX, row, M, lse)
                self.reads_done(lse)
            else:
                if row < M:
                    lse = mLseIn[row]
        else:
            sx = Float32(0.0)
            if const_expr(self.lean):  # sums at the one shift c, no max
                m = Float32(self.options.softcap)
                if const_expr(self.options.label_smoothing):
                    m, s, sx = self.merge_max_sum(m, s_thr, buf, mbar, sx_thr)
                else:
                    m, s = self.merge_max_sum(m, s_thr, buf, mbar)
            elif const_expr(self.options.label_smoothing):
                m, s, sx = self.row_max_sum(x, buf, mbar, extra=self.row_sum(x, inside), also=fold)
            elif const_expr(self.hold):  # sums at the one shift c, no max; f_t: the leader's, the others' 0
                s, f_t = self.row_allreduce_pair(s_thr, f_t, add, Float32(0.0), buf, mbar, 0, 1)
                m = Float32(self.options.softcap)
            else:
                m, s = self.row_max_sum(x, buf, mbar, also=fold)
            if const_expr(self.posinf):
                s = self.posinf_sum(mX, row, M, m, s)
                self.reads_done(m)
            lse = m + cute.math.log(s, fastmath=False)
            k = s
            # the row's leader (column 0, first CTA of the cluster) writes the row's loss and lse; it
            # loads the target's logit only now (loaded before the reduction it timed slower)
            leader = tXcX[0][1] == 0
            if const_expr(L.cluster_n > 1):
                leader = leader and cy == 0
            if const_expr(self.hold or self.inplace):  # the target's logit loaded before the round
                if leader and row < M:
                    loss = Float32(0.0)
                    if bad:
                        loss = Float32(math.nan)
                    elif valid:
                        loss = self.row_loss(lse, s, sx, xt)
                    mLoss[row] = loss
                    if const_expr(mLseOut is not None):
                        mLseOut[row] = lse
            elif leader and row < M:
                loss = Float32(0.0)
                if bad:
                    loss = Float32(math.nan)
                elif valid:
                    loss = self.row_loss(lse, s, sx, Float32(mX[row, target]))
                mLoss[row] = loss
                if const_expr(mLseOut is not None):
                    mLseOut[row] = lse

        if const_expr(self.mode != "forward"):
            scale = Float32(0.0)
            if row < M and valid:
                if const_expr(self.mode == "fwd_bwd"):
                    scale = dloss
                else:
                    scale = mDloss[row]
            if bad:
                scale = Float32(math.nan)
            rD = cute.make_rmem_tensor_like(rX, Float32)
            if const_expr(self.hold):
                self.held_dlogits(rD, x, f_t, lse, scale, tXcX, target + shift)
            else:
                self.dlogits(rD, x, lse, scale, k, tXcX, target + shift)
            rO = cute.make_rmem_tensor_like(rX, self.x_dtype)
            rO.store(rD.load().to(self.x_dtype))
            if row < M:
                if const_expr(self.shifted):  # dx's rows lie at x's offsets (the host's condition)
                    self.store_window(rO, self.row_window(mDx, bidx, M, part)[1], tXcX, shift)
                else:
                    self.copy_row(rO, part(mDx, bidx), tXcX, self.x_dtype)
        self.launch_dependents()

    @cute.jit
    def stream_body(self, mX: cute.Tensor, mTarget: cute.Tensor, mDloss: Optional[cute.Tensor],
                    mLseIn: Optional[cute.Tensor], mLoss: Optional[cute.Tensor], mLseOut: Optional[cute.Tensor],
                    mDx: Optional[cute.Tensor], ignore_index: Int32, tc: cute.TiledCopy, bidx, cy, buf, mbar, M):
        """One row a CTA, its columns in passes: CTA ``cy`` of the cluster takes ``passes`` consecutive
        tiles of ``STREAM_UNITS`` units a thread. The forward folds each tile's (max, sum of exp) into
        the thread's running pair (rescaled to the larger max), and the pairs merge over the row at
        the end in one round; the dlogits modes then read the tiles again (the row's chunk was just
        read: mostly from L2) and store dx tile by tile. Columns past N load as -inf."""
        width, passes = self.stream_tiling()
        tidx, _, _ = cute.arch.thread_idx()
        thr = tc.get_slice(tidx)
        row = bidx
        src, dst, at, lo = mX, mDx, row, 0  # the row's tensors, its row coordinate, its first column there
        if const_expr(self.shifted):
            src, lo = self.window(mX, row, M)
            if const_expr(mDx is not None):  # dx's rows lie at x's offsets (the host's condition)
                dst = self.window(mDx, row, M)[0]
            at = 0
        ident = cute.make_identity_tensor(src.shape)
        target = Int32(0)
        if row < M:
            target = Int32(mTarget[row])

        lse = Float32(0.0)
        k = Float32(0.0)  # the row's count of +inf logits, where its lse is +inf
        if const_expr(self.mode == "backward"):
            if row < M:
                lse = mLseIn[row]
            if const_expr(self.posinf):
                k = self.count_posinf(mX, row, M, lse)
        else:
            m, s, sx = Float32(-math.inf), Float32(0.0), Float32(0.0)
            if row < M:
                # only a row's last tiles hold columns past it, so the tiles before them run a loop without the
                # mask (a branch a tile is if-converted: every value would pay it). Those tiles: for the softcap's
                # lean sums, each CTA's tiles wholly inside the row (a run-time count); for the others, all but
                # each CTA's last ``masked_tiles`` (a compile-time count: fewer registers for the smoothing sum).
                # Each way was timed the faster for its kernels.
                first = 0
                if const_expr(self.inside_tested and not self.shifted):
                    if const_expr(self.lean):
                        first = cutlass.min(cutlass.max(Int32(self.n // width) - cy * passes, 0), passes)
                    else:
                        first = passes - self.masked_tiles()
                    for p in cutlass.range(first, unroll=2):
                        rX, _ = self.stream_tile(src, ident, thr, at, cy * passes + p, lo)
                        m, s, sx = self.stream_fold(rX, None, m, s, sx)
                for p in cutlass.range(first, passes, unroll=2):
                    rX, tXcX = self.stream_tile(src, ident, thr, at, cy * passes + p, lo)
                    m, s, sx = self.stream_fold(rX, self.inside(rX, tXcX, lo), m, s, sx)
                if const_expr(self.lean):
                    m = Float32(self.options.softcap)
                if const_expr(self.posinf):
                    if m == Float32(math.inf):  # only threads that met a +inf: their count, a NaN still NaN
                        s = self.stream_count_posinf(src, ident, thr, at, cy * passes, passes, lo)
            self.wait_cluster()
            if const_expr(self.options.label_smoothing):
                m, s, sx = self.merge_max_sum(m, s, buf, mbar, sx, self.posinf)
            else:
                m, s = self.merge_max_sum(m, s, buf, mbar, None, self.posinf)
            lse = m + cute.math.log(s, fastmath=False)
            k = s
            if tidx == 0 and cy == 0 and row < M:
                loss = Float32(0.0)
                if target != ignore_index:
                    if target < 0 or target >= self.n:
                        loss = Float32(math.nan)
                    else:
                        loss = self.row_loss(lse, s, sx, Float32(mX[row, target]))
                mLoss[row] = loss
                if const_expr(mLseOut is not None):
                    mLseOut[row] = lse

        if const_expr(self.mode != "forward"):
            valid = target != ignore_index
            bad = valid and (target < 0 or target >= self.n)
            scale = Float32(0.0)
            if row < M and valid:
                scale = mDloss[row]
            if bad:
                scale = Float32(math.nan)
            if row < M:
                for p in cutlass.range(passes, unroll=2):
                    tile = cy * passes + p
                    rX, tXcX = self.stream_tile(src, ident, thr, at, tile, lo)
                    rD = cute.make_rmem_tensor_like(rX, Float32)
                    # the dlogits from the logits as loaded (a softcap's ``raw`` form); dx past the row is not stored
                    x = rX.load().to(Float32)
                    self.dlogits(rD, x, lse, scale, k, tXcX, target + lo)
                    rO = cute.make_rmem_tensor_like(rX)
                    rO.store(rD.load().to(self.x_dtype))
                    self.store_stream_tile(rO, thr.partition_D(cute.local_tile(dst, (1, width), (at, tile))), tXcX,
                                           lo)
        self.launch_dependents()

    @cute.jit
    def stream_fold(self, rX: cute.Tensor, inside, m: Float32, s: Float32, sx: Float32):
        """A streamed forward's running (max, sum of exp, sum of logits) with one tile's values ``rX`` folded
        in (``inside``: which are the row's columns, as ``inside``; None where all are)."""
        if const_expr(self.lean):  # sums at the one shift c, no max
            s_t, sx_t = self.capped_sum(rX, inside)
            s, sx = s + s_t, sx + sx_t
        else:
            x = self.capped(rX.load().to(Float32), rX, inside)
            if const_expr(self.options.label_smoothing):
                sx = sx + self.row_sum(x, inside)
            m_new = cute.arch.fmax(m, x.reduce(cute.ReductionOp.MAX, init_val=Float32(-math.inf),
                                               reduction_profile=0))
            shift = m_new
            if m_new == Float32(-math.inf):  # only -inf so far: sums stay 0, never NaN
                shift = Float32(0.0)
            # no +inf branch a tile (ptxas if-converts one, and every logit pays it): a tile holding
            # +inf makes s NaN, and such a thread counts its +inf logits after the loop
            s = s * cute.math.exp2((m - shift) * LOG2E, fastmath=True) + cute.math.exp2(
                (x - shift) * LOG2E, fastmath=True).reduce(cute.ReductionOp.ADD, init_val=Float32(0.0),
                                                           reduction_profile=0)
            m = m_new
        return m, s, sx

    @cute.jit
    def is_leader(self, tXcX: cute.Tensor, cy):
        """Whether this thread leads its row: holds its column 0, in the cluster's first CTA."""
        leader = tXcX[0][1] == 0
        if const_expr(self.launch.cluster_n > 1):
            leader = leader and cy == 0
        return leader

    def masked_tiles(self) -> int:
        """Of an unshifted streamed CTA's tiles, how many (its last) may hold columns past the row in any CTA
        of the cluster: as many as the padding past the row's last column spans."""
        width, passes = self.stream_tiling()
        return min(passes, -(-(passes * width * self.launch.cluster_n - self.n) // width))

    def stream_tiling(self) -> tuple[int, int]:
        """(columns a streamed tile covers, tiles a CTA passes over)."""
        L = self.launch
        width = STREAM_UNITS * L.vec * L.threads_per_row
        return width, -(-L.cols_per_cta // width)

    @cute.jit
    def stream_tile(self, src: cute.Tensor, ident: cute.Tensor, thr, at, tile, lo):
        """This thread's slice of column tile ``tile`` of row ``at`` of ``src`` in registers, columns
        outside the row -inf. -> (values, their coordinates)."""
        L = self.launch
        width, passes = self.stream_tiling()
        even = passes * width * L.cluster_n == L.N and not self.shifted
        tXgX = thr.partition_S(cute.local_tile(src, (1, width), (at, tile)))
        tXcX = thr.partition_S(cute.local_tile(ident, (1, width), (at, tile)))
        atom = self.atom(self.x_dtype)
        rX = cute.make_rmem_tensor_like(tXgX)
        if const_expr(not even):
            rX.fill(-math.inf)
        end = L.N  # past it no vector is read: the padding's, and a window's vectors past the row
        if const_expr(self.shifted):
            end = lo + self.n
        for i in cutlass.range_constexpr(STREAM_UNITS):
            first = tXcX[(0, 0), 0, i][1]
            if const_expr(even):
                cute.copy(atom, tXgX[None, None, i], rX[None, None, i])
            elif first < end:
                cute.copy(atom, tXgX[None, None, i], rX[None, None, i])
                if const_expr(self.shifted):  # an edge vector: its columns of the rows beside
                    if first < lo or first + L.vec > lo + self.n:
                        r_i, c_i = rX[None, None, i], tXcX[None, None, i]
                        for j in cutlass.range_constexpr(cute.size(r_i)):
                            if c_i[j][1] < lo or c_i[j][1] >= lo + self.n:
                                r_i[j] = r_i.element_type(-math.inf)
        return rX, tXcX

    @cute.jit
    def store_stream_tile(self, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor, lo):
        """Store a tile of ``stream_tile``'s shape: its vectors inside the row (``store_window`` for a
        shifted row), nothing past the row."""
        L = self.launch
        if const_expr(self.shifted):
            self.store_window(src, dst, tXcX, lo)
        else:
            atom = self.atom(self.x_dtype)
            for i in cutlass.range_constexpr(STREAM_UNITS):
                if tXcX[(0, 0), 0, i][1] < L.N:
                    cute.copy(atom, src[None, None, i], dst[None, None, i])


@dataclasses.dataclass(frozen=True, slots=True)
class CrossEntropyKey:
    """What a cross-entropy kernel is compiled for; M, strides and ignore_index are runtime. Built once
    where a launch is prepared, it is the memoized compile's one argument."""
    mode: str  # one of MODES
    dtype: str  # the logits' torch name
    target_dtype: str
    N: int
    arch: str
    _: dataclasses.KW_ONLY
    store_lse: bool = True  # the lse stored (never by the backward)
    # False: rows off 16-byte boundaries are not moved as aligned windows (dlogits rows not at the logits'
    # offsets; the reductions where the windows setting is False: a window splits a row by its address)
    window: bool = True
    options: CEOptions = PLAIN  # compile-time constants (the plain kernel's key and code without them)
    inplace: bool = False  # dx is the logits (``CrossEntropy``'s; rows register-held, even where they would stream)


@memo
def compiled_cross_entropy(k: CrossEntropyKey):
    """Compile (or fetch) the cross-entropy kernel for ``k``."""
    mode, dtype, target_dtype, N, arch = k.mode, k.dtype, k.target_dtype, k.N, k.arch
    store_lse, window, options, inplace = k.store_lse, k.window, k.options, k.inplace
    if not 1 <= N <= MAX_N:
        raise ValueError(f"N={N}: the cross-entropy kernels handle 1 <= N <= {MAX_N}")
    dt, tt = cute_dtype(dtype), cute_dtype(target_dtype)
    width = shifted_window(N, dt.width) if window else None
    stream = stream_rows(width or N, dt.width, mode) and not inplace
    held = functools.partial(cross_entropy_launch, arch=arch, mode=mode)
    if not options.plain and mode != "forward":  # the options' dlogits hold more live values a thread
        held = functools.partial(option_launch, arch=arch, mode=mode)
    shifted = held(width, dt.width, shifted=True) if width and not stream else None
    if stream:  # shifted rows stream through their windows
        key = f"cross_entropy/{mode}_stream{'_shifted' if width else ''}/x{dt.width}"
        launch = pick(key, arch, stream_launch(width or N, dt.width))
    elif shifted is not None and shifted.rows_per_cta == 1:  # a window needs one row a CTA
        launch = pick(f"cross_entropy/{mode}_shifted/x{dt.width}", arch, shifted)
    else:
        launch = pick(f"cross_entropy/{mode}/x{dt.width}", arch, held(N, dt.width))
    store_lse = store_lse and mode != "backward"

    def build():
        one = Int64(launch.vec)
        f32 = gmem_ptr(Float32, 4)
        fwd, bwd = mode != "backward", mode != "forward"
        kernel = CrossEntropy(launch, dt, tt, mode, N, stream, options, inplace)
        if mode == "backward" and not stream:
            kernel.min_ctas = backward_min_ctas(launch, dt.width, options.plain)
        return compile_kernel(
            kernel, gmem_ptr(dt), gmem_ptr(tt, tt.width // 8),
            f32 if bwd else None, f32 if mode == "backward" else None, f32 if fwd else None,
            f32 if store_lse else None, gmem_ptr(dt) if bwd else None, Int32(1), one, one, Int32(-100),
            fake_stream(), arch=arch)

    key = ("cross_entropy", mode, dtype, target_dtype, store_lse, N, arch, launch)
    key += (STREAM_UNITS,) if stream else ()
    key = key if options.plain else key + (options,)
    return CACHE.get(key + ("inplace",) if inplace else key, build)
