"""``tiering.copy.bulk``: tables of copies by address, in one GIL-free call or a loop."""

from __future__ import annotations

import ctypes
import importlib.metadata
import itertools
import json
import shutil
import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.copy import bulk

Bytes = np.ndarray[Any, np.dtype[np.uint8]]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(params=bulk.MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each test runs with every way that works here: the C extension, the memmove loop,
    the batched system call."""
    bulk._reset_for_tests(request.param)
    if bulk.active_mode() != request.param:
        bulk._reset_for_tests(None)
        pytest.skip(f"bulk-copy way {request.param!r} is unavailable here")
    yield request.param
    bulk._reset_for_tests(None)


def _addr(arr: Bytes) -> int:
    return int(arr.ctypes.data)


def _table(
    regions: list[tuple[int, int, int]], src: Bytes, dst: Bytes
) -> tuple[list[int], list[int], list[int]]:
    return (
        [_addr(src) + s for s, _, _ in regions],
        [_addr(dst) + d for _, d, _ in regions],
        [n for _, _, n in regions],
    )


@st.composite
def region_tables(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """A buffer size and non-overlapping destination regions with arbitrary sources."""
    size = draw(st.integers(1, 1 << 16))
    cuts = sorted(set(draw(st.lists(st.integers(0, size), max_size=40))) | {0, size})
    regions = []
    for lo, hi in itertools.pairwise(cuts):
        n = hi - lo
        if draw(st.booleans()):
            continue  # a gap: those destination bytes stay untouched
        s = draw(st.integers(0, size - n))
        regions.append((s, lo, n))
    return size, draw(st.permutations(regions))


# ``mode`` only selects the copy path: nothing in it needs resetting between examples.
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(table=region_tables(), seed=st.integers(0, 2**32 - 1))
def test_copy_regions_moves_exactly_the_listed_bytes(
    mode: str, table: tuple[int, list[tuple[int, int, int]]], seed: int
) -> None:
    size, regions = table
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    expected = dst.copy()
    for s, d, n in regions:
        expected[d : d + n] = src[s : s + n]
    bulk.copy_regions(*_table(regions, src, dst))
    assert np.array_equal(dst, expected)


def test_more_regions_than_one_system_call_takes(mode: str) -> None:
    n = bulk.IOV_MAX * 2 + 7
    src = np.arange(n * 3, dtype=np.uint64).view(np.uint8)  # 24 bytes per region
    dst = np.zeros_like(src)
    order = np.random.default_rng(1).permutation(n)
    region = 24
    starts = np.arange(n, dtype=np.uint64) * np.uint64(region)
    bulk.copy_regions(
        _addr(src) + starts, _addr(dst) + starts[order], np.full(n, region, np.uint64)
    )
    moved = dst.reshape(n, region)[order]
    assert np.array_equal(moved, src.reshape(n, region))


def test_empty_tables_and_zero_lengths_copy_nothing(mode: str) -> None:
    src = np.full(16, 7, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    bulk.copy_regions([], [], [])
    bulk.copy_regions([_addr(src)], [_addr(dst)], [0])
    assert not dst.any()


def test_tables_of_different_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="one size"):
        bulk.copy_regions([1, 2], [3], [4, 5])


@pytest.mark.parametrize("value", ["", "bogus"])
def test_the_extension_is_the_default_where_built(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(bulk.ENV_MODE, value)
    bulk._reset_for_tests(None)
    try:
        assert bulk.active_mode() == ("native" if bulk.native_available() else "memmove")
        assert not bulk.uses_system_call()
    finally:
        bulk._reset_for_tests(None)


def test_without_the_extension_the_memmove_loop_copies(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(bulk, "_native", None)
    monkeypatch.setenv(bulk.ENV_MODE, "native")
    bulk._reset_for_tests(None)
    try:
        assert bulk.active_mode() == "memmove" and not bulk.native_available()
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        bulk.copy_regions([_addr(src)], [_addr(dst)], 64)
        assert np.array_equal(src, dst)
    finally:
        bulk._reset_for_tests(None)
    assert "was not built" in caplog.text


def test_the_extension_is_built_by_an_install_that_had_a_compiler() -> None:
    """``make install`` (an editable install of this tree) must not silently lose it."""
    installed = list(
        importlib.metadata.distributions(name="kv-tiering", path=site.getsitepackages())
    )
    if not installed:
        pytest.skip("kv-tiering is not installed in this interpreter's site-packages")
    url = json.loads(installed[0].read_text("direct_url.json") or "{}")
    editable = url.get("dir_info", {}).get("editable", False)
    if not editable or Path(url.get("url", "").removeprefix("file://")) != ROOT:
        pytest.skip("kv-tiering is not installed in editable mode from this tree")
    if shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") is None:
        pytest.skip("no C compiler here: the install rightly went on without the extension")
    assert bulk.native_available(), "setup.py did not build tiering.copy._bulkcopy"


def test_the_system_call_is_chosen_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bulk.ENV_MODE, "process_vm")
    bulk._reset_for_tests(None)
    try:
        # Where the kernel refuses it (seccomp, not Linux) the probe falls back to the loop.
        assert bulk.uses_system_call() == (bulk._probe_system_call() is not None)
    finally:
        bulk._reset_for_tests(None)


@pytest.fixture
def ctypes_way() -> Iterator[None]:
    """The fallback ways' code path (the tests below replace the system call with a fake)."""
    bulk._reset_for_tests("memmove")
    yield
    bulk._reset_for_tests(None)


class _ShortWritev:
    """A system call that copies nothing and reports ``result``, as a refused or partial one."""

    def __init__(self, result: int, errno: int = 0) -> None:
        self.result, self.errno, self.calls = result, errno, 0

    def __call__(self, local: Any, remote: Any, count: int) -> int:
        self.calls += 1
        ctypes.set_errno(self.errno)
        return self.result


@pytest.mark.parametrize(("result", "errno"), [(5, 0), (0, 0), (-1, 1), (-1, 38)])
@pytest.mark.usefixtures("ctypes_way")
def test_a_partial_or_refused_system_call_is_finished_by_the_loop(
    monkeypatch: pytest.MonkeyPatch, result: int, errno: int
) -> None:
    fake = _ShortWritev(result, errno)
    monkeypatch.setattr(bulk, "_system_call", lambda: fake)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    bulk.copy_regions([_addr(src), _addr(src) + 32], [_addr(dst) + 32, _addr(dst)], [32, 32])
    assert fake.calls == 1
    assert np.array_equal(dst, np.concatenate([src[32:], src[:32]]))


@pytest.mark.usefixtures("ctypes_way")
def test_a_bad_address_from_the_kernel_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bulk, "_system_call", lambda: _ShortWritev(-1, 14))  # EFAULT
    src = np.zeros(8, dtype=np.uint8)
    with pytest.raises(OSError, match="process_vm_writev"):
        bulk.copy_regions([_addr(src)], [_addr(src)], [8])


