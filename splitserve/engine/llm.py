"""The offline API: `LLM(model=DIR).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any

from tqdm import tqdm

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine, Prompt
from splitserve.engine.lora.request import LoRARequest
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.platform import resolve_device, resolve_dtype
from splitserve.engine.sampling_params import SamplingParams

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}
LoRA = LoRARequest | str


class LLM:
    """Generate completions for a batch of prompts with continuous batching.

    `dtype` "auto" is the checkpoint's torch_dtype (float16/bfloat16; otherwise bfloat16 on a
    GPU and float32 on the CPU); `device` "auto" is the GPU when
    there is one. `options` are `EngineConfig` fields (block_size, max_num_batched_tokens,
    num_kv_blocks, enable_prefix_caching, …); an unknown option is an error, not ignored.
    """

    def __init__(
        self, model: str | Path, dtype: str = "auto", device: str = "auto", **options: Any
    ) -> None:
        unknown = sorted(set(options) - _ENGINE_OPTIONS)
        if unknown:
            raise ValueError(f"unknown LLM option(s) {unknown}; valid: {sorted(_ENGINE_OPTIONS)}")
        device = resolve_device(device)
        options.setdefault("stream_text", False)  # nothing streams: decode text once, at the end
        checkpoint_dtype = ModelConfig.from_pretrained(model).torch_dtype
        config = EngineConfig(
            dtype=resolve_dtype(dtype, device, checkpoint_dtype), device=device, **options
        )
        self.engine = LLMEngine(model, config)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults applied."""
        defaults: dict[str, Any] = dict(self.engine.model_config.generation_defaults)
        return SamplingParams(**defaults)

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: SequenceABC[int] | None = None,
        lora_request: LoRA | SequenceABC[LoRA] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. A prompt is a string or a list of token ids.

        `lora_request` is the LoRA adapter (a `LoRARequest` or its name; None: the base model)
        for every prompt, or a list with one per prompt, as in vLLM.

        Every prompt is validated before any is queued, so a bad one raises ValueError (an
        unknown adapter LookupError) and nothing runs.
        """
        batch = _as_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.default_sampling_params()] * len(batch)
        else:
            params_list = list(sampling_params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(batch)
        if lora_request is None or isinstance(lora_request, LoRARequest | str):
            loras: list[LoRA | None] = [lora_request] * len(batch)
        else:
            loras = list(lora_request)
        if len(loras) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(loras)} LoRA requests")
        engine = self.engine
        ids = []
        try:
            for prompt, params, prio, lora in zip(
                batch, params_list, priorities, loras, strict=True
            ):
                ids.append(engine.add_request(prompt, params, priority=prio, lora_request=lora))
        except (ValueError, LookupError):
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        finally:
            bar.close()
        return [finished[request_id] for request_id in ids]


def _as_batch(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single token-id prompt
    return items
