#!/usr/bin/env bash
# Session 2: offline throughput (both shapes) and the kernel bench on the final code.
source "$(dirname "$0")/device_common.sh"
TAIL=10 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
TAIL=10 step throughput_llama8b python3 -m bench.offline_throughput --shape llama-3-8b --baseline-batches 1 --out "$OUT/throughput_llama8b.json"
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
exit 0
