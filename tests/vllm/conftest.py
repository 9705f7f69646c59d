"""Fixtures for the tests that run against the released vLLM 0.33 package.

These tests import vLLM, so they run inside the environment
``scripts/vllm_env.sh`` builds; ``tests/test_vllm_integration.py`` does that
from the main suite and runs them in a subprocess. In an environment without
vLLM this directory is not collected at all (the outer test is what reports
its result).
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: Empty stand-ins scripts/vllm_env.sh builds for the CUDA libraries vLLM's C
#: file-I/O extension lists but never calls; loaded so vLLM's filesystem tier
#: runs its C fast path, as on a GPU machine.
FSIO_STUBS = ("libc10_cuda.so", "libnvrtc.so.13", "libtorch_cuda.so")


def preload_fsio_stubs() -> bool:
    """Load the stubs before vLLM's fs tier is imported; False if they are missing."""
    import torch  # noqa: F401  (libtorch first: the extension links against it)

    paths = [os.path.join(sys.prefix, "fsio_cuda_stubs", name) for name in FSIO_STUBS]
    if not all(os.path.exists(p) for p in paths):
        return False
    for path in paths:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return True


@pytest.fixture
def make_manager() -> Iterator[Callable[..., Any]]:
    """Build vLLM TieringOffloadingManagers (via the spec); shut them all down afterwards.

    ``make_manager(secondary_tiers, block_bytes=..., num_chunks=..., **options)``
    returns ``(manager, driver)``; options go to
    :func:`tiering.integrations.vllm.driver.offloading_config`.
    """
    from tiering.integrations.vllm.driver import SchedulerDriver, build_manager, offloading_config

    built: list[tuple[Any, Any]] = []

    def make(
        secondary_tiers: list[dict[str, Any]],
        *,
        block_bytes: int = 64 * 1024,
        num_chunks: int = 32,
        **options: Any,
    ) -> tuple[Any, Any]:
        config = offloading_config(
            secondary_tiers, block_bytes=block_bytes, num_chunks=num_chunks, **options
        )
        manager = build_manager(config)
        driver = SchedulerDriver(manager)
        built.append((manager, driver))
        return manager, driver

    yield make
    for manager, driver in reversed(built):
        shut_down(manager, driver)


def shut_down(manager: Any, driver: Any) -> None:
    """Shut a manager down the way vLLM does (drop views of the primary buffer first)."""
    if getattr(manager, "_kv_tiering_test_shut_down", False):
        return
    driver.release_rows()
    gc.collect()
    manager.shutdown()
    manager._kv_tiering_test_shut_down = True
