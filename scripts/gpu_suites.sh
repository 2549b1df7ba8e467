#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/part2/setup.sh`): run the benchmark suites for the ops
# that have kernels, with every output, and pack the results under $OUT.
set -uo pipefail
res=/tmp/oink-results
rm -rf "$res"; mkdir -p "$res"
ops=${OINK_OPS:-rmsnorm_forward,fused_add_rmsnorm_,rmsnorm_backward}
providers=${OINK_PROVIDERS:+--oink-providers=$OINK_PROVIDERS}
for suite in ${OINK_SUITES:-dsv3 quack}; do
  python3 -m pytest -p pytest_oink.plugin -p no:cacheprovider bench -q --oink-suite="$suite" --oink-ops="$ops" $providers \
    --oink-profile --oink-csv="$res/$suite.csv" --oink-summary="$res/summary-$suite.md" --oink-svg="$res/svg" \
    --benchmark-json="$res/$suite.json" 2>&1 | tail -n 25
done
tar cf "$OUT/results.tar" -C "$res" .
