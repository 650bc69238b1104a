#!/usr/bin/env bash
# Session 2: decode attention lets the next kernel launch after its main loop; re-time.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-8}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAIL=3 step attn_tests python3 -m pytest tests/kernels/test_decode_attention.py tests/kernels/test_triton_backend.py tests/engine/test_gpu_parity.py -q -p no:cacheprovider
TAIL=26 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
TAIL=8 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
exit 0
