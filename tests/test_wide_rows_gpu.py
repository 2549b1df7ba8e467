"""The launch shapes the heuristics pick for wide rows (clusters, whole-warp tilings within a
cluster, capped CTAs: see pick_row_launch and tests/test_spills.py) run correctly: every row op,
through its public call, against its reference (the benchmark gate: 3 seeds, float64 reference),
at a partial CTA and a full wave of rows."""
from __future__ import annotations

import pytest

from pytest_oink.suites import Case

OPS = ("rmsnorm_forward", "rmsnorm_forward_w32", "fused_add_rmsnorm_", "layernorm", "rmsnorm_backward",
       "layernorm_backward", "softmax_forward", "softmax_backward", "softmax_fwd_bwd")
CE_OPS = ("cross_entropy_forward", "cross_entropy_backward", "cross_entropy_fwd_bwd")
WIDE = (12288, 14336, 18432, 28672, 65536)
VOCABS = (128256, 151936, 201088, 256000)
# SM90's cluster of 16 at widths with no launch-table entry: the norm backward's one kernel, and
# the softmax backward modes at fp32 (bf16 keeps 8 CTAs there)
WIDE16 = [(op, N) for op in ("rmsnorm_backward", "layernorm_backward") for N in (90112, 122880)] + [
    (op, 256000) for op in ("softmax_backward", "softmax_fwd_bwd")]
CASES = [(op, N) for op in OPS for N in WIDE] + [(op, N) for op in CE_OPS for N in VOCABS] + WIDE16


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [37, 1000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op,N", CASES, ids=[f"{op}-{N}" for op, N in CASES])
def test_wide_row_launch_runs_correctly(op, N, dtype, M):
    assert _gated_launches(op, N, dtype, M), "no row kernel ran (the call took the reference)"


def _gated_launches(op, N, dtype, M) -> set:
    """The op through its public call against its reference (the benchmark gate), M x N; the launches it ran."""
    import torch

    from oink.kernels.compile import CACHE
    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import SPECS, build

    device = torch.device("cuda")
    CACHE.clear_used()
    result = gate(SPECS[op], build(op, "oink", device), Case("test", op, M, N, dtype), getattr(torch, dtype), device)
    assert result["passed"], result.get("report")
    return CACHE.used_launches()


# the wide-row rule (row_rules.cluster_rows) at widths no table entry serves: whole-warp tilings of 128-416
# threads over clusters of 4-16, padded shares (40968 = 8 x 5121; 100008 = 8 x 12501, 7 accesses a thread, whose
# loads past the row read its last vector: ``RMSNormForward.load_clamped``), and odd widths (one element an access)
# (and the softmax backward modes': softmax_rules.BWD_WIDE_MIN_N, full-width 16-bit rows on sm_90a)
RULE_OPS = ("rmsnorm_forward", "rmsnorm_forward_w32", "fused_add_rmsnorm_", "layernorm", "softmax_forward",
            "softmax_backward", "softmax_fwd_bwd")
RULE_CASES = [(op, N) for op in RULE_OPS for N in (24576, 40968, 53248, 98304, 100008, 180224, 40961, 147457)]
# row_rules.narrow_rows: 16-bit rows whose width is not a multiple of 8, one CTA of many narrow accesses a thread
# (the softmax reads rows of 1- and 2-element accesses through aligned windows: 16383's, of 16392 columns,
# takes a cluster; 16380, of 4-element accesses, does not)
NARROW_CASES = [(op, N) for op in ("rmsnorm_forward", "fused_add_rmsnorm_", "layernorm", "softmax_forward")
                for N in (4619, 4750, 8077, 16380 if op == "softmax_forward" else 16383)]
# and the norm forwards' rows of 2-element accesses counted in values: one CTA up to 16384 columns (narrow_rows'
# short, which also counts rows of 4 up to 1024 so), CTAs of 256 threads over a cluster past 16384
# (row_rules.narrow_cluster_rows; RMSNorm's staged: rmsnorm_rules.staged_rows)
NARROW_CASES += [(op, N) for op in ("rmsnorm_forward", "layernorm")
                 for N in (210, 644, 746, 1018, 1020, 1030, 3078, 9044, 11002, 20482, 49474, 67810, 98306, 131750,
                           180226)]


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [37, 600])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op,N", NARROW_CASES, ids=[f"{op}-{N}" for op, N in NARROW_CASES])
def test_narrow_access_rows_run_correctly(op, N, dtype, M):
    """One CTA a row up to 16384 columns, a cluster past it."""
    ran = _gated_launches(op, N, dtype, M)
    assert any((L[2] > 1) == (N > 16384) for L in ran), f"no launch of the rule's kind ran: {ran}"


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [37, 600])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op,N", RULE_CASES, ids=[f"{op}-{N}" for op, N in RULE_CASES])
def test_wide_row_rule_runs_correctly(op, N, dtype, M):
    ran = _gated_launches(op, N, dtype, M)
    assert any(L[2] > 1 for L in ran), f"no clustered launch ran: {ran}"


