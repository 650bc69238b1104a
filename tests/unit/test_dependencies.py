"""Every module that splitserve/, tests/ and bench/ import comes from a declared dependency (the
package's own, or its `test` and `bench` extras), checked by deptry against pyproject.toml; and
the constraints file that the README's commands install from pins every one of them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized as PEP 503 does."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def test_every_import_comes_from_a_declared_dependency():
    deptry = shutil.which("deptry")
    assert deptry, "deptry is in the test extra"
    run = subprocess.run(
        [deptry, "."], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No dependency issues found" in run.stdout + run.stderr


def test_the_constraints_file_pins_every_declared_dependency_exactly():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"not an exact pin: {line}"
            pins[_name(name)] = version
    assert declared - set(pins) == set(), "declared but not pinned"
    assert "splitserve" not in pins
