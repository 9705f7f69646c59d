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

Each job records a start and an end event (blocking-sync events); the start
event after the job's host work (byte runs, index arrays), so the job's
``transfer_time`` is the device's time alone. Completion
is observed with ``end_event.query()``, which never blocks: ``done()`` polls
it; ``wait()`` without a timeout sleeps in ``cudaEventSynchronize`` (no core
spins, the GIL is released, the thread wakes 60-100 us after the end on an H100;
a timed wait polls with a back-off, CUDA having no timed event wait); and
``wait_async()`` polls from an asyncio loop with a back-off of 20 us doubling
to 1 ms. The loop polls rather than waiting in an executor thread because a
query costs about a microsecond while a thread hop costs 20-130 us on these
machines (``docs/runtime.md``) and an executor would need one thread per
waited job.

How bytes move
--------------
The primary buffer is page-locked once (:mod:`tiering.copy.cuda.pins`), so
copies from and to it are true asynchronous DMA. Per job and tensor the engine
picks :func:`~tiering.copy.cuda.copies.dma_copy` or
:func:`~tiering.copy.cuda.copies.kernel_copy`; ``strategy="auto"`` uses
kernels for pages under ``dma_min_bytes`` when the buffer is mapped into the
device address space, and DMA otherwise.

The device
----------
The engine reaches the GPU only through a
:class:`~tiering.copy.cuda.device.CudaDevice`: the real one by default, or a
:class:`~tiering.copy.cuda.simulated.SimulatedCudaDevice` that keeps CUDA's
ordering rules in host memory, which is how the engine is tested without a GPU.
The same code runs on both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from tiering.copy.arrays import host_rows
from tiering.copy.cuda.copies import (
    PreparedCopies,
    dma_copy,
    flat_bytes,
    gpu_block_rows,
    kernel_copy,
    prepare_copies,
)
from tiering.copy.cuda.device import CudaDevice, DeviceEvent
from tiering.copy.engine import CopyEngine, CopyJob, CopyOutcome
from tiering.copy.layout import KVLayout
from tiering.copy.plan import BlockCopies, Lane, TransferPlan
from tiering.core.errors import TierClosedError

logger = logging.getLogger(__name__)

Strategy = Literal["auto", "dma", "kernel"]

#: ``auto`` copies pages at least this large with DMA, smaller ones with kernels.
DEFAULT_DMA_MIN_BYTES = 256 * 1024

#: Bytes read back through the mapping at the start of each registered chunk.
_MAPPING_PROBE_BYTES = 4096