@pytest.mark.usefixtures("ctypes_way")
def test_large_regions_take_the_memmove_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _ShortWritev(-1, 14)  # would raise if it were used
    monkeypatch.setattr(bulk, "_system_call", lambda: fake)
    n = bulk.LOOP_MIN_REGION_BYTES
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    bulk.copy_regions([_addr(src)], [_addr(dst)], [n])
    assert fake.calls == 0 and np.array_equal(src, dst)


def test_small_copies_hold_the_gil_in_batches_and_large_ones_release_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bulk._reset_for_tests("memmove")
    calls: list[tuple[str, int]] = []

    def spy(kind: str, real: Any) -> Any:
        def call(d: int, s: int, n: int) -> Any:
            calls.append((kind, n))
            return real(d, s, n)

        return call

    monkeypatch.setattr(bulk, "_memmove", spy("free", ctypes.memmove))
    monkeypatch.setattr(bulk, "_memmove_holding_gil", spy("held", bulk._memmove_holding_gil))
    hold = bulk.HOLD_GIL_MAX_BYTES
    small = hold // 4
    lengths = [small] * 6 + [hold] + [small] * 2  # 1.5 batches of small, one large, a half
    size = sum(lengths)
    src = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    try:
        bulk.copy_regions(_addr(src) + offsets, _addr(dst) + offsets, lengths)
    finally:
        bulk._reset_for_tests(None)
    assert np.array_equal(src, dst)
    assert calls == [
        *[("held", small)] * 4,
        ("free", 0),  # a release point after a full batch
        *[("held", small)] * 2,
        ("free", 0),
        ("free", hold),  # a large copy releases the GIL itself
        *[("held", small)] * 2,
        ("free", 0),
    ]


