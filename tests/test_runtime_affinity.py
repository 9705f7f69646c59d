"""Pinning what runs a tier (the ``cpus`` option): checks, the loop thread, its threads, a child.

The pinned CPU is one this process may already use (the last of them), so
the tests run on any Linux machine; the scheduler thread's own affinity must
never change.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.runtime_support import key, one_result, primary, store
from tiering.core.errors import ConfigError
from tiering.isolation import IsolatedTierManager
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager
from tiering.runtime.affinity import (
    _parse_cpu_list,
    allowed_cpus,
    check_cpus,
    format_cpu_list,
    pin_current_thread,
)
from tiering.tier import TierContext
from tiers.memory import MemoryTier

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="the platform cannot pin threads"
)

ALLOWED = allowed_cpus()
TARGET = max(ALLOWED) if ALLOWED else 0


class ThreadRecordingTier(MemoryTier):
    """Records the affinity of its loop thread and of a worker thread it starts while opening."""

    def __init__(self) -> None:
        super().__init__()
        self.loop_thread_cpus: set[int] = set()
        self.worker_cpus: set[int] = set()

    async def open(self, context: TierContext) -> None:
        await super().open(context)
        self.loop_thread_cpus = os.sched_getaffinity(0)
        self.worker_cpus = await asyncio.to_thread(os.sched_getaffinity, 0)


# -- checks -------------------------------------------------------------------------------------


def test_none_means_not_pinned_and_ids_or_list_strings_are_accepted() -> None:
    assert check_cpus(None) is None
    assert check_cpus([TARGET]) == {TARGET}
    assert check_cpus((TARGET,)) == {TARGET}
    assert check_cpus(str(TARGET)) == {TARGET}
    assert check_cpus(format_cpu_list(ALLOWED)) == ALLOWED


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "at least one CPU"),
        ("", r"'' in '' is not a CPU id"),
        ("1-x", r"'1-x' in '1-x' is not a CPU id or a range"),
        ("3-1", r"'3-1' in '3-1' is not a valid CPU range"),
        ("-1", r"'-1' in '-1' is not a CPU id"),
        ([-1], r"CPU ids \(ints >= 0\), got -1"),
        (["0"], r"CPU ids \(ints >= 0\), got '0'"),
        ([True], r"CPU ids \(ints >= 0\), got True"),
        (1, "a list of CPU ids or a string"),
        ({"cpu": 1}, "a list of CPU ids or a string"),
    ],
)
def test_bad_values_are_refused_with_what_is_wrong(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_cpus(value)


def test_cpus_this_machine_lacks_are_named() -> None:
    missing = (os.cpu_count() or 1) + 1000
    with pytest.raises(ConfigError, match=rf"cpus: {missing} not a CPU of this machine"):
        check_cpus([TARGET, missing])


CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")
IN_A_CPUSET = """
import os, sys
from tiering.core.errors import ConfigError
from tiering.runtime.affinity import pin_current_thread
target, outside = int(sys.argv[1]), int(sys.argv[2])
before = os.sched_getaffinity(0)
try:
    pin_current_thread(frozenset({target, outside}))
except ConfigError as exc:
    print("refused:", exc)
print("unchanged" if os.sched_getaffinity(0) == before else "changed")
"""


@pytest.fixture
def one_cpu_cpuset() -> Iterator[Path]:
    """A cgroup-v1 cpuset of one CPU (``TARGET``), removed afterwards."""
    if os.geteuid() != 0 or not (CPUSET_ROOT / "cpuset.cpus").is_file():
        pytest.skip("needs root and a cgroup-v1 cpuset hierarchy at /sys/fs/cgroup/cpuset")
    group = CPUSET_ROOT / f"kv-tiering-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpuset.mems").write_text((CPUSET_ROOT / "cpuset.mems").read_text())
        (group / "cpuset.cpus").write_text(str(TARGET))
        yield group
    finally:
        group.rmdir()  # the child has exited: the group is empty


def test_a_cpu_outside_the_cpuset_fails_at_pinning_and_changes_nothing(
    one_cpu_cpuset: Path,
) -> None:
    """The real kernel: a process in a one-CPU cpuset asks for a second CPU."""
    machine = os.cpu_count() or 1
    if machine < 2:
        pytest.skip("a one-CPU machine has no CPU outside the cpuset")
    outside = (TARGET + 1) % machine
    tasks = one_cpu_cpuset / "tasks"
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"open({str(tasks)!r}, 'w').write(str(__import__('os').getpid()))\n" + IN_A_CPUSET,
            str(TARGET),
            str(outside),
        ],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    refusal = f"refused: cpus: {outside} not allowed to this process"
    assert refusal in child.stdout, child.stdout + child.stderr
    assert child.stdout.rstrip().endswith("unchanged"), child.stdout


def test_pinning_outside_the_cpuset_is_refused_and_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same as above on every machine: a kernel whose cpuset allows one CPU.

    Linux narrows an affinity mask to the cpuset without an error, and refuses
    (EINVAL) a mask with no allowed CPU at all; the thread must end as it began.
    """
    cpuset = {TARGET}
    mask = {"now": set(cpuset)}

    def set_affinity(tid: int, cpus: object) -> None:
        assert tid == 0
        narrowed = set(cpus) & cpuset  # type: ignore[call-overload]
        if not narrowed:
            raise OSError(22, "Invalid argument")
        mask["now"] = narrowed

    monkeypatch.setattr(os, "sched_setaffinity", set_affinity)
    monkeypatch.setattr(os, "sched_getaffinity", lambda tid: set(mask["now"]))
    outside = TARGET + 1
    with pytest.raises(ConfigError, match=rf"cpus: {outside} not allowed to this process"):
        pin_current_thread(frozenset({TARGET, outside}))
    assert mask["now"] == cpuset  # narrowed for a moment, then put back
    with pytest.raises(ConfigError, match=rf"cpus: cannot run on {outside}: "):
        pin_current_thread(frozenset({outside}))
    assert mask["now"] == cpuset
    pin_current_thread(frozenset({TARGET}))  # what the cpuset allows works
    assert mask["now"] == cpuset


