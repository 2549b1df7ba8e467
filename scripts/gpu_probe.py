"""Quick GPU check of the infrastructure kernel (run on the lent H100)."""
import time
import torch
from oink.kernels.rowsumsq import rowsumsq

torch.manual_seed(0)
bad = 0
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for M in (1, 3, 128, 4097):
        for N in (8, 64, 1000, 4096, 16384, 131072, 262144):
            if M * N > 2**28:
                continue
            base = torch.randn(M, N + 16, device="cuda", dtype=dtype)
            x = base[:, :N]  # padded rows
            out = rowsumsq(x)
            ref = (x.double() ** 2).sum(1)
            err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
            ok = err < 1e-4 and not torch.isnan(out).any()
            bad += not ok
            if not ok:
                print("FAIL", dtype, M, N, err)
print("rowsumsq failures:", bad)
