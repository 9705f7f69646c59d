"""The tier's process: one event loop running the tier's service, fed and drained by rings.

Started (``spawn``) by :class:`~tiering.isolation.IsolatedTierManager` with a
:class:`ChildSpec`. It attaches to the shared primary buffer and the two
rings, builds the tier from the spec's factory and runs
:class:`~tiering.runtime.service.TierService` on its main thread's event
loop, exactly as a loop thread does in one process. What arrives on the
jobs ring (jobs, presence checks, touches) goes to the service; what the
service publishes (results, the lookup view's changes, events, counters)
is shipped back on the results ring, coalesced once per loop iteration.

The control pipe carries the start-up answer (``ready`` or the exception
that stopped the tier from opening, its type kept), and later the order to
close; its end of file (the scheduler's process died) closes the tier too.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import pickle
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tiering.core.jobs import JobMetadata
from tiering.isolation.mirror import (
    ChangeLog,
    RecordingKeys,
    RecordingPresent,
    RecordingTimes,
    SignallingDeque,
)
from tiering.isolation.ring import WAKE_WORD, ByteRing
from tiering.isolation.wakeup import SAFETY_POLL_S, WakeReceiver
from tiering.primary.host_buffer import HostBuffer
from tiering.runtime.affinity import pin_current_process
from tiering.runtime.gil_handoff import handoff_loop_factory
from tiering.runtime.service import TierService, _Job
from tiering.tier import AsyncTier, TierContext

logger = logging.getLogger("tiering.isolation")

#: Most results, changes or events one shipped message carries (keeps messages well
#: under the ring's size when a tier opens with a million keys to announce).
CHUNK = 16384
#: How soon a message the full results ring refused is offered again.
RETRY_S = 0.001


@dataclass(frozen=True)
class ChildSpec:
    """Everything the tier's process needs, picklable."""

    tier_factory: Callable[[], AsyncTier]
    name: str
    primary_name: str
    num_rows: int
    block_bytes: int
    jobs_ring: str
    results_ring: str
    ring_bytes: int
    layout_fingerprint: str
    job_timeout_s: float
    open_timeout_s: float
    cancel_grace_s: float
    shared_absent_ttl_s: float
    shared_present_ttl_s: float
    shared_max_known_keys: int
    max_events: int
    verify: bool | None
    cpus: frozenset[int] | None = None
    max_gil_hold_s: float | None = None


def serve(spec: ChildSpec, control: Connection, wake: Connection) -> None:
    """The child process's entry point (returns when the tier is closed)."""
    # The scheduler's process decides when to stop: a signal to the whole process group
    # (Ctrl-C, a closed terminal, systemd's SIGTERM) must not kill the tier mid-job.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    try:
        pin_current_process(spec.cpus)  # before the tier starts threads: they inherit it
        with asyncio.Runner(loop_factory=handoff_loop_factory(spec.max_gil_hold_s)) as runner:
            runner.run(_Child(spec, control, wake).run())
    except BaseException as exc:  # reported to the parent, which raises it
        logger.debug("tier process %s failed", spec.name, exc_info=True)
        _send_error(control, exc)


def _send_error(control: Connection, exc: BaseException) -> None:
    try:
        # An exception that pickles but cannot be rebuilt (an __init__ with other
        # arguments) would reach the parent as a confusing TypeError: described instead.
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        control.send(("error", exc))
    except Exception:
        with contextlib.suppress(OSError):  # OSError: the parent is gone
            control.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))