class CudaCopyJob(CopyJob):
    """A job whose completion is its end event on the lane's stream."""

    def __init__(
        self,
        plan: TransferPlan,
        start_event: DeviceEvent,
        end_event: DeviceEvent,
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
            if not self.end_event.query():
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

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished or ``timeout`` seconds passed; True if finished.

        Without a timeout the thread sleeps in ``cudaEventSynchronize`` on the
        end event (a blocking-sync event: no core spins, the GIL is released)
        and wakes 60-100 us after the copy's end (an H100 VM), where polling
        added up to its back-off of 1 ms. CUDA has no timed event wait, so a timeout
        polls as the base class does.
        """
        if timeout is not None or self._outcome is not None:
            return super().wait(timeout)
        try:
            self.end_event.synchronize()
        except RuntimeError as exc:  # an asynchronous CUDA error surfaced here
            self._finish(CopyOutcome(False, 0.0, f"{type(exc).__name__}: {exc}"))
            return True
        return self.done()

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


def default_device(tensors: Sequence[Any]) -> CudaDevice:
    """The real device the KV tensors live on.

    Raises ``TypeError`` if the first tensor is not a CUDA tensor (not a
    tensor at all, before anything else) and ``RuntimeError`` where CUDA is
    unavailable.
    """
    first = tensors[0] if tensors else None
    if not isinstance(first, torch.Tensor):
        raise TypeError("KV-cache tensor 0 must be a CUDA tensor for the CUDA copy engine")
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA copy engine needs a CUDA device; use HostCopyEngine")
    if first.device.type != "cuda":
        raise TypeError("KV-cache tensor 0 must be a CUDA tensor for the CUDA copy engine")
    from tiering.copy.cuda.torch_device import TorchCudaDevice

    return TorchCudaDevice(first.device)


class CudaCopyEngine(CopyEngine):
    """Copies between CUDA KV-cache tensors and the (pinned) primary buffer.

    ``host`` is the primary buffer (a ``HostBuffer``, a 2-D memoryview or numpy
    array, usually attached by name to the scheduler's shared memory); it is
    page-locked for the engine's lifetime unless ``pin=False``. ``device`` is
    the GPU seam (default: the real device of the KV tensors).
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
        device: CudaDevice | None = None,
    ) -> None:
        super().__init__(layout)
        if strategy not in ("auto", "dma", "kernel"):
            raise ValueError(f"strategy must be 'auto', 'dma' or 'kernel', got {strategy!r}")
        if len(gpu_tensors) != layout.num_tensors:
            raise ValueError(
                f"{len(gpu_tensors)} KV-cache tensors but the layout describes {layout.num_tensors}"
            )
        self.device: CudaDevice = device if device is not None else default_device(gpu_tensors)
        self._gpu = [
            gpu_block_rows(self.device, t, layout.gpu_page_bytes[i], f"KV-cache tensor {i}")
            for i, t in enumerate(gpu_tensors)
        ]
        places = {t.device for t in self._gpu}
        if len(places) != 1:
            raise ValueError(
                f"the KV-cache tensors are on several devices: {sorted(map(str, places))}"
            )
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
        self._host_flat = flat_bytes(self._host)
        self._host_ptr = int(self._host.data_ptr())
        self._host_nbytes = int(self._host_flat.numel())
        self.pinned = pin and self.device.pins.pin(
            self.device, self._host_ptr, self._host_nbytes, row_bytes=int(host_arr.strides[0])
        )
        self._gpu_flat = [flat_bytes(rows) for rows in self._gpu]

        self.strategy = strategy
        self.dma_min_bytes = dma_min_bytes
        self._mapped: torch.Tensor | None = None
        try:
            if strategy != "dma" and self.pinned:
                self._mapped = self._map_host()
            if strategy == "kernel" and self._mapped is None:
                raise RuntimeError(
                    "strategy='kernel' needs the primary buffer pinned and mapped into the "
                    "device address space, which failed on this machine; use 'auto' or 'dma'"
                )
            self._streams = {
                Lane.STORE: self.device.new_stream(),
                Lane.LOAD: self.device.new_stream(),
                # Expedited loads are awaited within the step: give them priority.
                Lane.LOAD_EXPEDITED: self.device.new_stream(high_priority=True),
            }
        except BaseException:
            self._release_pin()
            raise
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
        """The pinned buffer as a device tensor (device-mapped), verified, or None."""
        device = self.device
        # The device address of the registered range (equal to the host address
        # under unified addressing, but asking is what is guaranteed to work).
        dptr = device.host_device_pointer(self._host_ptr)
        if dptr is None:
            logger.info("primary buffer not mapped for kernels: no device address for it")
            return None
        pinned = device.pins.get(self._host_ptr, self._host_nbytes)
        chunks = [] if pinned is None else sorted(pinned.chunks + pinned.foreign_chunks)
        # Chunks registered one by one must still be one contiguous device range.
        for chunk_ptr, _ in chunks:
            if device.host_device_pointer(chunk_ptr) != dptr + (chunk_ptr - self._host_ptr):
                logger.info("primary buffer not mapped for kernels: its chunks are not contiguous")
                return None
        starts = sorted({0, *(chunk_ptr - self._host_ptr for chunk_ptr, _ in chunks)})
        try:
            mapped = device.device_bytes(dptr, self._host_nbytes)
            for start in starts:
                # A read through the mapping must return the host's bytes.
                end = min(self._host_nbytes, start + _MAPPING_PROBE_BYTES)
                seen = device.read_back(mapped[start:end])
                if not torch.equal(seen, self._host_flat[start:end]):
                    logger.warning("primary buffer mapping returned wrong bytes; kernels disabled")
                    return None
        except RuntimeError as exc:
            device.clear_last_error()
            logger.warning("primary buffer not mapped for kernels: %s", exc)
            return None
        return mapped

    def _release_pin(self) -> None:
        if self.pinned:
            self.device.pins.unpin(self.device, self._host_ptr, self._host_nbytes)
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
        device = self.device
        stream = self._streams[plan.lane]
        self._in_flight = [job for job in self._in_flight if not job.done()]
        deps = [
            job
            for job in self._in_flight
            if job.lane is not plan.lane and plan.conflicts_with(job.plan)
        ]
        start = device.new_event()
        end = device.new_event()
        keepalive: list[torch.Tensor] = []
        error: str | None = None
        # The compute stream is whatever stream the worker is on when it submits.
        compute = device.current_stream()
        with device.on_stream(stream):
            stream.wait_stream(compute)
            for dep in deps:
                stream.wait_event(dep.end_event)
            try:
                # Host work first, so the start event (and transfer_time) leaves it out:
                # on an H200 it was about 12 % of a 64 MiB job's event-timed figure.
                prepared = prepare_copies(plan, self.layout, self._gpu, self.uses_kernel)
            except Exception as exc:  # nothing enqueued: the job fails at once
                prepared, error = None, f"{type(exc).__name__}: {exc}"
            start.record(stream)
            if prepared is not None:
                try:
                    self._enqueue(plan, prepared, keepalive)
                except Exception as exc:  # the job fails; what was enqueued still runs, in order
                    error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                logger.warning("CUDA copy job on lane %s failed: %s", plan.lane.value, error)
            end.record(stream)
        job = CudaCopyJob(plan, start, end, keepalive, error)
        self._in_flight.append(job)
        return job

    def _enqueue(
        self, plan: TransferPlan, prepared: PreparedCopies, keepalive: list[torch.Tensor]
    ) -> None:
        """Enqueue ``plan``'s copies on the current stream (``prepared`` beforehand)."""
        device = self.device
        to_cpu = plan.lane.gpu_to_cpu
        indices: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if prepared.host_idx is not None:
            dev_idx, buffers = device.upload(prepared.host_idx)
            keepalive += buffers
            pos = 0
            for e in prepared.kernel_entries:
                n = len(e)
                indices[id(e)] = (
                    dev_idx[pos : pos + n],
                    dev_idx[pos + n : pos + 2 * n],
                    dev_idx[pos + 2 * n : pos + 3 * n],
                )
                pos += 3 * n
        for entry in plan.copies:
            rows = self._gpu[entry.tensor_idx]
            if id(entry) in indices:
                assert self._mapped is not None
                device.launch(
                    kernel_copy, entry, self.layout, rows, self._mapped, *indices[id(entry)], to_cpu
                )
            else:
                flat = self._gpu_flat[entry.tensor_idx]
                dma_copy(
                    device,
                    entry,
                    self.layout,
                    rows,
                    flat,
                    self._host_flat,
                    to_cpu,
                    self.pinned,
                    prepared.runs[id(entry)],
                )

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
