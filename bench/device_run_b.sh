#!/usr/bin/env bash
# Second device call: re-checks after the fused GPU path, split sweep, roofline, throughput.
source "$(dirname "$0")/device_common.sh"
step kernel_tests python3 -m pytest tests/kernels -q -p no:cacheprovider
step gpu_parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=40 step split_sweep python3 -m bench.decode_split_sweep
step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
TAIL=10 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
