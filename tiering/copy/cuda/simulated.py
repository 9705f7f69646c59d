"""A simulated CUDA device in host memory that keeps CUDA's ordering rules.

:class:`SimulatedCudaDevice` implements the engine's device seam
(:class:`~tiering.copy.cuda.device.CudaDevice`) so that the CUDA copy engine's
own code runs, unchanged, where no GPU exists. This module owns the device's
memory, the work it queues and host registration, with their faults; its
streams and events, and the running of them, are
:class:`~tiering.copy.cuda.simulated_streams.SimulatedStreams`, which it
builds on. What it keeps of CUDA:

* each stream is a FIFO of operations run *later*, in order: copies and
  kernels really move their bytes when the stream reaches them, so a missing
  wait shows up as stale bytes, not as luck;
* events complete when their stream reaches them, ``wait_event`` /
  ``wait_stream`` hold a stream until then, and nothing else is ordered;
* host registration answers CUDA error codes (712 for an overlap), with
  device addresses distinct from host addresses;
* an error while running is sticky: every later ``Event.query`` raises.

Two ways to run the streams:

* ``mode="threads"`` (default): a worker thread per stream, sleeping a random
  0..``max_delay_s`` before each operation (seeded), so completion order
  varies like a GPU's;
* ``mode="manual"``: nothing runs until the test says so: :meth:`step` runs
  the next operation of one stream, :meth:`drain` runs everything runnable.
  A Hypothesis state machine chooses the completion order this way.

Faults (:attr:`faults`, :meth:`fail_copies`, :meth:`pause`): registration
refused with a given code or above a per-call size limit, no device pointer,
a mapping that reads other bytes, copies that raise when enqueued or fail
when run, and streams that stop (a job that never finishes).

Device memory is CPU tensors this device allocated (:meth:`alloc`,
:meth:`to_device`); :meth:`close` stops the worker threads.
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from tiering.copy.cuda.device import (
    CUDA_ERROR_ALREADY_REGISTERED,
    CUDA_ERROR_MEMORY_ALLOCATION,
    CudaDevice,
)
from tiering.copy.cuda.pins import DEFAULT_MAX_CHUNK_BYTES, PinRegistry
from tiering.copy.cuda.simulated_streams import (
    SimulatedEvent,
    SimulatedStream,
    SimulatedStreams,
    StreamOp,
)

__all__ = [
    "CUDA_ERROR_NOT_REGISTERED",
    "DEVICE_ADDRESS_OFFSET",
    "SimulatedCudaDevice",
    "SimulatedEvent",
    "SimulatedFaults",
    "SimulatedStream",
]


#: ``cudaErrorHostMemoryNotRegistered``: unregistering a range nobody registered.
CUDA_ERROR_NOT_REGISTERED = 713
#: Device addresses of mapped host memory are host addresses plus this (as without UVA).
DEVICE_ADDRESS_OFFSET = 1 << 52


@dataclass
class SimulatedFaults:
    """Faults to inject; change them at any time."""

    #: Every ``register_host`` answers this CUDA error code (e.g. 712, 2).
    register_error: int | None = None
    #: ``register_host`` of more bytes than this answers ``cudaErrorMemoryAllocation``.
    register_limit_bytes: int | None = None
    #: ``host_device_pointer`` answers None (no mapping for kernels).
    no_device_pointer: bool = False
    #: The mapping reads other memory than the host's (a broken mapping).
    mapping_reads_wrong_bytes: bool = False
    #: Wrapping a device address as a tensor raises (as an unsupported mapping would).
    mapping_raises: bool = False
    #: Each registration gets device addresses of its own, not one contiguous range.
    scattered_device_addresses: bool = False


class SimulatedCudaDevice(SimulatedStreams, CudaDevice):
    """CUDA's ordering rules over host memory. See the module docstring."""

    def __init__(
        self,
        *,
        mode: Literal["threads", "manual"] = "threads",
        seed: int = 0,
        max_delay_s: float = 200e-6,
        max_register_chunk_bytes: int | None = None,
        min_register_chunk_bytes: int = 4096,
    ) -> None:
        super().__init__(mode=mode, seed=seed, max_delay_s=max_delay_s)
        self.torch_device = torch.device("cpu")
        self.faults = SimulatedFaults()
        self.pins = PinRegistry(
            max_chunk_bytes=max_register_chunk_bytes or DEFAULT_MAX_CHUNK_BYTES,
            min_chunk_bytes=min_register_chunk_bytes,
        )
        self._storages: dict[int, Any] = {}  # storage identity -> storage, kept alive
        self._registered: dict[int, int] = {}  # host ptr -> nbytes
        self._register_calls: list[tuple[int, int, int]] = []
        self._copy_faults: deque[Literal["enqueue", "run"]] = deque()

    # -------------------------------------------------------------- lifecycle
    # (close, which stops the streams' worker threads, is SimulatedStreams')

    def __enter__(self) -> SimulatedCudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SimulatedCudaDevice(mode={self.mode})"

    # -------------------------------------------------------------- device memory

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype = torch.int8) -> torch.Tensor:
        """A zeroed device tensor."""
        return self._adopt(torch.zeros(shape, dtype=dtype))

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor (synchronous, as a test's setup)."""
        return self._adopt(tensor.detach().clone())

    def _adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        with self._cond:
            self._storages[_storage_id(storage)] = storage
        return tensor

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        with self._cond:
            return _storage_id(tensor.untyped_storage()) in self._storages

    # -------------------------------------------------------------- work

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() * dst.element_size() != src.numel() * src.element_size():
            raise RuntimeError(
                f"copy of {src.numel() * src.element_size()} bytes into "
                f"{dst.numel() * dst.element_size()}"
            )
        self._enqueue_work(lambda: dst.copy_(src), is_copy=True)

    def launch(self, kernel: Callable[..., None], *args: Any) -> None:
        self._enqueue_work(lambda: kernel(*args), is_copy=False)

    def upload(self, values: npt.NDArray[np.int64]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        staged = torch.from_numpy(np.array(values, dtype=np.int64))
        on_device = self.alloc((int(staged.numel()),), torch.int64)
        self._enqueue_work(lambda: on_device.copy_(staged), is_copy=True)
        return on_device, [staged, on_device]

    def read_back(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    def fail_copies(self, count: int = 1, *, when: Literal["enqueue", "run"] = "enqueue") -> None:
        """Make the next ``count`` copies raise at enqueue, or fail (stickily) when run."""
        with self._cond:
            self._copy_faults.extend([when] * count)

    def _enqueue_work(self, work: Callable[[], object], *, is_copy: bool) -> None:
        stream = self.current_stream()
        with self._cond:
            fault = self._copy_faults.popleft() if is_copy and self._copy_faults else None
            if fault == "enqueue":
                raise RuntimeError("CUDA error: invalid argument (simulated)")
            if fault == "run":
                work = _failing_work
            stream._push(StreamOp("work", work=work))

    # -------------------------------------------------------------- host memory

    def register_host(self, ptr: int, nbytes: int) -> int:
        with self._cond:
            code = self._register_code(ptr, nbytes)
            self._register_calls.append((ptr, nbytes, code))
            if code == 0:
                self._registered[ptr] = nbytes
            return code

    def _register_code(self, ptr: int, nbytes: int) -> int:
        if self.faults.register_error is not None:
            return self.faults.register_error
        limit = self.faults.register_limit_bytes
        if limit is not None and nbytes > limit:
            return CUDA_ERROR_MEMORY_ALLOCATION
        for start, size in self._registered.items():
            if start < ptr + nbytes and ptr < start + size:
                return CUDA_ERROR_ALREADY_REGISTERED
        return 0

    def unregister_host(self, ptr: int) -> int:
        with self._cond:
            if self._registered.pop(ptr, None) is None:
                return CUDA_ERROR_NOT_REGISTERED
            return 0

    @property
    def register_calls(self) -> list[tuple[int, int, int]]:
        """``(ptr, nbytes, answered code)`` of every ``register_host`` call, in order."""
        with self._cond:
            return list(self._register_calls)

    def registered_bytes(self, ptr: int, nbytes: int) -> int:
        """How many bytes of ``[ptr, ptr + nbytes)`` are registered now."""
        with self._cond:
            return sum(
                max(0, min(ptr + nbytes, start + size) - max(ptr, start))
                for start, size in self._registered.items()
            )

    def host_device_pointer(self, ptr: int) -> int | None:
        with self._cond:
            if self.faults.no_device_pointer or not self._is_registered(ptr):
                return None
            if self.faults.scattered_device_addresses:
                start = next(s for s, n in self._registered.items() if s <= ptr < s + n)
                return ptr + DEVICE_ADDRESS_OFFSET + list(self._registered).index(start) * 4096
            return ptr + DEVICE_ADDRESS_OFFSET

    def _is_registered(self, ptr: int) -> bool:
        return any(start <= ptr < start + size for start, size in self._registered.items())

    def device_bytes(self, device_ptr: int, nbytes: int) -> torch.Tensor:
        host_ptr = device_ptr - DEVICE_ADDRESS_OFFSET
        with self._cond:
            if not (self._is_registered(host_ptr) and self._is_registered(host_ptr + nbytes - 1)):
                raise RuntimeError(f"device address {device_ptr:#x} is not mapped host memory")
            if self.faults.mapping_raises:
                raise RuntimeError("CUDA error: operation not supported (simulated)")
            if self.faults.mapping_reads_wrong_bytes:
                return self._adopt(torch.full((nbytes,), 0x3C, dtype=torch.int8))
        raw = (ctypes.c_int8 * nbytes).from_address(host_ptr)
        mapped = torch.frombuffer(raw, dtype=torch.int8)
        self._adopt(mapped)
        return mapped

    def clear_last_error(self) -> None:
        pass  # nothing is sticky in a failed runtime call here


def _storage_id(storage: Any) -> int:
    """The identity of a tensor's storage (shared by its views; a host buffer's is another)."""
    return int(storage._cdata)


def _failing_work() -> None:
    raise RuntimeError("an illegal memory access was encountered")
