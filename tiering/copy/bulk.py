"""Many memory-to-memory copies with the bytes moved outside the GIL.

:func:`copy_regions` copies a table of regions (source address, destination
address, length), built with numpy once per job. Two ways, chosen per process:

* ``memmove`` (default): a C-level loop (``map`` over ``ctypes.memmove``, no
  bytecode per region). Copies of :data:`HOLD_GIL_MAX_BYTES` (16 KiB) or more
  each run with the GIL released; smaller ones run with the GIL held, in
  batches of about 16 KiB (about 1.5 us) with a GIL release between batches:
  for a small copy the hand-over costs more than the copy, and a thread
  that releases the GIL behind a busy Python thread waits up to the switch
  interval (5 ms) to get it back, each time. Measured on these machines:
  89-110 % of one large memcpy for 32 KiB regions at random offsets (best
  of 40), where the numpy slice loop it replaced held the GIL for about 1 us
  of Python per region.
* ``process_vm`` (opt-in, ``TIERING_BULK_COPY=process_vm``): one system call
  per :data:`IOV_MAX` regions, Linux's ``process_vm_writev`` on this very
  process, which releases the GIL once for the whole batch (a thread that
  gets the GIL back behind a busy Python thread waits up to the switch
  interval, 5 ms, so one hand-off per batch instead of one per region matters
  when the scheduler thread is CPU-bound). The kernel pins every page it
  copies: 43-47 % of memcpy at 32 KiB regions (best of 40; 29-32 % at
  8 KiB), which is why it is not the default. It is tried once per process
  in a child process first, as a seccomp policy may kill the caller with
  SIGSYS, which cannot be caught; where it fails, ``memmove`` is used.

Regions of :data:`LOOP_MIN_REGION_BYTES` or more (on average) always take the
memmove loop: per-region overhead is negligible there.

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
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

Addresses = npt.NDArray[np.uint64]

#: Most regions one ``process_vm_writev`` call takes (Linux's UIO_MAXIOV).
IOV_MAX = 1024

#: Regions at least this long (on average) are copied by a memmove loop.
LOOP_MIN_REGION_BYTES = 256 << 10

#: Environment variable choosing the way: ``memmove`` (default) or ``process_vm``.
ENV_MODE = "TIERING_BULK_COPY"
MODES = ("memmove", "process_vm")

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
_probed = False
_writev: _VmWritev | None = None


def _system_call() -> _VmWritev | None:
    """The system call if this process may use it (probed once, in a child first)."""
    global _probed, _writev
    if _probed:
        return _writev
    with _lock:
        if not _probed:
            _writev = _probe()
            _probed = True
    return _writev


def _probe() -> _VmWritev | None:
    mode = os.environ.get(ENV_MODE, "").strip().lower() or "memmove"
    if mode not in MODES:
        logger.warning("%s=%r is not one of %s; using memmove", ENV_MODE, mode, ", ".join(MODES))
    if mode != "process_vm":
        return None
    return _probe_system_call()


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
    return _system_call() is not None


def copy_regions(
    src: Sequence[int] | npt.ArrayLike,
    dst: Sequence[int] | npt.ArrayLike,
    lengths: int | Sequence[int] | npt.ArrayLike,
) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to address ``dst[i]``, for every ``i``.

    ``src`` and ``dst`` are lists of Python ints or 1-D integer arrays, of one
    size; ``lengths`` one of the same size, or one int for every region.
    Zero lengths are allowed. The GIL is released for every copy of
    :data:`HOLD_GIL_MAX_BYTES` or more and between batches of about that many
    bytes of smaller copies (the default), or once per batch of
    :data:`IOV_MAX` regions where :func:`uses_system_call`. Raises
    ``OSError`` if the kernel refuses an address (a caller's bug: the bytes
    copied before it stay copied).
    """
    s_list, d_list = _as_list(src), _as_list(dst)
    n = len(s_list)
    if len(d_list) != n:
        raise ValueError(f"src has {n} addresses, dst {len(d_list)}: they must be of one size")
    if n == 0:
        return
    writev = _system_call()
    if isinstance(lengths, int):
        # One length for all (a tier's blocks): no numpy at all on this path.
        if writev is None or lengths >= LOOP_MIN_REGION_BYTES:
            _memmove_same(s_list, d_list, lengths)
            return
        len_a = np.full(n, lengths, dtype=np.uint64)
    else:
        len_a = np.asarray(lengths, dtype=np.uint64)
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


def _as_list(values: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Addresses as a list of Python ints (a list is taken as it is: it must hold ints)."""
    if isinstance(values, list):
        return values
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"addresses must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"addresses must be integers, got {arr.dtype}")
    listed: list[int] = arr.tolist()
    return listed


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
    """Tests: ``"memmove"`` forces the loop, ``"process_vm"`` probes the system call,
    None forgets the choice (the environment decides again at the next copy)."""
    global _probed, _writev
    with _lock:
        _probed = mode is not None
        _writev = _probe_system_call() if mode == "process_vm" else None


__all__ = [
    "ENV_MODE",
    "HOLD_GIL_MAX_BYTES",
    "IOV_MAX",
    "LOOP_MIN_REGION_BYTES",
    "MODES",
    "address_of",
    "copy_regions",
    "uses_system_call",
]
