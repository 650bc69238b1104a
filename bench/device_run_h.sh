#!/usr/bin/env bash
# Session 2: offline throughput (both shapes) and the kernel bench on the final code.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-8}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
TAIL=10 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
TAIL=10 step throughput_llama8b python3 -m bench.offline_throughput --shape llama-3-8b --baseline-batches 1 --out "$OUT/throughput_llama8b.json"
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
exit 0
