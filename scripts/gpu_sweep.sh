#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/part2/setup.sh`): time ops under several launch settings
# and print each setting's geomean lines; with SWEEP_CSV=DIR also keep one CSV per setting.
# A setting is comma-separated VAR=value pairs of the kernels' override knobs, e.g.
#   OINK_OPS=layernorm_backward SWEEP="OINK_BWD_UPT=2,OINK_BWD_TPSM=1024 OINK_BWD_UPT=1" bash scripts/gpu_sweep.sh
#   OINK_OPS=nvfp4_quantize SUITE=nvfp4 PROVIDERS=oink SWEEP="OINK_FP4_UPT=1 OINK_FP4_UPT=2" bash scripts/gpu_sweep.sh
set -uo pipefail
ops=${OINK_OPS:-rmsnorm_backward,layernorm_backward}
for setting in ${SWEEP:?SWEEP=\"VAR=value,... VAR=value ...\"}; do
  echo "== $setting"
  csv=${SWEEP_CSV:+--oink-csv=$SWEEP_CSV/${setting//[,=]/_}.csv}
  env ${setting//,/ } python3 -m pytest -p pytest_oink.plugin -p no:cacheprovider bench -q --oink-suite="${SUITE:-dsv3}" \
    --oink-ops="$ops" --oink-providers="${PROVIDERS:-oink,quack}" --oink-summary=/tmp/sweep.md $csv 2>&1 \
    | grep -E "failed|passed" | tail -1
  grep -E "^## |Geomean" /tmp/sweep.md
done
