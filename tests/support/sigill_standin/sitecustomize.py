"""SIGILL stand-in: makes io_uring ring construction die as an AVX-512 binding does.

Put this directory first on ``PYTHONPATH``. In every Python process started
with it, constructing :class:`tiers.fs.io.kernel_ring.KernelRing` (or any ring
of the ``liburing`` package, stubbed next to this file) kills the process with
SIGILL, which nothing in the process can catch: the same failure as the
``liburing`` 2026.3.x wheels on a CPU without AVX-512. A process that survives
with this on its path never constructed a ring without its child-process probe
saying the path works - and the probe's child dies here, so it never does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import signal
import sys
from types import ModuleType
from typing import Any

_TARGET = "tiers.fs.io.kernel_ring"


def _die(*_args: Any, **_kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGILL)


class _CrashingRingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        real_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            real_exec(module)
            module.KernelRing.__init__ = _die  # type: ignore[attr-defined]

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _CrashingRingFinder())
