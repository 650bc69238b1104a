#!/usr/bin/env bash
# Session 2: one rotary kernel (WRITE_KV switch) instead of two; GPU tests and the roofline.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step rotary_tests python3 -m pytest tests/kernels/test_rotary.py tests/kernels/test_rotary_write_kv.py tests/kernels/test_triton_backend.py tests/kernels/test_pdl.py -q -p no:cacheprovider
TAIL=6 step parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=8 step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
exit 0
