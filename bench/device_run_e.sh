#!/usr/bin/env bash
# Fifth device call: kernel bench timed from CUDA graphs, backend test, roofline, fixed-length grid.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-8}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAIL=3 step backend_test python3 -m pytest tests/kernels/test_triton_backend.py -q -p no:cacheprovider
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
TAIL=5 step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
TAIL=12 step throughput_grid python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 1 --grid --out "$OUT/throughput_qwen3_grid.json"
