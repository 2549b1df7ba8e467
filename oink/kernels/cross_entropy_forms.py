"""The cross-entropy kernels' register forms of the options (softcap, label smoothing, z-loss) and of the
+inf limit: methods of ``CrossEntropy`` (``oink.kernels.cross_entropy``), kept apart so each file reads on
its own. They use the kernel's attributes (``options``, ``launch``, ``x_dtype``, ``n``, ``shifted``,
``stream``, ``inside_tested``, ``posinf``) and, for a streamed row's count, its ``stream_tile``."""
from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .fma_exp2 import exp2_affine_fma, exp2_fma
from .reduction import LOG2E, add
from .row_rules import WARP

# every this many exps of a softcap forward's capped logits, one is on the FMA pipe (``CrossEntropyForms.capped_sum``:
# 16-bit logits ``exp2_affine_fma``, fp32 ``exp2_fma``): more, and the instructions it adds bind it instead
# (bench/RESULTS.md); the dlogits kernels take none
FMA_EXP_EVERY = 3
# the degree of that exp's polynomial: 4 is two instructions fewer than 5, at a relative error
# (2.7e-6) far below the loss's tolerance
EXP2_DEGREE = 4


class CrossEntropyForms:
    """The options' and the +inf limit's per-value forms (a mixin of ``CrossEntropy``)."""

    @cute.jit
    def inside(self, rX: cute.Tensor, tXcX: cute.Tensor, lo):
        """Which of the thread's values are the row's columns (``lo``: the row's first column in the
        coordinates), as booleans; None where every one is, or no option needs it (padding is -inf,
        which the plain sums ignore; a capped -inf and the smoothing sum do not)."""
        if const_expr(not self.inside_tested):
            return None
        if const_expr(not self.shifted):
            return self.inside_vectors(rX, tXcX, every=self.stream)
        return self.window_columns(rX, tXcX, lo)

    @cute.jit
    def capped(self, x, rX: cute.Tensor, inside):
        """fp32 values x through the softcap c: c * tanh(x / c) (+-inf to +-c; ``capped_one``), the columns
        outside the row (``inside`` false) back to -inf; x itself without a softcap."""
        c = self.options.softcap
        if const_expr(c is None):
            return x
        rC = cute.make_rmem_tensor_like(rX, Float32)
        rC.store(x)
        for i in cutlass.range_constexpr(cute.size(rC)):
            rC[i] = self.capped_one(rC[i])
        y = rC.load()
        if const_expr(inside is not None):
            y = cute.where(inside, y, cute.full_like(y, -math.inf))
        return y

    @cute.jit
    def capped_one(self, x: Float32) -> Float32:
        """``capped`` of one value. 16-bit logits take the hardware's tanh.approx (relative error 2^-11, a
        quarter of a bf16 logit's own rounding, in one special-function op where the exp2 form takes two and
        left the capped kernels bound by them: bench/RESULTS.md); fp32 logits the exp2 form (~2^-22)."""
        c = self.options.softcap
        if const_expr(c is not None):
            if const_expr(self.x_dtype.width == 16):
                x = Float32(c) * cute.math.tanh(x * Float32(1.0 / c), approx=True)
            else:
                x = Float32(c) - Float32(2 * c) * cute.arch.rcp_approx(
                    cute.math.exp2(x * Float32(2 * LOG2E / c), fastmath=True) + Float32(1.0))
        return x

    @cute.jit
    def capped_exp_slope(self, x: Float32, shift, fma: cutlass.Constexpr = False):
        """The softcap's dlogits form of one logit x through the softcap c: (exp(t - shift), 1 - (t / c)^2, t) of
        its capped value t = c u, u = tanh(x / c), straight from x: 16-bit logits take tanh.approx (as
        ``capped_one``) and exp2(u c log2(e) - shift log2(e)), one FMA's argument (not t rounded, then shifted and
        scaled); fp32 ones ``capped_one``'s exact form, u = 1 - 2 r with r = 1 / (exp(2x / c) + 1), so t - shift
        = c - shift - 2 c r, and the derivative 4 r (1 - r), exact where 1 - u^2 would cancel (|x| >> c).
        ``shift``: the row's lse (the dlogits' exp(t - lse)), or c (a compile-time constant, folded). ``fma``:
        that exp on the FMA pipe (``exp2_fma``): the forward (``capped_sum``) takes every ``FMA_EXP_EVERY``-th
        so, as two special-function ops a logit bound it where the plain forward takes one."""
        c = self.options.softcap
        # with the FMA's exp the shift is c, so its argument lies in [-2 c log2(e), 0]: no clamp needed (c <= 40)
        exp2 = functools.partial(cute.math.exp2, fastmath=True)
        if const_expr(fma):
            exp2 = functools.partial(exp2_fma, degree=EXP2_DEGREE, clamp=False)
        e, f, t = Float32(0.0), Float32(0.0), Float32(0.0)
        if const_expr(self.x_dtype.width == 16):
            u = cute.math.tanh(x * Float32(1.0 / c), approx=True)
            e = exp2(u * Float32(c * LOG2E) - shift * Float32(LOG2E))
            f = Float32(1.0) - u * u
            t = u * Float32(c)
        else:
            r = cute.arch.rcp_approx(cute.math.exp2(x * Float32(2 * LOG2E / c), fastmath=True) + Float32(1.0))
            e = exp2(r * Float32(-2 * c * LOG2E) + (Float32(c) - shift) * Float32(LOG2E))
            f = r * (Float32(4.0) - Float32(4.0) * r)
            t = Float32(c) - Float32(2 * c) * r
        return e, f, t

    @cute.jit
    def capped_sum(self, rX: cute.Tensor, inside):
        """A softcap forward's (``lean``) sums over the thread's logits ``rX``: (the sum of exp(t - c), the sum of
        t) of their capped values t (t <= c, so c is the shift and no max is taken, and c <= 40 keeps exp(t - c) a
        normal fp32). The second only with label smoothing, else 0. The columns outside the row (``inside``
        false) add 0. 16-bit logits: t = c u, u = tanh(x / c) (``capped_exp_slope``'s form), exp(t - c) =
        2^(u c log2(e) - c log2(e)), every ``FMA_EXP_EVERY``-th on the FMA pipe (``exp2_affine_fma``); fp32
        logits ``capped_exp_slope``'s exact form."""
        c = self.options.softcap
        rE = cute.make_rmem_tensor_like(rX, Float32)
        rT = cute.make_rmem_tensor_like(rX, Float32)
        rE.store(rX.load().to(Float32))
        k = c * LOG2E
        for i in cutlass.range_constexpr(cute.size(rE)):
            if const_expr(self.x_dtype.width == 16):
                u = cute.math.tanh(rE[i] * Float32(1.0 / c), approx=True)
                rT[i] = u  # the sum of t is c times theirs
                if const_expr(i % FMA_EXP_EVERY == FMA_EXP_EVERY - 1):
                    rE[i] = exp2_affine_fma(u, k, k, degree=EXP2_DEGREE)
                else:
                    rE[i] = cute.math.exp2(u * Float32(k) - Float32(k), fastmath=True)
            else:
                rE[i], _, rT[i] = self.capped_exp_slope(rE[i], Float32(c), i % FMA_EXP_EVERY == FMA_EXP_EVERY - 1)
        e = rE.load()
        if const_expr(inside is not None):
            e = cute.where(inside, e, cute.full_like(e, 0.0))
        s = e.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        sx = Float32(0.0)
        if const_expr(self.options.label_smoothing):
            sx = self.row_sum(rT.load(), inside)
            if const_expr(self.x_dtype.width == 16):
                sx = sx * Float32(c)
        return s, sx

    @cute.jit
    def held_exp(self, x, rX: cute.Tensor, inside):
        """The thread's fp32 logits x as the fused kernel holds them from its forward's sum to its dlogits, in
        one tanh and one exp a logit (the capped values' exp for the sum and again for the gradient take two):
        each value becomes h = exp(t - c) (1 - (t / c)^2) of its capped value t (``capped_exp_slope``), and the
        thread's sum of exp(t - c) its part of the row's: every t is at most c, so c is the shift and no max is
        taken (``softcap_form``: c <= 40, so exp(t - c) >= exp(-80) is a normal fp32, nothing underflows). The
        dlogits are then scale (1 + 2 z lse) exp(c - lse) h, less scale (1 - (t / c)^2) at the target
        (``held_dlogits``). The columns outside the row (``inside`` false) add 0 to the sum.
        -> (the thread's sum of exp(t - c), h)."""
        c = Float32(self.options.softcap)
        rE = cute.make_rmem_tensor_like(rX, Float32)
        rF = cute.make_rmem_tensor_like(rX, Float32)
        rE.store(x)
        for i in cutlass.range_constexpr(cute.size(rE)):
            rE[i], rF[i], _ = self.capped_exp_slope(rE[i], c)
        e, h = rE.load(), rE.load() * rF.load()
        if const_expr(inside is not None):
            e = cute.where(inside, e, cute.full_like(e, 0.0))
        s = e.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        # + 0 * (the sum of h): h in the round's input, so computed before it; without it ptxas computed h after the
        # round, from e and u kept live across it (2 registers a logit, not 1: spilled at 256000 bf16)
        s = s + Float32(0.0) * h.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)
        return s, h

    @cute.jit
    def held_dlogits(self, rD: cute.Tensor, h, f_t: Float32, lse: Float32, scale: Float32, tXcX: cute.Tensor, tcol):
        """The held softcap form's fp32 dlogits into ``rD`` from ``held_exp``'s values h (exp(t - c) times the
        softcap's derivative): scale (1 + 2 z lse) exp(c - lse) h, less scale f_t at the target's column
        ``tcol`` (one multiply a logit)."""
        coef = scale
        if const_expr(self.options.z_loss):
            coef = scale * (Float32(1.0) + Float32(2 * self.options.z_loss) * lse)
        g = coef * cute.math.exp2((Float32(self.options.softcap) - lse) * LOG2E, fastmath=True)
        rD.store(h * g)
        for i in cutlass.range_constexpr(cute.size(rD)):
            if tXcX[i][1] == tcol:  # ignored rows have scale 0, so no column needs the guard
                rD[i] = rD[i] - scale * f_t

    @cute.jit
    def row_sum(self, x, inside) -> Float32:
        """The thread's sum of its values in the row (label smoothing's sum of logits)."""
        if const_expr(inside is not None):
            x = cute.where(inside, x, cute.full_like(x, 0.0))
        return x.reduce(cute.ReductionOp.ADD, init_val=Float32(0.0), reduction_profile=0)

    @cute.jit
    def row_loss(self, lse: Float32, s: Float32, sx: Float32, xt: Float32) -> Float32:
        """A row's loss from its lse, its sum of exp (the count of +inf logits where lse is +inf), its
        sum of logits ``sx`` (label smoothing) and the target's logit as loaded."""
        O = self.options
        xt = self.capped_one(xt)
        nll = lse - xt
        if const_expr(self.posinf):
            if xt == Float32(math.inf):  # the limit: log k
                nll = cute.math.log(s, fastmath=False)
        loss = nll
        if const_expr(O.label_smoothing):
            smooth = lse - sx * Float32(1.0 / self.n)  # mean_j -log p_j
            if const_expr(self.posinf):
                if lse == Float32(math.inf):  # log k at the +inf logits, +inf elsewhere: log V if all are
                    smooth = Float32(math.inf)
                    if s == Float32(self.n):
                        smooth = cute.math.log(s, fastmath=False)
            loss = Float32(1.0 - O.label_smoothing) * nll + Float32(O.label_smoothing) * smooth
        if const_expr(O.z_loss):
            loss = loss + Float32(O.z_loss) * lse * lse
        return loss

    @cute.jit
    def dlogits(self, rD: cute.Tensor, x, lse: Float32, scale: Float32, k: Float32, tXcX: cute.Tensor, tcol):
        """The row's fp32 dlogits into ``rD`` from its (capped) values x: scale * ((1 + 2 z lse) p - eps / V
        - (1 - eps) onehot(target)), times 1 - (x / c)^2 through the softcap; p is exp(x - lse), or 1/k
        on the k +inf logits of a row whose lse is +inf. ``tcol``: the target's column in ``tXcX``."""
        O = self.options
        coef = scale
        if const_expr(O.z_loss):
            coef = scale * (Float32(1.0) + Float32(2 * O.z_loss) * lse)
        smooth = Float32(0.0)
        if const_expr(O.label_smoothing):
            smooth = scale * Float32(O.label_smoothing / self.n)
        at_target = scale
        if const_expr(O.label_smoothing):
            at_target = scale * Float32(1.0 - O.label_smoothing)
        if const_expr(O.softcap is not None):
            # one value at a time, in place: the factor 1 - (x / c)^2 needs x after p, and whole arrays of
            # both would spill (capped logits are finite: no +inf limit here)
            rD.store(x)
            if const_expr(self.raw):  # x: the logits as loaded (``softcap_form``'s "raw")
                rel = tcol - tXcX[0][1]  # the target's column against each value's offset, a constant
                for i in cutlass.range_constexpr(cute.size(rD)):
                    p, f, _ = self.capped_exp_slope(rD[i], lse)
                    d = p * coef - smooth
                    if tXcX[i][1] - tXcX[0][1] == rel:
                        d = d - at_target
                    rD[i] = d * f
                return
            for i in cutlass.range_constexpr(cute.size(rD)):
                xi = rD[i]
                d = cute.math.exp2((xi - lse) * LOG2E, fastmath=True) * coef - smooth
                if tXcX[i][1] == tcol:
                    d = d - at_target
                t = xi * Float32(1.0 / O.softcap)
                rD[i] = d * (Float32(1.0) - t * t)
            return
        p = cute.math.exp2((x - lse) * LOG2E, fastmath=True)
        if const_expr(O.label_smoothing):
            rD.store(p * coef - smooth)
        else:
            rD.store(p * coef)
        if const_expr(self.posinf and not O.z_loss):  # (with a z-loss such a row's gradient is undefined)
            if lse == Float32(math.inf):
                # exp(x - lse) is NaN exactly at the +inf logits here (a NaN logit makes the forward's lse
                # NaN, and count_posinf's k): read from rD, so x need not stay live beside it
                for i in cutlass.range_constexpr(cute.size(rD)):
                    v = rD[i]
                    rD[i] = -smooth
                    if v != v:
                        rD[i] = coef / k - smooth
        for i in cutlass.range_constexpr(cute.size(rD)):
            if tXcX[i][1] == tcol:  # ignored rows have scale 0, so no column needs the guard
                rD[i] = rD[i] - at_target

    @cute.jit
    def count_posinf(self, mX: cute.Tensor, row, M, lse: Float32) -> Float32:
        """The count of the row's +inf logits where ``lse`` (or its max) is +inf, else 0; NaN if the row
        holds a NaN: the row's group of lanes reads the row once more, a warp at a time (only such rows
        pay), so every warp has it without an exchange."""
        L = self.launch
        group = min(L.threads_per_row, WARP)
        k = Float32(0.0)
        if cute.arch.vote_any_sync(lse == Float32(math.inf)):  # warp-uniform: the shuffles below
            lane = cute.arch.lane_idx() % group
            if row < M:
                for j in cutlass.range(cute.ceil_div(self.n, group)):
                    col = j * group + lane
                    if col < self.n:
                        v = Float32(mX[row, col])
                        if v == Float32(math.inf):
                            k = k + Float32(1.0)
                        if v != v:  # a NaN: the row's dlogits stay NaN
                            k = k + v
            k = cute.arch.warp_reduction(k, add, threads_in_group=group)
        return k

    @cute.jit
    def reads_done(self, top: Float32):
        """In place: every thread of the row (its CTA, its cluster) past its reads of the row from memory
        (``count_posinf``'s, where the row's max or lse ``top`` is +inf) before any stores dlogits over it.
        With one row a CTA, ``top`` is the same in every thread of the CTA (cluster), so only such a row
        waits (no other row reads twice); a CTA of several rows waits always (its rows' ``top`` differ)."""
        if const_expr(self.inplace):
            if const_expr(self.launch.rows_per_cta == 1):
                if top == Float32(math.inf):
                    self.row_barrier()
            else:
                self.row_barrier()

    @cute.jit
    def row_barrier(self):
        """Every thread of the CTA (of the cluster, for a row over a cluster) arrives before any goes on."""
        if const_expr(self.launch.cluster_n > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()

    @cute.jit
    def posinf_sum(self, mX: cute.Tensor, row, M, m: Float32, s: Float32) -> Float32:
        """The row's sum of exp(x - m), or where its max m is +inf (each exp(inf - inf) made the sum NaN)
        the limit's: the count of its +inf logits, by ``count_posinf`` (only such rows pay; the reduction
        rounds of every other row run as the plain kernel's)."""
        k = self.count_posinf(mX, row, M, m)
        if m == Float32(math.inf):
            s = k
        return s

    @cute.jit
    def stream_count_posinf(self, src: cute.Tensor, ident: cute.Tensor, thr, at, first, passes, lo) -> Float32:
        """The count of +inf values in this thread's tiles ``first`` .. ``first + passes - 1`` of a streamed row,
        read again (NaN if one is NaN): the streamed fold's sum where the thread's max is +inf (the limit), which
        ``merge_max_sum(posinf=True)`` adds over the row. Only such threads pay."""
        k = Float32(0.0)
        for p in cutlass.range(passes, unroll=2):
            rX, _ = self.stream_tile(src, ident, thr, at, first + p, lo)
            x = rX.load().to(Float32)
            for i in cutlass.range_constexpr(cute.size(x.shape)):
                v = x[i]
                if v == Float32(math.inf):
                    k = k + Float32(1.0)
                if v != v:
                    k = k + v
        return k
