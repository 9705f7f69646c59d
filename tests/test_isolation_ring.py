"""The isolation channel's parts in one process: ByteRing, the lookup-view mirror, wake-ups.

Two :class:`ByteRing` objects over the same shared-memory name stand for the
two processes (each only uses its own half); the mirror's recording
containers are driven directly and their change log replayed into a
:class:`Mirror`; the wake-up pair runs over a plain ``os.pipe``.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import termios
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.runtime_support import key
from tiering.isolation.mirror import (
    ABSENT_DROP,
    ABSENT_SET,
    PRESENT_ADD,
    PRESENT_DROP,
    UNSETTLED_ADD,
    UNSETTLED_DROP,
    ChangeLog,
    Mirror,
    RecordingKeys,
    RecordingPresent,
    RecordingTimes,
    SignallingDeque,
)
from tiering.isolation.ring import ByteRing
from tiering.isolation.wakeup import WakeReceiver, WakeSender

SMALL = 4096
LENGTH_PREFIX = 4


@contextmanager
def ring_pair(capacity: int = SMALL) -> Iterator[tuple[ByteRing, ByteRing]]:
    """(producer, consumer): the creator's side and a second side attached by name."""
    producer = ByteRing.create(capacity)
    consumer = ByteRing.attach(producer.name, capacity)
    try:
        yield producer, consumer
    finally:
        producer.unlink()
        consumer.close()
        producer.close()


# -- ByteRing ---------------------------------------------------------------------------------


def test_messages_arrive_whole_and_in_order() -> None:
    with ring_pair() as (producer, consumer):
        assert consumer.receive() == []
        assert not consumer.pending()
        sent = [b"", b"a", b"hello", bytes(range(256)), b"\x00" * 1000]
        for message in sent:
            assert producer.try_send(message)
        assert consumer.pending()
        assert consumer.receive() == sent
        assert not consumer.pending()
        assert consumer.receive() == []


def test_the_attached_side_sees_the_creators_geometry() -> None:
    with ring_pair(8192) as (producer, consumer):
        assert consumer.name == producer.name
        assert consumer.capacity == producer.capacity == 8192
        assert producer.max_message == 8192 - LENGTH_PREFIX


def test_a_message_wraps_around_the_end_of_the_data_area() -> None:
    with ring_pair() as (producer, consumer):
        first = os.urandom(3000)
        assert producer.try_send(first)
        assert consumer.receive() == [first]
        # Starts at position 3004: its bytes run past the end and continue at offset 0.
        wrapped = os.urandom(2000)
        assert producer.try_send(wrapped)
        assert consumer.receive() == [wrapped]


def test_a_length_prefix_split_by_the_end_of_the_data_area_is_read_back() -> None:
    with ring_pair() as (producer, consumer):
        assert producer.try_send(bytes(SMALL - LENGTH_PREFIX - 2))  # the next prefix at 4094
        assert len(consumer.receive()[0]) == SMALL - LENGTH_PREFIX - 2
        split = os.urandom(100)
        assert producer.try_send(split)
        assert consumer.receive() == [split]


def test_a_full_ring_refuses_without_writing_and_accepts_after_a_receive() -> None:
    with ring_pair() as (producer, consumer):
        whole = os.urandom(producer.max_message)
        assert producer.try_send(whole)  # exactly fills the ring
        assert producer.try_send(b"") is False  # even an empty message needs its prefix
        assert producer.try_send(b"late") is False
        assert consumer.receive() == [whole]  # nothing was appended behind it
        assert consumer.receive() == []
        assert producer.try_send(b"late")
        assert consumer.receive() == [b"late"]


def test_a_ring_with_room_for_some_messages_refuses_the_one_too_many() -> None:
    with ring_pair() as (producer, consumer):
        message = bytes(1020)  # 1024 bytes with its prefix: four fill the ring
        assert [producer.try_send(message) for _ in range(5)] == [True] * 4 + [False]
        assert consumer.receive() == [message] * 4
        assert [producer.try_send(message) for _ in range(5)] == [True] * 4 + [False]
        assert consumer.receive() == [message] * 4


