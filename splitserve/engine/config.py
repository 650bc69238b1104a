"""The engine's own configuration (cache, scheduler, dtype); the model's is `model_config`.

Frozen; values discovered at run time (the number of KV blocks, say) make a new object with
`dataclasses.replace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from splitserve.engine.spec_decode.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


DEFAULT_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
"""The KV pool's size on the CPU when `kv_cache_memory_bytes` is not given."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn "float32" / "bfloat16" / "float16" (or a torch dtype) into a torch dtype. ("auto" is
    the platform's call: `platform.default_dtype`.)"""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of {sorted(_DTYPES)}")
        return dtype
    key = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(
        dtype, dtype
    )
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's own settings. Defaults suit the CPU; `LLM(**options)` overrides them.

    The KV pool is sized from a memory budget: `kv_cache_memory_bytes` when given; otherwise on a
    GPU `gpu_memory_utilization` of the card less what is in use once the weights are loaded,
    and on the CPU `DEFAULT_CPU_KV_CACHE_BYTES`. `num_kv_blocks` overrides all of them (tests use
    it to force preemption).
    """

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    # With max_model_len unset: serve at most what the KV pool holds of one sequence when that
    # is less than the model's context, and say so, rather than refuse to start (workers whose
    # context and pool size were both left to their defaults: a 32k context on a CPU's pool).
    fit_max_model_len_to_pool: bool = False
    enable_prefix_caching: bool = True
    # Record prefix-cache insertions/evictions for a registry's prefix index (workers).
    record_prefix_events: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    # Sliding-window layers keep only the blocks their window still covers, in a pool of their
    # own (engine/window_slots.py); False keeps every block for every layer. Its slots are
    # sized with the pool (`num_window_slots`, the null slot included; None: no window pool).
    sliding_window_kv: bool = True
    num_window_slots: int | None = None
    # A host-memory tier of this many bytes (pinned on a GPU host) behind the prefix cache
    # (engine/host_tier.py); None: none. Not with a window pool or tensor parallelism.
    kv_host_cache_bytes: int | None = None
    scheduling_policy: str = "fcfs"
    # "auto": Triton kernels on CUDA, the plain-torch backend elsewhere.
    attention_backend: str = "auto"
    # "safetensors" reads the checkpoint; "dummy" fills random weights of the config's shape
    # (for benchmarks of large shapes without writing their checkpoints).
    load_format: str = "safetensors"
    # FP8 weights (engine/quantization.py): None runs the checkpoint as stored (FP8 if it is);
    # "fp8" quantizes a 16/32-bit one at load; "none" refuses an FP8 checkpoint.
    quantization: str | None = None
    # The KV cache's dtype: "auto" is the model's; "fp8" stores e4m3 (scale 1: values saturate
    # at +-448), half the bytes of bf16 per block, so twice the tokens in the same memory.
    kv_cache_dtype: str = "auto"
    # LoRA (engine/lora/): adapters loaded at start as (name, PEFT directory) pairs; with
    # `enable_lora` (implied by them) more load at run time. `max_loras` device slots (the
    # most distinct adapters in one step), each of rank up to `max_lora_rank`.
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    max_lora_rank: int = 16
    # Stream outputs, text included, every step (services); off (offline `LLM`), `step` returns
    # a request's output once, when it finishes, and its text is decoded then.
    stream_text: bool = True
    # Capture CUDA graphs for decode batches (one per batch-size bucket).
    enable_cuda_graphs: bool = True
    # Launch a plain-greedy decode step before the previous one's tokens reach the host
    # (engine/overlap.py); None turns it on with CUDA graphs.
    async_scheduling: bool | None = None
    # Programmatic dependent launch for the Triton kernels (Hopper and newer; kernels/pdl.py).
    enable_pdl: bool = True
    # Speculative decoding (engine/spec_decode/): None decodes one token per step.
    speculative: SpeculativeConfig | None = None
    # Ranks (processes, one GPU each) the model is sharded over (engine/parallel/): rank 0 is
    # this engine; it starts the others.
    tensor_parallel_size: int = 1
    # Capture decode graphs at TP > 1 too, the collectives inside them (NCCL); False runs TP > 1
    # steps eager (TP=2 decode at batch 1 on H100s: 4.7 ms with graphs, 46.8 ms eager).
    tensor_parallel_cuda_graphs: bool = True
    # All-reduces of up to this many bytes go over peer memory at TP > 1 on GPUs, not NCCL
    # (engine/parallel/peer_all_reduce.py: one-shot up to 1 MiB, two-shot above); 0: NCCL.
    tensor_parallel_peer_all_reduce_bytes: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_lora(self)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_host_cache_bytes is not None and self.kv_host_cache_bytes <= 0:
            raise ValueError("kv_host_cache_bytes must be positive")
        if self.num_window_slots is not None and self.num_window_slots < 2:
            raise ValueError("num_window_slots must be at least 2 (slot 0 is the null slot)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be 'fcfs' or 'priority'")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}")
        if self.quantization not in (None, "none", "fp8"):
            raise ValueError("quantization must be 'none' or 'fp8'")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError("load_format must be 'safetensors' or 'dummy'")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError("max_model_len must be at least 2")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.tensor_parallel_size > 1 and self.quantization == "fp8":
            raise ValueError("quantization 'fp8' is not supported with tensor_parallel_size > 1")

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV pool holds (`kv_cache_dtype`)."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.dtype

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)


MAX_LORA_RANK = 64


def _check_lora(config: EngineConfig) -> None:
    if not 1 <= config.max_lora_rank <= MAX_LORA_RANK:
        raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}]")
    if config.max_loras < 1:
        raise ValueError("max_loras must be at least 1")
    names = [name for name, _ in config.lora_modules]
    if len(set(names)) != len(names) or not all(names):
        raise ValueError(f"lora_modules needs distinct, non-empty names, got {names}")
    if config.lora_enabled and config.quantization == "fp8":
        raise ValueError("LoRA adapters are not supported with quantization 'fp8'")
    if config.lora_enabled and getattr(config, "tensor_parallel_size", 1) > 1:
        raise ValueError("LoRA adapters are not supported with tensor_parallel_size > 1")
