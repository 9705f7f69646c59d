"""``IsolatedTierManager``: the facade of :class:`~tiering.runtime.AsyncTierManager`, the tier
in a child process.

Opt-in (issue 20.4): the tier's event loop runs in a process of its own, so
its Python never holds the scheduler's GIL. The child attaches to the same
shared-memory primary buffer (copies need no extra hop), jobs go to it on a
shared-memory ring (no system call while it is busy, one coalesced wake-up
when it is idle) and its results, lookup-view changes, events and counters
come back on another, read by the scheduler thread whenever it calls the
facade. Everything the scheduler sees is the in-process facade's: the same
checks and errors at submission, the same lookup answers, results, events
and stats (its scheduler-side state is inherited, not copied).

What differs: the tier is built in the child by ``tier_factory`` (a
picklable zero-argument callable, e.g. ``functools.partial(MemoryTier,
capacity_blocks=1024)``), so ``self.tier`` does not exist here; the primary
buffer must be a named shared :class:`~tiering.primary.host_buffer.HostBuffer`; and
if the child dies, every job in flight fails, later jobs fail at once, and
lookups answer False (never a wrong hit); the death is logged once.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import pickle
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Unpack

from tiering.core.errors import ConfigError
from tiering.core.jobs import JobResult, SecondaryTierManager
from tiering.core.keys import OffloadKey, ReqContext
from tiering.isolation.child import ChildSpec, serve
from tiering.isolation.mirror import Mirror
from tiering.isolation.ring import WAKE_WORD, ByteRing
from tiering.isolation.wakeup import WakeSender
from tiering.primary.host_buffer import HostBuffer
from tiering.runtime.affinity import check_cpus
from tiering.runtime.facade import AsyncTierManager
from tiering.runtime.gil_handoff import hold_seconds
from tiering.runtime.options import RuntimeOptions, resolved_options
from tiering.runtime.presence import Presence
from tiering.runtime.service_state import _Job
from tiering.runtime.stats import TierCounters
from tiering.runtime.young_gc import CollectorThread
from tiering.tier import AsyncTier

logger = logging.getLogger("tiering.isolation")

#: Default size of each ring (jobs out, results back).
RING_BYTES = 4 << 20
#: How often the scheduler side checks that the tier's process is alive.
LIVENESS_EVERY_S = 0.05
#: How long starting the child process (interpreter and imports) may take, on top of
#: ``open_timeout_s``.
SPAWN_ALLOWANCE_S = 60.0


class IsolatedTierManager(AsyncTierManager):
    """Runs the tier ``tier_factory()`` builds in a child process (see the module docs).

    ``primary`` is the primary tier's buffer, a named shared
    :class:`~tiering.primary.host_buffer.HostBuffer` (``CPUPrimaryTier(...,
    shared_name=...)``'s ``buffer``). The keyword options are
    :class:`~tiering.runtime.AsyncTierManager`'s, with the same meaning
    (``cpus`` pins every thread of the child process, before the tier opens;
    ``max_gil_hold_ms`` bounds the child's loop between GIL hand-offs to the
    tier's own threads, the scheduler's thread not being there);
    ``ring_bytes`` sizes each ring; ``gc_handoff`` (default True) runs the
    garbage collections the scheduler's step would run on a collector thread
    of this process instead (there is no loop thread here; the results it
    unpickles still allocate), on the CPUs of the thread that constructs the
    manager (not on ``cpus``, where the tier's process would preempt it).
    Construction starts the process and returns once the tier is open there;
    a tier that fails to open raises its own exception here (its type kept
    when it pickles), and
    ``TimeoutError`` if it does not open within ``open_timeout_s`` (plus
    :data:`SPAWN_ALLOWANCE_S` for the interpreter to start).
    """

    def __init__(
        self,
        tier_factory: Callable[[], AsyncTier],
        primary: HostBuffer,
        tier_type: str,
        *,
        ring_bytes: int = RING_BYTES,
        **options: Unpack[RuntimeOptions],
    ) -> None:
        if not callable(tier_factory):
            raise TypeError(f"tier_factory must be callable, not {type(tier_factory).__name__}")
        if not isinstance(primary, HostBuffer) or primary.closed:
            raise ConfigError(f"primary must be an open HostBuffer, got {primary!r}")
        if primary.name is None:
            raise ConfigError(
                "an isolated tier needs the primary buffer in named shared memory "
                "(HostBuffer.create(..., shared_name=...)); this one is anonymous"
            )
        opts = resolved_options(options)
        SecondaryTierManager.__init__(self, primary.view, tier_type)
        self.cpus = check_cpus(opts["cpus"])
        self.name = opts["name"] or tier_type
        self._init_scheduler_side(
            primary.view,
            None,
            opts["job_timeout_s"],
            opts["shutdown_timeout_s"],
            opts["failed_load_backoff_s"],
        )
        max_events = opts["max_events"]
        open_timeout_s = float(opts["open_timeout_s"])
        self._max_events = max_events
        self._events_dropped_here = 0
        self._jobs_failed_here = 0  # failed by this process: the tier's process had died
        self._mirror = Mirror()
        self._arrived: deque[JobResult] = deque()
        self._events: deque[tuple[list[OffloadKey], bool]] = deque()
        self._latest_counters = TierCounters()
        self._outbox: list[tuple[str, Any]] = []
        self._unsent: deque[bytes] = deque()
        self._dead: str | None = None
        self._next_liveness_check = 0.0
        self._jobs_ring = ByteRing.create(ring_bytes)
        self._results_ring = ByteRing.create(ring_bytes)
        context = multiprocessing.get_context("spawn")
        wake_reader, wake_writer = context.Pipe(duplex=False)
        self._control, child_control = context.Pipe()
        spec = ChildSpec(
            tier_factory=tier_factory,
            name=self.name,
            primary_name=primary.name,
            num_rows=self._num_rows,
            block_bytes=self.block_bytes,
            jobs_ring=self._jobs_ring.name,
            results_ring=self._results_ring.name,
            ring_bytes=ring_bytes,
            layout_fingerprint=opts["layout_fingerprint"],
            job_timeout_s=self.job_timeout_s,
            open_timeout_s=open_timeout_s,
            cancel_grace_s=float(opts["cancel_grace_s"]),
            shared_absent_ttl_s=float(opts["shared_absent_ttl_s"]),
            shared_present_ttl_s=float(opts["shared_present_ttl_s"]),
            shared_max_known_keys=opts["shared_max_known_keys"],
            max_events=max_events,
            verify=opts["verify"],
            cpus=self.cpus,
            max_gil_hold_s=hold_seconds(opts["max_gil_hold_ms"]),
        )
        self._process = context.Process(
            target=serve,
            args=(spec, child_control, wake_reader),
            name=f"tier-{self.name}",
            daemon=True,
        )
        started = False
        try:
            self._process.start()
            started = True
            self._pid = self._process.pid
            child_control.close()
            wake_reader.close()
            self._wake_conn = wake_writer
            self._wake = WakeSender(self._jobs_ring.word(WAKE_WORD), wake_writer.fileno())
            answer = self._await_start(open_timeout_s + SPAWN_ALLOWANCE_S)
        except BaseException:
            self._closed = True
            if started:  # start() fails before spawning when the spec does not pickle
                self._stop_process(self.shutdown_timeout_s)
            self._release()
            self._flat.release()  # as shutdown() would: the caller may unmap its buffer now
            raise
        finally:
            self._jobs_ring.unlink()  # both sides are attached (or the child is gone)
            self._results_ring.unlink()
        shared, self._touch_supported, self._capacity, self._tier_class = answer
        self._collector: CollectorThread | None = None
        if opts["gc_handoff"]:  # no loop thread here: the results it unpickles still allocate
            # Not on ``cpus``: there the tier's busy process preempts it mid-collection,
            # GIL held, and a scheduler back from the GPU waits out that time slice
            # (docs/runtime.md, "Garbage collections"). Where it is started (the
            # scheduler's CPUs), it collects while the scheduler waits for the GPU.
            self._collector = CollectorThread(f"tier-{self.name}-gc")
            self._offer_collection = self._collector.offer
        mirror = self._mirror
        self._bind_published(
            mirror.present,
            mirror.unsettled,
            mirror.absent_at,
            shared=shared,
            shared_absent_ttl_s=opts["shared_absent_ttl_s"],
            shared_present_ttl_s=opts["shared_present_ttl_s"],
        )

    def _await_start(self, timeout_s: float) -> tuple[bool, bool, int | None, str]:
        control = self._control
        ready = multiprocessing.connection.wait([control, self._process.sentinel], timeout_s)
        if control in ready:
            try:
                message = control.recv()
            except EOFError:
                message = None
            if message is not None and message[0] == "ready":
                return message[1], message[2], message[3], message[4]
            if message is not None and message[0] == "error":
                raise message[1]
        if not ready:
            raise TimeoutError(
                f"tier {self.name}: its process did not open the tier within {timeout_s} s"
            )
        self._process.join(1.0)
        raise RuntimeError(
            f"tier {self.name}: its process exited while starting (exit code "
            f"{self._process.exitcode})"
        )

    # -- the scheduler-facing contract: read what the child shipped first --------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if self._results_ring_pending():
            self._pump()
        return super().lookup(key, req_context)

    def lookup_state(self, key: OffloadKey) -> Presence:
        if self._results_ring_pending():
            self._pump()
        return super().lookup_state(key)

    def get_num_blocks(self) -> int:
        self._pump()
        return super().get_num_blocks()

    def take_events(self) -> Iterable[tuple[list[OffloadKey], bool]]:
        self._pump()
        return super().take_events()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        super().touch(keys, req_context)
        self._flush_outbox()

    def _lookup_shared(self, key: OffloadKey) -> bool | None:
        answer = super()._lookup_shared(key)
        self._flush_outbox()
        return answer

    # -- where jobs go and results come from: the rings ---------------------------------------

    def _post_job(self, job: _Job) -> None:
        if self._dead is not None:
            self._arrived.append(self._death_result(job.meta.job_id))
            return
        # Only what the service reads: a tuple pickles in ~1 us, the job object in ~13.
        meta = job.meta
        self._outbox.append(("job", (meta.job_id, meta.keys, job.rows, job.is_load, job.deadline)))
        self._flush_outbox()

    def _post_resolve(self, key: OffloadKey) -> None:
        if self._dead is None:
            self._outbox.append(("resolve", key))

    def _post_touch(self, keys: tuple[OffloadKey, ...]) -> None:
        if self._dead is None:
            self._outbox.append(("touch", keys))

    def _flush_outbox(self) -> None:
        if self._outbox:
            self._unsent.append(pickle.dumps(self._outbox, protocol=pickle.HIGHEST_PROTOCOL))
            self._outbox = []
        unsent = self._unsent
        if not unsent:
            return
        sent = False
        while unsent and self._jobs_ring.try_send(unsent[0]):
            unsent.popleft()
            sent = True
        if sent:
            try:
                self._wake.wake()
            except OSError:  # the child's end is gone: the liveness check will tell
                self._next_liveness_check = 0.0

    def _results_ring_pending(self) -> bool:
        if self._closed:  # the ring is unmapped: the facade's own check raises TierClosedError
            return False
        return self._results_ring.pending() or bool(self._unsent)

    def _pump(self) -> None:
        """Apply what the child shipped; retry jobs the full ring refused; notice a death."""
        if self._closed:
            return
        if self._unsent:
            self._flush_outbox()
        self._take_messages(apply_changes=True)
        now = time.monotonic()
        if self._dead is None and now >= self._next_liveness_check:
            self._next_liveness_check = now + LIVENESS_EVERY_S
            if not self._process.is_alive():
                self._on_death()

    def _keep_events(self, events: list[tuple[list[OffloadKey], bool]]) -> None:
        kept = self._events
        for event in events:
            if len(kept) >= self._max_events:
                self._events_dropped_here += len(event[0])
            else:
                kept.append(event)

    def _on_death(self) -> None:
        self._take_messages(apply_changes=False)  # the view is forgotten below
        code = self._process.exitcode
        self._dead = f"tier {self.name}: its process died (exit code {code})"
        logger.error("%s; its jobs fail and lookups answer False from now on", self._dead)
        self._mirror.forget_everything()
        self._outbox.clear()
        self._unsent.clear()
        answered = {result.job_id for result in self._arrived} | {r.job_id for r in self._ready}
        for job_id in self._outstanding:
            if job_id not in answered:
                self._arrived.append(self._death_result(job_id))

    def _take_messages(self, *, apply_changes: bool) -> None:
        """What the results ring holds: view changes (unless the view is gone), results,
        events and the latest counters."""
        for message in self._results_ring.receive():
            changes, results, events, counters = pickle.loads(message)
            if apply_changes:
                self._mirror.apply(changes)
            self._arrived.extend(results)
            self._keep_events(events)
            self._latest_counters = counters

    def _death_result(self, job_id: int) -> JobResult:
        assert self._dead is not None
        self._jobs_failed_here += 1
        return JobResult(job_id, False, frozenset(), error=self._dead)

    def _take_results(self) -> Sequence[JobResult]:
        self._pump()
        arrived = self._arrived
        if not arrived:
            return ()
        taken = list(arrived)
        arrived.clear()
        return taken

    def _results_waiting(self) -> bool:
        self._pump()
        return bool(self._arrived)

    def _wait_result(self, timeout_s: float | None) -> JobResult | None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._pump()
            if self._arrived:
                return self._arrived.popleft()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            wait = 0.0005 if remaining is None else min(0.0005, remaining)
            multiprocessing.connection.wait([self._process.sentinel], wait)

    def _counters(self) -> TierCounters:
        if not self._closed:
            self._pump()
        counters = self._latest_counters
        if self._events_dropped_here or self._jobs_failed_here:
            counters = TierCounters(**{f: getattr(counters, f) for f in counters.__slots__})
            counters.events_dropped += self._events_dropped_here
            counters.jobs_failed += self._jobs_failed_here
        return counters

    def _capacity_blocks(self) -> object:
        return self._capacity

    def _tier_class_name(self) -> str:
        return self._tier_class

    # -- shutdown -----------------------------------------------------------------------------

    def _close_backend(self, budget_s: float) -> None:
        try:
            self._stop_process(budget_s)
        finally:
            if self._collector is not None:
                self._collector.close()
            self._release()

    def _stop_process(self, budget_s: float) -> None:
        """Ask the child to close the tier (bounded), then make sure it is gone."""
        process = self._process
        deadline = time.monotonic() + budget_s
        if process.is_alive() and self._dead is None:
            try:
                self._flush_outbox()
                self._control.send(("close", budget_s * 0.8))
                while time.monotonic() < deadline:
                    if not self._control.poll(max(0.0, deadline - time.monotonic())):
                        break
                    message = self._control.recv()
                    if message[0] == "closed":
                        self._latest_counters = message[1]
                        break
            except (OSError, EOFError):
                pass  # it died meanwhile
        process.join(max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            logger.error(
                "tier %s: its process did not stop within %s s; killed", self.name, budget_s
            )
            process.kill()
            process.join(5.0)

    def _release(self) -> None:
        for closer in (self._control.close, self._jobs_ring.close, self._results_ring.close):
            try:
                closer()
            except Exception:
                logger.debug("tier %s: closing a channel failed", self.name, exc_info=True)
        wake = getattr(self, "_wake_conn", None)
        if wake is not None:
            wake.close()
        if self._process.exitcode is not None or not self._process.is_alive():
            self._process.close()

    @property
    def pid(self) -> int | None:
        """The tier's process id."""
        return self._pid


__all__ = ["IsolatedTierManager", "RING_BYTES"]
