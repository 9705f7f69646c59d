"""Many memory-to-memory copies with the bytes moved outside the GIL.

:func:`copy_regions` copies a table of regions (source address, destination
address, length). Three ways, chosen once per process:

* ``native`` (the default where it was built): one call into the optional C
  extension :mod:`tiering.copy._bulkcopy`, which copies every region with the
  GIL released once for the whole table (held for tables under
  :data:`HOLD_GIL_MAX_BYTES`, where the hand-over costs more than the copies).
  It prefetches a few regions ahead and writes with non-temporal stores for
  tables of 4 MiB or more and for regions of 64 KiB or more (the latter also
  flush their source lines from the caches once read, so a copy does not
  evict what other cores keep there: ``docs/copy-engine.md``). Regions of a
  few KiB at scattered addresses are bound by memory latency, not by the
  interpreter. Measured on these machines,
  % of one large memcpy, 8 x 8 KiB layers of random blocks: ctypes loop
  22-31 %, one C memmove loop 54-63 %, with prefetching and streaming stores
  84-93 % (``benchmarks/copy_engine.py``). One GIL hand-over per call also
  means a copying thread behind a busy scheduler thread waits for the GIL
  once per job, not once per region.
* ``memmove`` (the fallback where no C compiler was present at install): a
  C-level loop (``map`` over ``ctypes.memmove``, no bytecode per region), about
  0.3 us of call overhead per region. Copies of :data:`HOLD_GIL_MAX_BYTES`
  (16 KiB) or more each run with the GIL released; smaller ones run with the
  GIL held, in batches of about 16 KiB with a release point between (a thread
  that releases the GIL behind a busy Python thread waits up to the switch
  interval, 5 ms, to get it back, each time).
* ``process_vm`` (opt-in): one system call per :data:`IOV_MAX` regions,
  Linux's ``process_vm_writev`` on this very process. The kernel pins every
  page it copies: 43-47 % of memcpy at 32 KiB regions, 29-32 % at 8 KiB. It
  is tried once per process in a child process first, as a seccomp policy may
  kill the caller with SIGSYS, which cannot be caught.

``TIERING_BULK_COPY`` (:data:`ENV_MODE`) picks a way; one that cannot be used
here falls back to the default with a log line.

Callers guarantee that every region lies inside memory they hold for the
duration of the call, and that no destination overlaps any source of the
same call (a refused system call is redone region by region, which would
otherwise read bytes it already overwrote).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import os
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

_native: ModuleType | None
try:  # built at install where a C compiler was present (setup.py): optional
    from tiering.copy import _bulkcopy as _native
except ImportError:  # pragma: no cover - depends on the install
    _native = None

logger = logging.getLogger(__name__)

Addresses = npt.NDArray[np.uint64]

#: Most regions one ``process_vm_writev`` call takes (Linux's UIO_MAXIOV).
IOV_MAX = 1024

#: Regions at least this long (on average) are copied by a memmove loop.
LOOP_MIN_REGION_BYTES = 256 << 10

#: Environment variable choosing the way: ``native`` (the default where built),
#: ``memmove`` (the default elsewhere) or ``process_vm``.
ENV_MODE = "TIERING_BULK_COPY"
MODES = ("native", "memmove", "process_vm")

#: Copies shorter than this are made with the GIL held, in runs of at most
#: this many bytes (about 1.5 us of memcpy), with a GIL release between runs.
#: Below it, handing the GIL over costs more than the copy: a thread that
#: releases the GIL behind a busy Python thread waits for it up to the switch
#: interval (5 ms), and each hand-over is a context switch.
HOLD_GIL_MAX_BYTES = 16 << 10

# libc's memmove, releasing the GIL (ctypes' own) and holding it (PYFUNCTYPE).
_memmove = ctypes.memmove
_memmove_holding_gil: Any = ctypes.PYFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)(ctypes._memmove_addr)  # type: ignore[attr-defined]


class _VmWritev:
    """``process_vm_writev`` on this process, once it is known to work here."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.process_vm_writev
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        self._fn = fn
        self._pid = os.getpid()

    def __call__(self, local: Addresses, remote: Addresses, count: int) -> int:
        """Copy ``count`` regions (iovec rows of ``local`` to those of ``remote``).

        Returns the bytes copied, or -1 (``ctypes.get_errno()`` says why).
        """
        if self._pid != os.getpid():  # forked: the cached pid is the parent's
            self._pid = os.getpid()
        return int(self._fn(self._pid, local.ctypes.data, count, remote.ctypes.data, count, 0))