def test_a_call_of_few_small_bytes_never_hands_the_gil_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bulk._reset_for_tests("memmove")
    freed: list[int] = []
    monkeypatch.setattr(bulk, "_memmove", lambda d, s, n: freed.append(n))
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    try:
        bulk.copy_regions(
            [_addr(src), _addr(src) + 128], [_addr(dst) + 128, _addr(dst)], [128, 128]
        )
    finally:
        bulk._reset_for_tests(None)
    assert freed == [] and np.array_equal(dst, np.concatenate([src[128:], src[:128]]))


@pytest.mark.parametrize("count", [1, 5, 40])
@pytest.mark.parametrize(
    "length", [1, 4096, bulk.HOLD_GIL_MAX_BYTES - 1, bulk.HOLD_GIL_MAX_BYTES, 3 << 15]
)
def test_one_length_for_every_region(mode: str, count: int, length: int) -> None:
    rng = np.random.default_rng(count * length)
    src = rng.integers(0, 256, count * length, dtype=np.uint8)
    dst = np.zeros_like(src)
    order = rng.permutation(count)
    starts = [i * length for i in range(count)]
    bulk.copy_regions(
        [_addr(src) + starts[i] for i in order], [_addr(dst) + s for s in starts], length
    )
    assert np.array_equal(dst.reshape(count, length), src.reshape(count, length)[order])


def test_one_small_length_copies_in_gil_held_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    bulk._reset_for_tests("memmove")
    releases: list[int] = []
    real = ctypes.memmove
    monkeypatch.setattr(bulk, "_memmove", lambda d, s, n: (releases.append(n), real(d, s, n)))
    length = bulk.HOLD_GIL_MAX_BYTES // 4
    src = np.random.default_rng(5).integers(0, 256, 10 * length, dtype=np.uint8)
    dst = np.zeros_like(src)
    starts = [i * length for i in range(10)]
    try:
        bulk.copy_regions(
            [_addr(src) + s for s in starts], [_addr(dst) + s for s in starts], length
        )
    finally:
        bulk._reset_for_tests(None)
    assert np.array_equal(src, dst)
    assert releases == [0, 0, 0]  # batches of 4, 4 and 2 copies, a release point after each


native_only = pytest.mark.skipif(not bulk.native_available(), reason="the extension is not built")


@native_only
@pytest.mark.parametrize("length", [1, 63, 4096, 8192 + 5])
@pytest.mark.parametrize("misalign", [0, 1, 15])
def test_large_tables_stream_exact_bytes(length: int, misalign: int) -> None:
    """Tables of 4 MiB or more take the non-temporal path: unaligned heads and tails too."""
    count = (4 << 20) // length + 3
    rng = np.random.default_rng(length + misalign)
    src = rng.integers(0, 256, count * length + 64, dtype=np.uint8)
    dst = np.zeros(count * length + 64, dtype=np.uint8)
    order = rng.permutation(count)
    starts = np.arange(count, dtype=np.uint64) * np.uint64(length)
    bulk._reset_for_tests("native")
    try:
        bulk.copy_regions(
            _addr(src) + misalign + starts[order], _addr(dst) + misalign + starts, length
        )
    finally:
        bulk._reset_for_tests(None)
    body = dst[misalign : misalign + count * length].reshape(count, length)
    assert np.array_equal(
        body, src[misalign : misalign + count * length].reshape(count, length)[order]
    )
    assert not dst[:misalign].any() and not dst[misalign + count * length :].any()


