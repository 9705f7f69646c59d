"""Worker-side transfer handlers: the shape vLLM's offloading connector drives.

:class:`TransferHandler` is one direction (vLLM's ``OffloadingHandler`` /
``SingleDirectionOffloadingHandler``): ``transfer_async(job_id, (src, dst))``
submits without blocking and returns whether the job was accepted,
``get_finished()`` returns the results of finished jobs, ``wait(job_ids)``
blocks until they finish, ``shutdown()`` stops it. :class:`CopyWorker`
composes a store, a load and an expedited-load handler over one engine like
vLLM 0.33's ``OffloadingWorker`` (``submit_store`` / ``submit_load``).

A job either succeeds entirely or is reported with ``success=False``: a
rejected submission returns False (nothing was started and no result will
follow); an error while copying makes the job's result a failure, even if
some blocks were already copied. All methods are called from the worker's
thread; only the engine's completion state is shared with other threads.
"""

from __future__ import annotations

import logging
import numbers
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tiering.copy.arrays import block_rows, host_rows, is_torch_tensor
from tiering.copy.engine import CopyEngine, CopyJob
from tiering.copy.layout import CanonicalKVCacheRef, KVCachesLike, KVLayout
from tiering.copy.plan import Lane, plan_transfer
from tiering.core.errors import ContractError, TierClosedError, TieringError
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec

logger = logging.getLogger(__name__)

TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]

#: Default time ``shutdown`` waits for jobs in flight before failing them.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The outcome of one transfer job.

    ``transfer_bytes`` is what the job moves (reported for failures too, as
    what it would have moved); ``transfer_time`` the copy's duration in
    seconds; ``error`` a one-line reason for a failure.
    """

    job_id: int
    success: bool
    transfer_bytes: int = 0
    transfer_time: float = 0.0
    error: str | None = None

    @property
    def transfer_size(self) -> int:
        """vLLM 0.33's name for :attr:`transfer_bytes`."""
        return self.transfer_bytes


