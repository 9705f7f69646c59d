"""Private anonymous mappings for block bytes: huge pages asked for, not inherited by forks;
why the kernel's settings refuse huge pages, and the host buffer's log line saying so."""

from __future__ import annotations

import logging
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

import tiering.primary.host_buffer as host_buffer
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.primary.mappings import HUGE_PAGE_BYTES, huge_pages_refused, private_anonymous

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def vm_flags(address: int) -> set[str]:
    """The kernel's flags of the mapping holding ``address`` (``/proc/self/smaps``)."""
    current: tuple[int, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            current = (low, high)
        elif head == "VmFlags:" and current and current[0] <= address < current[1]:
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_only
def test_a_private_mapping_asks_for_huge_pages_and_is_not_inherited_by_forks() -> None:
    mapping = private_anonymous(4 * HUGE_PAGE_BYTES)
    array = np.frombuffer(mapping, dtype=np.uint8)
    try:
        assert not array.any()  # zero-filled
        flags = vm_flags(array.ctypes.data)
        # hg: MADV_HUGEPAGE; dc: MADV_DONTFORK; no "sh": private, not shared memory.
        assert {"hg", "dc"} <= flags and "sh" not in flags
    finally:
        del array
        mapping.close()


@linux_only
def test_an_anonymous_host_buffer_is_private_and_a_shared_one_advised() -> None:
    with HostBuffer.create(2, HUGE_PAGE_BYTES) as buf:
        flags = vm_flags(buf.as_numpy().ctypes.data)
        assert {"hg", "dc"} <= flags and "sh" not in flags
    with HostBuffer.create(2, HUGE_PAGE_BYTES, shared_name=make_shared_name("kvtier_test")) as buf:
        flags = vm_flags(buf.as_numpy().ctypes.data)
        assert {"hg", "sh"} <= flags and "dc" not in flags  # other processes attach to it


def test_a_mapping_under_one_huge_page_is_not_advised() -> None:
    mapping = private_anonymous(mmap.PAGESIZE)
    try:
        if sys.platform.startswith("linux"):
            array = np.frombuffer(mapping, dtype=np.uint8)
            assert "hg" not in vm_flags(array.ctypes.data)
            del array
    finally:
        mapping.close()


@pytest.mark.parametrize(
    ("shared", "text", "refused"),
    [
        (False, "always [madvise] never\n", False),
        (False, "[always] madvise never\n", False),
        (False, "always madvise [never]\n", True),
        (True, "always within_size advise [never] deny force\n", True),
        (True, "always within_size advise never [deny] force\n", True),
        (True, "always within_size [advise] never deny force\n", False),
        (True, "[always] within_size advise never deny force\n", False),
    ],
)
def test_huge_pages_refused_reads_the_chosen_setting(
    tmp_path: Path, shared: bool, text: str, refused: bool
) -> None:
    setting = "shmem_enabled" if shared else "enabled"
    (tmp_path / setting).write_text(text)
    reason = huge_pages_refused(shared, thp_dir=tmp_path)
    if refused:
        assert reason is not None
        assert str(tmp_path / setting) in reason  # names the file an operator changes
        assert ("'advise'" if shared else "'madvise'") in reason
    else:
        assert reason is None


def test_no_settings_to_read_is_not_a_refusal(tmp_path: Path) -> None:
    assert huge_pages_refused(False, thp_dir=tmp_path / "absent") is None
    (tmp_path / "enabled").write_text("garbled\n")
    assert huge_pages_refused(False, thp_dir=tmp_path) is None


@pytest.fixture
def thp_enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``enabled`` setting the host buffer reads, and a fresh log-once memory."""
    setting = tmp_path / "enabled"
    monkeypatch.setattr(
        host_buffer, "huge_pages_refused", lambda shared: huge_pages_refused(shared, tmp_path)
    )
    monkeypatch.setattr(host_buffer, "_small_pages_logged", set())
    return setting


def host_buffer_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tiering.primary.host_buffer"]


def test_the_host_buffer_logs_once_why_it_has_no_huge_pages(
    thp_enabled: Path, caplog: pytest.LogCaptureFixture
) -> None:
    thp_enabled.write_text("always madvise [never]\n")
    with caplog.at_level(logging.INFO, logger="tiering.primary.host_buffer"):
        for _ in range(3):
            with HostBuffer.create(2, HUGE_PAGE_BYTES):
                pass
        with HostBuffer.create(1, 4096):  # too small to ask: nothing to say
            pass
    lines = host_buffer_log(caplog)
    assert len(lines) == 1, lines
    assert "anonymous host buffers are in 4 KiB pages" in lines[0]
    assert str(thp_enabled) in lines[0]


def test_the_host_buffer_says_nothing_where_huge_pages_are_granted(
    thp_enabled: Path, caplog: pytest.LogCaptureFixture
) -> None:
    thp_enabled.write_text("always [madvise] never\n")
    with (
        caplog.at_level(logging.INFO, logger="tiering.primary.host_buffer"),
        HostBuffer.create(2, HUGE_PAGE_BYTES),
    ):
        pass
    assert not host_buffer_log(caplog)
