"""The package's shape: one installed import package, layers that import one way (import-linter
contracts), a gateway that never loads torch, and no top-level names that shadow others."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_contracts_hold():
    out = subprocess.run(
        ["lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_importing_the_gateway_loads_no_torch(tmp_path):
    code = (
        "import sys, importlib, pkgutil, splitserve.gateway as g\n"
        "for m in pkgutil.iter_modules(g.__path__):\n"
        "    importlib.import_module('splitserve.gateway.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'triton')))"
    )
    assert _run(code, tmp_path).strip() == "[]"


@pytest.mark.slow
def test_the_wheel_installs_exactly_one_top_level_package(built_wheel):
    with zipfile.ZipFile(built_wheel) as zf:
        names = zf.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"splitserve"}
    for layer in ("engine", "kernels", "protos", "gateway", "kv_transfer", "runtime"):
        assert f"splitserve/{layer}/__init__.py" in names


ENGINE_INTERNALS = (
    ".block_manager", ".scheduler.", ".runner.", "outputs.requests", "drain_events",
    "kv_caches", ".kv_cache.pool",
)  # fmt: skip


def test_no_module_outside_the_engine_reaches_into_engine_internals():
    """Beyond the import contracts: no attribute access to the engine's parts from services,
    transports, runtime or the app; they use `LLMEngine`'s methods, `stats()` and the KV
    connector."""
    offenders = []
    for folder in ("gateway", "prefill_service", "decode_service", "kv_transfer", "runtime",
                   "protos", "cli", "roles", "launch", "client"):  # fmt: skip
        for path in (REPO / "splitserve" / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if any(name in code for name in ENGINE_INTERNALS):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
