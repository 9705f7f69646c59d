"""The CUDA copy engine under faults only a simulated device can inject.

Registration refused (every size, or above a per-call limit), no device
pointer, a mapping that reads other bytes, copies that raise when enqueued or
fail when run, and a device that stops (shutdown past its deadline). Each
test checks what the engine promises: a clear outcome, bytes still right
where the engine says it copied, nothing pinned that should not be.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.cuda_rigs import TWO_GROUPS, KVRig, SimulatedRig, wait_all
from tests.test_copy_cuda import g0, round_trip
from tiering.copy import Lane, plan_transfer, required_cpu_block_bytes
from tiering.copy.cuda.device import (
    CUDA_ERROR_ALREADY_REGISTERED,
    CUDA_ERROR_MEMORY_ALLOCATION,
)
from tiering.copy.cuda.pins import PinRegistry
from tiering.copy.cuda.simulated import (
    CUDA_ERROR_NOT_REGISTERED,
    DEVICE_ADDRESS_OFFSET,
    SimulatedCudaDevice,
)
from tiering.core.specs import CPULoadStoreSpec

ROW = required_cpu_block_bytes(TWO_GROUPS[0], 1)
ENGINE_LOG = "tiering.copy.cuda"


@pytest.fixture
def rig() -> Any:
    rig = SimulatedRig(seed=11)
    yield rig
    rig.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith(ENGINE_LOG)
    ]


def test_a_refused_registration_falls_back_to_pageable_with_one_warning(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.faults.register_error = 999
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="auto", dma_min_bytes=2500)
    try:
        engine: Any = kv.worker.engine
        assert not engine.pinned and engine._mapped is None  # no mapping without pinning
        (warning,) = warnings_of(caplog)
        assert "CUDA error 999" in warning and "pageable" in warning
        assert not rig.is_pinned(kv.host.as_numpy())
        round_trip(kv, seed=1)  # pageable copies still move the right bytes
    finally:
        kv.close()
    assert len(warnings_of(caplog)) == 1


def test_a_per_call_limit_is_met_by_halving_the_chunks(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM #52656: one registration of the whole buffer fails; smaller ones succeed."""
    rig.sim.pins = PinRegistry(max_chunk_bytes=64 * ROW, min_chunk_bytes=ROW)
    rig.sim.faults.register_limit_bytes = 7 * ROW
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="kernel")
    host = kv.host.as_numpy()
    try:
        calls = rig.sim.register_calls
        refused = [n for _, n, code in calls if code == CUDA_ERROR_MEMORY_ALLOCATION]
        granted = [(p, n) for p, n, code in calls if code == 0]
        assert refused == [24 * ROW, 12 * ROW]  # the whole buffer, then half of it
        assert [n for _, n in granted] == [6 * ROW] * 4
        assert all((p - host.ctypes.data) % ROW == 0 for p, _ in granted)  # row boundaries
        assert rig.is_pinned(host) and not warnings_of(caplog)
        round_trip(kv, seed=2)  # kernels read one mapping across the four chunks
    finally:
        kv.worker.shutdown()
    assert rig.sim.registered_bytes(host.ctypes.data, host.nbytes) == 0
    kv.host.close()


def test_a_limit_below_the_smallest_chunk_falls_back_and_leaves_nothing_registered(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.pins = PinRegistry(max_chunk_bytes=8 * ROW, min_chunk_bytes=4 * ROW)
    rig.sim.faults.register_limit_bytes = 3 * ROW
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS)
    try:
        assert not kv.worker.engine.pinned  # type: ignore[attr-defined]
        assert rig.sim.registered_bytes(kv.host.as_numpy().ctypes.data, 24 * ROW) == 0
        assert len(warnings_of(caplog)) == 1
        round_trip(kv, seed=3)
    finally:
        kv.close()


def test_a_partly_failed_registration_undoes_the_chunks_it_made(rig: SimulatedRig) -> None:
    sim = rig.sim
    pins = PinRegistry(max_chunk_bytes=4096, min_chunk_bytes=4096)
    buffer = np.zeros(4 * 4096, dtype=np.uint8)
    ptr = buffer.ctypes.data
    # Someone else holds the third page: 712 there is fine (used, never undone).
    assert sim.register_host(ptr + 2 * 4096, 4096) == 0
    assert pins.pin(sim, ptr, buffer.nbytes, row_bytes=4096)
    pinned = pins.get(ptr, buffer.nbytes)
    assert pinned is not None and pinned.foreign_chunks == [(ptr + 2 * 4096, 4096)]
    assert len(pinned.chunks) == 3
    pins.unpin(sim, ptr, buffer.nbytes)
    assert sim.registered_bytes(ptr, buffer.nbytes) == 4096  # only the other owner's page
    # Now a refusal past the first chunks: those are undone, nothing stays.
    sim.faults.register_limit_bytes = 0
    assert not pins.pin(sim, ptr, 2 * 4096, row_bytes=4096)
    assert sim.registered_bytes(ptr, 2 * 4096) == 0
    assert pins.holders(ptr, 2 * 4096) == 0
    assert sim.unregister_host(ptr + 2 * 4096) == 0
    assert sim.unregister_host(ptr) == CUDA_ERROR_NOT_REGISTERED


