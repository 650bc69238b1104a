"""The paged-KV transformer engine shared by prefill and decode workers.

The names below load on first use, so that `splitserve.engine.errors`, `.model_config`,
`.sampling_params` and `.prefix_hash` can be imported (by the gateway) without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm import LLM
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.outputs import CompletionOutput, RequestOutput
    from splitserve.engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "splitserve.engine.llm",
    "CompletionOutput": "splitserve.engine.outputs",
    "EngineConfig": "splitserve.engine.config",
    "LLMEngine": "splitserve.engine.llm_engine",
    "ModelConfig": "splitserve.engine.model_config",
    "RequestOutput": "splitserve.engine.outputs",
    "SamplingParams": "splitserve.engine.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'splitserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
