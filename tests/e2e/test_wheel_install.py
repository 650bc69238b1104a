"""The built wheel, installed (not editable) in a new virtual environment made without site
packages, starts the whole stack and answers: what `pip install .` puts on a user's machine is
enough, and nothing of the repository's source tree is needed beside it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from splitserve.launch.ports import free_port

pytestmark = pytest.mark.slow


def _venv_with_the_wheel(tmp_path: Path, wheel: Path) -> Path:
    """A new venv holding the wheel. NOTE: its dependencies are this test run's own, reached
    through a path file (a plain path line: no `.pth` in that folder runs, so our editable
    install's import hook stays out), so nothing is downloaded again; splitserve itself comes
    only from the wheel."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "borrowed_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return venv


def test_the_installed_wheel_starts_the_stack_and_answers(tiny_models, built_wheel, tmp_path):
    venv = _venv_with_the_wheel(tmp_path, built_wheel)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import splitserve; print(splitserve.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    port = free_port("127.0.0.1")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PYTHONUNBUFFERED": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    up = subprocess.Popen(
        [str(venv / "bin" / "splitserve"), "up", "--port", str(port),
         "--model", str(tiny_models["llama"])],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        assert up.stdout is not None
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, f"splitserve up exited early: {''.join(lines)}"
            lines.append(line)
            if "is serving on" in line:
                break
        assert "is serving on" in lines[-1], "".join(lines)
        answer = subprocess.run(
            [str(venv / "bin" / "splitserve"), "generate", "Hello", "--raw",
             "--address", f"127.0.0.1:{port}", "--max-tokens", "4"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        counts = re.search(r"\[(\d+) prompt \+ (\d+) generated tokens", answer.stderr)
        assert counts and int(counts[2]) > 0, answer.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            rest, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            rest, _ = up.communicate()
    assert up.returncode == 0, "".join(lines) + rest