def test_pin_registry_refuses_nonsense_chunk_sizes() -> None:
    with pytest.raises(ValueError, match="min_chunk_bytes <= max_chunk_bytes"):
        PinRegistry(max_chunk_bytes=10, min_chunk_bytes=20)
    with pytest.raises(ValueError, match="0 < min_chunk_bytes"):
        PinRegistry(min_chunk_bytes=0)


def test_already_registered_everywhere_means_pinned_but_never_unpinned_by_us(
    rig: SimulatedRig,
) -> None:
    rig.sim.faults.register_error = CUDA_ERROR_ALREADY_REGISTERED
    kv = KVRig(rig, TWO_GROUPS)
    try:
        assert kv.worker.engine.pinned  # type: ignore[attr-defined]
    finally:
        kv.close()
    assert all(code == CUDA_ERROR_ALREADY_REGISTERED for _, _, code in rig.sim.register_calls)


def test_without_a_device_pointer_auto_uses_dma_and_kernel_is_refused(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.faults.no_device_pointer = True
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="auto")
    try:
        engine: Any = kv.worker.engine
        assert engine.pinned and engine._mapped is None
        assert any("no device address" in r.getMessage() for r in caplog.records)
        round_trip(kv, seed=4)
    finally:
        kv.close()
    with pytest.raises(RuntimeError, match="strategy='kernel' needs the primary buffer"):
        KVRig(rig, TWO_GROUPS, strategy="kernel")
    assert not rig.sim.registered_bytes(0, 1 << 62), "the refused engine left its pin behind"


def test_a_mapping_that_reads_other_bytes_disables_kernels(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.faults.mapping_reads_wrong_bytes = True
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="auto")
    try:
        assert kv.worker.engine._mapped is None  # type: ignore[attr-defined]
        assert any("wrong bytes" in w for w in warnings_of(caplog))
        round_trip(kv, seed=5)
    finally:
        kv.close()


def test_an_unmappable_address_is_reported_not_wrapped(rig: SimulatedRig) -> None:
    with pytest.raises(RuntimeError, match="not mapped host memory"):
        rig.sim.device_bytes(DEVICE_ADDRESS_OFFSET + 4096, 16)


@pytest.mark.parametrize("strategy", ["dma", "kernel"])
def test_a_copy_that_raises_when_enqueued_fails_its_job_only(
    rig: SimulatedRig, strategy: str
) -> None:
    kv = KVRig(rig, TWO_GROUPS, strategy=strategy)
    try:
        rig.sim.fail_copies(1, when="enqueue")
        assert kv.worker.submit_store(1, g0([1, 2]), CPULoadStoreSpec([1, 2]))
        assert kv.worker.submit_store(2, g0([3]), CPULoadStoreSpec([3]))
        results = {r.job_id: r for r in wait_all(kv.worker, [1, 2])}
        assert not results[1].success and "invalid argument" in (results[1].error or "")
        assert results[2].success
        round_trip(kv, seed=6)  # the lane goes on
    finally:
        kv.close()


def before_each_dma_runs(monkeypatch: pytest.MonkeyPatch, first: Callable[[], None]) -> None:
    """Call ``first`` before each of the engine's byte-run computations (its host work)."""
    from tiering.copy.cuda import copies as cuda_copies

    real_runs = cuda_copies.dma_runs

    def wrapped(*args: Any) -> Any:
        first()
        return real_runs(*args)

    monkeypatch.setattr(cuda_copies, "dma_runs", wrapped)