class _Child:
    def __init__(self, spec: ChildSpec, control: Connection, wake: Connection) -> None:
        self.spec = spec
        self.control = control
        self.wake_conn = wake
        self.backlog: deque[bytes] = deque()
        self.flush_pending = False
        self.closing: asyncio.Future[float] | None = None

    async def run(self) -> None:
        spec = self.spec
        loop = asyncio.get_running_loop()
        self.loop = loop
        primary = HostBuffer.attach(spec.primary_name, spec.num_rows, spec.block_bytes)
        jobs = ByteRing.attach(spec.jobs_ring, spec.ring_bytes)
        results = ByteRing.attach(spec.results_ring, spec.ring_bytes)
        flat = primary.view.cast("B")
        try:
            tier = spec.tier_factory()
            if not isinstance(tier, AsyncTier):
                raise TypeError(f"tier_factory must return an AsyncTier, not {type(tier).__name__}")
            service = self._service(tier, flat)
            self.service, self.jobs, self.results = service, jobs, results
            context = TierContext(spec.block_bytes, spec.layout_fingerprint, spec.name)
            try:
                await asyncio.wait_for(
                    service.open(context, timeout_s=spec.open_timeout_s), spec.open_timeout_s
                )
            except BaseException:
                await service.close_tier_only(spec.open_timeout_s)
                raise
            self.receiver = WakeReceiver(jobs.word(WAKE_WORD), self.wake_conn.fileno())
            self.closing = loop.create_future()
            capacity = getattr(tier, "capacity_blocks", None)
            self.control.send(
                (
                    "ready",
                    service.shared,
                    service.touch_supported,
                    capacity if isinstance(capacity, int) else None,
                    type(tier).__name__,
                )
            )
            loop.add_reader(self.receiver.fd, self._on_wake)
            loop.add_reader(self.control.fileno(), self._on_control)
            poller = loop.create_task(self._poll_forever())
            budget = await self.closing
            poller.cancel()
            loop.remove_reader(self.receiver.fd)
            loop.remove_reader(self.control.fileno())
            self._take_jobs()  # what was sent before the order to close
            await service.aclose(budget)
            await self._ship_everything(budget)
            self.control.send(("closed", copy.copy(service.counters)))
        finally:
            flat.release()
            jobs.close()
            results.close()
            primary.close()

    def _service(self, tier: AsyncTier, flat: memoryview) -> TierService:
        spec = self.spec
        service = TierService(
            tier,
            name=spec.name,
            flat_view=flat,
            block_bytes=spec.block_bytes,
            job_timeout_s=spec.job_timeout_s,
            cancel_grace_s=spec.cancel_grace_s,
            shared_absent_ttl_s=spec.shared_absent_ttl_s,
            shared_present_ttl_s=spec.shared_present_ttl_s,
            shared_max_known_keys=spec.shared_max_known_keys,
            max_events=spec.max_events,
            verify=not tier.verifies_reads if spec.verify is None else spec.verify,
        )
        # Swap the published views for recording ones before anything is published.
        self.log = ChangeLog(self._dirty)
        present_options: dict[str, Any] = (
            {"ttl_s": spec.shared_present_ttl_s, "max_keys": spec.shared_max_known_keys}
            if service.shared
            else {}
        )
        service.present = RecordingPresent(self.log, **present_options)
        service.unsettled = RecordingKeys(self.log)
        service.absent_at = RecordingTimes(self.log)
        service.events = SignallingDeque(self._dirty)
        service.results = _SignallingResults(self._dirty)  # type: ignore[assignment]  # put only
        return service

    # -- jobs in ------------------------------------------------------------------------------

    def _on_wake(self) -> None:
        if not self.receiver.clear():
            self._close_soon(self.spec.job_timeout_s)  # the parent is gone
        self._take_jobs()

    def _take_jobs(self) -> None:
        service = self.service
        for message in self.jobs.receive():
            for kind, payload in pickle.loads(message):
                if kind == "job":
                    job_id, keys, rows, is_load, deadline = payload
                    meta = JobMetadata(job_id, keys, rows, is_load)
                    service.start_job(_Job(meta, rows, is_load, deadline))
                elif kind == "resolve":
                    service.request_resolve(payload)
                else:
                    service.touch(payload)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(SAFETY_POLL_S)
            if self.jobs.pending():
                self._take_jobs()

    def _on_control(self) -> None:
        try:
            message = self.control.recv()
        except (EOFError, OSError):
            self._close_soon(self.spec.job_timeout_s)  # the parent is gone
            return
        if message[0] == "close":
            self._close_soon(float(message[1]))

    def _close_soon(self, budget: float) -> None:
        if self.closing is not None and not self.closing.done():
            self.closing.set_result(budget)

    # -- results out --------------------------------------------------------------------------

    def _dirty(self) -> None:
        if not self.flush_pending:
            self.flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        service = self.service
        results = service.results
        assert isinstance(results, _SignallingResults)
        while results.items or self.log.changes or service.events:
            taken = [results.items.popleft() for _ in range(min(CHUNK, len(results.items)))]
            events = service.events
            shipped = [events.popleft() for _ in range(min(CHUNK, len(events)))]
            # Changes first in the message: the parent applies them before it hands out
            # the results they cover.
            message = (self.log.take(CHUNK), taken, shipped, copy.copy(service.counters))
            self.backlog.append(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        self._send_backlog()

    def _send_backlog(self) -> None:
        backlog = self.backlog
        while backlog and self.results.try_send(backlog[0]):
            backlog.popleft()
        if backlog and not self.flush_pending:
            self.flush_pending = True  # a retry is a flush too: it also ships what came since
            self.loop.call_later(RETRY_S, self._flush)

    async def _ship_everything(self, budget: float) -> None:
        deadline = self.loop.time() + max(budget, 1.0)
        self._flush()
        while self.backlog and self.loop.time() < deadline:
            await asyncio.sleep(RETRY_S)
            self._send_backlog()


class _SignallingResults:
    """Stands in for the service's results queue: ``put`` collects and signals."""

    def __init__(self, on_put: Callable[[], None]) -> None:
        self.items: deque[Any] = deque()
        self._on_put = on_put

    def put(self, item: Any) -> None:
        self.items.append(item)
        self._on_put()
