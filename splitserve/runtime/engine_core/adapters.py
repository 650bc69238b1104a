"""The engine core's LoRA adapter commands, the same on every worker role: load and unload on
the engine thread, between steps; each answers the adapters the engine then serves."""

from __future__ import annotations

from typing import Any

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.runtime.engine_core.server import Command


def adapter_commands(loop: EngineLoop) -> dict[str, Command]:
    def load(name: str, path: str) -> Any:
        def run(engine: LLMEngine) -> list[str]:
            engine.add_lora(name, path)
            return engine.list_loras()

        return loop.submit(run)

    def unload(name: str) -> Any:
        def run(engine: LLMEngine) -> list[str]:
            engine.remove_lora(name)  # NOTE: refused while a request uses it
            return engine.list_loras()

        return loop.submit(run)

    return {"load_adapter": Command(load), "unload_adapter": Command(unload)}
