"""The streams and events of the simulated CUDA device, and what runs them.

:class:`SimulatedStreams` is the half of
:class:`~tiering.copy.cuda.simulated.SimulatedCudaDevice` that keeps CUDA's
ordering rules: each :class:`SimulatedStream` is a FIFO of operations (event
records, waits, work) run *later*, in order; a :class:`SimulatedEvent`
completes when its stream reaches its latest record; ``wait_event`` /
``wait_stream`` hold a stream until then, and nothing else is ordered. It runs
the streams in ``mode="threads"`` (a worker thread per stream, a seeded random
delay before each operation) or ``mode="manual"`` (:meth:`~SimulatedStreams.step`
and :meth:`~SimulatedStreams.drain`, as the test says), stops them all on
:meth:`~SimulatedStreams.pause` (a device that hangs), and keeps the sticky
error an operation that failed while running leaves behind. What the
operations do (copies, kernels) and the device's memory are the device's.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal


class SimulatedEvent:
    """A CUDA event: complete once its stream reached its latest record."""

    def __init__(self, device: SimulatedStreams) -> None:
        self._device = device
        self._issued = 0  # records enqueued
        self._reached = 0  # records the stream has passed
        self._reached_at = 0.0

    def record(self, stream: Any = None) -> None:
        target = stream if stream is not None else self._device.current_stream()
        with self._device._cond:
            self._issued += 1
            target._push(StreamOp("record", event=self, generation=self._issued))

    def query(self) -> bool:
        with self._device._cond:
            self._device._raise_sticky_error()
            return self._reached >= self._issued

    def synchronize(self) -> None:
        """Block until the stream reached the latest record (or a sticky error is raised).

        As on a GPU, a paused (hung) device blocks this forever; so does
        manual mode until another thread steps the stream. A device closed
        meanwhile drops its queued work: ``RuntimeError``.
        """
        with self._device._cond:
            while True:
                self._device._raise_sticky_error()
                if self._reached >= self._issued:
                    return
                if self._device._closed:
                    raise RuntimeError("the simulated device was closed before the event completed")
                self._device._cond.wait()

    def elapsed_time(self, end_event: Any) -> float:
        with self._device._cond:
            for event in (self, end_event):
                if event._issued == 0 or event._reached < event._issued:
                    raise RuntimeError("elapsed_time needs two recorded, completed events")
            return float((end_event._reached_at - self._reached_at) * 1e3)


class SimulatedStream:
    """A CUDA stream: a FIFO of operations run by the device."""

    def __init__(self, device: SimulatedStreams, name: str, high_priority: bool) -> None:
        self._device = device
        self.name = name
        self.high_priority = high_priority
        self._queue: deque[StreamOp] = deque()

    def __repr__(self) -> str:
        return f"SimulatedStream({self.name}, {len(self._queue)} queued)"

    def wait_event(self, event: Any) -> None:
        with self._device._cond:
            self._push(StreamOp("wait", event=event, generation=event._issued))

    def wait_stream(self, stream: Any) -> None:
        marker = SimulatedEvent(self._device)
        marker.record(stream)
        self.wait_event(marker)

    def _push(self, op: StreamOp) -> None:
        """Enqueue (the device's lock held)."""
        self._queue.append(op)
        self._device._cond.notify_all()


@dataclass
class StreamOp:
    """One operation queued on a stream: an event record, a wait for one, or work."""

    kind: Literal["record", "wait", "work"]
    event: SimulatedEvent | None = None
    generation: int = 0
    work: Callable[[], object] | None = None


class SimulatedStreams:
    """Streams and events run in CUDA's order (threads or manual mode); see the module docstring.

    The lock (``_cond``) guards every stream and event; the device that
    builds on this class guards its own state with it too.
    """

    def __init__(
        self, *, mode: Literal["threads", "manual"], seed: int, max_delay_s: float
    ) -> None:
        if mode not in ("threads", "manual"):
            raise ValueError(f"mode must be 'threads' or 'manual', got {mode!r}")
        self.mode = mode
        self.max_delay_s = max_delay_s
        self._seed = seed
        self._cond = threading.Condition()
        self._streams: list[SimulatedStream] = []
        self._workers: list[threading.Thread] = []
        self._current = threading.local()
        self._sticky_error: str | None = None
        self._paused = False
        self._running = 0  # operations taken off a queue and not yet finished
        self._closed = False
        self.default_stream = self._make_stream("default", high_priority=False)

    def close(self) -> None:
        """Stop the worker threads (queued work is dropped). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for worker in self._workers:
            worker.join()
        self._workers.clear()

    # -------------------------------------------------------------- streams and events

    def new_stream(self, *, high_priority: bool = False) -> SimulatedStream:
        return self._make_stream(f"stream-{len(self._streams)}", high_priority)

    def _make_stream(self, name: str, high_priority: bool) -> SimulatedStream:
        stream = SimulatedStream(self, name, high_priority)
        with self._cond:
            index = len(self._streams)
            self._streams.append(stream)
        if self.mode == "threads":
            worker = threading.Thread(
                target=self._run_stream,
                args=(stream, random.Random(self._seed * 1000 + index)),
                name=f"simulated-cuda-{name}",
                daemon=True,
            )
            self._workers.append(worker)
            worker.start()
        return stream

    def current_stream(self) -> SimulatedStream:
        current: SimulatedStream | None = getattr(self._current, "stream", None)
        return current if current is not None else self.default_stream

    def new_event(self) -> SimulatedEvent:
        return SimulatedEvent(self)

    def on_stream(self, stream: Any) -> AbstractContextManager[None]:
        return self._on_stream(stream)

    @contextmanager
    def _on_stream(self, stream: SimulatedStream) -> Iterator[None]:
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    # -------------------------------------------------------------- running streams

    def pause(self) -> None:
        """Stop every stream before its next operation (a device that hangs)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def step(self, stream: SimulatedStream) -> bool:
        """Run the next operation of ``stream`` if it may run now; False if it may not."""
        with self._cond:
            if not self._runnable(stream):
                return False
            op = stream._queue.popleft()
            self._running += 1
        self._run(op)
        return True

    def runnable_streams(self) -> list[SimulatedStream]:
        """The streams whose next operation may run now."""
        with self._cond:
            return [s for s in self._streams if self._runnable(s)]

    def drain(self) -> None:
        """Run operations (manual mode) until no stream can run; in threads mode, wait for that."""
        if self.mode == "threads":
            with self._cond:
                while self._running or any(self._runnable(s) for s in self._streams):
                    self._cond.wait(0.01)
            return
        while True:
            ready = self.runnable_streams()
            if not ready:
                return
            for stream in ready:
                self.step(stream)

    def _runnable(self, stream: SimulatedStream) -> bool:
        """Whether the head of ``stream`` may run (the lock held)."""
        if self._paused or not stream._queue:
            return False
        head = stream._queue[0]
        if head.kind == "wait":
            assert head.event is not None
            return head.event._reached >= head.generation
        return True

    def _run(self, op: StreamOp) -> None:
        if op.kind == "work":
            assert op.work is not None
            try:
                op.work()
            except Exception as exc:  # a kernel fault: sticky, as CUDA's asynchronous errors
                with self._cond:
                    self._sticky_error = self._sticky_error or f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._running -= 1
            if op.kind == "record":
                assert op.event is not None
                op.event._reached = max(op.event._reached, op.generation)
                op.event._reached_at = time.perf_counter()
            self._cond.notify_all()

    def _raise_sticky_error(self) -> None:
        if self._sticky_error is not None:
            raise RuntimeError(f"CUDA error (simulated, sticky): {self._sticky_error}")

    def _run_stream(self, stream: SimulatedStream, rng: random.Random) -> None:
        """A stream's worker thread (threads mode): a random delay before each operation."""
        while True:
            with self._cond:
                while not self._closed and not self._runnable(stream):
                    self._cond.wait()
                if self._closed:
                    return
            if self.max_delay_s > 0:
                time.sleep(rng.uniform(0.0, self.max_delay_s))
            with self._cond:
                # Closed or paused meanwhile: the top of the loop sorts it out.
                if self._closed or not self._runnable(stream):
                    continue
                op = stream._queue.popleft()
                self._running += 1
            self._run(op)