class OffloadingHandler(ABC):
    """One transfer direction, as vLLM's offloading connector drives it."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start job ``job_id`` copying ``spec = (src_spec, dst_spec)``; never blocks.

        Returns False, starting nothing, when the job is rejected.
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call. Never blocks."""

    @abstractmethod
    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        """Block until the given jobs (those this handler knows) have finished."""

    @abstractmethod
    def shutdown(self, timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop accepting jobs and wait for those in flight. Idempotent."""


class _JobIds:
    """The job ids in flight in one worker, shared by its handlers (ids are worker-unique)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()


class TransferHandler(OffloadingHandler):
    """One lane of a :class:`CopyEngine` driven by job id.

    ``lane`` fixes the direction: ``Lane.STORE`` takes ``(GPULoadStoreSpec,
    CPULoadStoreSpec)``, the load lanes take ``(CPULoadStoreSpec,
    GPULoadStoreSpec)``. The handler does not own the engine.
    """

    def __init__(self, engine: CopyEngine, lane: Lane, *, job_ids: _JobIds | None = None) -> None:
        self.engine = engine
        self.lane = lane
        self._job_ids = job_ids or _JobIds()
        self._jobs: dict[int, CopyJob] = {}
        self._closed = False

    @property
    def src_type(self) -> type[LoadStoreSpec]:
        return GPULoadStoreSpec if self.lane.gpu_to_cpu else CPULoadStoreSpec

    @property
    def dst_type(self) -> type[LoadStoreSpec]:
        return CPULoadStoreSpec if self.lane.gpu_to_cpu else GPULoadStoreSpec

    def submit(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> CopyJob:
        """Start a job, raising on misuse (the exception-raising form of ``transfer_async``).

        Raises :class:`~tiering.core.errors.ContractError` for a job id already in
        flight or specs that do not fit the direction or the layout, and
        :class:`~tiering.core.errors.TierClosedError` after ``shutdown``. Nothing
        changes when it raises.
        """
        if self._closed:
            raise TierClosedError(f"the {self.lane.value} handler was shut down")
        raw: object = job_id  # vLLM passes ints; numpy integers are fine too
        if isinstance(raw, bool) or not isinstance(raw, numbers.Integral):
            raise ContractError(f"job_id must be an int, got {raw!r}")
        job_id = int(raw)
        if job_id in self._job_ids.ids:
            raise ContractError(f"job {job_id} is already in flight")
        for spec, want, role in (
            (src_spec, self.src_type, "source"),
            (dst_spec, self.dst_type, "destination"),
        ):
            if not isinstance(spec, want):
                raise ContractError(
                    f"job {job_id}: a {self.lane.value} job's {role} must be a {want.__name__}, "
                    f"got {type(spec).__name__}"
                )
        if self.lane.gpu_to_cpu:
            assert isinstance(src_spec, GPULoadStoreSpec) and isinstance(dst_spec, CPULoadStoreSpec)
            gpu_spec, cpu_spec = src_spec, dst_spec
        else:
            assert isinstance(src_spec, CPULoadStoreSpec) and isinstance(dst_spec, GPULoadStoreSpec)
            gpu_spec, cpu_spec = dst_spec, src_spec
        try:
            plan = plan_transfer(self.engine.layout, gpu_spec, cpu_spec, self.lane)
        except ContractError as exc:
            raise ContractError(f"job {job_id}: {exc}") from exc
        job = self.engine.submit(plan)
        self._jobs[job_id] = job
        self._job_ids.ids.add(job_id)
        return job

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        try:
            src_spec, dst_spec = spec
            self.submit(job_id, src_spec, dst_spec)
        except (TieringError, ValueError, TypeError) as exc:
            logger.warning("rejected %s job %r: %s", self.lane.value, job_id, exc)
            return False
        except Exception:  # e.g. a CUDA error setting up the streams: a failed job, not a crash
            logger.exception("%s job %r failed at submission", self.lane.value, job_id)
            return False
        return True

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        for job_id, job in list(self._jobs.items()):
            if not job.done():
                continue
            outcome = job.outcome()
            del self._jobs[job_id]
            self._job_ids.ids.discard(job_id)
            results.append(
                TransferResult(
                    job_id=job_id,
                    success=outcome.success,
                    transfer_bytes=job.num_bytes,
                    transfer_time=outcome.seconds,
                    error=outcome.error,
                )
            )
        return results

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        """Block until the given jobs finished; ids of other handlers are ignored.

        Raises ``TimeoutError`` if ``timeout`` seconds pass first. The results
        are still collected with :meth:`get_finished`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.wait(left):
                raise TimeoutError(
                    f"{self.lane.value} job {job_id} still running after {timeout} s"
                )

    async def wait_async(self, job_ids: Collection[int]) -> None:
        """Await the given jobs from an asyncio loop without blocking it.

        Cancellation only stops the waiting; the jobs run on and their results
        still come from :meth:`get_finished`.
        """
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                await job.wait_async()

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted whose results were not yet returned by ``get_finished``."""
        return len(self._jobs)

    def close(self) -> None:
        """Stop accepting jobs (without waiting for those in flight). Idempotent."""
        self._closed = True

    def shutdown(self, timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop accepting jobs and wait up to ``timeout`` s for this handler's jobs.

        Results of the jobs that finished stay available from :meth:`get_finished`.
        """
        self.close()
        try:
            self.wait(list(self._jobs), timeout)
        except TimeoutError:
            logger.warning(
                "%s handler shut down with jobs still in flight after %s s",
                self.lane.value,
                timeout,
            )


class CopyWorker:
    """Store, load and expedited-load handlers over one engine (vLLM 0.33's worker shape).

    Owns the engine: :meth:`shutdown` waits for the jobs in flight and then
    releases it (threads, pinned memory).
    """

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        ids = _JobIds()
        self.store_handler = TransferHandler(engine, Lane.STORE, job_ids=ids)
        self.load_handler = TransferHandler(engine, Lane.LOAD, job_ids=ids)
        self.expedited_load_handler = TransferHandler(engine, Lane.LOAD_EXPEDITED, job_ids=ids)
        self._handlers = (self.store_handler, self.load_handler, self.expedited_load_handler)
        self._closed = False

    def submit_store(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """GPU -> CPU, asynchronously. False if rejected (see ``transfer_async``)."""
        return self.store_handler.transfer_async(job_id, (src_spec, dst_spec))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: LoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """CPU -> GPU, asynchronously; ``expedited`` loads have their own lane."""
        handler = self.expedited_load_handler if expedited else self.load_handler
        return handler.transfer_async(job_id, (src_spec, dst_spec))

    def get_finished(self) -> list[TransferResult]:
        """Results of every job that finished since the last call. Never blocks."""
        results: list[TransferResult] = []
        for handler in self._handlers:
            results += handler.get_finished()
        return results

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        """Block until the given jobs finished (``TimeoutError`` after ``timeout`` s)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handler in self._handlers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            handler.wait(job_ids, left)

    async def wait_async(self, job_ids: Collection[int]) -> None:
        """Await the given jobs without blocking the loop.

        Cancellation only stops the waiting; the jobs run on.
        """
        for handler in self._handlers:
            await handler.wait_async(job_ids)

    def get_handlers(
        self,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], TransferHandler]]:
        """``(src_type, dst_type, handler)`` for the two directions (vLLM's ``get_handlers``)."""
        yield GPULoadStoreSpec, CPULoadStoreSpec, self.store_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self.load_handler

    @property
    def num_in_flight(self) -> int:
        return sum(h.num_in_flight for h in self._handlers)

    def shutdown(self, timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
        """Stop accepting jobs, wait up to ``timeout`` s for those in flight, release the engine.

        Jobs unfinished at the deadline are reported failed by ``get_finished``.
        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for handler in self._handlers:
            handler.close()
        self.engine.shutdown(timeout)


EngineKind = Literal["auto", "host", "cuda"]


def make_copy_worker(
    kv_caches: KVCachesLike,
    primary: Any,
    *,
    block_size_factor: int = 1,
    worker_index: int = 0,
    engine: EngineKind = "auto",
    **engine_options: Any,
) -> CopyWorker:
    """Build a :class:`CopyWorker` for ``kv_caches`` over the primary buffer ``primary``.

    ``primary`` is the scheduler's host buffer, typically
    ``HostBuffer.attach(name, num_blocks, block_bytes)`` in a worker process.
    ``engine="auto"`` picks the CUDA engine when the KV tensors are CUDA
    tensors (or a ``device=`` is given: a
    :class:`~tiering.copy.cuda.device.CudaDevice`, such as the simulated one
    the tests use) and the host engine otherwise. ``worker_index`` places this
    worker's slots in each CPU block (tensor parallelism: one area per
    worker). ``engine_options`` go to the engine's constructor. Raises
    ``ValueError`` / ``TypeError`` naming what does not fit.
    """
    tensors = [t.tensor for t in kv_caches.tensors]
    pages = [int(t.page_size_bytes) for t in kv_caches.tensors]
    if not tensors:
        raise ValueError("kv_caches has no tensors")
    on_cuda = [is_torch_tensor(t) and t.device.type == "cuda" for t in tensors]
    if engine == "auto":
        given_device = engine_options.get("device") is not None
        engine = "cuda" if any(on_cuda) or given_device else "host"
    host = host_rows(primary)
    if engine == "cuda":
        from tiering.copy.cuda import CudaCopyEngine, gpu_block_rows
        from tiering.copy.cuda.engine import default_device

        if engine_options.get("device") is None:
            engine_options["device"] = default_device(tensors)
        rows: Sequence[Any] = [
            gpu_block_rows(engine_options["device"], t, p, f"KV-cache tensor {i}")
            for i, (t, p) in enumerate(zip(tensors, pages, strict=True))
        ]
        counts = [int(r.shape[0]) for r in rows]
    elif engine == "host":
        from tiering.copy.host import HostCopyEngine

        rows = [
            block_rows(t, p, f"KV-cache tensor {i}")
            for i, (t, p) in enumerate(zip(tensors, pages, strict=True))
        ]
        counts = [int(r.shape[0]) for r in rows]
    else:
        raise ValueError(f"engine must be 'auto', 'host' or 'cuda', got {engine!r}")
    # No group references: one group that moves every tensor's whole page.
    refs = kv_caches.group_data_refs or [[CanonicalKVCacheRef(i, p) for i, p in enumerate(pages)]]
    layout = KVLayout.build(
        gpu_page_bytes=pages,
        gpu_num_blocks=counts,
        group_data_refs=refs,
        block_size_factor=block_size_factor,
        cpu_num_blocks=int(host.shape[0]),
        cpu_block_bytes=int(host.shape[1]),
        worker_index=worker_index,
    )
    copy_engine: CopyEngine
    if engine == "cuda":
        copy_engine = CudaCopyEngine(layout, rows, primary, **engine_options)
    else:
        copy_engine = HostCopyEngine(layout, rows, primary, **engine_options)
    return CopyWorker(copy_engine)
