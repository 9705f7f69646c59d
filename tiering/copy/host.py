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
from dataclasses import dataclass
from typing import Any

import numpy as np

from tiering.copy.arrays import ByteArray, block_rows, flat_bytes, host_rows
from tiering.copy.bulk import copy_regions
from tiering.copy.engine import CopyEngine, CopyJob, CopyOutcome
from tiering.copy.layout import KVLayout
from tiering.copy.plan import BlockCopies, Lane, Offsets, TransferPlan, byte_runs
from tiering.core.errors import TierClosedError

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


@dataclass(frozen=True, slots=True)
class _RegionTable:
    """Regions as (source addresses, destination addresses, lengths) arrays."""

    src: Offsets
    dst: Offsets
    lengths: Offsets
    in_source_order: bool


def _laid_out(
    src_base: Offsets, dst_base: Offsets, starts_s: Offsets, starts_d: Offsets, lengths: Offsets
) -> _RegionTable:
    """Tensor ``i``'s run ``j`` at ``(src_base[i] + starts_s[j], dst_base[i] + starts_d[j])``.

    ``starts_s`` ascends. The table is laid out in source order without a sort
    where the geometry allows (each sort and gather allocates and first-touches
    fresh pages: most of a job's planning time at 8 KiB pages): tensor by tensor
    when the tensors' spans do not interleave (stores from separate KV-cache
    tensors), run by run when each run's tensors fit between it and the next
    (loads from the host buffer's slots).
    """
    by_base = np.argsort(src_base, kind="stable")
    src_base, dst_base = src_base[by_base], dst_base[by_base]
    tensors, runs = src_base.size, starts_s.size
    base_gaps = np.diff(src_base)
    reach = int((starts_s + lengths).max()) - int(starts_s[0]) if runs else 0
    tensor_major = runs == 0 or bool((base_gaps >= reach).all())
    if not tensor_major:
        spread = int(src_base[-1] - src_base[0])
        run_gaps = starts_s[1:] - starts_s[:-1] - lengths[:-1]
        if bool((base_gaps >= int(lengths.max())).all()) and bool((run_gaps >= spread).all()):
            return _RegionTable(
                (starts_s[:, None] + src_base[None, :]).ravel(),
                (starts_d[:, None] + dst_base[None, :]).ravel(),
                np.repeat(lengths, tensors),
                in_source_order=True,
            )
    return _RegionTable(
        (src_base[:, None] + starts_s[None, :]).ravel(),
        (dst_base[:, None] + starts_d[None, :]).ravel(),
        np.tile(lengths, tensors),
        in_source_order=tensor_major,
    )


