#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/part2/setup.sh`): time the norm backward under several
# launch settings (units per thread : resident threads per SM), Oink against Quack, and print
# each setting's geomean lines. Usage: OINK_OPS=layernorm_backward SWEEP="2:1024 1:1024" bash scripts/gpu_sweep.sh
set -uo pipefail
ops=${OINK_OPS:-rmsnorm_backward,layernorm_backward}
for setting in ${SWEEP:-2:1024 1:1024 4:1024 2:2048}; do
  export OINK_BWD_UPT=${setting%%:*} OINK_BWD_TPSM=${setting##*:}
  echo "== units/thread $OINK_BWD_UPT, threads/SM $OINK_BWD_TPSM"
  python3 -m pytest -p pytest_oink.plugin -p no:cacheprovider bench -q --oink-suite="${SUITE:-dsv3}" --oink-ops="$ops" \
    --oink-providers=oink,quack --oink-summary=/tmp/sweep.md 2>&1 | grep -E "failed|passed" | tail -1
  grep -E "^## |Geomean" /tmp/sweep.md
done