@given(st.sets(st.integers(min_value=0, max_value=300)))
def test_the_list_format_round_trips(cpus: set[int]) -> None:
    text = format_cpu_list(cpus)
    assert (_parse_cpu_list(text) if text else set()) == cpus
    assert " " not in text


def test_a_bad_value_fails_the_manager_before_anything_starts() -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError, match="cpus must name at least one CPU"):
        AsyncTierManager(MemoryTier(), primary(rows=4).data, "memory", cpus=[])
    assert threading.active_count() == before


# -- what gets pinned -----------------------------------------------------------------------------


def test_the_loop_thread_and_the_threads_the_tier_starts_are_pinned() -> None:
    scheduler_cpus = os.sched_getaffinity(0)
    tier = ThreadRecordingTier()
    with AsyncTierManager(tier, primary(rows=4).data, "memory", cpus=str(TARGET)) as manager:
        assert manager.cpus == {TARGET}
        assert tier.loop_thread_cpus == {TARGET}
        assert tier.worker_cpus == {TARGET}
        loop_thread = manager._thread._thread
        assert loop_thread.native_id is not None
        assert os.sched_getaffinity(loop_thread.native_id) == {TARGET}
    assert os.sched_getaffinity(0) == scheduler_cpus  # the caller's thread is untouched


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_a_scheduler_pinned_apart_can_pin_its_tier_elsewhere() -> None:
    scheduler_cpu, tier_cpu = min(ALLOWED), max(ALLOWED)
    seen: dict[str, object] = {}

    def scheduler() -> None:  # its own thread: this affinity must not leak into other tests
        try:
            os.sched_setaffinity(0, {scheduler_cpu})
            tier = ThreadRecordingTier()
            with AsyncTierManager(tier, primary(rows=4).data, "memory", cpus=[tier_cpu]):
                seen["tier"] = tier.loop_thread_cpus
            seen["scheduler"] = os.sched_getaffinity(0)
        except BaseException as exc:
            seen["error"] = exc

    thread = threading.Thread(target=scheduler)
    thread.start()
    thread.join(30)
    assert "error" not in seen, seen.get("error")
    assert seen == {"tier": {tier_cpu}, "scheduler": {scheduler_cpu}}


def test_without_cpus_the_loop_thread_keeps_the_callers_affinity() -> None:
    tier = ThreadRecordingTier()
    with AsyncTierManager(tier, primary(rows=4).data, "memory") as manager:
        assert manager.cpus is None
        assert tier.loop_thread_cpus == os.sched_getaffinity(0)


def test_an_isolated_tiers_process_is_pinned() -> None:
    scheduler_cpus = os.sched_getaffinity(0)
    with HostBuffer.create(4, 4096, shared_name=make_shared_name("affinity")) as host:
        try:
            factory = functools.partial(MemoryTier, capacity_blocks=4)
            with IsolatedTierManager(
                factory, host, "memory", cpus=[TARGET], job_timeout_s=10.0
            ) as manager:
                assert manager.pid is not None
                tasks = os.listdir(f"/proc/{manager.pid}/task")
                assert tasks and all(os.sched_getaffinity(int(t)) == {TARGET} for t in tasks)
                manager.submit_store(store(1, [key(1)], [0]))
                assert one_result(manager).success
        finally:
            host.unlink()
    assert os.sched_getaffinity(0) == scheduler_cpus


def test_the_cpus_key_of_a_config_entry() -> None:
    view = primary(rows=4).data
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].*cpus: .* not a CPU of this"):
        create_secondary_tier({"type": "memory", "cpus": [os.cpu_count() or 1]}, view, position=1)
    manager = create_secondary_tier({"type": "memory", "cpus": [TARGET]}, view, position=0)
    try:
        assert manager.cpus == {TARGET}
        assert os.sched_getaffinity(manager._thread._thread.native_id or 0) == {TARGET}
    finally:
        manager.shutdown()
