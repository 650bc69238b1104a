"""The .proto sources follow the project's rules and the generated code is current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "splitserve" / "protos" / "v1").glob("*.proto"))


def test_generated_code_is_up_to_date():
    run = subprocess.run(
        [sys.executable, "-m", "splitserve.protos.generate", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path", PROTOS, ids=lambda p: p.name)
def test_every_field_and_enum_value_has_a_doc_comment(path):
    lines = path.read_text().splitlines()
    assert "package splitserve.v1;" in lines
    field = re.compile(r"^\s+(optional |repeated )?[\w.]+ \w+ = \d+;")
    enum_value = re.compile(r"^\s+[A-Z_0-9]+ = \d+;")
    for i, line in enumerate(lines):
        if field.match(line) or enum_value.match(line):
            assert lines[i - 1].strip().startswith("//"), f"{path.name}:{i + 1}: {line.strip()}"


@pytest.mark.parametrize("path", PROTOS, ids=lambda p: p.name)
def test_enums_start_with_unspecified_zero(path):
    text = path.read_text()
    for name, body in re.findall(r"enum (\w+) \{(.*?)\}", text, re.S):
        values = re.findall(r"([A-Z_0-9]+) = (\d+);", body)
        assert values[0][1] == "0" and values[0][0].endswith("_UNSPECIFIED"), name
