#!/usr/bin/env bash
# One device call: GPU kernel tests, engine-vs-HF bf16 parity, kernel and roofline benchmarks.
# Usage on the device machine: bash bench/device_checks.sh   (writes logs and JSON under $OUT)
TAIL=${TAIL:-12}
source "$(dirname "$0")/device_common.sh"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
step kernel_tests python3 -m pytest tests/kernels -q -x -p no:cacheprovider
step gpu_parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
