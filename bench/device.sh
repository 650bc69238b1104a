#!/usr/bin/env bash
# The GPU runner: named steps, each writing its log (and JSON) under $OUT and printing the log's
# tail, its exit status and its seconds. Steps run in the order given; a failing step does not
# stop the next.
#
#   bash bench/device.sh info kernel-tests parity kernels roofline
#   OUT=/tmp/results bash bench/device.sh throughput
#
# Steps:
#   setup           install carried wheels (.whl/*.whl) and an unpacked NIXL (.nixl/site.tgz)
#                   into /tmp, for hosts that can't reach a package index
#   info            versions, GPUs, clocks
#   kernel-tests    tests/kernels on the GPU            parity       engine vs HF in bf16
#   cache-tests     the kernels that read or write the paged KV cache
#   kernels         bench/kernels.py (decode/prefill attention against copy bandwidth)
#   roofline        bench/decode_roofline.py (batch 1 and 8, PDL off and on)
#   throughput      bench/offline_throughput.py (Qwen3-0.6B and Llama-3-8B shapes)
#   gemv            bench/gemv.py against cuBLAS at M = 1
#   kv-transfer     bench/kv_transfer.py between two worker processes (two GPUs)
#   serving         bench/serving.py, disaggregated against colocated (two GPUs)
#   serving4        bench/serving.py on four GPUs, 1P+3D: before/after the engine core process
#   serving-step    one decode worker's serving step at batch 128 and 256 against offline
#   serving-step-1gpu  the same with P and D sharing one GPU
#   serving-step-colocated  the same with one colocated worker on one GPU (its own prefills only)
#   gc-freeze       one shared GPU, 128 streams: serving processes' heap frozen or not
#   relay-merge     one gateway process's relay with a behind stream's messages merged or not
#   structured      bench/structured.py (sampler step, batch 64, half constrained vs free)
#   fp8             FP8 weights and KV cache: GEMV tiles, decode floor, throughput, accuracy
#   fp8-profile     where an FP8 batch-1 decode step's time goes (graph replay, host, kernels)
#   fp8-kv          the FP8 KV cache: its kernel tests, decode attention tiles, the decode step
#   fp8-throughput  offline throughput, FP8 weights and FP8 KV against bf16 (Llama-3-8B shape)
#   http-overhead   bench/http_overhead.py: HTTP vs gRPC per streamed token at the gateway
#   fp8-gemm        bench/fp8_gemm.py: FP8 matmuls at 2-256 rows against bf16 cuBLAS
#   fp8-skinny      the skinny FP8 GEMM: its GPU tests, then its tile sweep at 1-256 rows
#   async           overlapped decode steps: GPU parity, decode step and FP8 throughput, on/off
#   tensor-parallel bench/tensor_parallel.py on two GPUs: TP=2 against TP=1 (< 8 min)
#   tensor-parallel-parity TP=2 float32 greedy tokens against HF on two GPUs, eager and with
#                   the collectives captured in its decode graphs, over NCCL and peer memory
#   all-reduce-latency  bench/all_reduce_latency.py: one all-reduce inside a CUDA graph, NCCL
#                   and peer memory, 8 KiB to 32 MiB (two GPUs)
#   tensor-parallel-serve  a model too big for one GPU served through the gateway by one
#                   colocated worker at TP=2 (two GPUs, < 8 min)
#   serving4-targets issue 26's four-GPU points: 1P+3D at 48 and 60 req/s with the defaults and
#                   with 8192-token prefill steps, 2P+2D (tokens/s per decode GPU); then one
#                   decode worker's serving step (GPUs 0-1) beside the offline step (GPU 2) and
#                   multi-LoRA (GPU 3), in parallel
#   serving2-targets issue 26's points on two GPUs (no four): 1P+1D, 512/512, the rate raised
#                   past TPOT p50 15 ms (tokens/s per decode GPU; the decode worker's ITL tail
#                   against its load), then one all-reduce's latency in a CUDA graph
#   phased          the P:D planner against static splits on the phased workload (four GPUs)
#   singles4        on four GPUs at once: TP=2 bench (GPUs 0-1), speculative decoding (GPU 2),
#                   its GPU tests (GPU 3), TP=2 parity (GPUs 2-3), then a P/D pair at TP=2
#   moe             the fused MoE kernel's GPU tests, bench/moe_layer.py, the decode step of
#                   the Qwen3-30B-A3B shape at batch 1 and 64, bench/moe_offline.py
#   host-tier       the host-memory KV tier: its GPU tests, then bench/host_tier.py (a 32k-token
#                   host hit, the tier's cost, swap)
#   host-tier-working  bench/host_tier.py's working set twice the GPU cache, under load
#   mla             DeepSeek MLA: the absorbed decode kernel's and the latent write's tests (the
#                   real shape on the GPU), V2/V3 under CUDA graphs against HF, then
#                   bench/mla_decode.py (batch 64, 4k contexts, against copy bandwidth) and
#                   bench/mla_prefill.py (the latent path's prefill against per-head attention)
#   mla-sweep       the absorbed decode kernel's launch choices at batch 64 and 16 (4k contexts),
#                   (after the MLA GPU tests), then the DeepSeek-V2-Lite decode step at batch 1
#                   and 64 against its floor and where a batch-1 step's GPU time goes
#   mla-step        the DeepSeek-V2-Lite decode step at batch 1 and 64 against its floor, CUDA
#                   graphs (triton backend) against eager (torch backend)
#   profile-1gpu    splitserve profile --check on one GPU (Llama-3-8B shape, dummy weights, 1P+1D
#                   sharing the GPU): predicted TTFT p90 / TPOT p50 against the measured
#   prefix-reuse    bench/prefix_reuse.py on one GPU (Llama-3.2-1B shape): shared system prompts
#                   over two workers sharing it, then P/D multi-turn TTFT
#   lora            multi-LoRA: the kernels' GPU tests, their cost per decode step (PDL on/off),
#                   then bench/lora.py (decode/prefill with 1, 8, 32 adapters against the base)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# Never use NVLink multicast on a shared host (see docs/benchmarks.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-bench/results}
mkdir -p "$OUT"

