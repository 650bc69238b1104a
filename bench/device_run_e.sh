#!/usr/bin/env bash
# Fifth device call: kernel bench timed from CUDA graphs, backend test, roofline, fixed-length grid.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step backend_test python3 -m pytest tests/kernels/test_triton_backend.py -q -p no:cacheprovider
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
TAIL=5 step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
TAIL=12 step throughput_grid python3 -m bench.offline_throughput --shape qwen3-0.6b --baseline-batches 1 --grid --out "$OUT/throughput_qwen3_grid.json"
