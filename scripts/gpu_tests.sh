#!/usr/bin/env bash
# On the GPU machine (after `source .gpu/part2/setup.sh`): the tests given (default tests/), spread
# over pytest-xdist workers where it is installed (CuTeDSL compiles are CPU-bound); what failed is
# run again alone, since parallel workers can fail for memory the GPU lacks only when shared.
# Logs go under $OUT.
set -uo pipefail
out=${OUT:-/tmp/oink-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
workers=""; [ "${OINK_TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null && workers="-n ${OINK_TEST_WORKERS:-8}"
cache="-o cache_dir=/tmp/oink-pytest-cache"
start=$(date +%s)
timeout "${OINK_TEST_TIMEOUT:-480}" python3 -m pytest -p pytest_oink.plugin $cache -v -rfE $workers "${@:-tests}" \
  > "$out/tests.log" 2>&1
echo "rc=$? after $(( $(date +%s) - start )) s"
grep -c " PASSED " "$out/tests.log" | sed 's/^/passed lines: /'
grep -E " (FAILED|ERROR) " "$out/tests.log" | head -n 30
grep -v -E "^SKIPPED| (PASSED|SKIPPED) " "$out/tests.log" | tail -n 25
if grep -q -E "^(FAILED|ERROR)" "$out/tests.log"; then
  echo "== failures run again, one process"
  timeout "${OINK_RERUN_TIMEOUT:-120}" python3 -m pytest -p pytest_oink.plugin $cache -q -rfE --lf "${@:-tests}" \
    > "$out/rerun.log" 2>&1
  echo "rerun rc=$?"; grep -v "^SKIPPED" "$out/rerun.log" | tail -n 40
fi