_PROBE = """
import ctypes, ctypes.util, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
fn = libc.process_vm_writev
fn.restype = ctypes.c_ssize_t
fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
               ctypes.c_ulong]
src = ctypes.create_string_buffer(b"bulkcopy", 8)
dst = ctypes.create_string_buffer(8)
iov = (ctypes.c_uint64 * 2)(ctypes.addressof(src), 8)
rio = (ctypes.c_uint64 * 2)(ctypes.addressof(dst), 8)
n = fn(os.getpid(), ctypes.addressof(iov), 1, ctypes.addressof(rio), 1, 0)
sys.exit(0 if n == 8 and dst.raw == b"bulkcopy" else 3)
"""

_lock = threading.Lock()
_mode: str | None = None  # the way chosen; None until the first copy
_writev: _VmWritev | None = None


def native_available() -> bool:
    """Whether the C extension was built for this interpreter."""
    return _native is not None


def _default_mode() -> str:
    return "native" if _native is not None else "memmove"


def active_mode() -> str:
    """The way this process copies: ``native``, ``memmove`` or ``process_vm`` (chosen once)."""
    mode = _mode
    if mode is not None:
        return mode
    with _lock:
        if _mode is None:
            _choose(os.environ.get(ENV_MODE, "").strip().lower() or _default_mode())
        assert _mode is not None
        return _mode


def _choose(wanted: str) -> None:
    """Set the way to ``wanted`` if it can be used here, else to the default (log why)."""
    global _mode, _writev
    _writev = None
    if wanted not in MODES:
        logger.warning(
            "%s=%r is not one of %s; using %s", ENV_MODE, wanted, ", ".join(MODES), _default_mode()
        )
        wanted = _default_mode()
    if wanted == "native" and _native is None:
        logger.warning(
            "%s=native, but tiering.copy._bulkcopy was not built (no C compiler at install); "
            "using memmove",
            ENV_MODE,
        )
        wanted = "memmove"
    if wanted == "process_vm":
        _writev = _probe_system_call()
        if _writev is None:
            wanted = _default_mode()
    _mode = wanted


def _system_call() -> _VmWritev | None:
    """The system call if this process uses it (opt-in; probed once, in a child first)."""
    active_mode()
    return _writev


def _probe_system_call() -> _VmWritev | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        child = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.info("bulk copies use a memmove loop: the probe could not run (%s)", exc)
        return None
    if child.returncode != 0:
        logger.info(
            "bulk copies use a memmove loop: process_vm_writev is unavailable here "
            "(probe exit status %d)",
            child.returncode,
        )
        return None
    try:
        writev = _VmWritev()
        src = np.frombuffer(b"in-proc!", dtype=np.uint8)
        dst = np.zeros(8, dtype=np.uint8)
        local = np.array([src.ctypes.data, 8], dtype=np.uint64)
        remote = np.array([dst.ctypes.data, 8], dtype=np.uint64)
        if writev(local, remote, 1) != 8 or dst.tobytes() != b"in-proc!":
            return None
    except (AttributeError, OSError) as exc:
        logger.info("bulk copies use a memmove loop: %s", exc)
        return None
    return writev


def uses_system_call() -> bool:
    """Whether small regions are copied by one GIL-free system call per batch (opt-in)."""
    return active_mode() == "process_vm"


