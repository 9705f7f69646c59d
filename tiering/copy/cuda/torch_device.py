"""The real device: :class:`~tiering.copy.cuda.device.CudaDevice` over ``torch.cuda``.

Streams and events are torch's own (``torch.cuda.Stream`` / ``Event``);
copies are ``Tensor.copy_(non_blocking=True)`` (a ``cudaMemcpyAsync``), and a
job's runs to or from pinned memory one ``cudaMemcpyBatchAsync``
(:mod:`~tiering.copy.cuda.memcpy_batch`) where the runtime has it and a
self-test at first use passed; kernels are torch's indexing operations,
enqueued on the current stream as they are called. Host registration goes
through ``torch.cuda.cudart()``; the runtime calls torch does not wrap
(``cudaHostGetDevicePointer``, ``cudaGetLastError``, the batch) through
ctypes, on the ``libcudart`` torch itself loaded.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tiering.copy.cuda.device import CudaDevice, DeviceEvent, DeviceStream
from tiering.copy.cuda.memcpy_batch import MemcpyBatch
from tiering.copy.cuda.pins import PROCESS_PINS

logger = logging.getLogger(__name__)


class _CudaRuntime:
    """The few CUDA runtime calls torch does not expose, through ctypes.

    Loaded from the ``libcudart`` torch itself uses (by soname, so the already
    loaded library is returned); every method degrades to "unavailable".
    """

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        major = (torch.version.cuda or "").split(".")[0]
        names = [f"libcudart.so.{major}"] if major else []
        names += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        for name in names:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError:
                continue

    def clear_last_error(self) -> None:
        if self.lib is not None:
            self.lib.cudaGetLastError()

    def host_device_pointer(self, host_ptr: int) -> int | None:
        if self.lib is None:
            return None
        dptr = ctypes.c_void_p(0)
        if self.lib.cudaHostGetDevicePointer(ctypes.byref(dptr), ctypes.c_void_p(host_ptr), 0):
            self.clear_last_error()
            return None
        return dptr.value


_runtime: _CudaRuntime | None = None
_runtime_lock = threading.Lock()


def _cuda_runtime() -> _CudaRuntime:
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _CudaRuntime()
        return _runtime


def _error_code(result: Any) -> int:
    """torch's cudart binding answers an enum; plain ints elsewhere."""
    return int(getattr(result, "value", result))