run() {  # run NAME TAIL CMD...: CMD's output to $OUT/NAME.log, then its last TAIL lines
  local name=$1 tail=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "$tail" "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

pytest_q() { python3 -m pytest -q -p no:cacheprovider "$@"; }

for step in "$@"; do
  case "$step" in
    setup)
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      fi
      if [ -f .nixl/site.tgz ]; then mkdir -p /tmp/nixl && tar xzf .nixl/site.tgz -C /tmp/nixl; fi
      # NOTE: ahead of the host's own packages: the generated protos need these grpcio/protobuf.
      export PYTHONPATH=.:/tmp/site:/tmp/nixl:$PYTHONPATH
      python3 -c 'import nixl_cu13, crc32c, opentelemetry; print("setup ok")' ;;
    info)
      python3 -c 'import torch, triton, transformers; print("torch", torch.__version__,
"triton", triton.__version__, "transformers", transformers.__version__,
[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
      nvidia-smi topo -m 2>/dev/null | head -5 ;;
    kernel-tests) run kernel_tests 4 pytest_q tests/kernels ;;
    cache-tests)
      run cache_tests 4 pytest_q tests/kernels/test_kv_cache_write.py \
        tests/kernels/test_rotary_write_kv.py tests/kernels/test_decode_attention.py \
        tests/kernels/test_prefill_attention.py tests/kernels/test_triton_backend.py ;;
    parity) run parity 14 pytest_q -s tests/engine/test_gpu_parity.py ;;
    kernels) run kernels 30 python3 -m bench.kernels --out "$OUT/kernels.json" ;;
    roofline) run roofline 12 python3 -m bench.decode_roofline --pdl both --out "$OUT/roofline.json" ;;
    throughput)
      run throughput_qwen3 8 python3 -m bench.offline_throughput --shape qwen3-0.6b \
        --baseline-batches 2 --out "$OUT/throughput_qwen3.json"
      run throughput_llama8b 8 python3 -m bench.offline_throughput --shape llama-3-8b \
        --baseline-batches 1 --out "$OUT/throughput_llama8b.json" ;;
    gemv) run gemv 16 python3 -m bench.gemv --out "$OUT/gemv.json" ;;
    kv-transfer) run kv_transfer 30 python3 -m bench.kv_transfer --out "$OUT/kv_transfer.json" ;;
    serving) run serving 40 python3 -m bench.serving --out "$OUT/serving.json" ;;
    serving4)
      # Four GPUs, 1 prefill + 3 decode, 512/512: the engine loop as a thread of the worker's
      # process with one gateway process (before) against the defaults (after), same host.
      load=(--configs 1P+3D --duration-s 15 --client-processes 8 --timeout-s 300)
      run serving4_before 30 python3 -m bench.serving "${load[@]}" --label before \
        --workloads 512/512@48 --worker-args=--engine-core=thread \
        --gateway-args=--processes=1 --out "$OUT/serving4_before.json"
      run serving4_after 40 python3 -m bench.serving "${load[@]}" --label after \
        --workloads 512/512@48,64 --out "$OUT/serving4_after.json" ;;
    relay)
      run relay 30 python3 -m bench.relay --processes 1,8 --intervals 1,4 --streams 512 \
        --clients 8 --fake-processes 4 --seconds 8 --out "$OUT/relay.json" ;;
    serving-step)
      # One decode worker at a steady batch (closed loop, 512/512) against the offline step.
      for c in 128 256; do
        run "serving_step_$c" 20 python3 -m bench.serving --configs 1P+1D --label "c$c" \
          --workloads 512/512@$((c / 4)) --duration-s 12 --concurrency "$c" \
          --client-processes 8 --timeout-s 300 --out "$OUT/serving_step_$c.json"
      done
      run roofline_768 12 python3 -m bench.decode_roofline --batches 128 256 --context 768 \
        --pdl on --async-scheduling on --out "$OUT/roofline_768.json" ;;
    serving-step-1gpu)
      # The same on one GPU shared by P and D (a host with one GPU): the closed loop's waves
      # of fixed-length streams keep prefill to short bursts between 512-step decode runs.
      for c in 128 256; do
        run "serving_step_1gpu_$c" 20 python3 -m bench.serving --configs "1P+1D one GPU" \
          --label "c$c" --workloads 512/512@$((c / 4)) --duration-s 12 --concurrency "$c" \
          --client-processes 8 --timeout-s 300 --worker-args=--kv-cache-memory-bytes=38000000000 \
          --out "$OUT/serving_step_1gpu_$c.json"
      done
      run roofline_768 12 python3 -m bench.decode_roofline --batches 128 256 --context 768 \
        --pdl on --async-scheduling on --out "$OUT/roofline_768.json" ;;
    serving-step-colocated)
      # One GPU, one colocated worker, closed loop of 512/512 waves: between waves it prefills
      # (its own steps, outside the median), then decodes at the full batch; its median step
      # against the offline step at the same batch and mean context.
      for c in 128 256; do
        run "serving_step_colocated_$c" 24 python3 -m bench.serving --configs "1 colocated" \
          --label "c$c" --workloads 512/512@$((c / 4)) --duration-s 8 --concurrency "$c" \
          --client-processes 8 --timeout-s 300 --out "$OUT/serving_step_colocated_$c.json"
      done
      run roofline_768 12 python3 -m bench.decode_roofline --batches 128 256 --context 768 \
        --pdl on --async-scheduling on --out "$OUT/roofline_768.json" ;;
    gc-freeze)
      # The same closed loop at 128 streams on one shared GPU, the serving processes' start-up
      # heap frozen (the default) and not: ITL and step tails, and each process's collections.
      for f in 0 1; do
        SPLITSERVE_GC_FREEZE=$f SPLITSERVE_LOG_LEVEL=INFO run "gc_freeze_$f" 6 python3 -m \
          bench.serving --configs "1P+1D one GPU" --label "gc-freeze-$f" \
          --workloads 512/512@32 --duration-s 20 --concurrency 128 --client-processes 8 \
          --timeout-s 300 --worker-args=--kv-cache-memory-bytes=38000000000 \
          --out "$OUT/gc_freeze_$f.json"
        grep -h "garbage collection\|steps, mean batch" "$OUT/gc_freeze_$f.log" | cut -c1-220
      done ;;
    relay-merge)
      # One gateway process, one token per worker message, 512 streams: the relay with a behind
      # stream's messages merged (the default) and without, fakes as fast as read and at a
      # 10 ms step.
      for step in 0 10; do
        for m in 0 1; do
          SPLITSERVE_RELAY_MERGE=$m run "relay_step${step}_merge$m" 8 python3 -m bench.relay \
            --processes 1 --intervals 1 --streams 512 --clients 8 --fake-processes 4 \
            --seconds 8 --step-ms "$step" --out "$OUT/relay_step${step}_merge$m.json"
        done
      done ;;
    fp8-profile)
      run roofline_fp8_profile 60 python3 -m bench.decode_roofline --quantization fp8 --pdl on \
        --breakdown --profile --out "$OUT/roofline_fp8_profile.json" ;;
    structured) run structured 12 python3 -m bench.structured --out "$OUT/structured.json" ;;
    fp8)
      run gemv_fp8 16 python3 -m bench.gemv --fp8 --sweep --out "$OUT/gemv_fp8.json"
      run roofline_fp8 10 python3 -m bench.decode_roofline --quantization both --pdl on \
        --out "$OUT/roofline_fp8.json"
      run roofline_fp8_kv 10 python3 -m bench.decode_roofline --quantization fp8 --pdl on \
        --kv-cache-dtype fp8 --out "$OUT/roofline_fp8_kv.json"
      run throughput_fp8 8 python3 -m bench.offline_throughput --shape llama-3-8b \
        --quantization fp8 --kv-cache-dtype fp8 --skip-hf --out "$OUT/throughput_fp8.json"
      run fp8_kv_attention 10 python3 -m bench.fp8_kv_attention --out "$OUT/fp8_kv_attention.json"
      run fp8_accuracy 10 python3 -m bench.fp8_accuracy --out "$OUT/fp8_accuracy.json" ;;
    fp8-kv)
      run fp8_kv_tests 4 pytest_q tests/kernels/test_decode_attention.py \
        tests/kernels/test_rotary_write_kv.py tests/kernels/test_kv_cache_write.py
      run fp8_kv_attention 12 python3 -m bench.fp8_kv_attention --out "$OUT/fp8_kv_attention.json"
      run roofline_fp8_kv 40 python3 -m bench.decode_roofline --quantization fp8 --pdl on \
        --kv-cache-dtype fp8 --breakdown --out "$OUT/roofline_fp8_kv.json" ;;
    fp8-throughput)
      run throughput_fp8 8 python3 -m bench.offline_throughput --shape llama-3-8b \
        --quantization fp8 --kv-cache-dtype fp8 --skip-hf --out "$OUT/throughput_fp8.json" ;;
    http-overhead)
      run http_overhead 16 env SPLITSERVE_KV_TRANSPORT=grpc python3 -m bench.http_overhead \
        --out "$OUT/http_overhead.json" ;;
    fp8-gemm) run fp8_gemm 50 python3 -m bench.fp8_gemm --out "$OUT/fp8_gemm.json" ;;
    fp8-skinny)
      run skinny_tests 4 pytest_q tests/kernels/test_fp8_skinny.py
      run fp8_skinny_sweep 40 python3 -m bench.fp8_gemm --rows 1,8,64,128,256 --sweep \
        --out "$OUT/fp8_skinny_sweep.json" ;;
    async)
      run parity 14 pytest_q -s tests/engine/test_gpu_parity.py
      run roofline_async 16 python3 -m bench.decode_roofline --quantization both --pdl on \
        --async-scheduling both --out "$OUT/roofline_async.json"
      run throughput_async 8 python3 -m bench.offline_throughput --shape llama-3-8b \
        --quantization fp8 --kv-cache-dtype fp8 --skip-hf --out "$OUT/throughput_async.json"
      run throughput_sync 8 python3 -m bench.offline_throughput --shape llama-3-8b \
        --quantization fp8 --kv-cache-dtype fp8 --skip-hf --async-scheduling off \
        --out "$OUT/throughput_sync.json" ;;
    moe-final)
      run moe_tests 4 timeout 60 python3 -m pytest -q -p no:cacheprovider -x \
        tests/kernels/test_fused_moe.py -k "gpu or fp8 or cuda_graph"
      run moe_layer_pdl 8 timeout 90 python3 -m bench.moe_layer --pdl --out "$OUT/moe_layer_pdl.json"
      run moe_roofline 40 timeout 200 python3 -m bench.decode_roofline --shape qwen3-30b-a3b \
        --batches 1 64 --context 1024 --pdl on --async-scheduling on --profile \
        --out "$OUT/moe_roofline.json"
      run moe_sweep 40 timeout 100 python3 -m bench.moe_layer --sweep --tokens 1,64 --layers 3 \
        --out "$OUT/moe_sweep.json" ;;
    moe-sweep)
      run moe_sweep 60 timeout 420 python3 -m bench.moe_layer --sweep --layers 3 \
        --out "$OUT/moe_sweep.json" ;;
    moe-step)
      run moe_roofline 8 timeout 220 python3 -m bench.decode_roofline --shape qwen3-30b-a3b \
        --batches 1 64 --context 1024 --pdl on --async-scheduling on \
        --out "$OUT/moe_roofline.json"
      run moe_offline 8 timeout 150 python3 -m bench.moe_offline --out "$OUT/moe_offline.json" ;;
    moe)
      # Mixture-of-Experts: the fused kernel's GPU tests, one layer against the copy floor
      # (Qwen3-30B-A3B shape), the whole decode step at batch 1 and 64, offline fused vs loop.
      run moe_tests 4 pytest_q tests/kernels/test_fused_moe.py
      run moe_layer 16 timeout 150 python3 -m bench.moe_layer --out "$OUT/moe_layer.json"
      run moe_roofline 8 timeout 220 python3 -m bench.decode_roofline --shape qwen3-30b-a3b \
        --batches 1 64 --context 1024 --pdl on --async-scheduling on \
        --out "$OUT/moe_roofline.json"
      run moe_offline 8 timeout 150 python3 -m bench.moe_offline --out "$OUT/moe_offline.json" ;;
    host-tier)
      run host_tier_tests 6 pytest_q tests/engine/test_gpu_host_tier.py
      run host_tier 40 timeout 420 python3 -m bench.host_tier --sections hit tpot swap \
        --out "$OUT/host_tier.json" ;;
    host-tier-working)
      run host_tier_working 40 timeout 540 python3 -m bench.host_tier --sections working \
        --out "$OUT/host_tier_working.json" ;;
    mla)
      run mla_tests 4 pytest_q tests/kernels/test_mla_decode.py tests/kernels/test_latent_write.py \
        tests/engine/test_gpu_parity.py -k "deepseek or mla or latent"
      run mla_decode 20 timeout 300 python3 -m bench.mla_decode --out "$OUT/mla_decode.json"
      run mla_prefill 8 timeout 150 python3 -m bench.mla_prefill --out "$OUT/mla_prefill.json" ;;
    mla-sweep)
      run mla_gpu_tests 4 pytest_q tests/kernels/test_mla_decode.py tests/kernels/test_mla_query.py \
        tests/kernels/test_latent_write.py tests/engine/test_gpu_parity.py -k "deepseek or mla or latent or rope"
      run mla_sweep 60 timeout 300 python3 -m bench.mla_decode --sweep --out "$OUT/mla_sweep.json"
      run mla_profile 40 timeout 200 python3 -m bench.decode_roofline --shape deepseek-v2-lite \
        --batches 1 64 --context 1024 --pdl on --async-scheduling on --profile \
        --out "$OUT/mla_profile.json" ;;
    mla-step)
      run mla_step 12 timeout 560 python3 -m bench.decode_roofline --shape deepseek-v2-lite \
        --batches 1 64 --context 1024 --pdl on --async-scheduling on \
        --attention-backends triton torch --out "$OUT/mla_step.json" ;;
    profile-1gpu)
      python3 -c 'from pathlib import Path; from bench.common import model_dir; model_dir("llama-3-8b", Path("/tmp/shapes"))'
      run profile_1gpu 40 timeout 580 python3 -m splitserve.cli profile --model /tmp/shapes/llama-3-8b \
        --load-format dummy --device cuda --max-model-len 8192 --prefill-lens 512 1024 2048 4096 \
        --decode-batches 1 8 32 64 128 --decode-contexts 1024 2048 --gpus 2 --request-rate 4 \
        --input-len 1024 --output-len 256 --range-ratio 0.5 --ttft-ms 1000 --tpot-ms 40 --check \
        --check-num-prompts 120 --no-plot --result-filename "$OUT/profile_1gpu.json" ;;
    prefix-reuse)
      run prefix_reuse 30 timeout 580 python3 -m bench.prefix_reuse --device cuda:0 \
        --concurrency 64 --out "$OUT/prefix_reuse.json" ;;
    lora)
      run lora_tests 4 pytest_q tests/kernels/test_lora.py
      run lora_kernels 8 python3 -m bench.lora_kernels --out "$OUT/lora_kernels.json"
      run lora_kernels_nopdl 8 python3 -m bench.lora_kernels --no-pdl \
        --out "$OUT/lora_kernels_nopdl.json"
      run lora 10 python3 -m bench.lora --out "$OUT/lora.json" ;;
    tensor-parallel)
      run tensor_parallel 40 python3 -m bench.tensor_parallel --tp 2 \
        --out "$OUT/tensor_parallel.json" ;;
    tensor-parallel-parity)
      run tensor_parallel_parity 8 pytest_q -s tests/engine/test_gpu_tp_parity.py ;;
    all-reduce-latency)
      run all_reduce_latency 10 python3 -m bench.all_reduce_latency \
        --out "$OUT/all_reduce_latency.json" ;;
    tensor-parallel-serve)
      run tensor_parallel_serve 16 python3 -m bench.tensor_parallel --serve --prefill 0 \
        --decode-tp 2 --out "$OUT/tensor_parallel_serve.json" ;;
    serving4-targets)
      load=(--duration-s 15 --client-processes 8 --timeout-s 300)
      run serving4_1p3d 14 python3 -m bench.serving --configs 1P+3D "${load[@]}" \
        --workloads 512/512@48,60 --out "$OUT/serving4_1p3d.json"
      run serving4_1p3d_p8k 14 python3 -m bench.serving --configs 1P+3D "${load[@]}" \
        --label p8k --workloads 512/512@60,68 --worker-args=--max-num-batched-tokens=8192 \
        --out "$OUT/serving4_1p3d_p8k.json"
      run serving4_2p2d 14 python3 -m bench.serving --configs 2P+2D "${load[@]}" \
        --workloads 512/512@44,52 --out "$OUT/serving4_2p2d.json"
      (export CUDA_VISIBLE_DEVICES=2
       run roofline_768 12 python3 -m bench.decode_roofline --batches 128 256 --context 768 \
         --pdl on --async-scheduling on --out "$OUT/roofline_768.json"
       run spec_gpu_tests 6 pytest_q tests/engine/test_spec_decode_gpu.py) &
      (export CUDA_VISIBLE_DEVICES=3
       run lora_tests 4 pytest_q tests/kernels/test_lora.py
       run lora_kernels 8 python3 -m bench.lora_kernels --out "$OUT/lora_kernels.json"
       run lora 10 python3 -m bench.lora --out "$OUT/lora.json") &
      for c in 128 256; do
        CUDA_VISIBLE_DEVICES=0,1 run "serving_step_$c" 20 python3 -m bench.serving \
          --configs 1P+1D --label "c$c" --workloads 512/512@$((c / 4)) --duration-s 12 \
          --concurrency "$c" --client-processes 8 --timeout-s 300 --out "$OUT/serving_step_$c.json"
      done
      wait ;;
    serving2-targets)
      run serving2_1p1d 20 python3 -m bench.serving --configs 1P+1D --duration-s 15 \
        --client-processes 8 --timeout-s 120 --workloads 512/512@16,24,32,40 \
        --out "$OUT/serving2_1p1d.json"
      run all_reduce_latency 10 python3 -m bench.all_reduce_latency \
        --out "$OUT/all_reduce_latency.json" ;;
    round2)
      run serving4_1p3d 14 python3 -m bench.serving --configs 1P+3D --duration-s 15 \
        --client-processes 8 --timeout-s 120 --workloads 512/512@48 --out "$OUT/serving4_1p3d.json"
      (export CUDA_VISIBLE_DEVICES=0,1
       run tensor_parallel 40 python3 -m bench.tensor_parallel --tp 2 --prompt-lens 4096 \
         --batches 1 --time-budget-s 270 --out "$OUT/tensor_parallel.json") &
      (export CUDA_VISIBLE_DEVICES=2
       run speculative 40 python3 -m bench.speculative --batches 1 128 --k 4 \
         --draft-layers 2 --corrupt 0 1 --real-model none --out "$OUT/speculative.json") &
      (export CUDA_VISIBLE_DEVICES=3
       run lora 10 python3 -m bench.lora --out "$OUT/lora.json") &
      wait
      run serving4_2p2d 14 python3 -m bench.serving --configs 2P+2D --duration-s 15 \
        --client-processes 8 --timeout-s 120 --workloads 512/512@52 --out "$OUT/serving4_2p2d.json" ;;
    phased)
      run phased 60 python3 -m bench.serving --phased --split-configs planner 1P+3D 2P+2D \
        "4 colocated" 3P+1D --phase-s 20 --gateways 4 --client-processes 8 --timeout-s 30 \
        --out "$OUT/phased.json" ;;
    singles4)
      (export CUDA_VISIBLE_DEVICES=0,1
       run tensor_parallel 40 python3 -m bench.tensor_parallel --tp 2 --prompt-lens 4096 \
         --batches 1 64 --time-budget-s 300 --out "$OUT/tensor_parallel.json") &
      (export CUDA_VISIBLE_DEVICES=2
       run speculative 40 python3 -m bench.speculative --batches 1 8 128 --k 4 \
         --draft-layers 2 --corrupt 0 0.3 1 --real-model none --out "$OUT/speculative.json") &
      (export CUDA_VISIBLE_DEVICES=3
       run spec_gpu_tests 6 pytest_q tests/engine/test_spec_decode_gpu.py) &
      wait
      CUDA_VISIBLE_DEVICES=0,1 run tensor_parallel_parity 8 pytest_q -s tests/engine/test_gpu_tp_parity.py
      run tensor_parallel_serve 16 python3 -m bench.tensor_parallel --serve --prefill-tp 2 \
        --decode-tp 2 --out "$OUT/tensor_parallel_serve.json" ;;
    *) echo "unknown step: $step" >&2 ;;
  esac
done