def copy_regions(
    src: Sequence[int] | npt.ArrayLike,
    dst: Sequence[int] | npt.ArrayLike,
    lengths: int | Sequence[int] | npt.ArrayLike,
) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to address ``dst[i]``, for every ``i``.

    ``src`` and ``dst`` are lists of Python ints or 1-D integer arrays, of one
    size; ``lengths`` one of the same size, or one int for every region.
    Zero lengths are allowed. The GIL is released once for the whole table
    when it holds :data:`HOLD_GIL_MAX_BYTES` or more (``native``), for every
    copy of that size or more and between batches of about that many bytes
    of smaller copies (``memmove``), or once per batch of :data:`IOV_MAX`
    regions (``process_vm``); see :func:`active_mode`. Raises ``OSError`` if
    the kernel refuses an address (a caller's bug: the bytes copied before it
    stay copied).
    """
    if active_mode() == "native":
        _copy_native(src, dst, lengths)
        return
    s_list, d_list = _as_list(src), _as_list(dst)
    n = len(s_list)
    if len(d_list) != n:
        raise ValueError(f"src has {n} addresses, dst {len(d_list)}: they must be of one size")
    if n == 0:
        return
    writev = _system_call()
    if isinstance(lengths, int):
        if lengths < 0:  # ctypes would pass it on as a huge size_t: a corrupted heap
            raise ValueError(f"lengths must be non-negative, got {lengths}")
        # One length for all (a tier's blocks): no numpy at all on this path.
        if writev is None or lengths >= LOOP_MIN_REGION_BYTES:
            _memmove_same(s_list, d_list, lengths)
            return
        len_a = np.full(n, lengths, dtype=np.uint64)
    else:
        given = np.asarray(lengths)
        if given.size and given.dtype.kind == "i" and int(given.min()) < 0:
            raise ValueError(f"lengths must be non-negative, got {int(given.min())}")
        len_a = given.astype(np.uint64)
        if len_a.shape != (n,):
            raise ValueError(f"{n} regions but lengths of shape {len_a.shape}")
        if writev is None or int(len_a.sum()) >= n * LOOP_MIN_REGION_BYTES:
            _memmove_loop(s_list, d_list, len_a)
            return
    src_a = np.asarray(s_list, dtype=np.uint64)
    dst_a = np.asarray(d_list, dtype=np.uint64)
    local = np.empty((n, 2), dtype=np.uint64)
    remote = np.empty((n, 2), dtype=np.uint64)
    local[:, 0], local[:, 1] = src_a, len_a
    remote[:, 0], remote[:, 1] = dst_a, len_a
    for start in range(0, n, IOV_MAX):
        stop = min(start + IOV_MAX, n)
        want = int(len_a[start:stop].sum())
        done = writev(local[start:], remote[start:], stop - start)
        if done == want:
            continue
        if done < 0:
            err = ctypes.get_errno()
            if err not in (0, 1, 38):  # EPERM / ENOSYS: refused now, copy it ourselves
                raise OSError(err, f"process_vm_writev: {os.strerror(err)}")
        # A partial or refused batch: copy it again region by region (the
        # destinations do not overlap the sources, so repeating is harmless).
        _memmove_loop(s_list[start:stop], d_list[start:stop], len_a[start:stop])


def _copy_native(
    src: Sequence[int] | npt.ArrayLike,
    dst: Sequence[int] | npt.ArrayLike,
    lengths: int | Sequence[int] | npt.ArrayLike,
) -> None:
    """One call into the extension (which checks the tables' sizes before copying)."""
    assert _native is not None
    one_length = isinstance(lengths, (int, np.integer))
    length_table = int(lengths) if one_length else _as_table(lengths)  # type: ignore[arg-type]
    _native.copy_regions(_as_table(src), _as_table(dst), length_table, HOLD_GIL_MAX_BYTES)


def _as_table(values: Sequence[int] | npt.ArrayLike) -> Sequence[int] | npt.NDArray[Any]:
    """A list as it is (the extension converts it), an array as 1-D 8-byte integers."""
    if isinstance(values, list):
        return values
    arr = _integer_array(values)
    if arr.dtype.itemsize != 8 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=np.uint64)
    return arr