class _CudaArrayInterface:
    """Exposes a device address range to ``torch.as_tensor`` without copying."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|i1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


class TorchCudaDevice(CudaDevice):
    """A CUDA GPU through torch. Needs ``torch.cuda.is_available()``.

    ``memcpy_batch=False`` issues one ``cudaMemcpyAsync`` per run even where
    the batch call exists (for comparisons).
    """

    def __init__(self, device: torch.device | str | int, *, memcpy_batch: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA copy engine needs a CUDA device; use HostCopyEngine")
        where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if where.type != "cuda":
            raise ValueError(f"TorchCudaDevice needs a CUDA device, got {where}")
        index = torch.cuda.current_device() if where.index is None else where.index
        self.torch_device = torch.device("cuda", index)
        self.pins = PROCESS_PINS
        #: The batch call once it passed its self-test; decided at the first batched copy.
        self._batch: MemcpyBatch | None = None
        self._batch_decided = not memcpy_batch

    def __repr__(self) -> str:
        return f"TorchCudaDevice({self.torch_device})"

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_cuda)

    def new_stream(self, *, high_priority: bool = False) -> DeviceStream:
        stream: DeviceStream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
            self.torch_device, priority=-1 if high_priority else 0
        )
        return stream

    def current_stream(self) -> DeviceStream:
        return torch.cuda.current_stream(self.torch_device)

    def new_event(self) -> DeviceEvent:
        # blocking=True (cudaEventBlockingSync): a waiting thread sleeps in the driver
        # instead of spinning a core; it wakes 60-100 us after completion on the H100 VM.
        event: DeviceEvent = torch.cuda.Event(  # type: ignore[no-untyped-call]
            enable_timing=True, blocking=True
        )
        return event

    def on_stream(self, stream: DeviceStream) -> AbstractContextManager[None]:
        return self._on_stream(stream)

    @contextmanager
    def _on_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
            yield

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

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
        batch = self._memcpy_batch() if host_pinned else None
        if batch is None:  # pageable memory: torch stages it, one copy at a time
            super().copy_runs_async(
                dst, src, dst_offsets, src_offsets, lengths, host_pinned=host_pinned
            )
            return
        batch.copy_runs(
            (dst.data_ptr(), dst.numel()),
            (src.data_ptr(), src.numel()),
            dst_offsets,
            src_offsets,
            lengths,
            torch.cuda.current_stream(self.torch_device).cuda_stream,
        )

    def _memcpy_batch(self) -> MemcpyBatch | None:
        """The batch call if this runtime has it and it copies right here (checked once)."""
        if not self._batch_decided:
            self._batch_decided = True
            batch = MemcpyBatch(_cuda_runtime().lib)
            why = batch.unavailable or self._batch_self_test(batch)
            if why:
                logger.info("one cudaMemcpyAsync per copy run: %s", why)
            else:
                self._batch = batch
        return self._batch

    def _batch_self_test(self, batch: MemcpyBatch) -> str | None:
        """Two runs each way between pinned and device memory; why it failed, or None."""
        host = torch.arange(4096, dtype=torch.int16).view(torch.int8).pin_memory()
        back = torch.zeros_like(host).pin_memory()
        stream: Any = torch.cuda.Stream(self.torch_device)  # type: ignore[no-untyped-call]
        try:
            # Everything on the test's own stream: the caller may be inside a lane's stream.
            with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
                on_device = torch.zeros(8192, dtype=torch.int8, device=self.torch_device)
                there, back_here = (on_device.data_ptr(), 8192), (back.data_ptr(), 8192)
                runs = ([4096, 0], [0, 6144], [2048, 2048])
                batch.copy_runs(there, (host.data_ptr(), 8192), *runs, stream.cuda_stream)
                batch.copy_runs(back_here, there, runs[1], runs[0], runs[2], stream.cuda_stream)
                stream.synchronize()
        except RuntimeError as exc:
            return f"cudaMemcpyBatchAsync failed its self-test: {exc}"
        expected = torch.zeros_like(host)
        expected[0:2048], expected[6144:8192] = host[0:2048], host[6144:8192]
        if not torch.equal(back, expected):
            return "cudaMemcpyBatchAsync failed its self-test: wrong bytes"
        return None

    def launch(self, kernel: Callable[..., None], *args: Any) -> None:
        kernel(*args)  # its operations enqueue themselves on the current stream

    def upload(self, values: npt.NDArray[np.int64]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Pinned staging, so the copy is asynchronous and ordered on the stream.
        staged = torch.from_numpy(values).pin_memory()
        on_device = staged.to(self.torch_device, non_blocking=True)
        return on_device, [staged, on_device]

    def read_back(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(self.torch_device):
            # torch.add reads through a kernel, as the engine's gathers will.
            return torch.add(tensor, 0).cpu()

    def register_host(self, ptr: int, nbytes: int) -> int:
        with torch.cuda.device(self.torch_device):
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            return _error_code(cudart.cudaHostRegister(ptr, nbytes, 0))

    def unregister_host(self, ptr: int) -> int:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        return _error_code(cudart.cudaHostUnregister(ptr))

    def host_device_pointer(self, ptr: int) -> int | None:
        with torch.cuda.device(self.torch_device):
            return _cuda_runtime().host_device_pointer(ptr)

    def device_bytes(self, device_ptr: int, nbytes: int) -> torch.Tensor:
        with torch.cuda.device(self.torch_device):
            return torch.as_tensor(
                _CudaArrayInterface(device_ptr, nbytes), device=self.torch_device
            )

    def clear_last_error(self) -> None:
        _cuda_runtime().clear_last_error()
