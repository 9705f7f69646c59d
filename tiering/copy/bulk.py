"""Many memory-to-memory copies in one call that releases the GIL.

A Python loop of copies holds the GIL between two copies: with regions of
8-32 KiB, a quarter to a half of the loop's time, taken from every other
Python thread of the process (the scheduler, in an inference engine). Worse,
each copy hands the GIL over and back, and a thread taking it back behind a
busy Python thread waits up to the interpreter's switch interval (5 ms).

:func:`copy_regions` moves a whole table of regions (source address,
destination address, length) with one system call per :data:`IOV_MAX`
regions: Linux's ``process_vm_writev`` applied to this very process, called
through ctypes, which releases the GIL for the whole call. Regions of
:data:`LOOP_MIN_REGION_BYTES` or more go through a ``ctypes.memmove`` loop
instead (one GIL release per region is cheap there, and a user-space memcpy
of a large region beats the kernel's page-by-page copy).

Where the system call cannot be used (not Linux, or a seccomp policy that
refuses or kills it) the memmove loop does everything. The call is tried
once per process in a child process first, as a policy may kill the caller
with SIGSYS, which cannot be caught. ``TIERING_BULK_COPY=loop`` skips it.

Callers guarantee that every region lies inside memory they hold for the
duration of the call, and that no destination overlaps any source of the
same call (a failed system call is retried region by region, which would
otherwise read bytes it already overwrote).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

Addresses = npt.NDArray[np.uint64]

#: Most regions one ``process_vm_writev`` call takes (Linux's UIO_MAXIOV).
IOV_MAX = 1024

#: Regions at least this long (on average) are copied by a memmove loop.
LOOP_MIN_REGION_BYTES = 256 << 10

#: Environment variable: ``loop`` never uses the system call.
ENV_MODE = "TIERING_BULK_COPY"

_memmove = ctypes.memmove


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
    if os.environ.get(ENV_MODE, "").strip().lower() == "loop":
        return None
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
    """Whether small regions are copied by one GIL-free system call per batch here."""
    return _system_call() is not None


def copy_regions(src: npt.ArrayLike, dst: npt.ArrayLike, lengths: npt.ArrayLike) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to address ``dst[i]``, for every ``i``.

    Releases the GIL for the whole batch where :func:`uses_system_call` (one
    system call per :data:`IOV_MAX` regions), else per region. Addresses and
    lengths are 1-D integer arrays of one size; zero lengths are allowed.
    Raises ``OSError`` if the kernel refuses an address (a caller's bug: the
    bytes copied before it stay copied).
    """
    src_a = np.asarray(src, dtype=np.uint64)
    dst_a = np.asarray(dst, dtype=np.uint64)
    len_a = np.asarray(lengths, dtype=np.uint64)
    n = int(len_a.size)
    if src_a.shape != (n,) or dst_a.shape != (n,):
        raise ValueError(
            f"src, dst and lengths must be 1-D of one size, got {src_a.shape}, {dst_a.shape}, "
            f"{len_a.shape}"
        )
    if n == 0:
        return
    total = int(len_a.sum())
    writev = _system_call()
    if writev is None or total >= n * LOOP_MIN_REGION_BYTES:
        _memmove_loop(src_a, dst_a, len_a)
        return
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
        _memmove_loop(src_a[start:stop], dst_a[start:stop], len_a[start:stop])


def _memmove_loop(src: Addresses, dst: Addresses, lengths: Addresses) -> None:
    memmove: Any = _memmove
    for s, d, k in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        if k:
            memmove(d, s, k)


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
    """Forget the probe (tests): ``"loop"`` forces the loop, None probes again."""
    global _probed, _writev
    with _lock:
        _probed = mode == "loop"
        _writev = None


__all__ = ["IOV_MAX", "LOOP_MIN_REGION_BYTES", "address_of", "copy_regions", "uses_system_call"]
