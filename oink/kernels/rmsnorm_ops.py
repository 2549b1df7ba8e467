"""RMSNorm family (and the LayerNorm that shares its kernels) as seen by the dispatch path: which inputs the
kernels take (CHECKS) and their launches on torch tensors, each prepared once per argument layout (PLANS, see
``dispatch.prepare``). Imported only on a supported GPU."""
from __future__ import annotations

import torch

from .compile import stream_of
from .host import (allocator, dense, dtype_name, kernel_ready_rows, prepare_vector, resident_clusters,
                   row_layout, vec_for, width_reason, window_key)
from .launch_table import few_rows
from .rmsnorm import compiled_forward
from .rmsnorm_rules import ForwardKey, forward_window
from .partial_sum import compiled_partial_sum
from .rmsnorm_bwd import compiled_backward, compiled_split_backward
from .rmsnorm_bwd_rules import (BackwardKey, backward_launch, backward_tpsm, direct_sums, head_launch, persistent_ctas,
                                split_groups, split_rows)


def heads_of(weight, bias) -> int:
    """H of per-head parameters [H, D] (either may be [D], or None), else 1."""
    return next((t.shape[0] for t in (weight, bias) if t is not None and t.dim() == 2), 1)


def head_params(weight, bias, heads: int, vec: int):
    """Kernel-ready parameters: per head both [H, D] (a [D] one broadcast over the heads), else [D]."""
    def one(t):
        if t is None:
            return None
        if heads > 1:
            t = t.expand(heads, t.shape[-1]).contiguous() if t.dim() == 1 else t
            return prepare_vector(t.reshape(-1), vec).view(heads, -1)
        return prepare_vector(t, vec)

    return one(weight), one(bias)


def check_forward(t: dict, arch: str) -> str | None:
    if t.get("residual") is None and t.get("residual_dtype") is not None:
        return "residual_dtype without a residual: reference"
    return width_reason(t["x"].shape[-1])


def check_backward(t: dict, arch: str) -> str | None:
    heads = heads_of(t["weight"], None)
    x = t["x"]
    if heads > 1 and head_launch(backward_launch(x.shape[-1], x.element_size() * 8, arch,
                                                 dres=t.get("dresidual_out") is not None), heads) is None:
        return f"{heads} heads of width {x.shape[-1]}: no backward launch holds whole heads a CTA: reference"
    return width_reason(x.shape[-1])


def check_layernorm(t: dict, arch: str) -> str | None:
    return width_reason(t["x"].shape[-1])


def check_fused_add(t: dict, arch: str) -> str | None:
    return width_reason(t["x"].shape[-1])  # operands the kernel can't read as they are go through dense copies


