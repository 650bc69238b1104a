#!/usr/bin/env bash
# Session 2 device calls: gemv tests and sweep, GPU parity, decode step breakdown + profile.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step gemv_test python3 -m pytest tests/kernels/test_gemv.py -q -p no:cacheprovider
TAIL=12 step parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=60 step roofline python3 -m bench.decode_roofline --breakdown --profile --out "$OUT/roofline.json"
[ "${GEMV:-0}" = 1 ] && TAIL=16 step gemv_bench python3 -m bench.gemv --sweep --out "$OUT/gemv.json"
exit 0
