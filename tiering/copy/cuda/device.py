"""The device seam: everything the CUDA copy engine asks of a GPU, in one narrow interface.

The engine (:mod:`tiering.copy.cuda.engine`) never calls ``torch.cuda`` or the
CUDA runtime itself; it calls a :class:`CudaDevice`. Two implementations keep
the same rules:

* :class:`~tiering.copy.cuda.torch_device.TorchCudaDevice`: a real GPU, through
  ``torch.cuda`` and the few ``cudart`` calls torch does not wrap;
* :class:`~tiering.copy.cuda.simulated.SimulatedCudaDevice`: host memory that
  keeps CUDA's ordering rules (streams run late, in order, events complete in
  stream order, waits are honoured), with injectable faults, so the engine's
  ordering and failure paths run in every test run, not only on a GPU.

The contract an implementation keeps (CUDA's, restated):

* **Streams** are FIFO queues of work. Work enqueued on a stream runs after
  everything enqueued on it before, and after every wait enqueued before it
  is satisfied; nothing else is ordered. Enqueuing never blocks on the work.
* **Events** complete when the stream they were recorded on reaches them.
  ``query()`` never blocks; an event never recorded counts as complete.
  ``stream.wait_event(e)`` orders later work of ``stream`` after the *latest*
  record of ``e`` issued before the call; ``stream.wait_stream(other)`` after
  everything ``other`` had been given before the call.
* **Copies and kernels** (:meth:`CudaDevice.copy_async`,
  :meth:`CudaDevice.copy_runs_async`, :meth:`CudaDevice.launch`) are
  enqueued on the stream made current by :meth:`CudaDevice.on_stream`;
  their operands must stay alive until the stream has passed them (the
  caller keeps them). An error found while
  enqueuing raises at once; one found while running surfaces later, as a
  ``RuntimeError`` from an event's ``query()``.
* **Host registration** returns CUDA error codes instead of raising: 0 on
  success, 712 (``cudaErrorHostMemoryAlreadyRegistered``) when the range is
  already registered, anything else on failure; after a failed call
  :meth:`CudaDevice.clear_last_error` resets the thread's sticky error.

All methods are called from the engine's submitting thread except
``Event.query``, ``Event.synchronize`` and ``Event.elapsed_time``, which any
thread may call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from tiering.copy.cuda.memcpy_batch import check_runs

if TYPE_CHECKING:
    from tiering.copy.cuda.pins import PinRegistry

#: ``cudaErrorHostMemoryAlreadyRegistered``: the range is pinned already (by someone else).
CUDA_ERROR_ALREADY_REGISTERED = 712
#: ``cudaErrorInvalidValue``: what a too-large ``cudaHostRegister`` answers on some drivers.
CUDA_ERROR_INVALID_VALUE = 1
#: ``cudaErrorMemoryAllocation``: what the driver answers when it cannot lock the pages.
CUDA_ERROR_MEMORY_ALLOCATION = 2


class DeviceEvent(Protocol):
    """A CUDA event (``torch.cuda.Event`` has exactly these methods)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None:
        """Block until the event completed, releasing the GIL (raises on a device error)."""
        ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event`` (both complete)."""
        ...


class DeviceStream(Protocol):
    """A CUDA stream (``torch.cuda.Stream`` has exactly these methods)."""

    def wait_stream(self, stream: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...


class CudaDevice(ABC):
    """One GPU as the copy engine sees it. See the module docstring for the contract."""

    #: Where device tensors live (``cuda:N``; ``cpu`` for the simulated device).
    torch_device: torch.device
    #: Reference counts of the host ranges registered through this device's runtime.
    pins: PinRegistry

    @abstractmethod
    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is memory of this device (a KV-cache tensor must be)."""

    # -------------------------------------------------------------- streams and events

    @abstractmethod
    def new_stream(self, *, high_priority: bool = False) -> DeviceStream:
        """A new stream; ``high_priority`` ones are scheduled first where the device can."""

    @abstractmethod
    def current_stream(self) -> DeviceStream:
        """The calling thread's current stream: the model's compute stream, for a worker."""

    @abstractmethod
    def new_event(self) -> DeviceEvent:
        """A new event with timing enabled whose ``synchronize`` sleeps rather than spins."""

    @abstractmethod
    def on_stream(self, stream: DeviceStream) -> AbstractContextManager[None]:
        """Within the block, :meth:`copy_async` and :meth:`launch` enqueue on ``stream``."""

    # -------------------------------------------------------------- work

    @abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst[:] = src`` (equal byte sizes; host memory pinned for true DMA)."""

    def copy_runs_async(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        dst_offsets: Any,
        src_offsets: Any,
        lengths: Any,
        *,
        host_pinned: bool,
    ) -> None:
        """Enqueue ``dst[d:d + n] = src[s:s + n]`` for every run, in order.

        ``dst`` and ``src`` are 1-D byte tensors, one on the device and one
        over host memory (pinned if ``host_pinned``). Raises ``ValueError``
        before enqueuing anything if a run is empty or outside its tensor.
        This default issues one :meth:`copy_async` per run; a device may move
        them all in one call.
        """
        d, s, n = check_runs(dst.numel(), src.numel(), dst_offsets, src_offsets, lengths)
        for dst_at, src_at, nbytes in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
            self.copy_async(dst[dst_at : dst_at + nbytes], src[src_at : src_at + nbytes])

    @abstractmethod
    def launch(self, kernel: Callable[..., None], *args: Any) -> None:
        """Enqueue ``kernel(*args)``: tensor operations on device tensors that run as kernels.

        On a real device ``kernel`` runs now and its operations enqueue
        themselves on the current stream; a simulated device runs it when
        the stream reaches it. Either way it must only use its arguments.
        """

    @abstractmethod
    def upload(self, values: npt.NDArray[np.int64]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Enqueue a host-to-device copy of a small index array.

        Returns the device tensor and the buffers to keep alive until the
        stream has passed the copy.
        """

    @abstractmethod
    def read_back(self, tensor: torch.Tensor) -> torch.Tensor:
        """A synchronous host copy of device ``tensor``, read by a kernel (a probe)."""

    # -------------------------------------------------------------- host memory

    @abstractmethod
    def register_host(self, ptr: int, nbytes: int) -> int:
        """``cudaHostRegister``: page-lock and map ``[ptr, ptr + nbytes)``; a CUDA error code."""

    @abstractmethod
    def unregister_host(self, ptr: int) -> int:
        """``cudaHostUnregister`` of the range registered at ``ptr``; a CUDA error code."""

    @abstractmethod
    def host_device_pointer(self, ptr: int) -> int | None:
        """The device address of registered host memory at ``ptr``, or None."""

    @abstractmethod
    def device_bytes(self, device_ptr: int, nbytes: int) -> torch.Tensor:
        """A 1-D int8 device tensor over ``nbytes`` at ``device_ptr``, not copying.

        Raises ``RuntimeError`` if the address cannot be wrapped.
        """

    @abstractmethod
    def clear_last_error(self) -> None:
        """Reset the thread's sticky "last error" a failed runtime call leaves behind."""
