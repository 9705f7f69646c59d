"""GIL hand-offs of a loop thread: when the selector pauses, and that loops still work over it."""

from __future__ import annotations

import asyncio
import itertools
import selectors
import socket
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.errors import ConfigError
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager, LoopThread
from tiering.runtime.facade import DEFAULT_MAX_GIL_HOLD_MS, check_runtime_options
from tiering.runtime.gil_handoff import (
    DEFAULT_MAX_GIL_HOLD_S,
    HandoffSelector,
    handoff_loop_factory,
    handoffs_of,
)
from tiers.memory import MemoryTier


class FakeTime:
    """A clock that moves only when told to, and a sleep that records pauses."""

    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def _selector(max_hold_s: float, fake: FakeTime, pause_s: float = 20e-6) -> HandoffSelector:
    return HandoffSelector(max_hold_s, pause_s, clock=fake.clock, sleep=fake.sleep)


def test_a_loop_busy_for_less_than_the_budget_never_pauses() -> None:
    fake = FakeTime()
    with _selector(0.001, fake) as selector:
        for _ in range(9):
            fake.now += 0.0001
            assert selector.select(0) == []
        assert selector.handoffs == 0 and fake.pauses == []


def test_a_loop_busy_past_the_budget_pauses_once_then_starts_a_new_budget() -> None:
    fake = FakeTime()
    with _selector(0.001, fake, pause_s=30e-6) as selector:
        fake.now += 0.0011
        selector.select(0)
        assert fake.pauses == [30e-6] and selector.handoffs == 1
        fake.now += 0.0005  # within the new budget
        selector.select(0)
        assert selector.handoffs == 1
        fake.now += 0.0006
        selector.select(0)
        assert selector.handoffs == 2


def test_a_poll_that_blocked_restarts_the_budget_and_one_that_did_not_keeps_it() -> None:
    fake = FakeTime()
    real_select = selectors.DefaultSelector.select

    def select_taking(seconds: float) -> Any:
        def select(self: Any, timeout: float | None = None) -> Any:
            fake.now += seconds
            return real_select(self, 0)

        return select

    with _selector(0.001, fake, pause_s=20e-6) as selector:
        fake.now += 0.0009
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(selectors.DefaultSelector, "select", select_taking(1e-6))
            selector.select(0.5)  # events were ready at once: the loop never let go
        fake.now += 0.0002
        selector.select(0)
        assert selector.handoffs == 1  # 0.9 + 0.2 ms of work: a pause
        fake.now += 0.0011
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(selectors.DefaultSelector, "select", select_taking(1e-6))
            selector.select(0.5)  # a poll that may block pauses too once the budget is spent
        assert selector.handoffs == 2
        fake.now += 0.0009
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(selectors.DefaultSelector, "select", select_taking(0.01))
            selector.select(0.5)  # it slept 10 ms: waiters had the GIL
        fake.now += 0.0009
        selector.select(0)
        assert selector.handoffs == 2  # 0.9 + 0.9 ms, but a wait in between


@given(
    st.lists(
        st.tuples(st.floats(0, 0.003), st.sampled_from([0.0, 0.0, None, 10e-6, 0.002])),
        max_size=60,
    )
)
def test_a_poll_pauses_exactly_when_the_loop_has_held_the_gil_for_its_budget(
    steps: list[tuple[float, float | None]],
) -> None:
    """Each step: some loop work, then a poll (0: work is ready; None: an event at once;
    a positive timeout: nothing comes, the poll waits that long). A poll pauses if and
    only if the loop has not let go of the GIL (a pause, or a wait of at least the pause)
    for ``budget``; so no callback starts with more than the budget held, and pauses are
    at least ``budget`` apart."""
    fake = FakeTime()
    budget, pause = 0.001, 20e-6
    selector = _selector(budget, fake, pause_s=pause)
    last_let_go = fake.now
    pause_times: list[float] = []

    def inner_select(self: Any, timeout: float | None = None) -> list[Any]:
        fake.now += timeout or 0.0  # nothing registered: a positive timeout runs out
        return []

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(selectors.DefaultSelector, "select", inner_select)
        for work, timeout in steps:
            fake.now += work
            pauses_before = len(fake.pauses)
            polled_at = fake.now
            selector.select(timeout)
            paused = len(fake.pauses) > pauses_before
            assert paused == (polled_at - last_let_go >= budget)
            after_pause = polled_at + pause if paused else polled_at
            if paused:
                pause_times.append(polled_at)
                last_let_go = after_pause
            if fake.now - after_pause >= pause:
                last_let_go = fake.now
    selector.close()
    assert all(b - a >= budget for a, b in itertools.pairwise(pause_times))


