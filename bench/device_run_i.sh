#!/usr/bin/env bash
# Session 2: decode attention lets the next kernel launch after its main loop; re-time.
source "$(dirname "$0")/device_common.sh"
TAIL=3 step attn_tests python3 -m pytest tests/kernels/test_decode_attention.py tests/kernels/test_triton_backend.py tests/engine/test_gpu_parity.py -q -p no:cacheprovider
TAIL=26 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
TAIL=8 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
exit 0