def test_a_message_longer_than_the_ring_raises() -> None:
    with ring_pair() as (producer, consumer):
        with pytest.raises(ValueError, match="cannot fit"):
            producer.try_send(bytes(producer.max_message + 1))
        assert consumer.receive() == []
        assert producer.try_send(bytes(producer.max_message))  # the limit itself fits


@pytest.mark.parametrize("capacity", [0, 1024, 2048, 4095, 5000, 6144, -4096])
def test_a_capacity_not_a_power_of_two_of_at_least_4096_is_refused(capacity: int) -> None:
    with pytest.raises(ValueError, match="power of two >= 4096"):
        ByteRing.create(capacity)


ring_ops = st.lists(
    st.one_of(
        st.binary(max_size=SMALL // 3).map(lambda data: ("send", data)),
        st.just(("receive", b"")),
    ),
    max_size=60,
)


@given(ring_ops)
def test_any_send_and_receive_sequence_delivers_exactly_the_accepted_messages(
    ops: list[tuple[str, bytes]],
) -> None:
    with ring_pair() as (producer, consumer):
        in_ring: deque[bytes] = deque()  # accepted, not yet received (the model)
        for op, data in ops:
            if op == "send":
                used = sum(LENGTH_PREFIX + len(m) for m in in_ring)
                fits = SMALL - used >= LENGTH_PREFIX + len(data)
                assert producer.try_send(data) is fits
                if fits:
                    in_ring.append(data)
            else:
                assert consumer.pending() is bool(in_ring)
                assert consumer.receive() == list(in_ring)
                in_ring.clear()
        assert consumer.receive() == list(in_ring)


# -- the lookup-view mirror -------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def recorded() -> tuple[ChangeLog, list[int]]:
    """A change log and the list its dirty signal appends to."""
    signals: list[int] = []
    return ChangeLog(lambda: signals.append(1)), signals


def test_each_change_is_logged_in_order_and_signalled() -> None:
    log, signals = recorded()
    clock = FakeClock()
    present = RecordingPresent(log, ttl_s=10.0, max_keys=2, clock=clock)
    unsettled = RecordingKeys(log)
    absent_at = RecordingTimes(log)
    a, b, c = key(1), key(2), key(3)

    present.add(a)
    present.add(b)
    present.add(c)  # over max_keys: a is forgotten
    present.discard(key(9))  # unknown: no change
    present.discard(b)
    unsettled.add(a)
    unsettled.add(a)  # already in: no change
    unsettled.discard(a)
    unsettled.discard(a)  # already out: no change
    absent_at[b] = 1.5
    absent_at.pop(b)
    assert absent_at.pop(b, None) is None  # absent: no change
    absent_at[c] = 2.5
    del absent_at[c]
    clock.now += 11
    assert present.expire() == [c]

    assert log.changes == [
        (PRESENT_ADD, a, 0.0),
        (PRESENT_ADD, b, 0.0),
        (PRESENT_ADD, c, 0.0),
        (PRESENT_DROP, a, 0.0),
        (PRESENT_DROP, b, 0.0),
        (UNSETTLED_ADD, a, 0.0),
        (UNSETTLED_DROP, a, 0.0),
        (ABSENT_SET, b, 1.5),
        (ABSENT_DROP, b, 0.0),
        (ABSENT_SET, c, 2.5),
        (ABSENT_DROP, c, 0.0),
        (PRESENT_DROP, c, 0.0),
    ]
    assert len(signals) == len(log.changes)


def test_take_hands_out_the_oldest_changes_first_in_chunks() -> None:
    log, _ = recorded()
    for i in range(5):
        log.record(PRESENT_ADD, key(i))
    assert [k for _, k, _ in log.take(2)] == [key(0), key(1)]
    assert [k for _, k, _ in log.take(2)] == [key(2), key(3)]
    assert [k for _, k, _ in log.take(2)] == [key(4)]
    assert log.take(2) == []


def test_a_signalling_deque_signals_each_append() -> None:
    signals: list[int] = []
    events = SignallingDeque(lambda: signals.append(1))
    events.append(([key(1)], False))
    events.append(([key(2)], True))
    assert list(events) == [([key(1)], False), ([key(2)], True)]
    assert len(signals) == 2


def test_mirror_forgets_everything_when_the_tiers_process_is_gone() -> None:
    mirror = Mirror()
    mirror.apply([(PRESENT_ADD, key(1), 0.0), (UNSETTLED_ADD, key(2), 0.0)])
    mirror.apply([(ABSENT_SET, key(3), 4.0)])
    assert (list(mirror.present), mirror.unsettled, mirror.absent_at) == (
        [key(1)],
        {key(2)},
        {key(3): 4.0},
    )
    mirror.forget_everything()
    assert (mirror.present, mirror.unsettled, mirror.absent_at) == ({}, set(), {})


UNRECORDED_KEYS: list[Callable[[RecordingKeys], Any]] = [
    lambda s: s.remove(key(1)),
    lambda s: s.pop(),
    lambda s: s.clear(),
    lambda s: s.update({key(2)}),
    lambda s: s.difference_update({key(1)}),
    lambda s: s.intersection_update(set()),
    lambda s: s.symmetric_difference_update({key(1)}),
    lambda s: s.__ior__({key(2)}),
    lambda s: s.__iand__(set()),
    lambda s: s.__isub__({key(1)}),
    lambda s: s.__ixor__({key(1)}),
]


@pytest.mark.parametrize("mutation", UNRECORDED_KEYS)
def test_unrecorded_set_mutations_raise_and_change_nothing(
    mutation: Callable[[RecordingKeys], Any],
) -> None:
    log, _ = recorded()
    keys = RecordingKeys(log)
    keys.add(key(1))
    with pytest.raises(NotImplementedError, match="not mirrored"):
        mutation(keys)
    assert set(keys) == {key(1)}
    assert len(log.changes) == 1


def test_in_place_set_operators_raise() -> None:
    keys = RecordingKeys(ChangeLog(lambda: None))
    keys.add(key(1))
    with pytest.raises(NotImplementedError):
        keys |= {key(2)}
    with pytest.raises(NotImplementedError):
        keys -= {key(1)}
    assert set(keys) == {key(1)}


UNRECORDED_TIMES: list[Callable[[RecordingTimes], Any]] = [
    lambda d: d.popitem(),
    lambda d: d.clear(),
    lambda d: d.setdefault(key(2), 1.0),
    lambda d: d.update({key(2): 1.0}),
    lambda d: d.__ior__({key(2): 1.0}),
]


@pytest.mark.parametrize("mutation", UNRECORDED_TIMES)
def test_unrecorded_dict_mutations_raise_and_change_nothing(
    mutation: Callable[[RecordingTimes], Any],
) -> None:
    log, _ = recorded()
    times = RecordingTimes(log)
    times[key(1)] = 3.0
    with pytest.raises(NotImplementedError, match="not mirrored"):
        mutation(times)
    assert dict(times) == {key(1): 3.0}
    assert len(log.changes) == 1


POOL = [key(i) for i in range(6)]
pool_keys = st.sampled_from(POOL)
view_ops = st.lists(
    st.one_of(
        st.tuples(st.just("present_add"), pool_keys),
        st.tuples(st.just("present_discard"), pool_keys),
        st.tuples(st.just("present_expire"), st.floats(0.0, 3.0)),
        st.tuples(st.just("unsettled_add"), pool_keys),
        st.tuples(st.just("unsettled_discard"), pool_keys),
        st.tuples(st.just("absent_set"), pool_keys, st.floats(0.0, 1e6)),
        st.tuples(st.just("absent_del"), pool_keys),
        st.tuples(st.just("absent_pop"), pool_keys),
        st.tuples(st.just("ship"), st.integers(1, 8)),
    ),
    max_size=80,
)
present_options = st.sampled_from(
    [{}, {"ttl_s": 2.0}, {"max_keys": 3}, {"ttl_s": 2.0, "max_keys": 2}]
)


@given(view_ops, present_options)
def test_replaying_the_log_reproduces_the_recorded_containers(
    ops: list[tuple[Any, ...]], options: dict[str, float]
) -> None:
    log, _ = recorded()
    clock = FakeClock()
    present = RecordingPresent(log, clock=clock, **options)
    unsettled = RecordingKeys(log)
    absent_at = RecordingTimes(log)
    mirror = Mirror()  # fed in chunks, as the child ships them
    for op, *args in ops:
        if op == "present_add":
            present.add(args[0])
            clock.now += 0.5
        elif op == "present_discard":
            present.discard(args[0])
        elif op == "present_expire":
            clock.now += args[0]
            present.expire()
        elif op == "unsettled_add":
            unsettled.add(args[0])
        elif op == "unsettled_discard":
            unsettled.discard(args[0])
        elif op == "absent_set":
            absent_at[args[0]] = args[1]
        elif op == "absent_del":
            if args[0] in absent_at:
                del absent_at[args[0]]
            else:
                with pytest.raises(KeyError):
                    del absent_at[args[0]]
        elif op == "absent_pop":
            absent_at.pop(args[0], None)
        else:
            mirror.apply(log.take(args[0]))
    mirror.apply(log.take(len(log.changes)))
    assert set(mirror.present) == set(present)
    assert mirror.unsettled == set(unsettled)
    assert mirror.absent_at == dict(absent_at)
    assert log.changes == []


# -- wake-ups ---------------------------------------------------------------------------------


def unread_bytes(fd: int) -> int:
    """Bytes waiting in a pipe (without reading them)."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count, True)
    return count[0]


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        with contextlib.suppress(OSError):  # the test closed it
            os.close(fd)


def test_one_write_per_pending_flag_and_clear_resets_it(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    flag = memoryview(bytearray(8))
    sender, receiver = WakeSender(flag, write_end), WakeReceiver(flag, read_end)
    for _ in range(3):
        sender.wake()
    assert flag[0] == 1
    assert unread_bytes(read_end) == 1  # coalesced
    assert receiver.clear() is True
    assert flag[0] == 0
    assert unread_bytes(read_end) == 0
    sender.wake()  # the flag is clear again: a new wake-up is written
    sender.wake()
    assert unread_bytes(read_end) == 1


def test_clear_without_a_wake_up_is_harmless(pipe: tuple[int, int]) -> None:
    read_end, _ = pipe
    flag = memoryview(bytearray(8))
    assert WakeReceiver(flag, read_end).clear() is True
    assert flag[0] == 0


def test_clear_answers_false_once_the_sender_is_gone(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    flag = memoryview(bytearray(8))
    WakeSender(flag, write_end)
    receiver = WakeReceiver(flag, read_end)
    os.close(write_end)
    flag[0] = 1
    assert receiver.clear() is False
    assert flag[0] == 0
    assert receiver.clear() is False  # and keeps saying so


def test_a_wake_up_sent_before_the_sender_went_is_consumed_first(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    flag = memoryview(bytearray(8))
    sender, receiver = WakeSender(flag, write_end), WakeReceiver(flag, read_end)
    sender.wake()
    os.close(write_end)
    assert receiver.clear() is True  # the pending wake-up (its messages are in the ring)
    assert receiver.clear() is False  # then the end of file: the pipe stays readable for it


def test_wake_raises_broken_pipe_once_the_receiver_is_gone(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    sender = WakeSender(memoryview(bytearray(8)), write_end)
    os.close(read_end)
    with pytest.raises(BrokenPipeError):
        sender.wake()


def test_a_full_pipe_neither_blocks_nor_fails_a_wake_up_and_clear_empties_it(
    pipe: tuple[int, int],
) -> None:
    read_end, write_end = pipe
    flag = memoryview(bytearray(8))
    sender, receiver = WakeSender(flag, write_end), WakeReceiver(flag, read_end)
    with pytest.raises(BlockingIOError):  # non-blocking: fill it until it refuses
        while True:
            os.write(write_end, bytes(65536))
    assert unread_bytes(read_end) > 4096
    sender.wake()  # full: the receiver will wake anyway
    assert flag[0] == 1
    assert receiver.clear() is True  # reads in 4 KiB chunks until the pipe is empty
    assert unread_bytes(read_end) == 0
    assert flag[0] == 0
