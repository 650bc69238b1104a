"""The README's serving command and examples, run as a user would: `splitserve up` as a real
process on the default model (SmolLM2-135M-Instruct, already in the cache the `smollm2` fixture
filled, as on a second start), the README's Python client, `splitserve generate` printing the
README's answer, and a clean shutdown on Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.launch.up import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _readme_block(marker: str, lang: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```{lang}\n(.*?)```", text, re.S)
    assert match, f"README has no {marker} block"
    return match.group(1)


def test_up_serves_readme_client_and_generate_then_stops_cleanly(smollm2):
    up_command = _readme_block("up-command", "bash").strip()
    assert up_command.endswith("splitserve up --port 50051")
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    env = {**os.environ, **smollm2.env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "up", "--port", str(port)]
        + ["--http-port", str(http_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines = []
    try:
        deadline = time.monotonic() + 180
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"splitserve up exited early: {''.join(lines)}"
            lines.append(line)
            if "is serving on" in line:
                break
        banner = lines[-1]
        # NOTE: the lines after the banner are read here too: communicate() below reads the
        # pipe itself, past what readline() has already buffered.
        while "OpenAI-compatible API" not in lines[-1]:
            line = proc.stdout.readline()
            assert line, f"splitserve up exited early: {''.join(lines)}"
            lines.append(line)
        assert f"127.0.0.1:{port}" in banner
        assert "(model " in banner and "SmolLM2-135M-Instruct," in banner, banner

        client = _readme_block("client-example", "python").replace(
            "127.0.0.1:50051", f"127.0.0.1:{port}"
        )
        ran = subprocess.run(
            [sys.executable, "-c", client], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert ran.returncode == 0, ran.stderr
        assert "completion_tokens: 32" in ran.stdout

        command = shlex.split(_readme_block("generate-example", "bash").strip())
        assert command[:2] == ["splitserve", "generate"]
        command[command.index("--address") + 1] = f"127.0.0.1:{port}"
        gen = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", *command[1:]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        answer, counts = _readme_block("generate-output", "text").strip().splitlines()
        assert gen.stdout.strip() == answer  # the README shows the real answer …
        assert gen.stderr.strip() == counts  # … and what it printed on stderr

        http = _readme_block("http-example", "python").replace(
            "127.0.0.1:8000", f"127.0.0.1:{http_port}"
        )
        ran = subprocess.run(
            [sys.executable, "-c", http], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip(), "the streamed completion is empty"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopped" in out
    # on loopback it serves without a key and says so; its Redis's password is masked
    said = "".join(lines)
    assert "no API key" in said and "redis://:***@" in banner, said
