"""A tier that outlives the process warns once when vLLM's block keys are per-process.

vLLM seeds a non-cryptographic prefix hash (``xxhash``) with random bytes in
each process unless ``PYTHONHASHSEED`` is set: a shared or persistent tier
then never hits across engines or restarts. The seed is resolved after the
tiers are built, so the check runs at the first store.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from vllm.v1.core import kv_cache_utils

from tests.vllm.test_vllm_tiers import ours
from tiering.integrations.vllm.driver import chained_keys, fill_pattern

WARNING = "hashes prefixes with a random per-process seed"


def stores(make_manager: Any, tier: dict[str, Any], caplog: pytest.LogCaptureFixture) -> int:
    _, driver = make_manager([tier])
    with caplog.at_level(logging.WARNING, logger="tiering.integrations.vllm"):
        for name in ("one", "two"):
            driver.store(name, chained_keys(name, 2), fill_pattern)
            driver.run_until_idle()
    return sum(WARNING in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("seed", "hashseed", "warnings"),
    [
        ("0f" * 32, None, 1),  # random per process: one line, not one per store
        (kv_cache_utils.DEFAULT_NONE_HASH_SEED, None, 0),  # sha256's fixed seed
        ("0f" * 32, "1234", 0),  # PYTHONHASHSEED makes every process agree
    ],
)
def test_a_storage_tier_warns_once_when_keys_differ_between_processes(
    make_manager: Any,
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    seed: str,
    hashseed: str | None,
    warnings: int,
) -> None:
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", seed)
    if hashseed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", hashseed)
    tier = ours("KVTieringFileSystemTier", root_dir=str(tmp_path / "fs"))
    assert stores(make_manager, tier, caplog) == warnings


def test_a_memory_tier_never_outlives_the_process_so_never_warns(
    make_manager: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", "0f" * 32)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert stores(make_manager, ours("KVTieringMemoryTier"), caplog) == 0