# RMSNorm's rows of 4- and 2-element accesses past 16384 columns (rmsnorm_rules.staged_rows): staged in shared memory
# over a cluster of 2-16 CTAs of 256-512 threads, 8-32 accesses a thread, registers capped (staged_min_ctas), padded
# shares
STAGED_WIDTHS = (16388, 40964, 73124, 123460, 200004, 262140, 16386, 33794, 88002, 150002, 200002, 262142)


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [37, 600])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N", STAGED_WIDTHS)
def test_staged_rule_runs_correctly(N, dtype, M):
    from oink.kernels.compile import CACHE
    from oink.kernels.rmsnorm_rules import ran_staged

    ran = _gated_launches("rmsnorm_forward", N, dtype, M)
    assert ran_staged(CACHE.used) and any(L[2] > 1 for L in ran), f"no staged launch ran: {ran}"


SPLIT_CASES = [(op, N) for op in ("rmsnorm_backward", "layernorm_backward") for N in (151936, 200000, 262144)]


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [1, 5, 32, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("op,N", SPLIT_CASES, ids=[f"{op}-{N}" for op, N in SPLIT_CASES])
def test_split_backward_runs_correctly(op, N, dtype, M):
    """The norm backward's split kernels (rows past 131072 columns: a row over independent CTAs, dx
    from re-read rows): dx, dweight and dbias against the float64 reference, at 1 row, at a partial
    group of rows (5), at 32 and at many rows (the gate checks 128-256 of them: each of kernel B's
    CTAs walks several groups of rows); 200000 leaves a partial last chunk."""
    import torch

    from oink.kernels.compile import CACHE
    from oink.kernels.rmsnorm_bwd_rules import split_launches, split_rows
    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import SPECS, build

    assert split_rows(N, getattr(torch, dtype).itemsize * 8, "sm_90a", op == "layernorm_backward")
    device = torch.device("cuda")
    CACHE.clear_used()
    result = gate(SPECS[op], build(op, "oink", device), Case("test", op, M, N, dtype), getattr(torch, dtype), device)
    assert result["passed"], result.get("report")
    la, lb = split_launches(N, getattr(torch, dtype).itemsize * 8)
    ran = CACHE.used_launches()
    shapes = {(la.threads_per_row, la.num_threads, la.cluster_n), (lb.threads_per_row, lb.num_threads, lb.cluster_n)}
    assert shapes <= ran, ran


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("layernorm,weight", [(False, "none"), (False, "bfloat16"), (False, "float32"),
                                              (True, "bfloat16"), (True, "float32")],
                         ids=["rmsnorm-none", "rmsnorm-bfloat16", "rmsnorm-float32", "layernorm-bfloat16",
                              "layernorm-float32"])  # (the LayerNorm backward takes a weight)
def test_split_backward_all_inputs_with_correlated_dout(weight, layernorm):
    """The split backward's other inputs (RMSNorm: dresidual_out added to dx, dbias, a weight offset,
    no weight; LayerNorm: a bias, a wider weight) against the float64 reference. dout is made
    close to xhat * weight so that the row's sums (the shares kernel A writes and kernel B adds) carry
    most of dx: with independent random dout they are O(1/sqrt(N)) of it and a wrong sum could pass."""
    import torch

    import oink
    from oink.reference import norms

    torch.manual_seed(7)
    M, N, dev = 7, 131072 + 64, "cuda"  # 7 rows: one full group of 4 and a partial one; a partial chunk
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 2 + 0.5
    w = None if weight == "none" else torch.randn(N, device=dev, dtype=getattr(torch, weight)) + 1
    xf = x.double()
    mean = xf.mean(-1) if layernorm else torch.zeros(M, device=dev, dtype=torch.float64)
    rstd = ((xf - mean[:, None]).pow(2).mean(-1) + 1e-6).rsqrt()
    xhat = (xf - mean[:, None]) * rstd[:, None]
    dout = (xhat * (1 if w is None else w.double()) + 0.05 * torch.randn_like(xhat)).to(x.dtype)
    rstd, mean = rstd.float(), mean.float()
    if layernorm:
        b = torch.randn(N, device=dev, dtype=w.dtype)
        got = oink.layernorm_backward(dout, x, w, rstd, mean, b)
        want = norms.layernorm_backward(dout.double(), xf, w.double(), rstd.double(), mean.double(), b.double())
        names = ("dx", "dw", "db")
    else:
        dres = torch.randn_like(x)
        got = oink.rmsnorm_backward(x, w, dout, rstd, dres, has_bias=True, has_residual=True, weight_offset=1.0)
        want = norms.rmsnorm_backward(xf, None if w is None else w.double(), dout.double(), rstd.double(),
                                      dres.double(), has_bias=True, has_residual=True, weight_offset=1.0)
        names = ("dx", "dw", "db", "dresidual")
    for g, r, name in zip(got, want, names):
        assert (g is None) == (r is None), name
        if g is not None:
            assert torch.isfinite(g).all(), name
            torch.testing.assert_close(g.double(), r.double(), rtol=2e-2, atol=2e-2 * r.abs().max().item(), msg=name)


STAGED_OPS = ("rmsnorm_forward", "rmsnorm_forward_w32", "fused_add_rmsnorm_", "layernorm")


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("M", [1, 37, 1000])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("N", [1000, 4096, 65536, 67810, 262144])
@pytest.mark.parametrize("op", STAGED_OPS)
def test_staged_forward_runs_correctly(op, N, dtype, M, monkeypatch):
    """The norm forward with its rows staged in shared memory (``fwd_stage=True``: every tile that fits,
    padded (1000, 67810) or not, so the table's and the heuristic's launches both), against the reference
    at one row, a partial CTA and many rows; it must have run staged where the tile allows it (never with a
    residual: ``stage_rows``)."""
    import torch

    from tests.helpers import set_dev
    from oink.kernels.compile import CACHE
    from oink.kernels.rmsnorm_rules import STAGE_MAX_BYTES, ran_staged
    from pytest_oink.bench_runner import gate
    from pytest_oink.providers import SPECS, build

    set_dev(monkeypatch, fwd_stage=True)
    device = torch.device("cuda")
    CACHE.clear_used()
    result = gate(SPECS[op], build(op, "oink", device), Case("test", op, M, N, dtype), getattr(torch, dtype), device)
    assert result["passed"], result.get("report")
    (tpr, nt, cluster_n), = CACHE.used_launches()
    tile_bytes = nt // tpr * N // cluster_n * getattr(torch, dtype).itemsize * (2 if op == "fused_add_rmsnorm_" else 1)
    fits = tile_bytes <= STAGE_MAX_BYTES and op != "fused_add_rmsnorm_"
    assert ran_staged(CACHE.used) == fits, (tile_bytes, CACHE.used_launches())


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("path", ["plan", "launch"])
@pytest.mark.parametrize("N", [512, 1536, 4096, 7168, 65536, 131072])  # 512, 1536: several rows a CTA
@pytest.mark.parametrize("layernorm,weight", [(False, "none"), (False, "bfloat16"), (False, "float32"),
                                              (True, "bfloat16"), (True, "float32")])
def test_one_row_backward_writes_dweight_directly(layernorm, weight, N, path):
    """One row: the backward's one CTA (or cluster) stores dweight and dbias in the weight's dtype and
    no partials' sum runs (``direct_sums``), through the public call and through dispatch.launch;
    every output against the float64 reference, with dout close to xhat * weight (as above) so that
    the row's sums carry dx, and RMSNorm's dresidual_out, bias and weight offset."""
    import torch

    import oink
    import oink.ops  # noqa: F401  (the declarations name each op's kernels to dispatch.launch)
    from oink.dispatch import launch
    from oink.kernels.compile import CACHE
    from oink.reference import norms

    torch.manual_seed(N + layernorm)
    dev = "cuda"
    x = torch.randn(1, N, device=dev, dtype=torch.bfloat16) * 2 + 0.5
    w = None if weight == "none" else torch.randn(N, device=dev, dtype=getattr(torch, weight)) + 1
    xf = x.double()
    mean = xf.mean(-1) if layernorm else torch.zeros(1, device=dev, dtype=torch.float64)
    rstd = ((xf - mean[:, None]).pow(2).mean(-1) + 1e-6).rsqrt()
    xhat = (xf - mean[:, None]) * rstd[:, None]
    dout = (xhat * (1 if w is None else w.double()) + 0.05 * torch.randn_like(xhat)).to(x.dtype)
    rstd, mean = rstd.float(), mean.float()
    CACHE.clear_used()
    if layernorm:
        b = torch.randn(N, device=dev, dtype=w.dtype)
        args = (dout, x, w, rstd, mean, b)
        got = (oink.layernorm_backward(*args) if path == "plan"
               else launch("layernorm_backward", "sm_90a", **dict(zip(("dout", "x", "weight", "rstd", "mean", "bias"),
                                                                      args))))
        want = norms.layernorm_backward(dout.double(), xf, w.double(), rstd.double(), mean.double(), b.double())
        names = ("dx", "dw", "db")
    else:
        dres = torch.randn_like(x)
        kw = dict(has_bias=True, has_residual=True, weight_offset=1.0)
        got = (oink.rmsnorm_backward(x, w, dout, rstd, dres, **kw) if path == "plan"
               else launch("rmsnorm_backward", "sm_90a", x=x, weight=w, dout=dout, rstd=rstd, dresidual_out=dres, **kw))
        want = norms.rmsnorm_backward(xf, None if w is None else w.double(), dout.double(), rstd.double(),
                                      dres.double(), **kw)
        names = ("dx", "dw", "db", "dresidual")
    for g, r, name in zip(got, want, names):
        assert (g is None) == (r is None), name
        if g is not None:
            assert torch.isfinite(g).all(), name
            if name in ("dw", "db"):
                assert g.dtype == (w.dtype if w is not None else x.dtype), name
            torch.testing.assert_close(g.double(), r.double(), rtol=2e-2, atol=2e-2 * r.abs().max().item(), msg=name)
    ran = [k[0][0] for k in CACHE.used if k]
    assert "partial_sum" not in ran and any(kind.endswith("_bwd") for kind in ran), ran


# the norm backward's CTAs of several rows whose last access is partly idle: pipeline depth 1
# (``rmsnorm_bwd_rules.backward_depth``), rows of 8-, 4-, 2- and 1-element accesses
SEVERAL_ROWS_NS = (200, 300, 368, 424, 469, 578, 680, 750, 904)


@pytest.mark.gpu
@pytest.mark.sm(90, exact=True)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N", SEVERAL_ROWS_NS)
def test_backward_of_several_rows_a_cta_runs_correctly(N, dtype):
    """16-bit rows whose budget counts values (at every row count: batch invariance), 5000 of them: 32-64 threads a
    row."""
    ran = _gated_launches("rmsnorm_backward", N, dtype, 5000)
    assert any(L[1] > L[0] for L in ran), f"no launch of several rows a CTA ran: {ran}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("N", (4098, 4702, 4862))
@pytest.mark.parametrize("M", (3, 333, 5000))
def test_backward_of_narrow_row_pairs_runs_correctly(N, M, dtype):
    """RMSNorm backward rows of 2-element accesses past 4096 columns, two rows of 128 threads a CTA
    (``rmsnorm_bwd_rules.NARROW_PAIR_VALUES``; 4862: its widest), also where a CTA's second row lies past M."""
    ran = _gated_launches("rmsnorm_backward", N, dtype, M)
    assert any(tuple(L[:3]) == (128, 256, 1) for L in ran), f"no launch of two rows of 128 threads ran: {ran}"
