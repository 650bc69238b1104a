#!/usr/bin/env bash
# Third device call: GPU tests after fixes, then offline throughput for both published shapes.
source "$(dirname "$0")/device_common.sh"
TAIL=4 step kernel_tests python3 -m pytest tests/kernels -q -p no:cacheprovider
TAIL=12 step gpu_parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=10 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
TAIL=10 step throughput_llama8b python3 -m bench.offline_throughput --shape llama-3-8b --baseline-batches 1 --out "$OUT/throughput_llama8b.json"
