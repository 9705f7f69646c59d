"""The host copy engine: the CUDA engine's interface over CPU memory.

Used on machines without CUDA (tests, CI, CPU-only development, replaying
traces), with CPU arrays standing in for the GPU KV cache. Each lane is one
thread that runs its jobs in submission order, the host counterpart of a CUDA
stream; a job waits for earlier conflicting jobs of other lanes first.

Each job's copies (every tensor's, runs of adjacent blocks coalesced) are
gathered with numpy into one table of (source, destination, length) regions
and moved by :func:`tiering.copy.bulk.copy_regions`: a C-level loop of
``memmove`` calls, each with the GIL released, and no bytecode between two
copies (opt-in: one ``process_vm_writev`` per 1,024 regions, see
:mod:`tiering.copy.bulk`). The numpy slice loop this replaced spent about
1 us of Python per region with the GIL held: a quarter to a half of its time
at 8-32 KiB pages. Vectorised numpy alternatives measured slower at every
page size: fancy-index gather + scatter (0.7-1.8 GB/s, it allocates and
faults a temporary), ``np.take(out=)`` + scatter (the scatter is the slow
half) and ``torch.index_select`` with the default 2 intra-op threads
(13 ms-2.2 s stalls per call on 2-core machines). A process that runs torch
CPU copies of its own on these buffers should call
``torch.set_num_threads(1)`` (see ``docs/copy-engine.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tiering.copy.arrays import ByteArray, block_rows, flat_bytes, host_rows
from tiering.copy.bulk import copy_regions
from tiering.copy.engine import CopyEngine, CopyJob, CopyOutcome
from tiering.copy.layout import KVLayout
from tiering.copy.plan import BlockCopies, Lane, Offsets, TransferPlan, byte_runs
from tiering.errors import TierClosedError

logger = logging.getLogger(__name__)


class HostCopyJob(CopyJob):
    """A job of the host engine; finished by its lane thread (or by shutdown)."""

    def __init__(self, plan: TransferPlan, depends_on: Sequence[HostCopyJob]) -> None:
        super().__init__(plan)
        self.depends_on = tuple(depends_on)
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._outcome: CopyOutcome | None = None
        self._callbacks: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._finished.is_set()

    def outcome(self) -> CopyOutcome:
        outcome = self._outcome
        if outcome is None:
            raise RuntimeError("the copy job has not finished")
        return outcome

    def wait(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def finish(self, outcome: CopyOutcome) -> bool:
        """Record the outcome unless one was already recorded; True if this call did."""
        with self._lock:
            if self._outcome is not None:
                return False
            self._outcome = outcome
            callbacks, self._callbacks = self._callbacks, []
            self._finished.set()
        for callback in callbacks:
            callback()
        return True

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the finishing thread) once finished; at once if already."""
        with self._lock:
            if self._outcome is None:
                self._callbacks.append(callback)
                return
        callback()

    def remove_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    async def wait_async(self) -> CopyOutcome:
        """Await the job; the lane thread wakes the loop (no polling).

        Cancellation only stops the waiting: the copy itself runs on.
        """
        if self.done():
            return self.outcome()
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        def from_thread() -> None:
            # RuntimeError: the loop was closed meanwhile, so nobody is waiting.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake)

        self.add_done_callback(from_thread)
        try:
            await woken
        finally:
            self.remove_done_callback(from_thread)
        return self.outcome()


