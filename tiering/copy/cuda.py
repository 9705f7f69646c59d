"""The CUDA copy engine: GPU KV blocks <-> the pinned primary buffer on CUDA streams.

Threads, streams and events
---------------------------
Everything runs on the thread that calls :meth:`CudaCopyEngine.submit` (the
worker's thread); no helper thread exists. Each lane (stores, loads, expedited
loads) has its own CUDA stream, so stores never queue behind loads or the other
way round, and each job of a lane runs after the previous one. At submission a
job's stream first waits for the compute stream (``wait_stream``): a store must
not read KV blocks the model is still writing, a load must not overwrite blocks
before queued work that still reads or zeroes them. It then waits for the end
events of earlier jobs of *other* lanes that touch the same blocks, so a load
submitted after a store of the same CPU block reads the stored bytes.

Each job records a start and an end event. Completion is observed with
``end_event.query()``, which never blocks: ``done()`` polls it, ``wait()``
polls it with a short back-off, and ``wait_async()`` polls it from an asyncio
loop with a back-off of 20 us doubling to 1 ms. Polling was chosen over waiting
in an executor thread because a query costs about a microsecond while a
thread hop costs 20-130 us on these machines (``shared/bench/limits.md``),
a blocked ``cudaEventSynchronize`` spins a core unless events are created
with blocking sync, and an executor would need one thread per waited job.

How bytes move
--------------
The primary buffer is page-locked once with ``cudaHostRegister`` (through
``torch.cuda.cudart()``), so copies from and to it are true asynchronous DMA.
Per job and tensor the engine picks one of two strategies:

* ``dma``: the block copies, coalesced into runs of adjacent blocks, are
  issued as ``cudaMemcpyAsync`` calls (``Tensor.copy_(non_blocking=True)``) on
  the lane's stream. The copy engines do the work; no SM is used. Best for
  large pages, where a few microseconds of launch cost per run are amortised.
* ``kernel``: the pinned buffer is also mapped into the device address space
  (``cudaHostGetDevicePointer``) and wrapped as a CUDA tensor; one gather
  (``index_select`` / advanced indexing) and one scatter (``index_copy_`` /
  ``index_put_``) kernel per tensor move every block of the job over PCIe.
  Best for small pages, where one call per block would be launch-bound.

``strategy="auto"`` uses ``kernel`` for pages under ``dma_min_bytes`` when the
mapping is available and ``dma`` otherwise.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from tiering.copy.arrays import host_rows
from tiering.copy.engine import CopyEngine, CopyJob, CopyOutcome
from tiering.copy.layout import KVLayout
from tiering.copy.plan import BlockCopies, Lane, TransferPlan, byte_runs
from tiering.errors import TierClosedError

logger = logging.getLogger(__name__)

Strategy = Literal["auto", "dma", "kernel"]

#: ``auto`` copies pages at least this large with DMA, smaller ones with kernels.
DEFAULT_DMA_MIN_BYTES = 256 * 1024

_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


# --------------------------------------------------------------------------- runtime


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
        """Reset the thread's sticky "last error" a failed runtime call leaves behind."""
        if self.lib is not None:
            self.lib.cudaGetLastError()

    def host_device_pointer(self, host_ptr: int) -> int | None:
        """The device address of registered host memory, or None."""
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
    return int(getattr(result, "value", result))


# --------------------------------------------------------------------------- pinning