def test_host_work_that_raises_fails_its_job_only_and_enqueues_nothing(
    rig: SimulatedRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = KVRig(rig, TWO_GROUPS, strategy="dma")
    calls: list[None] = []

    def fail_the_first() -> None:
        calls.append(None)
        if len(calls) == 1:
            raise MemoryError("no room for the byte runs")

    try:
        before = kv.host.as_numpy().copy()
        before_each_dma_runs(monkeypatch, fail_the_first)
        assert kv.worker.submit_store(1, g0([1, 2]), CPULoadStoreSpec([1, 2]))
        (failed,) = wait_all(kv.worker, [1])
        assert not failed.success and failed.error == "MemoryError: no room for the byte runs"
        assert np.array_equal(kv.host.as_numpy(), before)  # nothing of job 1 was copied
        round_trip(kv, seed=7)  # the lane goes on
    finally:
        kv.close()


def test_a_jobs_start_event_is_recorded_after_its_host_work(
    rig: SimulatedRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transfer_time, timed by the start and end events, leaves the submission's Python out."""
    kv = KVRig(rig, TWO_GROUPS, strategy="dma")
    order: list[str] = []
    real_new_event = rig.sim.new_event

    def logged_event() -> Any:
        event = real_new_event()
        real_record = event.record

        def record(stream: Any = None) -> None:
            order.append("record")
            real_record(stream)

        event.record = record  # type: ignore[method-assign]
        return event

    try:
        before_each_dma_runs(monkeypatch, lambda: order.append("runs"))
        monkeypatch.setattr(rig.sim, "new_event", logged_event)
        assert kv.worker.submit_store(1, g0([1, 2]), CPULoadStoreSpec([1, 2]))
        (result,) = wait_all(kv.worker, [1])
        assert result.success
        # Two tensors: both entries' runs, then the start event, then (after the copies) the end.
        assert order == ["runs", "runs", "record", "record"]
    finally:
        kv.close()


def test_a_copy_that_fails_on_the_device_fails_the_jobs_after_it(rig: SimulatedRig) -> None:
    kv = KVRig(rig, TWO_GROUPS, strategy="dma")
    try:
        rig.sim.fail_copies(1, when="run")
        assert kv.worker.submit_store(1, g0([1]), CPULoadStoreSpec([1]))
        (result,) = wait_all(kv.worker, [1])
        assert not result.success and "illegal memory access" in (result.error or "")
        # The error is sticky, as CUDA's are: later jobs fail too, none hangs.
        assert kv.worker.submit_load(2, CPULoadStoreSpec([1]), g0([5]))
        (later,) = wait_all(kv.worker, [2])
        assert not later.success
    finally:
        kv.close()


def test_shutdown_past_its_deadline_fails_the_stuck_jobs_and_keeps_the_buffer_pinned(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    kv = KVRig(rig, TWO_GROUPS)
    host = kv.host.as_numpy()
    assert kv.worker.submit_store(1, g0([1]), CPULoadStoreSpec([1]))
    wait_all(kv.worker, [1])
    rig.sim.pause()  # the device stops: the next jobs never finish
    assert kv.worker.submit_store(2, g0([2]), CPULoadStoreSpec([2]))
    assert kv.worker.submit_load(3, CPULoadStoreSpec([1]), g0([7]), expedited=True)
    with caplog.at_level(logging.WARNING, logger=ENGINE_LOG):
        kv.worker.shutdown(timeout=0.2)
    results = {r.job_id: r for r in kv.worker.get_finished()}
    assert sorted(results) == [2, 3]
    assert all(not r.success and "shut down before" in (r.error or "") for r in results.values())
    assert kv.worker.engine.jobs_left_running == 2
    assert rig.is_pinned(host), "unpinned while a DMA may still write into the buffer"
    assert any("stays pinned" in w for w in warnings_of(caplog))
    rig.sim.resume()
    rig.sim.drain()
    # Late completions never turn the reported failures into successes.
    assert kv.worker.get_finished() == []
    kv.host.close()


def test_the_simulated_device_refuses_what_cuda_would(rig: SimulatedRig) -> None:
    sim = rig.sim
    a, b = sim.alloc((4,)), sim.alloc((8,))
    with pytest.raises(RuntimeError, match="copy of 8 bytes into 4"):
        sim.copy_async(a, b)
    event = sim.new_event()
    with pytest.raises(RuntimeError, match="two recorded, completed events"):
        event.elapsed_time(sim.new_event())
    assert event.query()  # never recorded: complete
    with pytest.raises(ValueError, match="mode must be"):
        SimulatedCudaDevice(mode="lazy")  # type: ignore[arg-type]
    assert "queued" in repr(sim.default_stream) and "threads" in repr(sim)


def test_chunks_without_one_contiguous_device_range_are_not_mapped(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.pins = PinRegistry(max_chunk_bytes=8 * ROW, min_chunk_bytes=ROW)
    rig.sim.faults.scattered_device_addresses = True
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="auto")
    try:
        assert kv.worker.engine._mapped is None  # type: ignore[attr-defined]
        assert any("not contiguous" in r.getMessage() for r in caplog.records)
        round_trip(kv, seed=8)
    finally:
        kv.close()


def test_a_mapping_the_device_cannot_wrap_leaves_kernels_off(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    rig.sim.faults.mapping_raises = True
    with caplog.at_level(logging.INFO, logger=ENGINE_LOG):
        kv = KVRig(rig, TWO_GROUPS, strategy="auto")
    try:
        assert kv.worker.engine._mapped is None  # type: ignore[attr-defined]
        assert any("operation not supported" in w for w in warnings_of(caplog))
        round_trip(kv, seed=9)
    finally:
        kv.close()


def test_a_failed_unregistration_is_logged_not_raised(
    rig: SimulatedRig, caplog: pytest.LogCaptureFixture
) -> None:
    buffer = np.zeros(4096, dtype=np.uint8)
    pins = PinRegistry(min_chunk_bytes=4096)
    assert pins.pin(rig.sim, buffer.ctypes.data, 4096)
    assert rig.sim.unregister_host(buffer.ctypes.data) == 0  # pulled from under us
    pins.unpin(rig.sim, buffer.ctypes.data, 4096)
    pins.unpin(rig.sim, buffer.ctypes.data, 4096)  # once too often: nothing happens
    assert any(f"CUDA error {CUDA_ERROR_NOT_REGISTERED}" in m for m in caplog.messages)


class SpyEvent:
    """A job's end event that counts how it is waited on (everything else passes through)."""

    def __init__(self, event: Any) -> None:
        self.event, self.queries, self.synchronizes = event, 0, 0

    def query(self) -> bool:
        self.queries += 1
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.synchronizes += 1
        self.event.synchronize()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.event, name)


def spied_store(kv: KVRig, gpu_block: int, cpu_block: int) -> tuple[Any, SpyEvent]:
    plan = plan_transfer(kv.layout, g0([gpu_block]), CPULoadStoreSpec([cpu_block]), Lane.STORE)
    job: Any = kv.worker.engine.submit(plan)
    job.end_event = spy = SpyEvent(job.end_event)
    return job, spy


def test_an_untimed_wait_sleeps_on_the_end_event_instead_of_polling(rig: SimulatedRig) -> None:
    kv = KVRig(rig, TWO_GROUPS)
    try:
        rig.slow_fill(kv.gpu[0][5], 77)  # the model's work ahead of the store
        job, spy = spied_store(kv, 5, 2)
        assert job.wait()
        assert spy.synchronizes == 1 and spy.queries <= 1  # one query: done() afterwards
        assert job.outcome().success
        assert np.all(kv.host.as_numpy()[2][:2048] == 77)
        assert job.wait() and spy.synchronizes == 1  # finished: no second wait
    finally:
        kv.close()


def test_an_untimed_wait_turns_a_device_error_into_a_failed_job(rig: SimulatedRig) -> None:
    kv = KVRig(rig, TWO_GROUPS, strategy="dma")
    try:
        rig.sim.fail_copies(1, when="run")
        job, spy = spied_store(kv, 1, 1)
        assert job.wait()
        assert spy.synchronizes == 1
        outcome = job.outcome()
        assert not outcome.success and "illegal memory access" in (outcome.error or "")
    finally:
        kv.close()


def test_an_untimed_wait_on_a_device_closed_meanwhile_fails_the_job(rig: SimulatedRig) -> None:
    kv = KVRig(rig, TWO_GROUPS)
    try:
        rig.sim.pause()  # the device stops: the job never runs
        job, _ = spied_store(kv, 3, 3)
        closer = threading.Timer(0.05, rig.sim.close)
        closer.start()
        assert job.wait()  # woken by the close, before it or after it alike
        closer.join()
        outcome = job.outcome()
        assert not outcome.success and "closed before the event completed" in (outcome.error or "")
    finally:
        kv.close()


def test_a_timing_the_device_cannot_give_still_reports_the_job_done(rig: SimulatedRig) -> None:
    class Untimed:
        def elapsed_time(self, end_event: Any) -> float:
            raise RuntimeError("CUDA error: invalid resource handle (no timing on this event)")

    kv = KVRig(rig, TWO_GROUPS)
    try:
        job, _ = spied_store(kv, 4, 4)
        job.start_event = Untimed()
        assert job.wait()
        assert job.outcome().success and job.outcome().seconds == 0.0
        assert not rig.sim.step(rig.sim.default_stream)  # nothing queued: nothing to run
    finally:
        kv.close()