def backward_grid(launch, M: int, device, tpsm: int) -> tuple[int, int, int]:
    """(CTAs of the backward's persistent grid, partial rows they write, the most any M's grid writes) for M
    rows, the grid sized for ``tpsm`` threads a SM (``backward_tpsm``) in the clusters the device runs at once."""
    at_once = resident_clusters(device.index, launch.cluster_n)
    most = persistent_ctas(launch, at_once, tpsm)
    ctas = max(1, min(-(-M // launch.rows_per_cta), most))
    return ctas, ctas * launch.rows_per_cta, most * launch.rows_per_cta


def partial_width(N: int) -> int:
    """A partial row's length: N rounded up to 16 bytes of fp32, so each kind's rows stay aligned."""
    return -(-N // 4) * 4


def partial_buffers(parts: int, N: int, has_dw: bool, has_db: bool, device, alloc):
    """One fp32 buffer [parts, k, partial_width(N)] holding the k (0-2) partial kinds interleaved by
    row, which one reduction sums:
    -> (buffer, dweight partials [parts, N] view or None, dbias partials view or None)."""
    buf = alloc((parts, int(has_dw) + int(has_db), partial_width(N)), device=device, dtype=torch.float32)
    return buf, (buf[:, 0, :N] if has_dw else None), (buf[:, -1, :N] if has_db else None)


def partial_sum(arch: str, parts: int, N: int, has_dw: bool, has_db: bool, dtype, device, most: int = 0):
    """The partials' sum prepared for ``parts`` rows of a ``partial_buffers`` buffer (its kernel fit to ``most``,
    the most any call of the backward writes, where larger: a new M compiles nothing): a function of the
    buffer's address returning (dweight, dbias) in ``dtype``. The PartialSum kernel, one launch for both
    kinds; each output gets its own storage (a custom op's outputs may not share any)."""
    kinds = int(has_dw) + int(has_db)
    if kinds == 0:
        return lambda address: (None, None)
    fn = compiled_partial_sum(N, kinds, dtype_name(dtype), arch, max(parts, most))
    new_out, stream = allocator((N,), dtype, device), stream_of(device)

    def run(address: int):
        outs = [new_out() for _ in range(kinds)]
        fn(address, outs[0].data_ptr(), outs[-1].data_ptr() if kinds == 2 else None, parts, stream())
        return (outs[0] if has_dw else None), (outs[-1] if has_db else None)

    return run


def sum_partials(arch: str, buf, has_dw: bool, has_db: bool, N: int, dtype):
    """(dweight, dbias) in ``dtype`` from a ``partial_buffers`` buffer (``partial_sum``, launched once)."""
    return partial_sum(arch, buf.shape[0], N, has_dw, has_db, dtype, buf.device)(buf.data_ptr())


# ---- launches, each prepared once per argument layout (see dispatch.prepare) ---------------------
DENSE = torch.contiguous_format  # outputs are dense rows, whatever x's leading strides
F32 = torch.float32


def _params(weight, bias, heads: int, vec: int):
    """What passes the weight and bias to the kernel each call: None where they go as they are, else a
    function making them kernel-ready (``head_params``: per-head copies, or copies of unaligned ones)."""
    if heads == 1 and kernel_ready_rows(weight, vec) and kernel_ready_rows(bias, vec):
        return None
    return lambda w, b: head_params(w, b, heads, vec)


def _address(t) -> int | None:
    return None if t is None else t.data_ptr()


def _windowed(key: ForwardKey, dense: bool) -> ForwardKey:
    """The forward's key asking for aligned windows where its rule reads rows off 16-byte boundaries through them
    (``forward_window``, ``host.window_key``); only ``dense`` rows (x's rows N apart, at the output's offsets)."""
    return window_key(key, forward_window) if dense else key


def plan_forward(arch, a: dict):
    """RMSNorm forward (with a residual: of x + residual) prepared for ``a``'s layout: x and the
    residual copied to dense rows where the kernel can't read them as they are, per-head or unaligned
    parameters made kernel-ready, outputs dense; no launch for no rows."""
    # vLLM's rmsnorm routes here with x, weight and eps only: the rest take the reference's defaults
    x, w, b, res = a["x"], a["weight"], a.get("bias"), a.get("residual")
    N = x.shape[-1]
    M, vec, lead, device = x.numel() // N, vec_for(N, x), x.shape[:-1], x.device
    out_dtype = a.get("out_dtype") or x.dtype
    res_dtype = (a.get("residual_dtype") or res.dtype) if res is not None else None
    store_rstd, eps = a.get("store_rstd", False), float(a.get("eps", 1e-6))
    new_rstd = allocator(lead, F32, device) if store_rstd and M else None
    heads = heads_of(w, b)
    (copy_x, ldx), (copy_r, ldres) = row_layout(x, vec), row_layout(res, vec)
    params = _params(w, b, heads, vec)
    if M:
        key = ForwardKey(
            dtype_name(x), N, arch, w_dtype=dtype_name(w), b_dtype=dtype_name(b), res_dtype=dtype_name(res),
            res_out_dtype=dtype_name(res_dtype), store_rstd=store_rstd, out_dtype=dtype_name(out_dtype),
            weight_offset=float(a.get("weight_offset", 0.0)), heads=heads, few=few_rows(M))
        fn = compiled_forward(_windowed(key, ldx == N))
        stream = stream_of(device)
    ldres_out = N if res is not None else 0

    def run(a):
        x, w, b, res = a["x"], a["weight"], a.get("bias"), a.get("residual")
        out = torch.empty_like(x, dtype=out_dtype, memory_format=DENSE)  # cheaper than torch.empty(shape)
        res_out = torch.empty_like(x, dtype=res_dtype, memory_format=DENSE) if res is not None else None
        if not M:
            return out, (torch.empty(lead, device=x.device, dtype=F32) if store_rstd else None), res_out
        rstd = new_rstd() if store_rstd else None
        if copy_x:
            x = dense(x)
        if copy_r:
            res = dense(res)
        if params is not None:
            w, b = params(w, b)
        fn(x.data_ptr(), _address(w), _address(b), _address(res), out.data_ptr(), _address(res_out), _address(rstd),
           None, M, ldx, ldres, N, ldres_out, eps, stream())
        return out, rstd, res_out

    return run


def plan_fused_add(arch, a: dict):
    """x and the residual updated in place: the residual to x + residual, x to its RMSNorm; an unaligned
    weight copied. Where x or the residual can't be read as it is (rows off 16-byte boundaries, strides),
    both go through dense copies written back after, as the reference writes them (residual first): the
    kernel's rows are then the same whatever the operands' offsets, so a row's bits don't depend on where it
    sits in a batch."""
    x, res, w = a["x"], a["residual"], a["weight"]
    N = x.shape[-1]
    M, vec = x.numel() // N, vec_for(N, x)
    if not M:
        return lambda a: None
    staged = not (kernel_ready_rows(x, vec) and kernel_ready_rows(res, vec))
    ldx, ldres = (N, N) if staged else (row_layout(x, vec)[1], row_layout(res, vec)[1])
    eps, copy_w = float(a.get("eps", 1e-6)), not kernel_ready_rows(w, vec)
    fn = compiled_forward(ForwardKey(dtype_name(x), N, arch, w_dtype=dtype_name(w), res_dtype=dtype_name(res),
                                     res_out_dtype=dtype_name(res), out_dtype=dtype_name(x), few=few_rows(M)))
    stream = stream_of(x.device)

    def run(a):
        # outputs alias the inputs: each element is read before it is overwritten, by one thread
        x, res, w = a["x"], a["residual"], a["weight"]
        if copy_w:
            w = dense(w)
        xs, rs = (dense(x), dense(res)) if staged else (x, res)
        xp, rp = xs.data_ptr(), rs.data_ptr()
        fn(xp, w.data_ptr(), None, rp, xp, rp, None, None, M, ldx, ldres, ldx, ldres, eps, stream())
        if staged:
            res.copy_(rs)
            x.copy_(xs)

    return run


def plan_layernorm(arch, a: dict):
    """LayerNorm forward; returns what the reference returns (y, or y with rstd and/or mean)."""
    x, w, b = a["x"], a["weight"], a.get("bias")
    N = x.shape[-1]
    M, vec, lead, device = x.numel() // N, vec_for(N, x), x.shape[:-1], x.device
    eps = float(a.get("eps", 1e-6))
    want_rstd, want_mean = a.get("return_rstd", False), a.get("return_mean", False)
    copy_x, ldx = row_layout(x, vec)
    params = _params(w, b, 1, vec)
    new_stat = allocator(lead, F32, device) if M else (lambda: torch.empty(lead, device=device, dtype=F32))
    if M:
        key = ForwardKey(dtype_name(x), N, arch, w_dtype=dtype_name(w), b_dtype=dtype_name(b), store_rstd=want_rstd,
                         layernorm=True, store_mean=want_mean, out_dtype=dtype_name(x), few=few_rows(M))
        fn = compiled_forward(_windowed(key, ldx == N))
        stream = stream_of(device)

    def run(a):
        x, w, b = a["x"], a["weight"], a.get("bias")
        out = torch.empty_like(x, memory_format=DENSE)
        rstd = new_stat() if want_rstd else None
        mean = new_stat() if want_mean else None
        if M:
            if copy_x:
                x = dense(x)
            if params is not None:
                w, b = params(w, b)
            fn(x.data_ptr(), w.data_ptr(), _address(b), None, out.data_ptr(), None, _address(rstd), _address(mean), M,
               ldx, 0, N, 0, eps, stream())
        if not (want_rstd or want_mean):
            return out
        return (out, *([rstd] if want_rstd else []), *([mean] if want_mean else []))

    return run


def _plan_backward(arch, x, weight, dout, rstd, mean, dres, has_bias, weight_offset, has_residual=None):
    """The norm backward (LayerNorm with ``mean``): dx with per-CTA fp32 partials of dweight/dbias (by
    the split kernels' two launches where ``split_rows``), then their sum (a device sum, no host round
    trip: the PartialSum kernel, or per head a torch sum), or dweight and dbias written by the kernel
    itself (``direct_sums``). Inputs copied where the kernel can't read them as they are, a strided row
    statistic flattened; no rows: dx empty, dweight/dbias the sum of zeroed partials."""
    N = x.shape[-1]
    M, vec, device, layernorm = x.numel() // N, vec_for(N, x), x.device, mean is not None
    heads, bits = heads_of(weight, None), x.element_size() * 8
    (copy_x, ldx), (copy_g, ldg), (copy_dr, lddr) = row_layout(x, vec), row_layout(dout, vec), row_layout(dres, vec)
    params = _params(weight, None, heads, vec)
    flat_stats = not all(t is None or t.is_contiguous() for t in (rstd, mean))
    named = dict(dout_dtype=dtype_name(dout), w_dtype=dtype_name(weight), dres_dtype=dtype_name(dres), has_db=has_bias,
                 layernorm=layernorm, weight_offset=float(weight_offset))
    split = heads == 1 and M > 0 and split_rows(N, bits, arch, layernorm)
    direct = False
    if split:
        fn_a, fn, chunks = compiled_split_backward(BackwardKey(dtype_name(x), N, arch, **named))
        ctas = parts = most = split_groups(M)
        new_shares = allocator((M, chunks, 2), F32, device)
    else:
        few = few_rows(M)
        # a narrow row's budget counted in values whatever the rows (batch invariance: the launch counting
        # accesses, faster at a few hundred rows, splits a row otherwise)
        launch = backward_launch(N, bits, arch, layernorm, few, dres=dres is not None)
        if heads > 1:
            launch = head_launch(launch, heads)
        ctas, parts, most = backward_grid(launch, M, device, backward_tpsm(N, bits, arch, layernorm, few))
        direct = M > 0 and direct_sums(launch, ctas, M, heads)
        if M:
            fn = compiled_backward(BackwardKey(dtype_name(x), N, arch, heads=heads, few=few,
                                               direct=direct, **named))
    has_dw = weight is not None
    kinds, Np = int(has_dw) + int(has_bias), partial_width(N)
    wdtype = weight.dtype if has_dw else x.dtype
    new_buf = allocator((parts, kinds, Np), F32, device) if kinds and not direct else None
    ldpart = kinds * Np if kinds and not direct else N
    second = (kinds - 1) * Np * 4  # bytes from the dweight partials to the dbias ones (interleaved rows)
    if heads == 1 and not direct:
        summed = partial_sum(arch, parts, N, has_dw, has_bias, wdtype, device, most)
    new_out = allocator((N,), wdtype, device)
    stream = stream_of(device)

    def run(a):
        x, w, g, r = a["x"], a["weight"], a["dout"], a["rstd"]
        m, dr = (a["mean"] if layernorm else None), a.get("dresidual_out")
        dx = torch.empty_like(x, memory_format=DENSE)
        if direct:  # dweight and dbias themselves
            dw, db = (new_out() if has_dw else None), (new_out() if has_bias else None)
            dwp, dbp = _address(dw), _address(db)
        else:
            buf = new_buf() if kinds else None
            bp = buf.data_ptr() if kinds else 0
            dwp, dbp = (bp if has_dw else None), (bp + second if has_bias else None)
        if M:
            if copy_x:
                x = dense(x)
            if copy_g:
                g = dense(g)
            if copy_dr:
                dr = dense(dr)
            if params is not None:
                w = params(w, None)[0]
            if flat_stats:  # held here until the launch is enqueued
                r, m = r.reshape(-1).contiguous(), (None if m is None else m.reshape(-1).contiguous())
            s = stream()
            lead = (x.data_ptr(), _address(w), g.data_ptr(), r.data_ptr(), _address(m))
            if split:
                shares = new_shares()
                fn_a(*lead, shares.data_ptr(), M, ldx, ldg, s)
                lead += (shares.data_ptr(),)
            fn(*lead, _address(dr), dx.data_ptr(), dwp, dbp, M, ldx, ldg, lddr, N, ldpart, ctas, s)
        elif kinds:
            buf.zero_()
        if heads > 1:  # partial row p holds rows of head p % H: one torch sum per head
            total = buf.view(parts // heads, heads, kinds, Np).sum(0)
            dw, db = (total[:, i, :N].to(wdtype).contiguous() for i in (0, -1))
            dw, db = (dw if has_dw else None), (db if has_bias else None)
        elif not direct:
            dw, db = summed(bp)
        if has_residual is None:  # LayerNorm
            return dx, dw, db
        return dx, dw, db, (dx if has_residual else None)

    return run


def plan_backward(arch, a: dict):
    return _plan_backward(arch, a["x"], a["weight"], a["dout"], a["rstd"], None, a.get("dresidual_out"),
                          a.get("has_bias", False), a.get("weight_offset", 0.0), a.get("has_residual", False))


def plan_layernorm_backward(arch, a: dict):
    return _plan_backward(arch, a["x"], a["weight"], a["dout"], a["rstd"], a["mean"], None, a.get("bias") is not None,
                          0.0)


PLANS = {"rmsnorm_forward": plan_forward, "fused_add_rmsnorm_": plan_fused_add, "layernorm": plan_layernorm,
         "rmsnorm_backward": plan_backward, "layernorm_backward": plan_layernorm_backward}

CHECKS = {"rmsnorm_forward": check_forward, "fused_add_rmsnorm_": check_fused_add,
          "rmsnorm_backward": check_backward, "layernorm": check_layernorm, "layernorm_backward": check_layernorm}