@native_only
@pytest.mark.parametrize("length", [64 << 10, (64 << 10) + 1, (64 << 10) + 63, 200_003])
@pytest.mark.parametrize(("src_misalign", "dst_misalign"), [(0, 0), (1, 0), (0, 1), (63, 17)])
def test_large_regions_stream_exact_bytes_in_a_small_call(
    length: int, src_misalign: int, dst_misalign: int
) -> None:
    """Regions of 64 KiB or more are streamed, their source lines flushed, in any call:
    every byte arrives, nothing around the destination changes, the source is intact."""
    rng = np.random.default_rng(length + src_misalign * 7 + dst_misalign)
    src = rng.integers(0, 256, 3 * length + 128, dtype=np.uint8)
    before = src.copy()
    dst = np.zeros(3 * length + 128, dtype=np.uint8)
    starts = np.array([2, 0, 1], dtype=np.uint64) * np.uint64(length)
    bulk._reset_for_tests("native")
    try:
        bulk.copy_regions(
            _addr(src) + src_misalign + starts,
            _addr(dst) + dst_misalign + np.arange(3, dtype=np.uint64) * np.uint64(length),
            length,
        )
    finally:
        bulk._reset_for_tests(None)
    copied = dst[dst_misalign : dst_misalign + 3 * length].reshape(3, length)
    sources = src[src_misalign : src_misalign + 3 * length].reshape(3, length)
    assert np.array_equal(copied, sources[[2, 0, 1]])
    assert not dst[:dst_misalign].any() and not dst[dst_misalign + 3 * length :].any()
    assert np.array_equal(src, before)


@native_only
def test_the_extension_flushes_source_lines_as_this_cpu_allows() -> None:
    """CLFLUSHOPT where CPUID has it, else CLFLUSH (every x86-64 CPU); none elsewhere."""
    from tiering.copy import _bulkcopy

    machine = sysconfig.get_platform()
    reported = _bulkcopy.SOURCE_FLUSH
    if not machine.endswith("x86_64"):
        assert reported == "none"
        return
    flags = {
        flag
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("flags")
        for flag in line.split(":", 1)[1].split()
    }
    assert reported == ("clflushopt" if "clflushopt" in flags else "clflush")


@native_only
def test_a_region_copied_onto_itself_in_a_large_table_is_unchanged() -> None:
    size = 5 << 20
    buf = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    before = buf.copy()
    bulk._reset_for_tests("native")
    try:
        bulk.copy_regions([_addr(buf)], [_addr(buf)], size)
    finally:
        bulk._reset_for_tests(None)
    assert np.array_equal(buf, before)


@native_only
@pytest.mark.parametrize(
    ("src", "dst", "lengths", "error", "match"),
    [
        ([1, 2], [3], 8, ValueError, "one size"),
        ([1], [2], [1, 2], ValueError, "1 regions but 2 lengths"),
        ([1], [2], -1, ValueError, "non-negative"),
        ([1], [2], np.array([-1]), ValueError, "impossible length"),
        ([-1], [2], 0, ValueError, r"src\[0\] must be a non-negative int"),
        ([1], [2], [-8], ValueError, r"lengths\[0\] must be a non-negative int"),
        (np.zeros((1, 1), np.uint64), [2], 0, ValueError, "1-D"),
        (np.zeros(1, np.float64), [2], 0, TypeError, "integers"),
    ],
)
def test_the_extension_refuses_bad_tables_before_copying(
    src: Any, dst: Any, lengths: Any, error: type[Exception], match: str
) -> None:
    bulk._reset_for_tests("native")
    try:
        with pytest.raises(error, match=match):
            bulk.copy_regions(src, dst, lengths)
    finally:
        bulk._reset_for_tests(None)


@pytest.mark.parametrize("mode", ["memmove", "process_vm"])
@pytest.mark.parametrize("lengths", [-8, [-8], np.array([-8])])
def test_a_negative_length_is_refused_by_every_way_before_copying(mode: str, lengths: Any) -> None:
    """ctypes hands a negative int on as a huge size_t: refused, never a corrupted heap."""
    buf = np.zeros(64, dtype=np.uint8)
    bulk._reset_for_tests(mode)
    try:
        with pytest.raises(ValueError, match="non-negative"):
            bulk.copy_regions([_addr(buf)], [_addr(buf) + 32], lengths)
    finally:
        bulk._reset_for_tests(None)
