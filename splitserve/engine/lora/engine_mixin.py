"""The engine's LoRA adapter API (`LLMEngine` inherits it): start the manager, resolve a
request's adapter, load and unload adapters at run time.

Kept apart from `engine/llm_engine.py` so the engine's step loop stays readable; it reads the
engine's model, platform, reservations and request states, and writes nothing but `lora`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import FailedPrecondition, InvalidRequest, NotFound
from splitserve.engine.lora.manager import LoRAConfig, LoRAManager
from splitserve.engine.lora.request import LoRARequest, check_adapter_name

if TYPE_CHECKING:
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.output_processor import OutputProcessor
    from splitserve.engine.platform import Platform
    from splitserve.engine.sequence import Sequence


class LoRAEngineMixin:
    """LoRA methods of `LLMEngine`; `lora` is None when the engine serves no adapters."""

    lora: LoRAManager | None
    model: Any
    model_config: ModelConfig
    platform: Platform
    outputs: OutputProcessor
    _reserved: dict[str, Sequence]

    def _start_lora(self, config: EngineConfig) -> LoRAManager | None:
        if not config.lora_enabled:
            return None
        lora_config = LoRAConfig(config.max_loras, config.max_lora_rank)
        manager = LoRAManager(self.model_config, lora_config, config.dtype, self.platform.device)
        manager.attach(self.model)
        for name, path in config.lora_modules:
            manager.load(name, path)
        return manager

    def _resolve_lora(self, request: LoRARequest | str | None) -> tuple[str | None, bytes | None]:
        """(adapter name, prefix-cache root) of a request's adapter, loading it first if the
        request names a path; (None, None) for the base model."""
        if request is None:
            return None, None
        if isinstance(request, str):
            request = LoRARequest(request)
        if self.lora is None:
            raise InvalidRequest(
                f"LoRA adapter {request.lora_name!r} requested, but this engine serves no "
                "adapters (start it with --enable-lora or --lora-modules)"
            )
        if request.lora_path is not None and request.lora_name not in self.lora.adapters:
            self.lora.load(request.lora_name, request.lora_path)
        return request.lora_name, self.lora.prefix_root(request.lora_name)

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter at run time (into host memory; it takes a device slot when a
        step first uses it)."""
        if self.lora is None:
            raise InvalidRequest(
                "this engine serves no LoRA adapters (start it with --enable-lora)"
            )
        self.lora.load(check_adapter_name(name), path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter. Refused (FailedPrecondition) while a request still uses it: no
        request in flight fails because of an unload."""
        if self.lora is None or name not in self.lora.adapters:
            raise NotFound(f"LoRA adapter {name!r} is not loaded")
        using = [
            seq.request_id
            for seq in itertools.chain(
                self._reserved.values(),
                (s for state in self.outputs.requests.values() for s in state.sequences),
            )
            if seq.lora_name == name and not seq.is_finished
        ]
        if using:
            raise FailedPrecondition(
                f"LoRA adapter {name!r} is in use by {len(set(using))} request(s); unload it "
                "when they finish"
            )
        self.lora.unload(name)

    def list_loras(self) -> list[str]:
        """Names of the adapters this engine serves."""
        return [] if self.lora is None else self.lora.names()