class _PinRegistry:
    """Process-wide reference counts of host ranges this module registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, int], int] = {}

    def pin(self, ptr: int, nbytes: int, device: torch.device) -> bool:
        """Page-lock ``[ptr, ptr + nbytes)``; True if it is pinned afterwards."""
        key = (ptr, nbytes)
        with self._lock:
            if key in self._counts:
                self._counts[key] += 1
                return True
            with torch.cuda.device(device):
                result = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)  # type: ignore[no-untyped-call]
            code = _error_code(result)
            if code == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                # Pinned by someone else (e.g. vLLM): usable, but not ours to unpin.
                _cuda_runtime().clear_last_error()
                return True
            if code != 0:
                _cuda_runtime().clear_last_error()
                logger.warning(
                    "cudaHostRegister of the primary buffer (%d bytes) failed with CUDA error %d; "
                    "copies fall back to pageable memory and block the submitting thread",
                    nbytes,
                    code,
                )
                return False
            self._counts[key] = 1
            return True

    def unpin(self, ptr: int, nbytes: int) -> None:
        key = (ptr, nbytes)
        with self._lock:
            count = self._counts.get(key, 0)
            if count == 0:
                return
            if count > 1:
                self._counts[key] = count - 1
                return
            del self._counts[key]
            code = _error_code(torch.cuda.cudart().cudaHostUnregister(ptr))  # type: ignore[no-untyped-call]
            if code != 0:
                _cuda_runtime().clear_last_error()
                logger.warning("cudaHostUnregister failed with CUDA error %d", code)


_pins = _PinRegistry()


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


# --------------------------------------------------------------------------- jobs


class CudaCopyJob(CopyJob):
    """A job whose completion is its end event on the lane's stream."""

    def __init__(
        self,
        plan: TransferPlan,
        start_event: torch.cuda.Event,
        end_event: torch.cuda.Event,
        keepalive: list[torch.Tensor],
        error: str | None,
    ) -> None:
        super().__init__(plan)
        self.start_event = start_event
        self.end_event = end_event
        self._keepalive = keepalive
        self._submit_error = error
        self._outcome: CopyOutcome | None = None

    def done(self) -> bool:
        if self._outcome is not None:
            return True
        try:
            if not self.end_event.query():  # type: ignore[no-untyped-call]
                return False
        except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
            self._finish(CopyOutcome(False, 0.0, f"{type(exc).__name__}: {exc}"))
            return True
        if self._submit_error is not None:
            self._finish(CopyOutcome(False, 0.0, self._submit_error))
        else:
            try:
                seconds = self.start_event.elapsed_time(self.end_event) * 1e-3
            except RuntimeError:
                seconds = 0.0
            self._finish(CopyOutcome(True, seconds))
        return True

    def outcome(self) -> CopyOutcome:
        if not self.done() or self._outcome is None:
            raise RuntimeError("the copy job has not finished")
        return self._outcome

    def abandon(self, reason: str) -> None:
        """Report the job failed without waiting for it (shutdown past its deadline)."""
        if self._outcome is None:
            self._finish(CopyOutcome(False, 0.0, reason))

    def _finish(self, outcome: CopyOutcome) -> None:
        self._outcome = outcome
        self._keepalive = []


def dma_copy(
    entry: BlockCopies,
    layout: KVLayout,
    gpu_rows: torch.Tensor,
    gpu_flat: torch.Tensor,
    host_flat: torch.Tensor,
    gpu_to_cpu: bool,
) -> None:
    """Enqueue one ``copy_`` (a ``cudaMemcpyAsync``) per run of adjacent blocks.

    ``gpu_flat`` / ``host_flat`` are 1-D byte views of the KV tensor and of the
    primary buffer; on the current stream, asynchronous when the host is pinned.
    """
    gpu_off = entry.gpu_offsets(gpu_rows.stride(0))
    cpu_off = entry.cpu_offsets(layout)
    if gpu_to_cpu:
        src, dst, src_off, dst_off = gpu_flat, host_flat, gpu_off, cpu_off
    else:
        src, dst, src_off, dst_off = host_flat, gpu_flat, cpu_off, gpu_off
    starts_s, starts_d, lengths = byte_runs(src_off, dst_off, entry.nbytes)
    for s, d, n in zip(starts_s.tolist(), starts_d.tolist(), lengths.tolist(), strict=True):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


