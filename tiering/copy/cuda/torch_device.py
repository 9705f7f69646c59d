"""The real device: :class:`~tiering.copy.cuda.device.CudaDevice` over ``torch.cuda``.

Streams and events are torch's own (``torch.cuda.Stream`` / ``Event``);
copies are ``Tensor.copy_(non_blocking=True)`` (a ``cudaMemcpyAsync``);
kernels are torch's indexing operations, enqueued on the current stream as
they are called. Host registration goes through ``torch.cuda.cudart()``; the
two runtime calls torch does not wrap (``cudaHostGetDevicePointer``,
``cudaGetLastError``) through ctypes, on the ``libcudart`` torch itself loaded.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tiering.copy.cuda.device import CudaDevice, DeviceEvent, DeviceStream
from tiering.copy.cuda.pins import PROCESS_PINS


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
    """A CUDA GPU through torch. Needs ``torch.cuda.is_available()``."""

    def __init__(self, device: torch.device | str | int) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA copy engine needs a CUDA device; use HostCopyEngine")
        where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if where.type != "cuda":
            raise ValueError(f"TorchCudaDevice needs a CUDA device, got {where}")
        index = torch.cuda.current_device() if where.index is None else where.index
        self.torch_device = torch.device("cuda", index)
        self.pins = PROCESS_PINS

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
        # instead of spinning a core, and wakes within microseconds of completion.
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
