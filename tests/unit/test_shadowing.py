"""No name of ours shadows anyone else's: the repository's top level holds no importable package
but `splitserve` (and the uninstalled `tests` and `bench`), so a process started from the
repository root imports every other distribution's modules as installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOT_INSTALLED = {"splitserve", "tests", "bench"}  # tests/ and bench/ never leave the repository


def _first_level_names() -> list[str]:
    """Every name directly under splitserve/: its subpackages and its modules."""
    names = set()
    for path in (REPO / "splitserve").iterdir():
        if path.is_dir() and (path / "__init__.py").is_file():
            names.add(path.name)
        elif path.suffix == ".py" and path.stem != "__init__":
            names.add(path.stem)
    return sorted(names)


def _install_stand_ins(site: Path, names: list[str]) -> None:
    """A one-module distribution per name, laid out as pip lays out an installed wheel."""
    for name in names:
        (site / name).mkdir()
        (site / name / "__init__.py").write_text(f"STAND_IN = {name!r}\n")
        info = site / f"{name}_stand_in-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}-stand-in\nVersion: 1.0\n"
        )
        (info / "top_level.txt").write_text(f"{name}\n")
        (info / "RECORD").write_text(f"{name}/__init__.py,,\n")


def test_the_tree_has_no_symlinks():
    links = [
        str(p.relative_to(REPO))
        for p in REPO.rglob("*")
        if p.is_symlink() and ".git" not in p.relative_to(REPO).parts
    ]
    assert links == []


def test_no_top_level_folder_but_splitserve_tests_and_bench_is_a_package():
    packages = {
        p.name for p in REPO.iterdir() if p.is_dir() and (p / "__init__.py").is_file()
    }
    assert packages <= NOT_INSTALLED, sorted(packages - NOT_INSTALLED)
    modules = [p.name for p in REPO.glob("*.py")]
    assert modules == []


def test_an_installed_stand_in_for_each_name_under_splitserve_wins_from_the_repository_root(
    tmp_path,
):
    """The layer and room names (engine, kernels, gateway, cli, …) are generic: another
    distribution may ship any of them (Hugging Face's `kernels` did, and transformers imports
    it). From the repository root, where Python puts the current folder first on sys.path, each
    must still resolve to the installed stand-in, never to our code."""
    names = _first_level_names()
    assert {"engine", "kernels", "protos", "gateway", "runtime", "kv_transfer"} <= set(names)
    _install_stand_ins(tmp_path, names)
    code = (
        "import importlib, json, sys\n"
        "from importlib.metadata import packages_distributions\n"
        f"names = {names!r}\n"
        "owners = packages_distributions()\n"
        "got = {}\n"
        "for name in names:\n"
        "    module = importlib.import_module(name)\n"
        "    got[name] = [getattr(module, 'STAND_IN', None), module.__file__, owners.get(name)]\n"
        "print(json.dumps(got))"
    )
    # NOTE: `-c` puts the current folder first on sys.path, as `python -m …` and the console
    # scripts started from it do; PYTHONPATH stands where site-packages stands, after it.
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    for name in names:
        stand_in, path, owners = got[name]
        assert stand_in == name, f"`import {name}` from the repository root found {path}"
        assert f"{name}-stand-in" in owners and "splitserve" not in owners, (name, owners)


def test_transformers_sees_no_kernels_distribution_of_ours():
    """transformers asks whether Hugging Face's `kernels` is installed and imports it if so: from
    the repository root that must be theirs (or nothing), never a folder of ours."""
    code = (
        "import json, importlib.util\n"
        "from importlib.metadata import packages_distributions\n"
        "from transformers.utils.import_utils import _is_package_available\n"
        "owners = packages_distributions()\n"
        "found = _is_package_available('kernels')\n"
        "found = found[0] if isinstance(found, tuple) else found\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(json.dumps([found, owners.get('kernels', []), owners.get('splitserve', []),"
        " spec.origin if spec else None]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    available, kernels_owners, splitserve_owners, origin = json.loads(run.stdout)
    assert "splitserve" not in kernels_owners
    assert set(splitserve_owners) == {"splitserve"}
    if available:  # transformers >= 5.25 depends on it
        assert set(kernels_owners) == {"kernels"}
        assert not Path(origin).resolve().is_relative_to(REPO), origin
    else:
        assert origin is None
