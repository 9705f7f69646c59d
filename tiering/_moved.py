"""Module paths from before ``tiering/`` was grouped into layer packages, still importable.

``import tiering.keys`` (or ``from tiering.host_buffer import HostBuffer``)
gives the module at its new path (``tiering.core.keys``): one module object
under both names, so classes, ``isinstance`` and pickles are the same. New
code imports the new paths; this keeps users' code and older docs working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

#: Old module path -> where it lives now.
MOVED = {
    "tiering.errors": "tiering.core.errors",
    "tiering.keys": "tiering.core.keys",
    "tiering.specs": "tiering.core.specs",
    "tiering.jobs": "tiering.core.jobs",
    "tiering.contract": "tiering.core.contract",
    "tiering.stats": "tiering.core.stats",
    "tiering.units": "tiering.support.units",
    "tiering.quoting": "tiering.support.quoting",
    "tiering.native_probe": "tiering.support.native_probe",
    "tiering.host_buffer": "tiering.primary.host_buffer",
    "tiering.mappings": "tiering.primary.mappings",
    "tiering.host_memory": "tiering.primary.host_memory",
    "tiering.auth": "tiering.tier.auth",
    "tiering.metrics_secondary": "tiering.metrics.secondary",
    "tiering.metrics_server": "tiering.metrics.server",
    "tiering.config_checks": "tiering.config.checks",
    "tiering.tier_types": "tiering.registry.types",
    "tiering.tier_entries": "tiering.registry.entries",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves an old path to the module at its new one."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already loaded."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
