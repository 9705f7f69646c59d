"""Our manager answers a request's tier filter as vLLM's manager does: one script, both managers.

The same two tiers in both stacks - an in-memory CPU tier that is local and an
in-memory "storage" tier that is remote - the same blocks stored in both and
evicted from the CPU primary tier, then a lookup carrying
``kv_transfer_params["kv_load_tiers"]`` as a user would send it. vLLM's context
is built by vLLM's own connector code (``_create_req_context``), ours by our
manager from the same params. Both must answer alike (promotion started or
miss) and promote from the same tier.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    _create_req_context,
)
from vllm.v1.kv_offload.base import LookupResult

from tests.manager_helpers import settle
from tests.vllm.test_vllm_tiers import ours, tier_of
from tiering.core.keys import ReqContext
from tiering.integrations.vllm.driver import chained_keys, fill_pattern
from tiering.manager import TieringOffloadingManager
from tiering.primary import CPUPrimaryTier
from tiering.registry import create_secondary_tier

BLOCK = 64 * 1024
CHUNKS = 16
NEAR = {"medium": "CPU", "locality": "LOCAL"}
FAR = {"medium": "STORAGE", "locality": "REMOTE"}
CASES = [
    None,
    [{"medium": "STORAGE"}],
    [{"locality": "remote"}],
    [{"medium": "cpu", "locality": "local"}],
    [{"medium": "CPU", "locality": "REMOTE"}],
    [],
    [{"medium": "GPU"}],
    "not-a-list",
    [{"medium": "STORAGE"}, {"medium": "CPU"}],
]


def vllm_answer(make_manager: Any, kv_load_tiers: Any) -> tuple[str, int | None]:
    manager, driver = make_manager(
        [ours("KVTieringMemoryTier", **NEAR), ours("KVTieringMemoryTier", **FAR)],
        block_bytes=BLOCK,
        num_chunks=CHUNKS,
    )
    keys = chained_keys("filters", 4)
    driver.store("held", keys, fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    params = None if kv_load_tiers is None else {"kv_load_tiers": kv_load_tiers}
    request = SimpleNamespace(request_id="filtered", kv_transfer_params=params, kv_hints=None)
    ctx = _create_req_context(request)  # as vLLM's connector builds it
    loaded = [tier_of(manager, i).stats().blocks_loaded for i in (0, 1)]
    with driver.lock():
        manager.on_new_request(ctx)
        result = manager.lookup(keys[0], ctx)
        driver.end_step()
    driver.run_until_idle()
    after = [tier_of(manager, i).stats().blocks_loaded for i in (0, 1)]
    served = [i for i in (0, 1) if after[i] > loaded[i]]
    kind = "miss" if result is LookupResult.MISS else "promoting"
    assert result in (LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY)
    return kind, served[0] if served else None


def our_answer(kv_load_tiers: Any) -> tuple[str, int | None]:
    primary = CPUPrimaryTier(CHUNKS, BLOCK)
    tiers = [
        create_secondary_tier({"type": "memory", **identity}, primary.kv_view, position=i)
        for i, identity in enumerate((NEAR, FAR))
    ]
    manager = TieringOffloadingManager(primary, tiers, metrics_registry=False)
    try:
        keys = chained_keys("filters", 4)
        out = manager.prepare_store(keys, ReqContext("held"))
        assert out is not None
        manager.complete_store(out.keys_to_store)
        settle(manager)
        filler = chained_keys("filler", CHUNKS)
        out = manager.prepare_store(filler, ReqContext("filler"))
        assert out is not None and len(out.evicted_keys) == 4
        manager.complete_store(out.keys_to_store, success=False)
        params = None if kv_load_tiers is None else {"kv_load_tiers": kv_load_tiers}
        answer = manager.lookup(keys[0], ReqContext("filtered", kv_transfer_params=params))
        settle(manager)
        served = [i for i, t in enumerate(manager.stats().secondary) if t.promotions]
        kind = "miss" if answer is False else "promoting"
        assert answer is not True
        return kind, served[0] if served else None
    finally:
        manager.shutdown()


@pytest.mark.parametrize("kv_load_tiers", CASES, ids=[repr(c) for c in CASES])
def test_our_manager_filters_tiers_as_vllms_does(make_manager: Any, kv_load_tiers: Any) -> None:
    theirs = vllm_answer(make_manager, kv_load_tiers)
    assert our_answer(kv_load_tiers) == theirs
