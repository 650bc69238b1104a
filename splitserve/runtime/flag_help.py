"""`--help` text of the flags made from the settings dataclasses (settings.add_flags).

One line per field name (`ServiceSettings`, `WorkerSettings`, `GatewaySettings` share one
table: a name means the same thing wherever it appears). tests/unit/test_cli_help.py walks every
`splitserve` command's flags and fails on one without help, so a new field needs a line here.
"""

from __future__ import annotations

_HELP = {
    # ServiceSettings
    "model": "the model to serve: an HF checkpoint directory, a .gguf file, 'tiny' or a model's "
    "name (as `splitserve up --model`)",
    "redis_url": "the registry's Redis, redis://host:port[/db] (required)",
    "host": "the address this service binds",
    "port": "the gRPC port (0: a free one)",
    "worker_id": "this service's id in the registry (default: <kind>-<host>-<random>)",
    "advertise_host": "the host others use to reach this one (default: --host)",
    "model_name": "the served model's name (default: the model directory's name)",
    "metrics_port": "serve Prometheus /metrics on this port (0: off)",
    "metrics_host": "address /metrics listens on (default: --host); off loopback it asks for "
    "the cluster secret as a bearer token",
    "drain_timeout_s": "on SIGTERM: seconds to wait for the requests in flight",
    "registry_retry_s": "seconds a registry call retries while Redis is unreachable",
    # WorkerSettings
    "dtype": "weights' and activations' dtype: auto (bfloat16 on a GPU, float32 on the CPU), "
    "bfloat16, float16, float32",
    "device": "where the engine runs: auto (the GPU when there is one), cpu, cuda, cuda:N",
    "block_size": "tokens per KV cache block (every worker and the gateway must agree)",
    "num_kv_blocks": "KV cache blocks (default: from --kv-cache-memory-bytes or "
    "--gpu-memory-utilization)",
    "kv_host_cache_gb": "GiB of pinned host memory for a second KV tier behind the prefix "
    "cache: blocks evicted from the GPU come back from it instead of being recomputed "
    "(default: none; at most nine tenths of the memory the host has available)",
    "kv_cache_memory_bytes": "the KV pool's bytes (default: GPU by --gpu-memory-utilization, "
    "CPU 512 MiB)",
    "gpu_memory_utilization": "share of the GPU's memory the worker may use, 0 to 1",
    "max_model_len": "context length served (default: the model's own)",
    "max_num_batched_tokens": "tokens one engine step computes at most",
    "max_num_seqs": "sequences one engine step holds at most",
    "lease_s": "seconds a reservation is held for a request that has not come",
    "heartbeat_ttl_s": "seconds the registry keeps this worker without a heartbeat",
    "engine_stall_s": "seconds the engine loop may go without a turn before the worker leaves "
    "the registry (at least; 3 times its recent longest wait if that is longer)",
    "pdl": "programmatic dependent launch in the GPU kernels (true/false)",
    "async_scheduling": "overlapped decode steps: auto (on with CUDA graphs), on, off",
    "kv_transport": "how KV moves between workers: auto, nixl, grpc",
    "kv_port": "a decode worker's gRPC KV receiver port (0: a free one)",
    "load_format": "safetensors (read the checkpoint) or dummy (random weights of its shape)",
    "quantization": "auto (the checkpoint as stored) or fp8 (quantize the weights at load)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8; every worker must agree",
    "tensor_parallel_size": "GPUs (one engine process each) the model is sharded over: "
    "--device's and the next N-1 (gloo processes on the CPU)",
    "max_reservations_per_caller": "a decode worker's reservations per client (0: no limit)",
    "engine_core": "where the engine loop runs: process (its own) or thread (the worker's)",
    "stream_interval": "new tokens per stream message at least (1: as they come)",
    "stream_interval_ms": "milliseconds between a stream's messages at least (0: as they come)",
    "decode_many": "one call per decode worker carries every stream to it, a message per engine "
    "step (true, the default; false: a call per stream)",
    "speculative_method": "speculative decoding: ngram or draft (empty: off)",
    "num_speculative_tokens": "tokens proposed per sequence per step at most",
    "speculative_model": "--speculative-method draft: the draft checkpoint's directory",
    "speculative_draft_layers": "--speculative-method draft without --speculative-model: the "
    "target's first k layers draft",
    "speculative_draft_catch_up_tokens": "a draft checkpoint's catch-up per step on KV it did "
    "not compute (an admitted prompt, a prefix hit); its sequence decodes plainly meanwhile "
    "(0: the engine's default)",
    "enable_lora": "serve LoRA adapters (implied by --lora-modules): loadable at run time",
    "lora_modules": "PEFT adapters loaded at start: name=DIR entries, separated by commas or "
    "spaces",
    "max_loras": "LoRA adapters on the device at once (the most distinct adapters in one step)",
    "max_lora_rank": "the largest LoRA rank served (1 to 64)",
    # GatewaySettings
    "max_inflight": "requests in flight at once; more are refused (RESOURCE_EXHAUSTED / 429)",
    "max_inflight_per_key": "requests one API key may have in flight (0: no own limit)",
    "max_tokens_per_minute_per_key": "tokens one API key may ask for per minute (0: no limit)",
    "local_prefill_tokens": "prompts up to this many tokens prefill on the decode worker",
    "routing_policy": "how workers are picked: least-loaded-prefix (the least loaded, by cached "
    "prefix)",
    "host_block_weight": "what a cached prompt block in a worker's host-memory KV tier counts "
    "for in routing, 0 to 1 (one on its GPU: 1)",
    "tool_call_parser": "how tool calls are read from the model's text (HTTP API): auto "
    "(from the chat template), hermes, json",
    "request_timeout_s": "seconds a request may take before it fails DEADLINE_EXCEEDED",
    "max_prefill_tokens_per_worker": "prompt tokens given to one prefill worker at once",
    "rpc_timeout_s": "deadline of the calls a healthy worker answers at once (Abort)",
    "reserve_timeout_s": "deadline of a Reserve (at least; 3 times the worker's recent longest "
    "wait if that is longer); a decode worker that misses it is suspect and another is asked",
    "reserve_hedge_s": "seconds after which an unanswered Reserve is also sent to another "
    "decode worker, the first answer winning (0: no hedge); a floor: twice the worker's recent "
    "peak Reserve answer when longer, at most 1 s",
    "stall_timeout_s": "seconds of silence (at least; paced as --reserve-timeout-s) after which "
    "a Decode stream's worker is checked; gone from the registry, the stream moves elsewhere",
    "suspect_s": "seconds a worker that missed a deadline gets no new requests (unless it "
    "answers a Reserve in time)",
    "max_migrations": "how often one stream may move to another decode worker",
    "http_port": "serve the OpenAI-compatible HTTP API on this port too (0: off)",
    "processes": "gateway processes sharing the ports (0: sized to the host)",
}


def flag_help(name: str) -> str:
    """The help text of the flag made from settings field `name` ("" if it has none)."""
    return _HELP.get(name, "")
