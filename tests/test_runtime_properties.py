"""Hypothesis: random store/load jobs with injected write failures against a simple model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.runtime_support import fill, key, load, one_result, primary, store, wait_until
from tiering.core.keys import NO_CONTEXT
from tiering.runtime import AsyncTierManager
from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.memory import MemoryTier

NUM_KEYS = 8
key_sets = st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=4, unique=True)
operations = st.lists(st.tuples(st.sampled_from(["store", "load"]), key_sets), max_size=10)


@settings(max_examples=25)
@given(ops=operations, failing=st.sets(st.integers(0, NUM_KEYS - 1), max_size=2))
def test_jobs_match_a_model_of_the_tier(
    ops: list[tuple[str, list[int]]], failing: set[int]
) -> None:
    # Rows 0..7 hold key i's bytes; loads go to rows 8.. (one per key of the job).
    buf = primary(rows=NUM_KEYS + 4)
    source = [fill(buf, i) for i in range(NUM_KEYS)]
    plan = FaultPlan(error_rate=1.0, keys={key(i) for i in failing}, ops={"write"})
    stored: set[int] = set()
    with AsyncTierManager(FaultyTier(MemoryTier(), plan), buf.data, "model") as manager:
        for job_id, (kind, ids) in enumerate(ops):
            keys = [key(i) for i in ids]
            if kind == "store":
                manager.submit_store(store(job_id, keys, ids))
                result = one_result(manager)
                expected_ok = {i for i in ids if i in stored or i not in failing}
                assert result.success == (expected_ok == set(ids))
                assert result.successful_keys == {key(i) for i in expected_ok}
                stored |= expected_ok
            else:
                rows = list(range(NUM_KEYS, NUM_KEYS + len(ids)))
                manager.submit_load(load(job_id, keys, rows))
                result = one_result(manager)
                assert result.success == set(ids).issubset(stored)
                if result.success:
                    for i, row in zip(ids, rows, strict=True):
                        assert bytes(buf[row]) == source[i]
            # Failed writes are checked in the background; once settled, lookup is exact.
            wait_until(
                lambda: all(manager.lookup(key(i), NO_CONTEXT) is not None for i in range(NUM_KEYS))
            )
            for i in range(NUM_KEYS):
                assert manager.lookup(key(i), NO_CONTEXT) is (i in stored)
        assert manager.get_num_blocks() == len(stored)
