#!/usr/bin/env bash
# Issue #34's GPU targets for the regression gate, on the card at hand, from the repository root on the GPU
# machine (after `source .gpu/part2/setup.sh`); logs and summaries go under $OUT (default /tmp/oink-gate):
#   same    RUNS (default 5) same-code runs of the quack suite's Oink rows with --oink-against=<a copy of
#           this tree>: none may read SLOWER
#   slow    scripts/ab_slowdown.sh: a tree 10% slower on softmax_forward; its rows SLOWER, no other
#   load    the same-code A/B of three ops beside a second process multiplying bf16 matrices: its rows
#           flagged (throttled or shared), none SLOWER
#   time    the suite's Oink rows alone, for the A/B's time over it
#   baseline  this card's JSON, kept for a run on another card to be refused against (--oink-baseline)
# Usage: bash scripts/gate_targets.sh [same] [slow] [load] [time] [baseline]   (none: all of them)
set -uo pipefail
out=${OUT:-/tmp/oink-gate}; mkdir -p "$out"
steps=${*:-same slow load time baseline}
suite=(python3 -m pytest -p pytest_oink.plugin -p no:cacheprovider --oink-suite=quack --oink-providers=oink -q)
same=$(mktemp -d /tmp/oink-same-XXXXXX); trap 'rm -rf "$same"' EXIT
cp -r oink "$same/oink"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/card.txt"

timed() {  # name, command...: the command's output to $out/name.log, its exit code and wall time printed
  local name=$1; shift
  local start; start=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - start )) s; $(grep -E '^[0-9]+ (passed|failed)' "$out/$name.log" | tail -n 1)"
  grep -h "rows compared" "$out/$name.md" 2>/dev/null | sed 's/ Ratio:.*//'
}

for step in $steps; do
  case $step in
    same)
      for i in $(seq 1 "${RUNS:-5}"); do
        timed "same_$i" "${suite[@]}" --oink-against="$same" --oink-summary="$out/same_$i.md"
      done ;;
    slow)
      SUMMARY="$out/slow.md" timed slow bash scripts/ab_slowdown.sh
      grep -E "SLOWER" "$out/slow.log" | grep -v "fails the session" ;;
    load)
      python3 -c "
import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
end = time.time() + ${LOAD_SECONDS:-240}
while time.time() < end:
    for _ in range(20): a @ b
    torch.cuda.synchronize()
" &
      load=$!; sleep 5
      timed load "${suite[@]}" --oink-ops=rmsnorm_forward,softmax_forward,cross_entropy_forward \
        --oink-against="$same" --oink-summary="$out/load.md"
      kill "$load" 2>/dev/null
      grep -h "^\[oink\] clocks" "$out/load.log" | cut -c1-200 ;;
    time)
      timed alone "${suite[@]}" --oink-summary="$out/alone.md"
      grep -h "time by provider" "$out"/alone.log "$out"/same_1.log 2>/dev/null ;;
    baseline)
      timed baseline "${suite[@]}" --oink-ops=rmsnorm_forward --benchmark-json="$out/baseline.json" ;;
    *) echo "unknown step $step (same, slow, load, time, baseline)" >&2; exit 2 ;;
  esac
done
