#!/usr/bin/env bash
# Session 2: final decode roofline (event-timed copy bandwidth), PDL off/on, with the breakdown.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-8}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAIL=9 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
TAIL=9 step roofline_again python3 -m bench.decode_roofline --pdl on --out "$OUT/roofline_again.json"
exit 0
