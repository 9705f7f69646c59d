"""Many host <-> device copies in one runtime call: ``cudaMemcpyBatchAsync`` through ctypes.

A DMA job of the CUDA engine is a list of byte runs, one per run of adjacent
blocks. Issued one at a time through torch, each run costs 7-13 us of Python
and launch before the copy engine sees it; on an H100 (first GPU check,
2026-11-26) that held 64 KiB runs to 5 GB/s and 256 KiB runs to 19-27 GB/s of
the 52-54 one large copy reaches, while one batch call for all of them reached
32-34 and 44-48 GB/s. The call takes host arrays of destination and source
addresses and sizes, read during the call only, and one attribute set that
orders the copies on the stream like any other work (``srcAccessOrder =
Stream``).

ABI: CUDA 12.8 introduced the call with a ``failIdx`` out-parameter before the
stream; CUDA 13.0 dropped that parameter. The runtime's own version
(``cudaRuntimeGetVersion``) picks the signature; before 12.8 the call is
unavailable and the device issues one copy per run.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import numpy.typing as npt

#: ``cudaMemcpySrcAccessOrderStream``: the copy reads its source in stream order.
SRC_ACCESS_ORDER_STREAM = 1
#: The first runtime versions with each signature (``cudaRuntimeGetVersion``: 1000 x
#: major + 10 x minor).
FIRST_VERSION = 12080
VERSION_WITHOUT_FAIL_INDEX = 13000

Offsets = npt.NDArray[np.int64]
Addresses = npt.NDArray[np.uint64]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``cudaMemcpyAttributes`` (no location hints: the runtime reads them off the pointers)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def check_runs(
    dst_nbytes: int, src_nbytes: int, dst_offsets: Any, src_offsets: Any, lengths: Any
) -> tuple[Offsets, Offsets, Offsets]:
    """The runs as int64 arrays; ``ValueError`` naming the first run outside its buffer.

    A copy past a buffer's end would corrupt memory silently, so every run is
    checked before anything is enqueued.
    """
    d, s, n = (
        np.asarray(a, dtype=np.int64).reshape(-1) for a in (dst_offsets, src_offsets, lengths)
    )
    if not len(d) == len(s) == len(n):
        raise ValueError(
            f"{len(d)} destination offsets, {len(s)} source offsets and {len(n)} lengths: "
            "one of each per run"
        )
    bad = (n <= 0) | (d < 0) | (s < 0) | (d + n > dst_nbytes) | (s + n > src_nbytes)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"copy run {i} ({int(n[i])} bytes from offset {int(s[i])} to offset {int(d[i])}) "
            f"is empty or outside its buffers ({src_nbytes} source, {dst_nbytes} destination "
            "bytes)"
        )
    return d, s, n


def run_addresses(
    dst_address: int, src_address: int, dst_offsets: Offsets, src_offsets: Offsets, lengths: Offsets
) -> tuple[Addresses, Addresses, Addresses]:
    """Absolute destination and source addresses and sizes of checked runs (``check_runs``)."""
    return (
        np.uint64(dst_address) + dst_offsets.astype(np.uint64),
        np.uint64(src_address) + src_offsets.astype(np.uint64),
        lengths.astype(np.uint64),
    )


class MemcpyBatch:
    """The runtime's ``cudaMemcpyBatchAsync`` with the right signature, or why there is none.

    ``lib`` is the ``libcudart`` torch loaded (a ``ctypes.CDLL``; None when
    none was found). :attr:`unavailable` is None when the call can be used.
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.runtime_version = 0
        self.unavailable: str | None = None
        version = ctypes.c_int(0)
        if lib is None:
            self.unavailable = "no CUDA runtime library was loaded"
        elif not hasattr(lib, "cudaMemcpyBatchAsync"):
            self.unavailable = "this CUDA runtime has no cudaMemcpyBatchAsync (CUDA 12.8+)"
        elif lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
            self.unavailable = "cudaRuntimeGetVersion failed"
        elif version.value < FIRST_VERSION:
            self.unavailable = f"CUDA runtime {version.value} predates cudaMemcpyBatchAsync"
        self.runtime_version = version.value
        self._attributes = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM)
        self._attribute_index = (ctypes.c_size_t * 1)(0)

    def __call__(
        self, dsts: Addresses, srcs: Addresses, sizes: Addresses, stream_handle: int
    ) -> int:
        """Enqueue ``len(sizes)`` copies on the stream; the CUDA error code (0: enqueued).

        The arrays need to live only during the call. Calling it where
        :attr:`unavailable` is set raises ``RuntimeError``.
        """
        if self.unavailable is not None:
            raise RuntimeError(f"cudaMemcpyBatchAsync is unavailable: {self.unavailable}")
        args: list[Any] = [
            ctypes.c_void_p(dsts.ctypes.data),
            ctypes.c_void_p(srcs.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data),
            ctypes.c_size_t(len(sizes)),
            ctypes.byref(self._attributes),
            self._attribute_index,
            ctypes.c_size_t(1),
        ]
        if self.runtime_version < VERSION_WITHOUT_FAIL_INDEX:
            args.append(ctypes.byref(ctypes.c_size_t(0)))  # failIdx (12.8, 12.9)
        args.append(ctypes.c_void_p(stream_handle))
        return int(self.lib.cudaMemcpyBatchAsync(*args))

    def copy_runs(
        self,
        dst: tuple[int, int],
        src: tuple[int, int],
        dst_offsets: Any,
        src_offsets: Any,
        lengths: Any,
        stream_handle: int,
    ) -> None:
        """Enqueue every run between ``dst`` and ``src`` (each ``(address, nbytes)``).

        ``ValueError`` (before anything is enqueued) for a run outside its
        buffer; ``RuntimeError`` naming the CUDA error if the call fails, after
        clearing the thread's last error.
        """
        d, s, n = check_runs(dst[1], src[1], dst_offsets, src_offsets, lengths)
        if not len(n):
            return
        code = self(*run_addresses(dst[0], src[0], d, s, n), stream_handle)
        if code != 0:
            self.lib.cudaGetLastError()
            raise RuntimeError(f"cudaMemcpyBatchAsync of {len(n)} runs failed: CUDA error {code}")
