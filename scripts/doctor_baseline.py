"""Write a doctored copy of a pytest-benchmark JSON: every row of the given providers claims
FACTOR times its time (0.5 = a baseline twice as fast), to prove the regression gate fails.
    python3 scripts/doctor_baseline.py IN.json OUT.json 0.5 [provider ...]"""
import json
import sys

src, dst, factor, *providers = sys.argv[1:]
providers = set(providers or ["oink"])
data = json.load(open(src))
n = 0
for b in data["benchmarks"]:
    if (b.get("extra_info") or {}).get("provider") in providers:
        for k in ("median", "min", "mean", "max"):
            if k in b["stats"]:
                b["stats"][k] *= float(factor)
        n += 1
json.dump(data, open(dst, "w"))
print(f"{dst}: {n} rows of {sorted(providers)} scaled by {factor}")
