"""RMSNorm family (and the LayerNorm that shares its kernels) as seen by the dispatch path: which inputs the kernels take (CHECKS) and how
they are launched on torch tensors (RUNNERS). Imported only on a supported GPU."""
from __future__ import annotations

import torch

from .compile import current_stream, stream_of
from .host import (allocator, dtype_name, in_place_reason, kernel_ready_rows, ld, prepare_rows, prepare_vector,
                   ptr, resident_clusters, rows_view, vec_for, width_reason)
from .launch_table import few_rows
from .rmsnorm import compiled_forward
from .rmsnorm_bwd import (backward_launch, backward_tpsm, compiled_backward, compiled_partial_sum,
                          compiled_split_backward, direct_sums, head_launch, persistent_ctas, split_groups,
                          split_rows)


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
    if heads > 1 and head_launch(backward_launch(x.shape[-1], x.element_size() * 8, arch), heads) is None:
        return f"{heads} heads of width {x.shape[-1]}: no backward launch holds whole heads a CTA: reference"
    return width_reason(x.shape[-1])


def check_layernorm(t: dict, arch: str) -> str | None:
    return width_reason(t["x"].shape[-1])


def check_fused_add(t: dict, arch: str) -> str | None:
    vec = vec_for(t["x"].shape[-1], t["x"])
    return (width_reason(t["x"].shape[-1]) or in_place_reason("x", t["x"], vec)
            or in_place_reason("residual", t["residual"], vec))


def _rows_and_output(x, out_dtype=None):
    """x as kernel-ready [M, N] rows, a fresh output like them (in ``out_dtype``, default x's), and
    what restores x's shape."""
    N = x.shape[-1]
    vec = vec_for(N, x)
    x2 = prepare_rows(x, vec)
    return x2, torch.empty(x2.shape, device=x.device, dtype=out_dtype or x.dtype), x.shape[:-1], vec


def _row_stat(x2, wanted: bool):
    return torch.empty(x2.shape[0], device=x2.device, dtype=torch.float32) if wanted else None


def run_forward(arch, x, weight=None, bias=None, residual=None, eps=1e-6, store_rstd=False, out_dtype=None,
                residual_dtype=None, weight_offset=0.0):
    x2, out, lead, vec = _rows_and_output(x, out_dtype)
    M, N = x2.shape
    rstd = _row_stat(x2, store_rstd)
    res2 = prepare_rows(residual, vec)
    res_out = (torch.empty((M, N), device=x.device, dtype=residual_dtype or residual.dtype)
               if residual is not None else None)
    heads = heads_of(weight, bias)
    if M > 0:
        w, b = head_params(weight, bias, heads, vec)
        _launch(arch, x2, w, b, res2, out, res_out, rstd, eps, weight_offset=weight_offset, heads=heads)
    return (out.view(*lead, N), None if rstd is None else rstd.view(lead),
            None if res_out is None else res_out.view(*lead, N))


def run_fused_add(arch, x, residual, weight, eps=1e-6):
    N = x.shape[-1]
    x2, r2 = rows_view(x), rows_view(residual)
    if x2.shape[0] > 0:
        # Outputs alias the inputs: each element is read before it is overwritten, by one thread.
        _launch(arch, x2, prepare_vector(weight, vec_for(N, x)), None, r2, x2, r2, None, eps)


def _launch(arch, x, w, b, res, out, res_out, rstd, eps, mean=None, layernorm=False, weight_offset=0.0, heads=1):
    M, N = x.shape
    fn = compiled_forward(dtype_name(x), N, arch, dtype_name(w), dtype_name(b), dtype_name(res),
                          dtype_name(res_out), rstd is not None, layernorm, mean is not None, dtype_name(out),
                          float(weight_offset), heads, few_rows(M))
    fn(ptr(x), ptr(w), ptr(b), ptr(res), ptr(out), ptr(res_out), ptr(rstd, 4), ptr(mean, 4), M, ld(x), ld(res),
       ld(out), ld(res_out), float(eps), current_stream(x.device))


