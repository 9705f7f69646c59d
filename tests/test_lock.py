"""Installs match what was tested: constraints.txt pins every dependency the Makefile installs."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "constraints.txt"
EXTRAS = ("all", "dev", "gpu")  # what `make install` installs
NOT_LOCKED = {"torch"}  # installed first by an exact pin (a range would pull a CUDA build)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt: {line!r} is not an exact pin"
        pins[canonical(name)] = version
    return pins


def project_requirements() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in EXTRAS:
        requirements += project["optional-dependencies"][extra]
    return {canonical(re.split(r"[<>=!~\[;\s]", r, maxsplit=1)[0]) for r in requirements}


def test_every_requirement_of_the_install_is_pinned() -> None:
    missing = project_requirements() - NOT_LOCKED - set(locked())
    assert not missing, f"not in constraints.txt (run `make lock`): {sorted(missing)}"


def test_installed_versions_are_the_locked_ones() -> None:
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not running in the Makefile's .venv (the one the lock installs)")
    wrong = {}
    for name, version in locked().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. a platform-specific dependency
        if installed != version:
            wrong[name] = f"installed {installed}, locked {version}"
    assert not wrong, f"environment differs from constraints.txt: {wrong}"
