"""GilBreaks and list_in_turns: GIL hand-offs inside one long piece of work (fake clocks)."""

from __future__ import annotations

import pytest

from tiering.runtime.gil_breaks import COPY_CHUNK, GilBreaks, clear_in_turns, list_in_turns


class FakeTime:
    """A clock that advances by ``step`` per read; ``sleep`` records and advances it."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.slept = 0.0, step, []

    def clock(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_pause_comes_once_the_budget_is_spent_and_restarts_it() -> None:
    fake = FakeTime(step=0.0004)  # each call reads the clock once: 0.4 ms of work between
    breaks = GilBreaks(0.001, 50e-6, clock=fake.clock, sleep=fake.sleep)
    for _ in range(10):
        breaks()
    # Work since the last pause passes 1 ms at every third call (0.4, 0.8, 1.2 ms...).
    assert breaks.pauses == len(fake.slept) == 3
    assert fake.slept == [50e-6] * 3


def test_short_work_never_pauses() -> None:
    fake = FakeTime(step=1e-6)
    breaks = GilBreaks(0.001, 50e-6, clock=fake.clock, sleep=fake.sleep)
    for _ in range(100):
        breaks()
    assert breaks.pauses == 0 and not fake.slept


@pytest.mark.parametrize(
    ("every_s", "pause_s"), [(0, 1e-5), (-1, 1e-5), (float("inf"), 0), (1e-3, -1)]
)
def test_bad_budgets_are_refused(every_s: float, pause_s: float) -> None:
    with pytest.raises(ValueError, match="every_s must be positive"):
        GilBreaks(every_s, pause_s)


@pytest.mark.parametrize("n", [0, 1, COPY_CHUNK - 1, COPY_CHUNK, 3 * COPY_CHUNK + 5])
def test_a_copy_in_turns_is_the_list_with_a_break_per_chunk(n: int) -> None:
    calls = []
    source = {i: str(i) for i in range(n)}
    assert list_in_turns(source.items(), lambda: calls.append(1)) == list(source.items())
    assert len(calls) == -(-n // COPY_CHUNK)  # one break after each chunk
    assert list_in_turns(iter(range(n))) == list(range(n))  # with its own GilBreaks


@pytest.mark.parametrize("n", [0, 1, COPY_CHUNK, 2 * COPY_CHUNK + 1])
def test_a_list_is_emptied_in_turns_from_its_end(n: int) -> None:
    calls = []
    items = list(range(n))
    seen_lengths = []
    clear_in_turns(items, lambda: (calls.append(1), seen_lengths.append(len(items))))
    assert items == [] and len(calls) == -(-n // COPY_CHUNK)
    assert seen_lengths == sorted(seen_lengths, reverse=True)  # shorter at every break
