"""A tier that blocks its own loop thread, or fails while the facade is being built.

Shutting down and giving up on an open must stay bounded by their timeouts even
then (the engine's shutdown must not hang on a tier's bug), and a constructor
that fails must leave no thread behind (a leftover portal thread keeps the
interpreter from exiting). Each wedge waits on an event the test sets afterwards,
so no thread outlives the test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from tests.runtime_support import key, primary, store
from tiering.core.keys import OffloadKey
from tiering.runtime import AsyncTierManager
from tiering.tier import TierContext
from tiers.memory import MemoryTier

BUDGET_S = 1.0
#: Timeouts are structural (future.result(timeout), thread.join(timeout)): the margin is
#: only for a loaded machine's scheduling.
MARGIN_S = 2.0


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set when the test is done: the wedged loop thread then finishes and stops."""
    event = threading.Event()
    yield event
    event.set()


class WedgedWrites(MemoryTier):
    def __init__(self, release: threading.Event, entered: threading.Event) -> None:
        super().__init__()
        self.release, self.entered = release, entered

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        self.entered.set()
        self.release.wait()  # a tier bug: a blocking call on its loop thread
        await super().write_many(keys, data)


class WedgedOpen(MemoryTier):
    def __init__(self, release: threading.Event) -> None:
        super().__init__()
        self.release = release

    async def open(self, context: TierContext) -> None:
        self.release.wait()
        await super().open(context)


def new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def test_shutdown_is_bounded_when_the_tier_blocks_its_loop(release: threading.Event) -> None:
    entered = threading.Event()
    rows = primary(8)
    manager = AsyncTierManager(
        WedgedWrites(release, entered), rows.data, "memory", shutdown_timeout_s=BUDGET_S
    )
    manager.submit_store(store(1, [key(1)], [0]))
    assert entered.wait(10)
    started = time.monotonic()
    manager.shutdown()
    assert time.monotonic() - started < BUDGET_S + MARGIN_S


def test_a_timed_out_open_is_bounded_when_the_tier_blocks_its_loop(
    release: threading.Event,
) -> None:
    rows = primary(8)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        AsyncTierManager(
            WedgedOpen(release),
            rows.data,
            "memory",
            open_timeout_s=BUDGET_S,
            shutdown_timeout_s=BUDGET_S,
        )
    assert time.monotonic() - started < 2 * BUDGET_S + MARGIN_S


class BrokenConcurrency(MemoryTier):
    max_concurrency: Any = None  # a tier bug: not an int


def test_a_constructor_that_fails_leaves_no_thread_behind() -> None:
    before = set(threading.enumerate())
    rows = primary(8)
    with pytest.raises(TypeError):
        AsyncTierManager(BrokenConcurrency(), rows.data, "memory", name="broken")
    assert new_threads(before) == []
