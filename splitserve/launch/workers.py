"""What prefill and decode workers' cores share at start-up: their engine, from the worker's
settings (what they tell the registry is `worker_record.py`, in the front)."""

from __future__ import annotations

import dataclasses

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.platform import resolve_device, resolve_dtype
from splitserve.engine.spec_decode.config import SpeculativeConfig
from splitserve.runtime.settings import ServiceSettings, WorkerSettings


def engine_config(
    worker: WorkerSettings, record_prefix_events: bool = False, checkpoint_dtype: str | None = None
) -> EngineConfig:
    """The engine settings a worker's flags (or SPLITSERVE_* variables) ask for; `--dtype auto`
    follows the checkpoint's `checkpoint_dtype`."""
    device = resolve_device(worker.device)
    return EngineConfig(
        record_prefix_events=record_prefix_events,
        dtype=resolve_dtype(worker.dtype, device, checkpoint_dtype),
        device=device,
        block_size=worker.block_size,
        num_kv_blocks=worker.num_kv_blocks,
        kv_cache_memory_bytes=worker.kv_cache_memory_bytes,
        kv_host_cache_bytes=(
            int(worker.kv_host_cache_gb * 2**30) if worker.kv_host_cache_gb else None
        ),
        gpu_memory_utilization=worker.gpu_memory_utilization,
        max_model_len=worker.max_model_len,
        # NOTE: only where neither the context nor the pool was asked for: sizes the user set
        # that do not fit each other stay an error at start (build_engine)
        fit_max_model_len_to_pool=worker.max_model_len is None
        and worker.num_kv_blocks is None
        and worker.kv_cache_memory_bytes is None,
        max_num_batched_tokens=worker.max_num_batched_tokens,
        max_num_seqs=worker.max_num_seqs,
        # NOTE: sliding layers' KV in a window pool (engine/window_slots.py): a prefill's push
        # and a stream's hand-off carry it (a sliding layer's window only). Not beside the
        # host tier, which saves and loads whole blocks of the one pool (engine/host_tier.py):
        # a worker with one keeps every block.
        sliding_window_kv=not worker.kv_host_cache_gb,
        enable_pdl=worker.pdl,
        load_format=worker.load_format,
        quantization=None if worker.quantization == "auto" else worker.quantization,
        kv_cache_dtype=worker.kv_cache_dtype,
        speculative=speculative_config(worker),
        tensor_parallel_size=worker.tensor_parallel_size,
        async_scheduling=_async_scheduling(worker.async_scheduling),
        enable_lora=worker.enable_lora,
        lora_modules=lora_modules(worker.lora_modules),
        max_loras=worker.max_loras,
        max_lora_rank=worker.max_lora_rank,
    )


def lora_modules(text: str) -> tuple[tuple[str, str], ...]:
    """`--lora-modules`: name=DIR entries separated by commas or whitespace."""
    entries = [e for e in text.replace(",", " ").split() if e]
    bad = [e for e in entries if "=" not in e or not e.split("=", 1)[0] or not e.split("=", 1)[1]]
    if bad:
        raise ValueError(f"--lora-modules takes name=DIR entries, got {bad[:3]}")
    return tuple((e.split("=", 1)[0], e.split("=", 1)[1]) for e in entries)


def speculative_config(worker: WorkerSettings) -> SpeculativeConfig | None:
    """`--speculative-method` and its companions (None: no speculation)."""
    if not worker.speculative_method:
        return None
    spec = SpeculativeConfig(
        worker.speculative_method,
        num_speculative_tokens=worker.num_speculative_tokens,
        model=worker.speculative_model or None,
        draft_layers=worker.speculative_draft_layers or None,
    )
    catch_up = worker.speculative_draft_catch_up_tokens
    if catch_up:  # NOTE: 0 keeps the engine's default
        spec = dataclasses.replace(spec, draft_catch_up_tokens=catch_up)
    return spec


def _async_scheduling(text: str) -> bool | None:
    """`--async-scheduling`: auto (None: on with CUDA graphs), on or off."""
    choices = {"auto": None, "on": True, "off": False}
    if text not in choices:
        raise ValueError(f"--async-scheduling must be one of auto, on, off, got {text!r}")
    return choices[text]


def build_engine(
    service: ServiceSettings, worker: WorkerSettings, record_prefix_events: bool = False
) -> LLMEngine:
    """The worker's engine; a KV pool too small for one sequence of the full context is an
    error at start (a worker would otherwise refuse long requests only when they come). What an
    MLA model (DeepSeek-V2/V3) cannot run with yet (TP, speculation, an FP8 KV cache, LoRA) is
    refused by name (engine/mla.py `check_engine`)."""
    model = ModelConfig.from_pretrained(service.model)
    config = engine_config(worker, record_prefix_events, model.torch_dtype)
    engine = LLMEngine(service.model, config)
    config = engine.config
    assert config.num_kv_blocks is not None
    need = config.blocks_for(engine.max_model_len)
    if config.num_kv_blocks < need:
        raise ValueError(
            f"the KV pool holds {config.num_kv_blocks} blocks "
            f"({config.num_kv_blocks * config.block_size} tokens) but one sequence of "
            f"max_model_len {engine.max_model_len} needs {need}: lower --max-model-len, or give "
            "the cache more memory (--gpu-memory-utilization, --kv-cache-memory-bytes, "
            "--num-kv-blocks)"
        )
    return engine