def kernel_copy(
    entry: BlockCopies,
    layout: KVLayout,
    gpu_rows: torch.Tensor,
    mapped_flat: torch.Tensor,
    gpu_idx: torch.Tensor,
    cpu_idx: torch.Tensor,
    sub_idx: torch.Tensor,
    gpu_to_cpu: bool,
) -> None:
    """Enqueue one gather and one scatter kernel for all of ``entry``'s blocks.

    ``mapped_flat`` is the primary buffer as a 1-D byte tensor on the device
    (device-mapped pinned memory); the indices are ``entry``'s block ids on
    the device. Pure tensor indexing, so it runs on any device.
    """
    t = entry.tensor_idx
    page = layout.gpu_page_bytes[t]
    pages = gpu_rows[:, : entry.nbytes]
    if layout.block_size_factor == 1:
        slots = torch.as_strided(
            mapped_flat,
            (layout.cpu_num_blocks, entry.nbytes),
            (layout.cpu_block_bytes, 1),
            layout.cpu_slot_offsets[t],
        )
        if gpu_to_cpu:
            slots.index_copy_(0, cpu_idx, pages.index_select(0, gpu_idx))
        else:
            pages.index_copy_(0, gpu_idx, slots.index_select(0, cpu_idx))
        return
    sub_slots = torch.as_strided(
        mapped_flat,
        (layout.cpu_num_blocks, layout.block_size_factor, entry.nbytes),
        (layout.cpu_block_bytes, page, 1),
        layout.cpu_slot_offsets[t],
    )
    if gpu_to_cpu:
        sub_slots.index_put_((cpu_idx, sub_idx), pages.index_select(0, gpu_idx))
    else:
        pages.index_copy_(0, gpu_idx, sub_slots[cpu_idx, sub_idx])


# --------------------------------------------------------------------------- engine


