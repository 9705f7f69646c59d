"""io_uring through the kernel's own interface: three syscalls and two shared rings.

No compiled binding is involved. The ring is set up with ``io_uring_setup``,
its submission and completion queues are mapped with :mod:`mmap`, entries are
written and read with :mod:`struct`, and ``io_uring_enter`` /
``io_uring_register`` are called through libc's ``syscall`` with :mod:`ctypes`.
Why not a binding: the PyPI ``liburing`` wheels (2026.3.x) contain AVX-512
instructions and kill the process with SIGILL on CPUs without them, and their
``io_uring_submit`` holds the GIL. Here the only native code is libc, and
ctypes releases the GIL for every syscall.

The rings are shared memory that the kernel reads and writes concurrently.
Entries are published by storing the queue tail after the entry, and consumed
by storing the head after reading them; on x86-64 the hardware keeps stores in
order and loads in order (TSO), so plain stores are enough. Other
architectures need barriers Python cannot express: :func:`ring_unsupported_reason`
says so and the tier uses its thread backend there.

Only the subset the filesystem tier needs: READ/WRITE (one buffer),
READV/WRITEV (several), FSYNC (datasync) and an eventfd for completions.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import struct
from typing import Final

__all__ = [
    "Completion",
    "KernelRing",
    "RingFull",
    "ring_unsupported_reason",
]

# Syscall numbers: io_uring was added (Linux 5.1) after the syscall tables were unified,
# so these are the same on every architecture.
_SYS_IO_URING_SETUP: Final = 425
_SYS_IO_URING_ENTER: Final = 426
_SYS_IO_URING_REGISTER: Final = 427

_IORING_OFF_SQ_RING: Final = 0
_IORING_OFF_CQ_RING: Final = 0x8000000
_IORING_OFF_SQES: Final = 0x10000000
_IORING_FEAT_SINGLE_MMAP: Final = 1 << 0
_IORING_REGISTER_EVENTFD: Final = 4
_IORING_ENTER_GETEVENTS: Final = 1

OP_READV: Final = 1
OP_WRITEV: Final = 2
OP_FSYNC: Final = 3
OP_READ: Final = 22
OP_WRITE: Final = 23
FSYNC_DATASYNC: Final = 1

# struct io_uring_sqe (64 bytes): opcode, flags, ioprio, fd, off, addr, len, rw_flags,
# user_data, buf_index, personality, splice_fd_in, addr3, pad.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")  # user_data, res, flags
_U32 = struct.Struct("<I")
_IOVEC = struct.Struct("<QQ")
assert _SQE.size == 64 and _CQE.size == 16

#: A completion: (user_data, result). A negative result is ``-errno``.
Completion = tuple[int, int]


class _SqOffsets(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint32)
        for name in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array")
    ] + [("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint32)
        for name in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags")
    ] + [("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SqOffsets),
        ("cq_off", _CqOffsets),
    ]


assert ctypes.sizeof(_Params) == 120

_libc = ctypes.CDLL(None, use_errno=True)  # CDLL: the GIL is released during each call
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def ring_unsupported_reason() -> str | None:
    """Why this module cannot drive a ring on this platform (None when it can)."""
    if platform.system() != "Linux":
        return f"io_uring is Linux only (this is {platform.system()})"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return (
            f"io_uring from Python needs x86-64 memory ordering (this is {machine}); "
            "the thread backend is used"
        )
    return None


class RingFull(Exception):
    """No submission entry is free: submit, or wait for completions, first."""


class KernelRing:
    """One io_uring instance. Not thread-safe: one thread (a tier's loop) owns it.

    ``prepare_*`` write entries into the submission queue, :meth:`submit` hands
    them to the kernel (one syscall, without the GIL), :meth:`completions`
    collects finished ones without blocking. :meth:`close` is idempotent; the
    caller must not close while the kernel still uses buffers it was given.
    """

    def __init__(self, entries: int) -> None:
        reason = ring_unsupported_reason()
        if reason is not None:
            raise OSError(errno.ENOSYS, reason)
        params = _Params()
        fd = _syscall(_SYS_IO_URING_SETUP, ctypes.c_uint32(entries), ctypes.byref(params))
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_uring_setup: {os.strerror(code)}")
        self.fd = int(fd)
        self._maps: list[mmap.mmap] = []
        try:
            self._map_rings(params)
        except BaseException:
            self._unmap()
            os.close(self.fd)
            raise
        self._closed = False

    def _map_rings(self, p: _Params) -> None:
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * _CQE.size
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

        def map_region(size: int, offset: int) -> mmap.mmap:
            region = mmap.mmap(self.fd, size, flags=flags, prot=prot, offset=offset)
            self._maps.append(region)
            return region

        if p.features & _IORING_FEAT_SINGLE_MMAP:
            sq_map = cq_map = map_region(max(sq_size, cq_size), _IORING_OFF_SQ_RING)
        else:
            sq_map = map_region(sq_size, _IORING_OFF_SQ_RING)
            cq_map = map_region(cq_size, _IORING_OFF_CQ_RING)
        sqe_map = map_region(p.sq_entries * _SQE.size, _IORING_OFF_SQES)
        self._sq = memoryview(sq_map)
        self._cq = self._sq if cq_map is sq_map else memoryview(cq_map)
        self._sqes = memoryview(sqe_map)

        self.sq_entries = p.sq_entries
        self.cq_entries = p.cq_entries
        self._sq_head = p.sq_off.head
        self._sq_tail = p.sq_off.tail
        self._sq_mask = _U32.unpack_from(self._sq, p.sq_off.ring_mask)[0]
        self._cq_head = p.cq_off.head
        self._cq_tail = p.cq_off.tail
        self._cq_mask = _U32.unpack_from(self._cq, p.cq_off.ring_mask)[0]
        self._cqes = p.cq_off.cqes
        # The SQ's index array maps ring positions to entries; identity, set once.
        for index in range(p.sq_entries):
            _U32.pack_into(self._sq, p.sq_off.array + 4 * index, index)
        self._tail = _U32.unpack_from(self._sq, self._sq_tail)[0]
        self._pending = 0  # entries written but not yet handed to the kernel

    # -- submission --------------------------------------------------------------------

    def free_entries(self) -> int:
        head: int = _U32.unpack_from(self._sq, self._sq_head)[0]
        return int(self.sq_entries - ((self._tail - head) & 0xFFFFFFFF))

    def _push(self, opcode: int, fd: int, offset: int, addr: int, length: int, flags: int,
              user_data: int) -> None:  # fmt: skip
        if self.free_entries() <= 0:
            raise RingFull
        slot = self._tail & self._sq_mask
        _SQE.pack_into(
            self._sqes, slot * 64, opcode, 0, 0, fd, offset, addr, length, flags, user_data,
            0, 0, 0, 0, 0,
        )  # fmt: skip
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        _U32.pack_into(self._sq, self._sq_tail, self._tail)  # publish after the entry
        self._pending += 1

    def prepare_rw(
        self, write: bool, fd: int, offset: int, spans: list[tuple[int, int]], user_data: int
    ) -> bytearray | None:
        """Queue one read or write of ``(address, length)`` spans at ``offset``.

        Returns the iovec array the kernel reads for several spans: keep it
        alive until this op's completion. Raises :class:`RingFull`.
        """
        if len(spans) == 1:
            address, length = spans[0]
            self._push(OP_WRITE if write else OP_READ, fd, offset, address, length, 0, user_data)
            return None
        iovecs = bytearray(_IOVEC.size * len(spans))
        for index, (address, length) in enumerate(spans):
            _IOVEC.pack_into(iovecs, index * _IOVEC.size, address, length)
        address = ctypes.addressof(ctypes.c_char.from_buffer(iovecs))
        self._push(OP_WRITEV if write else OP_READV, fd, offset, address, len(spans), 0, user_data)
        return iovecs

    def prepare_fdatasync(self, fd: int, user_data: int) -> None:
        """Queue an fdatasync of ``fd``. Raises :class:`RingFull`."""
        self._push(OP_FSYNC, fd, 0, 0, 0, FSYNC_DATASYNC, user_data)

    @property
    def pending(self) -> int:
        """Entries queued but not yet handed to the kernel."""
        return self._pending

    def submit(self, wait_for: int = 0) -> int:
        """Hand queued entries to the kernel; returns how many it took.

        With ``wait_for`` > 0 the call also blocks until that many completions
        are posted (without the GIL; for benchmarks and tools, never on an
        event loop). Raises OSError (EAGAIN/EBUSY when the kernel has no room
        for completions yet: the entries stay queued for the next call).
        """
        if not self._pending and not wait_for:
            return 0
        flags = _IORING_ENTER_GETEVENTS if wait_for else 0
        taken = _syscall(
            _SYS_IO_URING_ENTER, self.fd, self._pending, wait_for, flags, None, ctypes.c_size_t(0)
        )
        if taken < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_uring_enter: {os.strerror(code)}")
        self._pending -= int(taken)
        return int(taken)

    # -- completion --------------------------------------------------------------------

    def completions(self) -> list[Completion]:
        """Every completion posted so far (never blocks), oldest first."""
        head = _U32.unpack_from(self._cq, self._cq_head)[0]
        tail = _U32.unpack_from(self._cq, self._cq_tail)[0]
        if head == tail:
            return []
        out: list[Completion] = []
        cq, base, mask = self._cq, self._cqes, self._cq_mask
        while head != tail:
            user_data, res, _flags = _CQE.unpack_from(cq, base + (head & mask) * 16)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        _U32.pack_into(cq, self._cq_head, head)  # release the entries after reading them
        return out

    def register_eventfd(self, eventfd: int) -> None:
        """Have the kernel signal ``eventfd`` whenever it posts a completion."""
        value = ctypes.c_int(eventfd)
        result = _syscall(_SYS_IO_URING_REGISTER, self.fd, _IORING_REGISTER_EVENTFD,
                          ctypes.byref(value), 1)  # fmt: skip
        if result < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"io_uring_register(EVENTFD): {os.strerror(code)}")

    def close(self) -> None:
        """Tear the ring down (idempotent). The kernel must be done with every buffer."""
        if self._closed:
            return
        self._closed = True
        self._unmap()
        os.close(self.fd)

    def _unmap(self) -> None:
        for name in ("_sq", "_cq", "_sqes"):
            view = getattr(self, name, None)
            if view is not None:
                view.release()
        for region in self._maps:
            region.close()
        self._maps.clear()
