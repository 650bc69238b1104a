"""Shared fixtures: tiny random-weight checkpoints built locally, and HF reference outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.fixture(autouse=True)
def _single_thread_determinism() -> None:
    torch.manual_seed(0)