class _LaneThread:
    """One thread running one lane's jobs in order."""

    def __init__(self, engine: HostCopyEngine, lane: Lane) -> None:
        self.lane = lane
        self._engine = engine
        self.queue: queue.SimpleQueue[HostCopyJob | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, name=f"tiering-copy-{lane.value}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            for dep in job.depends_on:
                dep.wait()
            job.depends_on = ()  # finished jobs must not keep chains of earlier ones alive
            if job.done():  # failed by shutdown while queued
                continue
            start = time.perf_counter()
            try:
                self._engine.run_plan(job.plan)
            except Exception as exc:  # a failed copy fails its job, never the lane
                logger.warning(
                    "host copy job on lane %s failed: %s: %s",
                    self.lane.value,
                    type(exc).__name__,
                    exc,
                )
                job.finish(CopyOutcome(False, time.perf_counter() - start, _describe(exc)))
            else:
                job.finish(CopyOutcome(True, time.perf_counter() - start))


def _span(flat: ByteArray) -> tuple[int, int]:
    return int(flat.ctypes.data), int(flat.size)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class HostCopyEngine(CopyEngine):
    """Copies between CPU "GPU" tensors and the host buffer on one thread per lane.

    ``gpu_tensors[t]`` is viewed as ``(layout.gpu_num_blocks[t],
    layout.gpu_page_bytes[t])`` bytes and ``host`` as ``(cpu_num_blocks,
    cpu_block_bytes)``; both are used in place, never copied. Threads start at
    construction and stop at :meth:`shutdown`.
    """

    kind = "host"

    def __init__(
        self,
        layout: KVLayout,
        gpu_tensors: Sequence[Any],
        host: Any,
    ) -> None:
        super().__init__(layout)
        if len(gpu_tensors) != layout.num_tensors:
            raise ValueError(
                f"{len(gpu_tensors)} KV-cache tensors but the layout describes {layout.num_tensors}"
            )
        self._gpu: list[ByteArray] = []
        for t, tensor in enumerate(gpu_tensors):
            rows = block_rows(tensor, layout.gpu_page_bytes[t], what=f"KV-cache tensor {t}")
            if rows.shape[0] != layout.gpu_num_blocks[t]:
                raise ValueError(
                    f"KV-cache tensor {t} has {rows.shape[0]} blocks, the layout says "
                    f"{layout.gpu_num_blocks[t]}"
                )
            self._gpu.append(rows)
        self._host = host_rows(host)
        if self._host.shape != (layout.cpu_num_blocks, layout.cpu_block_bytes):
            raise ValueError(
                f"the host buffer is {self._host.shape[0]} x {self._host.shape[1]} bytes, the "
                f"layout says {layout.cpu_num_blocks} x {layout.cpu_block_bytes}"
            )
        self._gpu_flat = [flat_bytes(rows) for rows in self._gpu]
        self._host_flat = flat_bytes(self._host)
        # (first byte's address, bytes) of each array: copies go by address.
        self._gpu_span = [_span(flat) for flat in self._gpu_flat]
        self._host_span = _span(self._host_flat)
        self._closed = False
        self._in_flight: list[HostCopyJob] = []
        self._lanes = {lane: _LaneThread(self, lane) for lane in Lane}

    def submit(self, plan: TransferPlan) -> HostCopyJob:
        if self._closed:
            raise TierClosedError("the copy engine was shut down")
        self._in_flight = [job for job in self._in_flight if not job.done()]
        deps = [
            job
            for job in self._in_flight
            if job.lane is not plan.lane and plan.conflicts_with(job.plan)
        ]
        job = HostCopyJob(plan, deps)
        self._in_flight.append(job)
        self._lanes[plan.lane].queue.put(job)
        return job

    def run_plan(self, plan: TransferPlan) -> None:
        """Execute every copy of ``plan`` on the calling thread (the lane threads call this).

        One :func:`~tiering.copy.bulk.copy_regions` call for the whole job.
        """
        tables = [self.regions_of(entry, plan.lane.gpu_to_cpu) for entry in plan.copies]
        if not tables:
            return
        if len(tables) == 1:
            src, dst, lengths = tables[0]
        else:
            src = np.concatenate([t[0] for t in tables])
            dst = np.concatenate([t[1] for t in tables])
            lengths = np.concatenate([t[2] for t in tables])
            # In order of source address: scattered reads are what stalls a copy (the
            # writes of large tables are streamed). 8 KiB pages of random blocks, % of
            # one large memcpy, measured on these machines: stores 58-77 % tensor by
            # tensor, 75-91 % in source order; loads 67-70 % and 100-120 %.
            order = np.argsort(src)
            src, dst, lengths = src[order], dst[order], lengths[order]
        copy_regions(src, dst, lengths)

    def regions_of(self, entry: BlockCopies, gpu_to_cpu: bool) -> tuple[Offsets, Offsets, Offsets]:
        """One tensor's copies of a job as (source addresses, destination addresses, lengths).

        Runs of adjacent blocks are coalesced into one region each. The block
        ids were range-checked by :func:`~tiering.copy.plan.plan_transfer`;
        the regions are checked against the arrays once more here (vectorised),
        as a bad address would be a silent memory corruption, not an IndexError.
        """
        t = entry.tensor_idx
        gpu_off = entry.gpu_offsets(self._gpu[t].strides[0])
        cpu_off = entry.cpu_offsets(self.layout)
        if not (self._host if gpu_to_cpu else self._gpu[t]).flags.writeable:
            where = "the host buffer" if gpu_to_cpu else f"KV-cache tensor {t}"
            raise ValueError(f"{where} is read-only; this job writes into it")
        if gpu_to_cpu:
            src_off, dst_off = gpu_off, cpu_off
            src_base, src_span = self._gpu_span[t]
            dst_base, dst_span = self._host_span
        else:
            src_off, dst_off = cpu_off, gpu_off
            src_base, src_span = self._host_span
            dst_base, dst_span = self._gpu_span[t]
        starts_s, starts_d, lengths = byte_runs(src_off, dst_off, entry.nbytes)
        if lengths.size and (
            int((starts_s + lengths).max()) > src_span
            or int((starts_d + lengths).max()) > dst_span
            or int(min(starts_s.min(), starts_d.min())) < 0
        ):
            raise IndexError(f"tensor {t}: a copy falls outside its source or destination array")
        return starts_s + np.int64(src_base), starts_d + np.int64(dst_base), lengths

    def shutdown(self, timeout: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            lane.queue.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in self._lanes.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            lane.thread.join(left)
        stuck = [job for job in self._in_flight if not job.done()]
        for job in stuck:
            job.finish(CopyOutcome(False, 0.0, "the copy engine shut down before the job finished"))
        if stuck:
            logger.warning(
                "host copy engine shut down with %d unfinished job(s) after %.1f s; "
                "they are reported as failed",
                len(stuck),
                timeout or 0.0,
            )
        self._in_flight.clear()
        if not any(lane.thread.is_alive() for lane in self._lanes.values()):
            # Drop the views so the KV arrays and the shared mapping can be freed.
            empty = np.empty((0, 0), dtype=np.uint8)
            self._gpu, self._gpu_flat = [], []
            self._host, self._host_flat = empty, empty.reshape(-1)
            self._gpu_span, self._host_span = [], (0, 0)

    def __repr__(self) -> str:
        return (
            f"HostCopyEngine({self.layout.num_tensors} tensors, "
            f"{self.layout.cpu_num_blocks} CPU blocks x {self.layout.cpu_block_bytes} B)"
        )


__all__ = ["HostCopyEngine", "HostCopyJob"]
