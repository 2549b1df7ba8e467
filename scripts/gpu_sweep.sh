#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/part2/setup.sh`): time ops under several launch settings
# and print each setting's geomean lines; with SWEEP_CSV=DIR also keep one CSV per setting.
# A setting is comma-separated VAR=value pairs of the environment knobs (docs/knobs.md), e.g.
#   OINK_OPS=rmsnorm_forward,layernorm SWEEP="OINK_PDL=1 OINK_PDL=0" bash scripts/gpu_sweep.sh
# The development settings (launch dials, a rule's side forced) are not environment variables: time them
# with `python -m oink.tune --set NAME=VALUE` (docs/tuning.md) or in code with oink.config.override.
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
