#!/usr/bin/env bash
# Fourth device call: remaining GPU checks, kernel launch configs, kernel bench, profiled roofline.
source "$(dirname "$0")/device_common.sh"
TAIL=6 step kernel_tests python3 -m pytest tests/kernels -q -p no:cacheprovider
TAIL=6 step gpu_parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=22 step split_sweep python3 -m bench.decode_split_sweep
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels_h200.json"
TAIL=45 step roofline python3 -m bench.decode_roofline --profile --out "$OUT/roofline.json"