def gpu_block_rows(tensor: torch.Tensor, page_size_bytes: int, what: str) -> torch.Tensor:
    """A CUDA tensor as ``(num_blocks, page_size_bytes)`` int8 rows, sharing memory."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise TypeError(f"{what} must be a CUDA tensor for the CUDA copy engine")
    if tensor.dtype != torch.int8:
        tensor = tensor.view(torch.int8)
    if tensor.ndim == 2 and tensor.shape[1] == page_size_bytes and tensor.stride(1) == 1:
        return tensor
    try:
        return tensor.view(-1, page_size_bytes)
    except RuntimeError as exc:
        raise ValueError(
            f"{what} of shape {tuple(tensor.shape)} cannot be viewed as rows of "
            f"{page_size_bytes} bytes without a copy"
        ) from exc


def _flat(rows: torch.Tensor) -> torch.Tensor:
    """A 1-D byte view from the first to the last byte of ``rows`` (rows may be strided)."""
    span = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    return torch.as_strided(rows, (span,), (1,), rows.storage_offset())


class CudaCopyEngine(CopyEngine):
    """Copies between CUDA KV-cache tensors and the (pinned) primary buffer.

    ``host`` is the primary buffer (a ``HostBuffer``, a 2-D memoryview or numpy
    array, usually attached by name to the scheduler's shared memory); it is
    page-locked for the engine's lifetime unless ``pin=False``.
    """

    kind = "cuda"

    def __init__(
        self,
        layout: KVLayout,
        gpu_tensors: Sequence[torch.Tensor],
        host: Any,
        *,
        strategy: Strategy = "auto",
        dma_min_bytes: int = DEFAULT_DMA_MIN_BYTES,
        pin: bool = True,
    ) -> None:
        super().__init__(layout)
        if strategy not in ("auto", "dma", "kernel"):
            raise ValueError(f"strategy must be 'auto', 'dma' or 'kernel', got {strategy!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("the CUDA copy engine needs a CUDA device; use HostCopyEngine")
        if len(gpu_tensors) != layout.num_tensors:
            raise ValueError(
                f"{len(gpu_tensors)} KV-cache tensors but the layout describes {layout.num_tensors}"
            )
        self._gpu = [
            gpu_block_rows(t, layout.gpu_page_bytes[i], f"KV-cache tensor {i}")
            for i, t in enumerate(gpu_tensors)
        ]
        devices = {t.device for t in self._gpu}
        if len(devices) != 1:
            raise ValueError(
                f"the KV-cache tensors are on several devices: {sorted(map(str, devices))}"
            )
        self.device = self._gpu[0].device
        for i, rows in enumerate(self._gpu):
            if rows.shape[0] != layout.gpu_num_blocks[i]:
                raise ValueError(
                    f"KV-cache tensor {i} has {rows.shape[0]} blocks, the layout says "
                    f"{layout.gpu_num_blocks[i]}"
                )
        host_arr = host_rows(host)
        if host_arr.shape != (layout.cpu_num_blocks, layout.cpu_block_bytes):
            raise ValueError(
                f"the host buffer is {host_arr.shape[0]} x {host_arr.shape[1]} bytes, the "
                f"layout says {layout.cpu_num_blocks} x {layout.cpu_block_bytes}"
            )
        self._host = torch.from_numpy(host_arr.view(np.int8))
        self._host_flat = _flat(self._host)
        self._host_ptr = int(self._host.data_ptr())
        self._host_nbytes = int(self._host_flat.numel())
        self.pinned = pin and _pins.pin(self._host_ptr, self._host_nbytes, self.device)
        self._gpu_flat = [_flat(rows) for rows in self._gpu]

        self.strategy = strategy
        self.dma_min_bytes = dma_min_bytes
        self._mapped: torch.Tensor | None = None
        if strategy != "dma" and self.pinned:
            self._mapped = self._map_host()
        if strategy == "kernel" and self._mapped is None:
            self._release_pin()
            raise RuntimeError(
                "strategy='kernel' needs the primary buffer pinned and mapped into the device "
                "address space, which failed on this machine; use 'auto' or 'dma'"
            )
        self._streams = {
            Lane.STORE: torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
            Lane.LOAD: torch.cuda.Stream(self.device),  # type: ignore[no-untyped-call]
            # Expedited loads are awaited within the step: give them priority.
            Lane.LOAD_EXPEDITED: torch.cuda.Stream(self.device, priority=-1),  # type: ignore[no-untyped-call]
        }
        self._in_flight: list[CudaCopyJob] = []
        self._closed = False
        logger.info(
            "CUDA copy engine on %s: strategy=%s, primary buffer %s, %s",
            self.device,
            strategy,
            "pinned" if self.pinned else "pageable",
            "mapped for kernels" if self._mapped is not None else "not mapped",
        )

    # -------------------------------------------------------------- setup helpers

    def _map_host(self) -> torch.Tensor | None:
        """The pinned buffer as a CUDA tensor (device-mapped), verified, or None."""
        runtime = _cuda_runtime()
        # The device address of the registered range (equal to the host address
        # under unified addressing, but asking is what is guaranteed to work).
        with torch.cuda.device(self.device):
            dptr = runtime.host_device_pointer(self._host_ptr)
        if dptr is None:
            logger.info("primary buffer not mapped for kernels: no device address for it")
            return None
        try:
            with torch.cuda.device(self.device):
                mapped = torch.as_tensor(
                    _CudaArrayInterface(dptr, self._host_nbytes), device=self.device
                )
                # A read through the mapping must return the host's bytes.
                probe = min(self._host_nbytes, 4096)
                seen = torch.add(mapped[:probe], 0).cpu()
            if not torch.equal(seen, self._host_flat[:probe]):
                logger.warning("primary buffer mapping returned wrong bytes; kernels disabled")
                return None
        except RuntimeError as exc:
            runtime.clear_last_error()
            logger.warning("primary buffer not mapped for kernels: %s", exc)
            return None
        return mapped

    def _release_pin(self) -> None:
        if self.pinned:
            _pins.unpin(self._host_ptr, self._host_nbytes)
            self.pinned = False

    # -------------------------------------------------------------- submission

    def uses_kernel(self, entry: BlockCopies) -> bool:
        """Whether ``entry`` is copied by kernels (else by DMA runs)."""
        if self._mapped is None:
            return False
        return self.strategy == "kernel" or entry.nbytes < self.dma_min_bytes

    def submit(self, plan: TransferPlan) -> CudaCopyJob:
        if self._closed:
            raise TierClosedError("the copy engine was shut down")
        stream = self._streams[plan.lane]
        self._in_flight = [job for job in self._in_flight if not job.done()]
        deps = [
            job
            for job in self._in_flight
            if job.lane is not plan.lane and plan.conflicts_with(job.plan)
        ]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        keepalive: list[torch.Tensor] = []
        error: str | None = None
        # The compute stream is whatever stream the worker is on when it submits.
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_stream(compute)
            for dep in deps:
                stream.wait_event(dep.end_event)
            start.record(stream)
            try:
                self._enqueue(plan, keepalive)
            except Exception as exc:  # the job fails; what was enqueued still runs, in order
                error = f"{type(exc).__name__}: {exc}"
                logger.warning("CUDA copy job on lane %s failed: %s", plan.lane.value, error)
            end.record(stream)
        job = CudaCopyJob(plan, start, end, keepalive, error)
        self._in_flight.append(job)
        return job

    def _enqueue(self, plan: TransferPlan, keepalive: list[torch.Tensor]) -> None:
        kernel_entries = [e for e in plan.copies if self.uses_kernel(e)]
        indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if kernel_entries:
            # One pinned staging array and one H2D copy for every index of the job.
            host_idx = np.concatenate(
                [
                    np.concatenate((e.gpu_blocks, e.cpu_blocks, e.cpu_subblocks))
                    for e in kernel_entries
                ]
            )
            staged = torch.from_numpy(host_idx).pin_memory()
            dev_idx = staged.to(self.device, non_blocking=True)
            keepalive += [staged, dev_idx]
            pos = 0
            for e in kernel_entries:
                n = len(e)
                indices[id(e)] = (
                    dev_idx[pos : pos + n],
                    dev_idx[pos + n : pos + 2 * n],
                    dev_idx[pos + 2 * n : pos + 3 * n],
                )
                pos += 3 * n
        to_cpu = plan.lane.gpu_to_cpu
        for entry in plan.copies:
            rows = self._gpu[entry.tensor_idx]
            if id(entry) in indices:
                assert self._mapped is not None
                kernel_copy(entry, self.layout, rows, self._mapped, *indices[id(entry)], to_cpu)
            else:
                flat = self._gpu_flat[entry.tensor_idx]
                dma_copy(entry, self.layout, rows, flat, self._host_flat, to_cpu)

    # -------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        stuck: list[CudaCopyJob] = []
        for job in self._in_flight:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                stuck.append(job)
        for job in stuck:
            job.abandon("the copy engine shut down before the job finished")
        self._in_flight.clear()
        self.jobs_left_running = len(stuck)
        if stuck:
            # DMA may still be running into the buffer: unpinning now would be unsafe.
            logger.warning(
                "CUDA copy engine shut down with %d unfinished job(s); the primary buffer "
                "stays pinned",
                len(stuck),
            )
        else:
            self._mapped = None
            self._release_pin()
            # Drop the views so the KV tensors and the shared mapping can be freed.
            self._gpu, self._gpu_flat = [], []
            self._host = self._host_flat = torch.empty(0, dtype=torch.int8)

    def __repr__(self) -> str:
        return (
            f"CudaCopyEngine({self.device}, strategy={self.strategy}, "
            f"{self.layout.num_tensors} tensors, pinned={self.pinned})"
        )