def run_layernorm(arch, x, weight, bias=None, eps=1e-6, return_rstd=False, return_mean=False):
    """LayerNorm forward; returns what the reference returns (y, or y with rstd and/or mean)."""
    x2, out, lead, vec = _rows_and_output(x)
    M, N = x2.shape
    rstd, mean = _row_stat(x2, return_rstd), _row_stat(x2, return_mean)
    if M > 0:
        _launch(arch, x2, prepare_vector(weight, vec), prepare_vector(bias, vec), None, out, None, rstd, eps, mean,
                layernorm=True)
    extra = ([rstd.view(lead)] if return_rstd else []) + ([mean.view(lead)] if return_mean else [])
    y = out.view(*lead, N)
    return (y, *extra) if extra else y


def run_backward(arch, x, weight, dout, rstd, dresidual_out=None, has_bias=False, has_residual=False,
                 weight_offset=0.0):
    dx, dw, db = _backward(arch, x, weight, dout, rstd, None, dresidual_out, has_bias, weight_offset)
    return dx, dw, db, (dx if has_residual else None)


def run_layernorm_backward(arch, dout, x, weight, rstd, mean, bias=None):
    return _backward(arch, x, weight, dout, rstd, mean, None, bias is not None)


def _backward(arch, x, weight, dout, rstd, mean, dresidual_out, has_bias, weight_offset=0.0):
    """dx, and dw/db summed from per-CTA fp32 partials (a device sum, no host round trip)."""
    N = x.shape[-1]
    vec = vec_for(N, x)
    x2, g2, dr2 = prepare_rows(x, vec), prepare_rows(dout, vec), prepare_rows(dresidual_out, vec)
    heads = heads_of(weight, None)
    w = head_params(weight, None, heads, vec)[0]
    M = x2.shape[0]
    dx = torch.empty((M, N), device=x.device, dtype=x.dtype)
    layernorm, bits = mean is not None, x.element_size() * 8
    split = heads == 1 and M > 0 and split_rows(N, bits, arch, layernorm)
    if split:
        parts = split_groups(M)
    else:
        few = few_rows(M)
        launch = backward_launch(N, bits, arch, layernorm, few)
        if heads > 1:
            launch = head_launch(launch, heads)
        ctas, parts = backward_grid(launch, M, x.device, backward_tpsm(N, bits, arch, layernorm, few))
    wdtype = weight.dtype if weight is not None else x.dtype
    if not split and M > 0 and direct_sums(launch, ctas, M, heads):  # the kernel writes dw and db
        dw, db = (torch.empty(N, device=x.device, dtype=wdtype) if want else None
                  for want in (weight is not None, has_bias))
        launch_backward(arch, x2, w, g2, rstd, dr2, dx, dw, db, ctas, mean, weight_offset, heads, direct=True)
        return dx.view(x.shape), dw, db
    buf, dw_part, db_part = partial_buffers(parts, N, weight is not None, has_bias, x.device, torch.empty)
    if split:
        launch_split_backward(arch, x2, w, g2, rstd, dr2, dx, dw_part, db_part, mean, weight_offset)
    elif M > 0:
        launch_backward(arch, x2, w, g2, rstd, dr2, dx, dw_part, db_part, ctas, mean, weight_offset, heads)
    else:
        buf.zero_()
    if heads > 1:  # partial row p holds rows of head p % H: one torch sum per head
        total = buf.view(parts // heads, heads, buf.shape[1], buf.shape[2]).sum(0)
        dw, db = (total[:, i, :N].to(wdtype).contiguous() for i in (0, -1))
        return dx.view(x.shape), (dw if weight is not None else None), (db if has_bias else None)
    dw, db = sum_partials(arch, buf, weight is not None, has_bias, N, wdtype)
    return dx.view(x.shape), dw, db


def backward_grid(launch, M: int, device, tpsm: int) -> tuple[int, int]:
    """(CTAs of the backward's persistent grid, partial rows they write) for M rows, the grid sized
    for ``tpsm`` threads a SM (``backward_tpsm``) in the clusters the device runs at once."""
    at_once = resident_clusters(device.index, launch.cluster_n)
    ctas = max(1, min(-(-M // launch.rows_per_cta), persistent_ctas(launch, at_once, tpsm)))
    return ctas, ctas * launch.rows_per_cta


def partial_width(N: int) -> int:
    """A partial row's length: N rounded up to 16 bytes of fp32, so each kind's rows stay aligned."""
    return -(-N // 4) * 4


def partial_buffers(parts: int, N: int, has_dw: bool, has_db: bool, device, alloc):
    """One fp32 buffer [parts, k, partial_width(N)] holding the k (0-2) partial kinds interleaved by
    row, which one reduction sums:
    -> (buffer, dweight partials [parts, N] view or None, dbias partials view or None)."""
    buf = alloc((parts, int(has_dw) + int(has_db), partial_width(N)), device=device, dtype=torch.float32)
    return buf, (buf[:, 0, :N] if has_dw else None), (buf[:, -1, :N] if has_db else None)


def sum_partials(arch: str, buf, has_dw: bool, has_db: bool, N: int, dtype):
    """(dweight, dbias) in ``dtype`` from the partials: the PartialSum kernel, one launch for both (it
    replaced a torch fp32 sum and a cast per kind). Each output gets its own storage: a custom op's
    outputs may not share any."""
    kinds = buf.shape[1]
    if kinds == 0:
        return None, None
    outs = [torch.empty(N, device=buf.device, dtype=dtype) for _ in range(kinds)]
    fn = compiled_partial_sum(N, kinds, dtype_name(outs[0]), arch)
    fn(ptr(buf), ptr(outs[0], outs[0].element_size()), ptr(outs[-1], outs[-1].element_size()) if kinds == 2
       else None, buf.shape[0], current_stream(buf.device))
    return (outs[0] if has_dw else None), (outs[-1] if has_db else None)


def launch_backward(arch, x2, w, g2, rstd, dr2, dx, dw_part, db_part, ctas, mean=None, weight_offset=0.0,
                    heads=1, direct=False):
    """Launch into given outputs; dw_part/db_part have ctas * rows_per_cta rows (unit column stride,
    both with the same row stride), or with ``direct`` are dweight and dbias (``direct_sums``). With
    ``mean`` (per-row fp32) it is the LayerNorm backward."""
    M, N = x2.shape
    fn = compiled_backward(dtype_name(x2), N, arch, dtype_name(w), dtype_name(g2), dtype_name(dr2),
                           db_part is not None, mean is not None, float(weight_offset), heads, few_rows(M), direct)
    # per-row statistics as flat fp32 (a copy only if strided), held here until the launch is enqueued
    rstd = None if rstd is None else rstd.reshape(-1).contiguous()
    mean = None if mean is None else mean.reshape(-1).contiguous()
    part = dw_part if dw_part is not None else db_part
    ldpart = part.stride(0) if part is not None and not direct else N
    fn(ptr(x2), ptr(w), ptr(g2), ptr(rstd, 4), ptr(mean, 4), ptr(dr2), ptr(dx), ptr(dw_part),
       ptr(db_part), M, ld(x2), ld(g2), ld(dr2), ld(dx), ldpart, ctas, current_stream(x2.device))


def launch_split_backward(arch, x2, w, g2, rstd, dr2, dx, dw_part, db_part, mean=None, weight_offset=0.0):
    """The split backward (``rmsnorm_bwd.split_rows``): kernel A into a shares buffer, then kernel B
    into dx and ``split_groups(M)`` partial rows."""
    M, N = x2.shape
    fn_a, fn_b, chunks = compiled_split_backward(dtype_name(x2), N, arch, dtype_name(w), dtype_name(g2),
                                                 dtype_name(dr2), db_part is not None, mean is not None,
                                                 float(weight_offset))
    rstd = rstd.reshape(-1).contiguous()
    mean = None if mean is None else mean.reshape(-1).contiguous()
    shares = torch.empty((M, chunks, 2), device=x2.device, dtype=torch.float32)
    part = dw_part if dw_part is not None else db_part
    ldpart = part.stride(0) if part is not None else N
    stream = current_stream(x2.device)
    fn_a(ptr(x2), ptr(w), ptr(g2), ptr(rstd, 4), ptr(mean, 4), ptr(shares, 8), M, ld(x2), ld(g2), stream)
    fn_b(ptr(x2), ptr(w), ptr(g2), ptr(rstd, 4), ptr(mean, 4), ptr(shares, 8), ptr(dr2), ptr(dx), ptr(dw_part),
         ptr(db_part), M, ld(x2), ld(g2), ld(dr2), ld(dx), ldpart, split_groups(M), stream)


# ---- plans: a launch prepared once per argument layout (see dispatch.Route.plan) --------------
DENSE = torch.contiguous_format  # outputs are dense rows, whatever x's leading strides


def plan_forward(arch, a: dict):
    """The forward with its compiled function, leading dims and strides fixed; None where a copy or
    per-head parameters would be needed (the runner handles those)."""
    # vLLM's rmsnorm routes here with x, weight and eps only: the rest take the runner's defaults
    x, w, b, res = a["x"], a["weight"], a.get("bias"), a.get("residual")
    N = x.shape[-1]
    vec = vec_for(N, x)
    if (x.numel() == 0 or heads_of(w, b) > 1
            or not all(kernel_ready_rows(t, vec) for t in (x, w, b, res))):
        return None
    x2, r2 = rows_view(x), rows_view(res) if res is not None else None
    M = x2.shape[0]
    out_dtype = a.get("out_dtype") or x.dtype
    res_dtype = a.get("residual_dtype") or (res.dtype if res is not None else None)
    store_rstd, eps = a.get("store_rstd", False), float(a.get("eps", 1e-6))
    lead, device = x.shape[:-1], x.device
    stream = stream_of(device)
    fn = compiled_forward(dtype_name(x), N, arch, dtype_name(w), dtype_name(b), dtype_name(res),
                          dtype_name(res_dtype) if res is not None else None, store_rstd, False,
                          False, dtype_name(out_dtype), float(a.get("weight_offset", 0.0)), 1, few_rows(M))
    ldx, ldres, ldres_out = ld(x2), ld(r2), (N if res is not None else 0)
    new_rstd = allocator(lead, torch.float32, device) if store_rstd else None

    def run(a):
        x, w, b, res = a["x"], a["weight"], a.get("bias"), a.get("residual")
        out = torch.empty_like(x, dtype=out_dtype, memory_format=DENSE)  # cheaper than torch.empty(shape)
        rstd = new_rstd() if store_rstd else None
        res_out = torch.empty_like(x, dtype=res_dtype, memory_format=DENSE) if res is not None else None
        fn(x.data_ptr(), None if w is None else w.data_ptr(), None if b is None else b.data_ptr(),
           None if res is None else res.data_ptr(), out.data_ptr(), None if res_out is None else res_out.data_ptr(),
           None if rstd is None else rstd.data_ptr(), None, M, ldx, ldres, N, ldres_out, eps,
           stream())
        return out, rstd, res_out

    return run


def plan_fused_add(arch, a: dict):
    x, res, w = a["x"], a["residual"], a["weight"]
    N = x.shape[-1]
    if x.numel() == 0 or not kernel_ready_rows(w, vec_for(N, x)):
        return None
    x2, r2 = rows_view(x), rows_view(res)
    M, eps, device, wd = x2.shape[0], float(a.get("eps", 1e-6)), x.device, dtype_name(w)
    stream = stream_of(device)
    fn = compiled_forward(dtype_name(x), N, arch, wd, None, dtype_name(res), dtype_name(res), False, False, False,
                          dtype_name(x), 0.0, 1, few_rows(M))
    ldx, ldres = ld(x2), ld(r2)

    def run(a):
        # outputs alias the inputs: each element is read before it is overwritten, by one thread
        xp, rp = a["x"].data_ptr(), a["residual"].data_ptr()
        fn(xp, a["weight"].data_ptr(), None, rp, xp, rp, None, None, M, ldx, ldres, ldx, ldres, eps,
           stream())

    return run


def plan_layernorm(arch, a: dict):
    x, w, b = a["x"], a["weight"], a.get("bias")
    N = x.shape[-1]
    vec = vec_for(N, x)
    if x.numel() == 0 or not all(kernel_ready_rows(t, vec) for t in (x, w, b)):
        return None
    x2 = rows_view(x)
    M, eps, lead, device = x2.shape[0], float(a.get("eps", 1e-6)), x.shape[:-1], x.device
    stream = stream_of(device)
    want_rstd, want_mean = a.get("return_rstd", False), a.get("return_mean", False)
    fn = compiled_forward(dtype_name(x), N, arch, dtype_name(w), dtype_name(b), None, None, want_rstd, True,
                          want_mean, dtype_name(x), 0.0, 1, few_rows(M))
    ldx, new_stat = ld(x2), allocator(lead, torch.float32, device)

    def run(a):
        x, b = a["x"], a.get("bias")
        out = torch.empty_like(x, memory_format=DENSE)
        rstd = new_stat() if want_rstd else None
        mean = new_stat() if want_mean else None
        fn(x.data_ptr(), a["weight"].data_ptr(), None if b is None else b.data_ptr(), None, out.data_ptr(), None,
           None if rstd is None else rstd.data_ptr(), None if mean is None else mean.data_ptr(), M, ldx, 0, N, 0,
           eps, stream())
        if not (want_rstd or want_mean):
            return out
        return (out, *([rstd] if want_rstd else []), *([mean] if want_mean else []))

    return run


def _plan_backward(arch, x, weight, dout, rstd, mean, dres, has_bias, weight_offset, has_residual=None):
    """The norm backward (its launches: dx with the partials, by the split kernels' two where
    ``split_rows``, then their sum) with the compiled functions, grid and partial-buffer layout fixed; None where the runner must prepare something
    (a copy, per-head weights, a strided row statistic)."""
    N = x.shape[-1]
    vec = vec_for(N, x)
    if (x.numel() == 0 or heads_of(weight, None) > 1
            or not all(kernel_ready_rows(t, vec) for t in (x, weight, dout, dres))
            or not all(t is None or t.is_contiguous() for t in (rstd, mean))):
        return None
    x2, g2, dr2 = rows_view(x), rows_view(dout), rows_view(dres) if dres is not None else None
    M, layernorm, device = x2.shape[0], mean is not None, x.device
    current = stream_of(device)
    names = (dtype_name(x), N, arch, dtype_name(weight), dtype_name(dout), dtype_name(dres), has_bias, layernorm,
             float(weight_offset))
    bits = x.element_size() * 8
    split = split_rows(N, bits, arch, layernorm)
    direct = False
    if split:
        fn_a, fn, chunks = compiled_split_backward(*names)
        ctas = parts = split_groups(M)
        new_shares = allocator((M, chunks, 2), torch.float32, device)
    else:
        few = few_rows(M)
        launch = backward_launch(N, bits, arch, layernorm, few)
        ctas, parts = backward_grid(launch, M, device, backward_tpsm(N, bits, arch, layernorm, few))
        direct = direct_sums(launch, ctas, M)  # the kernel writes dw and db, no partials' sum
        fn = compiled_backward(*names, 1, few, direct)
    has_dw = weight is not None
    kinds = int(has_dw) + int(has_bias)
    Np = partial_width(N)
    wdtype = weight.dtype if has_dw else x.dtype
    fn_sum = None
    if kinds and not direct:
        fn_sum = compiled_partial_sum(N, kinds, dtype_name(wdtype), arch)
    ldx, ldg, lddr, ldpart = ld(x2), ld(g2), ld(dr2), kinds * Np if kinds else N
    second = (kinds - 1) * Np * 4  # bytes from the dweight partials to the dbias ones (interleaved rows)
    new_buf = allocator((parts, kinds, Np), torch.float32, device) if kinds and not direct else None
    new_out = allocator((N,), wdtype, device)

    def run(a):
        x, w, g, r = a["x"], a["weight"], a["dout"], a["rstd"]
        m, dr = (a["mean"] if layernorm else None), a.get("dresidual_out")
        dx = torch.empty_like(x, memory_format=DENSE)
        stream = current()
        outs = [new_out() for _ in range(kinds)]
        wp, mp = None if w is None else w.data_ptr(), None if m is None else m.data_ptr()
        lead = (x.data_ptr(), wp, g.data_ptr(), r.data_ptr(), mp)
        if split:
            shares = new_shares()
            fn_a(*lead, shares.data_ptr(), M, ldx, ldg, stream)
            lead += (shares.data_ptr(),)
        if direct:  # dweight and dbias themselves
            dwp, dbp = (outs[0].data_ptr() if has_dw else None), (outs[-1].data_ptr() if has_bias else None)
        else:
            buf = new_buf() if kinds else None
            bp = buf.data_ptr() if kinds else 0
            dwp, dbp = (bp if has_dw else None), (bp + second if has_bias else None)
        fn(*lead, None if dr is None else dr.data_ptr(), dx.data_ptr(), dwp, dbp, M, ldx, ldg, lddr, N, ldpart, ctas,
           stream)
        if kinds and not direct:
            fn_sum(bp, outs[0].data_ptr(), outs[-1].data_ptr() if kinds == 2 else None, parts, stream)
        dw = outs[0] if has_dw else None
        db = outs[-1] if has_bias else None
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
RUNNERS = {"rmsnorm_forward": run_forward, "fused_add_rmsnorm_": run_fused_add,
           "rmsnorm_backward": run_backward, "layernorm": run_layernorm,
           "layernorm_backward": run_layernorm_backward}
