#!/usr/bin/env bash
# Session 2: GPU kernel tests (PDL on), GPU parity, decode roofline PDL off/on + breakdown, gemv.
source "$(dirname "$0")/device_common.sh"
TAIL=4 step kernel_tests python3 -m pytest tests/kernels -q -x -p no:cacheprovider
TAIL=12 step parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=45 step roofline python3 -m bench.decode_roofline --breakdown --profile --out "$OUT/roofline.json"
TAIL=16 step gemv_bench python3 -m bench.gemv --out "$OUT/gemv.json"
exit 0