def _sharing(copies: Sequence[BlockCopies], engine: HostCopyEngine) -> list[list[BlockCopies]]:
    """``copies`` grouped by what makes their offsets equal up to a per-tensor shift.

    The same block arrays (plan_transfer hands every tensor of a group the same
    objects), the same bytes per block, and the same row stride and page size
    (the stride and page scale the offsets and decide which blocks are adjacent).
    """
    groups: dict[tuple[int, ...], list[BlockCopies]] = {}
    for entry in copies:
        t = entry.tensor_idx
        key = (
            id(entry.gpu_blocks),
            id(entry.cpu_blocks),
            id(entry.cpu_subblocks),
            entry.nbytes,
            engine.gpu_row_stride(t),
            engine.layout.gpu_page_bytes[t],
        )
        groups.setdefault(key, []).append(entry)
    return list(groups.values())


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

    def gpu_row_stride(self, tensor_idx: int) -> int:
        """Bytes from one block of KV-cache tensor ``tensor_idx`` to the next."""
        return int(self._gpu[tensor_idx].strides[0])

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
        src, dst, lengths = self.region_table(plan)
        if lengths.size:
            copy_regions(src, dst, lengths)

    def region_table(self, plan: TransferPlan) -> tuple[Offsets, Offsets, Offsets]:
        """Every region of ``plan`` as (source addresses, destination addresses, lengths).

        In order of source address: scattered reads are what stalls a copy (the
        writes of large tables are streamed). 8 KiB pages of random blocks, % of
        one large memcpy, measured on these machines: stores 58-77 % tensor by
        tensor, 75-91 % in source order; loads 67-70 % and 100-120 %.

        Every check runs before any byte moves, so a refused job changes nothing.
        The block ids were range-checked by :func:`~tiering.copy.plan.plan_transfer`;
        the regions are checked against the arrays once more here (vectorised),
        as a bad address would be a silent memory corruption, not an IndexError.
        """
        gpu_to_cpu = plan.lane.gpu_to_cpu
        tables = [
            self._shared_regions(entries, gpu_to_cpu) for entries in _sharing(plan.copies, self)
        ]
        if not tables:
            empty = np.empty(0, np.int64)
            return empty, empty, empty
        if len(tables) == 1 and tables[0].in_source_order:
            return tables[0].src, tables[0].dst, tables[0].lengths
        src = np.concatenate([t.src for t in tables])
        dst = np.concatenate([t.dst for t in tables])
        lengths = np.concatenate([t.lengths for t in tables])
        # Each tensor's rows are sorted already: a stable sort merges those runs in
        # linear time (8 x 1,024 regions: 20 us, against 250 us for a quicksort).
        order = np.argsort(src, kind="stable")
        return src[order], dst[order], lengths[order]

    def _shared_regions(self, entries: Sequence[BlockCopies], gpu_to_cpu: bool) -> _RegionTable:
        """The regions of tensors that copy the same blocks with the same geometry.

        A model's layers list the same block arrays (one KV-cache group), so the
        offsets, their order and the runs of adjacent blocks are computed once
        and shifted per tensor: per-job, not per-tensor, work on the lane thread.
        """
        first = entries[0]
        tensors = [entry.tensor_idx for entry in entries]
        for t in tensors:
            if not (self._host if gpu_to_cpu else self._gpu[t]).flags.writeable:
                where = "the host buffer" if gpu_to_cpu else f"KV-cache tensor {t}"
                raise ValueError(f"{where} is read-only; this job writes into it")
        # Offsets relative to each tensor's first byte / its slot in the CPU block.
        gpu_rel = first.gpu_offsets(self.gpu_row_stride(first.tensor_idx))
        cpu_rel = first.cpu_offsets(self.layout) - np.int64(
            self.layout.cpu_slot_offsets[first.tensor_idx]
        )
        host_base, host_span = self._host_span
        gpu_base = np.array([self._gpu_span[t][0] for t in tensors], np.int64)
        gpu_span = np.array([self._gpu_span[t][1] for t in tensors], np.int64)
        slots = np.array([self.layout.cpu_slot_offsets[t] for t in tensors], np.int64)
        if gpu_to_cpu:
            src_rel, dst_rel = gpu_rel, cpu_rel
            src_base, dst_base = gpu_base, slots + np.int64(host_base)
            src_span, dst_span = gpu_span, np.int64(host_span) - slots
        else:
            src_rel, dst_rel = cpu_rel, gpu_rel
            src_base, dst_base = slots + np.int64(host_base), gpu_base
            src_span, dst_span = np.int64(host_span) - slots, gpu_span
        order = np.argsort(src_rel, kind="stable")
        starts_s, starts_d, lengths = byte_runs(src_rel[order], dst_rel[order], first.nbytes)
        if lengths.size:
            low = int(min(starts_s.min(), starts_d.min()))
            outside = (int((starts_s + lengths).max()) > src_span) | (
                int((starts_d + lengths).max()) > dst_span
            )
            if low < 0 or outside.any():
                t = tensors[int(np.argmax(outside)) if outside.any() else 0]
                raise IndexError(
                    f"tensor {t}: a copy falls outside its source or destination array"
                )
        return _laid_out(src_base, dst_base, starts_s, starts_d, lengths)

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
