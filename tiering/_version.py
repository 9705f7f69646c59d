"""``tiering.__version__``: the installed distribution's version.

From the package metadata of ``kv-tiering`` when this copy of the code is the
installed one; from ``pyproject.toml`` when it runs from a source checkout
(``PYTHONPATH=.``), whose version may differ from whatever is installed; else
``0+unknown``.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

DISTRIBUTION = "kv-tiering"
UNKNOWN = "0+unknown"


def _from_checkout() -> str | None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        with pyproject.open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version") if project.get("name") == DISTRIBUTION else None
    return version if isinstance(version, str) else None


def _version() -> str:
    checkout = _from_checkout()
    if checkout is not None:
        return checkout
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


__version__ = _version()
