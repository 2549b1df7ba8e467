"""oink.linear_cross_entropy's time and peak memory (forward + backward) per chunk size, beside Liger's
and Quack's where installed: the numbers that set ``CHUNK_MIN_ROWS`` / ``CHUNK_MAX_BYTES`` (issue #35: peak memory <=
1/4 of torch eager's at M = 16384, V = 128256 and no more than Liger's; time <= the best peer's).

    python3 scripts/lce_chunks.py [--shapes 16384x4096x128256,16384x2304x256000] [--chunks 256,512,1024,2048,4096]

Shapes are M x H x V (tokens, hidden, vocabulary), optionally x S (softcap S, Gemma-2's 30), bf16, 10% of the
targets ignored, "mean" loss.
Per row: the median of CUDA-event timings of forward + backward (torch.autograd.grad, 10 calls after
3 warm-up calls; host work inside) or, with ``--graphs``, of CUDA-graph replays (the plugin's timer: the
GPU's time alone, as the training suite times; a call that does not capture, Liger's, by events), and the
peak memory allocated during one call beyond the inputs'. "default" is
Oink's own chunk rule (``oink.chunked_linear_ce.default_chunk_rows``)."""
from __future__ import annotations

import argparse
import statistics

import torch


def _timed(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median ms of ``iters`` calls under CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _graph_timed(fn) -> tuple[float, str]:
    """(median ms, method) of CUDA-graph replays of ``fn`` (events where it does not capture)."""
    from pytest_oink.timing import Rotation, time_cuda_graph

    out = time_cuda_graph(lambda _: fn(), Rotation([None]), calls_per_replay=3, replays=7)
    return statistics.median(out.samples) * 1e3, out.method


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _fwd_bwd(loss_fn, hidden, weight, target):
    def run():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        return torch.autograd.grad(loss_fn(h, w, target), (h, w))

    return run


def _peers(cap):
    peers = {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        peers["liger"] = lambda h, w, t: liger(h, w, t, softcap=cap)
    except ImportError:
        pass
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as quack

        if cap is None:  # Quack's takes no softcap
            peers["quack (chunk 4096)"] = lambda h, w, t: quack(h, w, t, chunk_size=4096)
    except Exception as e:  # quack-kernels 0.6.5's GEMM fails at import under some CuTeDSL versions
        print(f"# quack: {type(e).__name__}: {str(e)[:120]}")
    return peers


def main() -> None:
    import oink
    from oink.chunked_linear_ce import default_chunk_rows

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="16384x4096x128256,4096x4096x128256,16384x2304x256000")
    p.add_argument("--chunks", default="256,512,1024,2048,4096,8192")
    p.add_argument("--graphs", action="store_true", help="time by CUDA-graph replays (the suite's timer)")
    args = p.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.ones(8, 8, device="cuda", dtype=torch.bfloat16) @ torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()  # cuBLAS's workspace allocated now: no row's peak counts it
    print("| M | H | V | softcap | provider | chunk rows | ms | peak MiB |\n|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        M, H, V, *cap = (int(v) for v in shape.split("x"))
        cap = float(cap[0]) if cap else None
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(M, H, device="cuda", generator=g).bfloat16()
        weight = (torch.randn(V, H, device="cuda", generator=g) * 4 / H**0.5).bfloat16()
        target = torch.randint(0, V, (M,), device="cuda", generator=g)
        target[torch.rand(M, device="cuda", generator=g) < 0.1] = -100
        rows = [("oink", "default", None)] + [("oink", c, int(c)) for c in args.chunks.split(",")]
        runs = [(name, chunk, _fwd_bwd(lambda h, w, t, c=c: oink.linear_cross_entropy(h, w, t, chunk_size=c,
                                                                                             softcap=cap),
                                       hidden, weight, target)) for name, chunk, c in rows]
        runs += [(name, "-", _fwd_bwd(fn, hidden, weight, target)) for name, fn in _peers(cap).items()]

        def eager(h, w, t, cap=cap):
            logits = (h @ w.T).float()
            return torch.nn.functional.cross_entropy(logits if cap is None else cap * torch.tanh(logits / cap), t)

        runs.append(("torch eager", "-", _fwd_bwd(eager, hidden, weight, target)))
        runs.append(("torch.compile", "-", _fwd_bwd(torch.compile(eager), hidden, weight, target)))
        for name, chunk, run in runs:
            if chunk == "default":
                chunk = f"default ({default_chunk_rows(M, H, V, 2, 1, hidden.device)})"
            try:
                mib = _peak_mib(run)
                ms, method = _graph_timed(run) if args.graphs else (_timed(run), "events")
                print(f"| {M} | {H} | {V} | {cap} | {name} | {chunk} | {ms:.2f} ({method}) | {mib:.0f} |", flush=True)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"| {M} | {H} | {V} | {cap} | {name} | {chunk} | out of memory | - |", flush=True)
            except Exception as e:  # a peer's failure is a row, not the end of the table
                print(f"| {M} | {H} | {V} | {cap} | {name} | {chunk} | failed: {type(e).__name__} | - |", flush=True)
        del hidden, weight, target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
