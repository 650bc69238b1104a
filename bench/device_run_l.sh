#!/usr/bin/env bash
# Session 2: one-tile splits at small batch (MIN_SPLIT_LEN 64); re-test and re-time.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step attn_tests python3 -m pytest tests/kernels/test_decode_attention.py tests/kernels/test_triton_backend.py tests/engine/test_gpu_parity.py -q -p no:cacheprovider
TAIL=9 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
TAIL=7 step roofline_8k python3 -m bench.decode_roofline --max-model-len 8192 --out "$OUT/roofline_8k.json"
TAIL=26 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
TAIL=30 step split_sweep python3 -m bench.decode_split_sweep
TAIL=6 step throughput_qwen3 python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 1 --out "$OUT/throughput_qwen3.json"
exit 0
