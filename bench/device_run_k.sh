#!/usr/bin/env bash
# Session 2, final code: GPU tests, decode roofline (two max_model_len), offline throughput.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step kernel_tests python3 -m pytest tests/kernels -q -p no:cacheprovider
TAIL=10 step parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=9 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
TAIL=7 step roofline_8k python3 -m bench.decode_roofline --max-model-len 8192 --out "$OUT/roofline_8k.json"
TAIL=6 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
TAIL=6 step throughput_llama8b python3 -m bench.offline_throughput --shape llama-3-8b --baseline-batches 1 --out "$OUT/throughput_llama8b.json"
exit 0
