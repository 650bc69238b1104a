"""A GGUF checkpoint turned, once, into an HF-format directory in the user's cache.

`resolve_checkpoint(model)` is what every place that opens a model calls first: for an
HF-format directory it is the identity; for a `.gguf` file (or a directory holding one and no
config.json) it returns a directory under `$XDG_CACHE_HOME/splitserve/gguf/` holding
config.json, model.safetensors (dequantized: float32, float16 where the GGUF stored float16)
and the tokenizer files (tokenizer.json, tokenizer_config.json, chat template) that
transformers builds from the GGUF's metadata (`gguf_tokenizer`, from the metadata read once).
Converting once, rather than reading GGUF in each loader, keeps one loading path: the engine,
its tensor-parallel followers and the torch-free gateway all read the same files, and a second
start costs nothing.

The directory sits below a digest of the source's path, size and modification time (and of
this converter's version), so a changed file is converted again; it is written beside its
final name and renamed into place, so concurrent starts never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from splitserve.engine.gguf_loader import GGUFError, GGUFModel
from splitserve.engine.gguf_tokenizer import write_tokenizer

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when what is written changes: old cache entries are then ignored
SOURCE_FILE = "gguf_source.json"  # written last: a directory without it is incomplete


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """splitserve's cache directory: `$XDG_CACHE_HOME/splitserve` or ~/.cache/splitserve."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitserve"


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names (a `.gguf` file, or a directory with one and no
    config.json), or None for anything else (an HF directory, a missing path)."""
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise GGUFError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(
            f"{str(path)!r} holds several GGUF files ({', '.join(f.name for f in found)}); "
            "name one (split GGUF checkpoints are not supported)"
        )
    return found[0] if found else None


def resolve_checkpoint(model: str | Path, env: Mapping[str, str] | None = None) -> Path:
    """The HF-format directory to load for `model`: converted (once) when it is a GGUF."""
    source = find_gguf(model)
    if source is None:
        return Path(model)
    # NOTE: the directory keeps the name the user gave (a directory's, or the file's stem):
    # services call their model by it (`/v1/models`, metric labels).
    name = source.stem if Path(model).suffix.lower() == ".gguf" else Path(model).resolve().name
    out = cache_root(env) / "gguf" / _digest(source) / name
    if (out / SOURCE_FILE).is_file():
        return out
    log.warning("converting %s to an HF-format checkpoint in %s (once)", source, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        convert_gguf(source, tmp)
        tmp.chmod(0o755)  # NOTE: mkdtemp makes it private; the cache is the user's, readable
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: its copy is the same
            if not (out / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(source: Path, out_dir: Path) -> None:
    """Write the HF-format checkpoint of GGUF file `source` into `out_dir`."""
    from safetensors.numpy import save_file

    model = GGUFModel.open(source)
    if not model.has_tokenizer:
        raise GGUFError(f"{source.name}: no tokenizer in the GGUF metadata")
    (out_dir / "config.json").write_text(json.dumps(model.hf_config, indent=2) + "\n")
    save_file(dict(model.tensors()), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(model.header, model.hf_config["model_type"], out_dir)
    stat = source.stat()
    (out_dir / SOURCE_FILE).write_text(
        json.dumps({"path": str(source.resolve()), "size": stat.st_size,
                    "mtime_ns": stat.st_mtime_ns, "converter": CONVERTER_VERSION}) + "\n"
    )  # fmt: skip


def _digest(source: Path) -> str:
    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]