def test_registration_goes_to_the_platform_selector() -> None:
    left, right = socket.socketpair()
    with left, right, HandoffSelector(0.001) as selector:
        key = selector.register(left, selectors.EVENT_READ, "tag")
        assert selector.get_key(left) == key and key.data == "tag"
        assert selector.select(0) == []
        right.send(b"x")
        assert selector.select(1.0) == [(key, selectors.EVENT_READ)]
        selector.modify(left, selectors.EVENT_READ, "other")
        assert selector.get_map()[left].data == "other"
        selector.unregister(left)
        assert left not in selector.get_map()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_budget_that_is_not_a_positive_finite_time_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="max_hold_s"):
        HandoffSelector(bad)
    with pytest.raises(ValueError, match="max_hold_s"):
        handoff_loop_factory(bad)


def test_a_loop_over_the_selector_serves_streams_and_counts_its_handoffs() -> None:
    async def echo_and_spin() -> bytes:
        server_sock, client_sock = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=client_sock)
        server_reader, server_writer = await asyncio.open_connection(sock=server_sock)
        writer.write(b"ping\n")
        await writer.drain()
        line = await server_reader.readline()
        for _ in range(200):  # continuous work: every poll after the budget pauses
            await asyncio.sleep(0)
        for stream in (writer, server_writer):
            stream.close()
            await stream.wait_closed()
        del reader
        return line

    loop = handoff_loop_factory(1e-9)()
    try:
        assert loop.run_until_complete(echo_and_spin()) == b"ping\n"
        assert handoffs_of(loop) >= 200
    finally:
        loop.close()
    plain = handoff_loop_factory(None)()
    try:
        assert plain.run_until_complete(echo_and_spin()) == b"ping\n"
        assert handoffs_of(plain) == 0
    finally:
        plain.close()


def test_loop_threads_hand_off_by_default_and_not_when_turned_off() -> None:
    async def spin() -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    with LoopThread("handoff-tiny", max_gil_hold_s=1e-9) as portal:
        portal.call(spin)
        assert portal.gil_handoffs >= 50
    with LoopThread("handoff-off", max_gil_hold_s=None) as portal:
        portal.call(spin)
        assert portal.gil_handoffs == 0
    with LoopThread("handoff-default") as portal:
        assert isinstance(portal.loop._selector, HandoffSelector)  # type: ignore[attr-defined]
        assert portal.loop._selector._max_hold_s == DEFAULT_MAX_GIL_HOLD_S  # type: ignore[attr-defined]


def test_the_manager_option_reaches_its_loop_thread() -> None:
    primary = memoryview(bytearray(8 * 64)).cast("B", (8, 64))
    with AsyncTierManager(MemoryTier(), primary, "memory", max_gil_hold_ms=None) as manager:
        assert not isinstance(manager._thread.loop._selector, HandoffSelector)  # type: ignore[attr-defined]
    with AsyncTierManager(MemoryTier(), primary, "memory", max_gil_hold_ms=2.5) as manager:
        selector = manager._thread.loop._selector  # type: ignore[attr-defined]
        assert isinstance(selector, HandoffSelector) and selector._max_hold_s == 0.0025
    assert DEFAULT_MAX_GIL_HOLD_MS == 1.0


@pytest.mark.parametrize("bad", [0, -2, True, "1", float("inf"), float("nan")])
def test_a_bad_max_gil_hold_ms_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_gil_hold_ms"):
        check_runtime_options(max_gil_hold_ms=bad)
    primary = memoryview(bytearray(8 * 64)).cast("B", (8, 64))
    with pytest.raises(ConfigError, match="max_gil_hold_ms"):
        create_secondary_tier({"type": "memory", "max_gil_hold_ms": bad}, primary, position=0)


def test_the_config_key_sets_the_budget() -> None:
    primary = memoryview(bytearray(8 * 64)).cast("B", (8, 64))
    with create_secondary_tier(
        {"type": "memory", "max_gil_hold_ms": 0.5}, primary, position=0
    ) as manager:
        selector = manager._thread.loop._selector  # type: ignore[attr-defined]
        assert isinstance(selector, HandoffSelector) and selector._max_hold_s == 0.0005
    with create_secondary_tier(
        {"type": "memory", "max_gil_hold_ms": None}, primary, position=0
    ) as manager:
        assert not isinstance(manager._thread.loop._selector, HandoffSelector)  # type: ignore[attr-defined]
