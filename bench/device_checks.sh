#!/usr/bin/env bash
# One device call: GPU kernel tests, engine-vs-HF bf16 parity, kernel and roofline benchmarks.
# Usage on the device machine: bash bench/device_checks.sh   (writes logs and JSON under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-12}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
step kernel_tests python3 -m pytest tests/kernels -q -x -p no:cacheprovider
step gpu_parity python3 -m pytest tests/engine/test_gpu_parity.py -q -s -p no:cacheprovider
TAIL=30 step kernels_bench python3 -m bench.kernels --out "$OUT/kernels.json"
step roofline python3 -m bench.decode_roofline --out "$OUT/roofline.json"
