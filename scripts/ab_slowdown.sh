#!/usr/bin/env bash
# Issue #34's "real slowdown" target for --oink-against: a copy of this Oink whose softmax_forward is
# deliberately slower (one extra on-device read and write of FRACTION, default 0.1, of its input rows,
# captured in the CUDA graph like the kernel: about FRACTION more traffic for an op that reads x once
# and writes once), gated in one run against this checkout. Every softmax_forward row should read
# SLOWER and no other op's row should. From the repository root on the GPU machine:
#   bash scripts/ab_slowdown.sh                   # quack suite, softmax_forward and rmsnorm_forward
#   SUITE=smoke EXTRA=--oink-gate-cpu bash scripts/ab_slowdown.sh    # on a CPU (reference path, host timer)
set -euo pipefail
repo=$(pwd)
slow=$(mktemp -d /tmp/oink-slow-XXXXXX)
trap 'rm -rf "$slow"' EXIT
cp -r "$repo/oink" "$slow/oink"
cat >> "$slow/oink/__init__.py" <<EOF


def softmax_forward(x, *args, **kwargs):  # scripts/ab_slowdown.sh: slower on purpose
    from .ops import softmax_forward as fast

    rows = max(1, int(x.shape[0] * ${FRACTION:-0.1}))
    x[:rows].neg()  # one more read and write of those rows
    return fast(x, *args, **kwargs)
EOF
# this session's Oink is the slowed copy (run from its directory: first on the path, not this checkout's);
# the other tree is this checkout
cd "$slow"
PYTHONPATH="$slow:$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -p pytest_oink.plugin -p no:cacheprovider \
  --oink-suite="${SUITE:-quack}" --oink-ops="${OPS:-softmax_forward,rmsnorm_forward}" --oink-providers=oink \
  --oink-against="$repo" --oink-summary="${SUMMARY:-/tmp/ab_slowdown.md}" ${EXTRA:-} -q