def _as_list(values: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Addresses as a list of Python ints (a list is taken as it is: it must hold ints)."""
    if isinstance(values, list):
        return values
    listed: list[int] = _integer_array(values).tolist()
    return listed


def _integer_array(values: Sequence[int] | npt.ArrayLike) -> npt.NDArray[Any]:
    """``values`` as a 1-D integer array; ValueError / TypeError naming what is wrong."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"addresses and lengths must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"addresses and lengths must be integers, got {arr.dtype}")
    return arr


def _memmove_same(src: list[int], dst: list[int], length: int) -> None:
    """:func:`_memmove_loop` for regions of one ``length`` (pure Python, no numpy)."""
    free: Any = _memmove
    held: Any = _memmove_holding_gil
    hold = HOLD_GIL_MAX_BYTES
    n = len(src)
    if length >= hold:
        deque(map(free, dst, src, itertools.repeat(length, n)), maxlen=0)
        return
    per_batch = max(1, hold // max(1, length))
    if n <= per_batch:
        deque(map(held, dst, src, itertools.repeat(length, n)), maxlen=0)
        return
    for a in range(0, n, per_batch):
        b = min(a + per_batch, n)
        deque(map(held, dst[a:b], src[a:b], itertools.repeat(length, b - a)), maxlen=0)
        free(dst[a], dst[a], 0)  # a release point: a waiting thread gets the GIL here


def _memmove_loop(src: list[int], dst: list[int], lengths: Addresses) -> None:
    """Copies of :data:`HOLD_GIL_MAX_BYTES` or more release the GIL, each; smaller ones
    run in batches of about that many bytes with the GIL held, a release point between.

    ``map`` drives each batch in C: no bytecode runs between two copies.
    """
    free: Any = _memmove
    held: Any = _memmove_holding_gil
    d, s, n = dst, src, lengths.tolist()
    hold = HOLD_GIL_MAX_BYTES
    if int(lengths.min()) >= hold:
        deque(map(free, d, s, n), maxlen=0)
        return
    if int(lengths.sum()) <= hold:
        deque(map(held, d, s, n), maxlen=0)
        return
    big = lengths >= np.uint64(hold)
    # Batch by starting offset in the stream of bytes; a large copy is a batch alone.
    batch = (np.cumsum(lengths) - lengths) // np.uint64(hold)
    cuts = np.flatnonzero((batch[1:] != batch[:-1]) | big[1:] | big[:-1]) + 1
    bounds = [0, *cuts.tolist(), len(n)]
    for a, b in itertools.pairwise(bounds):
        if b - a == 1 and n[a] >= hold:
            free(d[a], s[a], n[a])
        else:
            deque(map(held, d[a:b], s[a:b], n[a:b]), maxlen=0)
            free(d[a], d[a], 0)  # a release point: a waiting thread gets the GIL here


def address_of(view: memoryview) -> int:
    """The address of the first byte of a C-contiguous ``view`` (read-only views too).

    The address stays valid while ``view`` is alive and not released.
    Raises ``ValueError`` for a view that is not C-contiguous.
    """
    if not view.c_contiguous:
        raise ValueError("bulk copies need C-contiguous buffers")
    if view.nbytes == 0:
        return 0
    if not view.readonly:  # the cheap way (0.2 us), for writable buffers only
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _reset_for_tests(mode: str | None) -> None:
    """Tests: use way ``mode`` where it works here (else the default), or forget the
    choice with None (the environment decides again at the next copy)."""
    global _mode, _writev
    with _lock:
        if mode is None:
            _mode, _writev = None, None
        else:
            _choose(mode)


__all__ = [
    "ENV_MODE",
    "HOLD_GIL_MAX_BYTES",
    "IOV_MAX",
    "LOOP_MIN_REGION_BYTES",
    "MODES",
    "active_mode",
    "address_of",
    "copy_regions",
    "native_available",
    "uses_system_call",
]
