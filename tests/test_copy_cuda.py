"""The CUDA copy engine, on the simulated device everywhere and on a real GPU where one exists.

Each test that takes ``kind`` runs once per device: ``simulated``
(:class:`~tiering.copy.cuda.simulated.SimulatedCudaDevice`: CUDA's ordering
rules in host memory, streams run late by worker threads with random delays)
and ``cuda`` (skipped with the reason where ``torch.cuda.is_available()`` is
False). The engine code is the same on both; only the device seam differs.
Faults only a simulated device can inject are in ``test_copy_cuda_faults.py``,
the ordering state machine in ``test_copy_cuda_machine.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
import torch

from tests.cuda_rigs import (
    CPU_BLOCKS,
    GROUP_SIZES,
    GROUP_STARTS,
    RIG_KINDS,
    SENTINEL,
    SHAPES,
    TWO_GROUPS,
    KVRig,
    check_host_rows,
    rig_for,
    split,
    wait_all,
)
from tests.test_copy_layout import cpu_blocks_needed, make_layout
from tiering.copy import Lane, plan_transfer, required_cpu_block_bytes
from tiering.copy.cuda import CudaCopyEngine, dma_copy, flat_bytes, gpu_block_rows, kernel_copy
from tiering.copy.cuda.engine import default_device
from tiering.copy.cuda.pins import PinRegistry
from tiering.copy.cuda.simulated import SimulatedCudaDevice
from tiering.copy.cuda.torch_device import TorchCudaDevice, _CudaRuntime
from tiering.core.errors import TierClosedError
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.primary.host_buffer import HostBuffer

# -- the copy functions, on CPU tensors ---------------------------------------------------

PAGES, GROUPS = TWO_GROUPS
GPU_IDS = [7, 3, 30, 12, 0, 21, 22, 9]
SIZES, STARTS = [5, 3], [3, 1]


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("method", ["kernel", "dma"])
def test_copy_functions_move_the_right_bytes(factor: int, method: str) -> None:
    layout = make_layout(PAGES, GROUPS, factor=factor, gpu_blocks=40, cpu_blocks=24)
    gen = torch.Generator().manual_seed(0)
    gpu = [torch.randint(-128, 127, (40, p), dtype=torch.int8, generator=gen) for p in PAGES]
    host = np.full((24, layout.cpu_block_bytes), SENTINEL, dtype=np.uint8)
    host_flat = torch.from_numpy(host.view(np.int8)).reshape(-1)
    cpu_ids = list(range(23, 23 - cpu_blocks_needed(SIZES, STARTS, factor), -1))
    sim = SimulatedCudaDevice(mode="manual")
    stream = sim.new_stream()

    def run(lane: Lane, gpu_ids: list[int]) -> None:
        spec = GPULoadStoreSpec(gpu_ids, group_sizes=SIZES, block_indices=STARTS)
        plan = plan_transfer(layout, spec, CPULoadStoreSpec(cpu_ids), lane)
        for entry in plan.copies:
            rows = gpu[entry.tensor_idx]
            if method == "kernel":
                idx = [
                    torch.from_numpy(np.array(a))
                    for a in (entry.gpu_blocks, entry.cpu_blocks, entry.cpu_subblocks)
                ]
                kernel_copy(entry, layout, rows, host_flat, *idx, lane.gpu_to_cpu)
            else:
                with sim.on_stream(stream):
                    dma_copy(sim, entry, layout, rows, flat_bytes(rows), host_flat, lane.gpu_to_cpu)
        sim.drain()

    run(Lane.STORE, GPU_IDS)
    check_host_rows(layout, [t.numpy() for t in gpu], host, split(GPU_IDS, SIZES), STARTS, cpu_ids)
    before = [t.clone() for t in gpu]
    targets = list(range(31, 39))
    run(Lane.LOAD, targets)
    for g, (src, dst) in enumerate(zip(split(GPU_IDS, SIZES), split(targets, SIZES), strict=True)):
        for copy in layout.group_copies[g]:
            t, n = copy.tensor_idx, copy.nbytes
            assert torch.equal(gpu[t][dst, :n], before[t][src, :n])
            assert torch.equal(gpu[t][dst, n:], before[t][dst, n:])  # padding untouched


def test_gpu_block_rows_views_device_tensors_and_names_what_does_not_fit() -> None:
    with SimulatedCudaDevice() as sim:
        with pytest.raises(TypeError, match="must be a CUDA tensor"):
            gpu_block_rows(sim, torch.zeros(4, 16, dtype=torch.int8), 16, "KV-cache tensor 0")
        halves = sim.alloc((4, 2, 8), torch.float16)  # a (blocks, K/V, ...) layout
        rows = gpu_block_rows(sim, halves, 32, "KV-cache tensor 0")
        assert rows.shape == (4, 32) and rows.data_ptr() == halves.data_ptr()
        exact = sim.alloc((4, 16))
        assert gpu_block_rows(sim, exact, 16, "t").data_ptr() == exact.data_ptr()
        with pytest.raises(ValueError, match="cannot be viewed as rows of 24 bytes"):
            gpu_block_rows(sim, sim.alloc((4, 16)), 24, "KV-cache tensor 1")
        transposed = sim.alloc((16, 4), torch.float16).t()
        with pytest.raises(ValueError, match="last dimension must be contiguous"):
            gpu_block_rows(sim, transposed, 32, "KV-cache tensor 2")


# -- round trips on each device -----------------------------------------------------------


def round_trip(kv: KVRig, seed: int) -> None:
    """Store random blocks of every group, check the rows, load them elsewhere, check the pages."""
    kv.host.as_numpy()[:] = SENTINEL  # no job in flight: what earlier tests wrote goes
    rng = random.Random(seed)
    groups = len(kv.groups)
    sizes, starts = GROUP_SIZES[:groups], GROUP_STARTS[:groups]
    factor = kv.layout.block_size_factor
    ids = rng.sample(range(20), sum(sizes))
    cpu_ids = rng.sample(range(CPU_BLOCKS), cpu_blocks_needed(sizes, starts, factor))
    store = GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=starts)
    assert kv.worker.submit_store(1, store, CPULoadStoreSpec(cpu_ids))
    (result,) = wait_all(kv.worker, [1])
    assert result.success and result.transfer_time >= 0
    copies = kv.layout.group_copies
    moved = sum(n * c.nbytes for n, g in zip(sizes, copies, strict=False) for c in g)
    assert result.transfer_bytes == moved
    gpu = [kv.rig.to_host(t).numpy() for t in kv.gpu]
    check_host_rows(kv.layout, gpu, kv.host.as_numpy(), split(ids, sizes), starts, cpu_ids)

    targets = rng.sample(range(20, 40), sum(sizes))
    load = GPULoadStoreSpec(targets, group_sizes=sizes, block_indices=starts)
    assert kv.worker.submit_load(2, CPULoadStoreSpec(cpu_ids), load, expedited=bool(seed % 2))
    assert [r.success for r in wait_all(kv.worker, [2])] == [True]
    after = [kv.rig.to_host(t).numpy() for t in kv.gpu]
    for g, (src, dst) in enumerate(zip(split(ids, sizes), split(targets, sizes), strict=True)):
        for copy in kv.layout.group_copies[g]:
            t, n = copy.tensor_idx, copy.nbytes
            assert np.array_equal(after[t][dst, :n], gpu[t][src, :n]), f"group {g} tensor {t}"
            assert np.array_equal(after[t][dst, n:], gpu[t][dst, n:]), "padding was written"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["dma", "kernel", "auto"])
@pytest.mark.parametrize("kind", RIG_KINDS)
def test_round_trip_is_byte_exact(kind: str, strategy: str, factor: int, shape: str) -> None:
    with rig_for(kind) as rig:
        # auto with a 2,500-byte switch: the 2,048/1,000/1,800-byte copies go by kernel,
        # the 3,000/3,500/4,096-byte ones by DMA, in the same job.
        kv = KVRig(rig, SHAPES[shape], factor=factor, strategy=strategy, dma_min_bytes=2500)
        try:
            round_trip(kv, seed=factor)
        finally:
            kv.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_auto_copies_large_pages_by_dma_and_small_ones_by_kernels(kind: str) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, SHAPES["3-groups"], strategy="auto", dma_min_bytes=2500)
        try:
            engine: Any = kv.worker.engine
            spec = GPULoadStoreSpec(list(range(12)), group_sizes=[5, 3, 4])
            plan = plan_transfer(kv.layout, spec, CPULoadStoreSpec(list(range(12))), Lane.STORE)
            chosen = {e.nbytes: engine.uses_kernel(e) for e in plan.copies}
            assert chosen == {2048: True, 3500: False, 1000: True, 1024: True, 1800: True}
            round_trip(kv, seed=3)
        finally:
            kv.close()
        default = KVRig(rig, SHAPES["1-group"], strategy="auto")
        try:  # the default switch is 256 KiB: 3,000-byte copies go by kernel where mapped
            entry = plan_transfer(
                default.layout, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]), Lane.STORE
            ).copies[0]
            assert default.worker.engine.uses_kernel(entry)  # type: ignore[attr-defined]
        finally:
            default.close()


# -- pinning ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_primary_buffer_is_pinned_while_the_engine_lives(kind: str) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, TWO_GROUPS)
        host = kv.host.as_numpy()
        assert kv.worker.engine.pinned  # type: ignore[attr-defined]
        assert rig.is_pinned(host)
        kv.worker.shutdown()
        assert not rig.is_pinned(host)
        kv.host.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_two_engines_share_one_registration_and_the_last_one_unpins(kind: str) -> None:
    with rig_for(kind) as rig:
        first = KVRig(rig, TWO_GROUPS)
        host = first.host.as_numpy()
        second = KVRig(rig, TWO_GROUPS, host=first.host)
        engine: Any = first.worker.engine
        pins = engine.device.pins
        assert pins.holders(host.ctypes.data, host.nbytes) == 2
        second.worker.shutdown()
        assert pins.holders(host.ctypes.data, host.nbytes) == 1 and rig.is_pinned(host)
        round_trip(first, seed=5)  # the survivor still copies
        first.close()
        assert pins.holders(host.ctypes.data, host.nbytes) == 0
        assert not rig.is_pinned(host)


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_a_buffer_registered_elsewhere_is_used_and_left_registered(kind: str) -> None:
    with rig_for(kind) as rig:
        host = HostBuffer.create(CPU_BLOCKS, required_cpu_block_bytes(PAGES, 1))
        host.as_numpy()[:] = SENTINEL
        unregister = rig.register_elsewhere(host.as_numpy())  # as vLLM pins its region
        kv = KVRig(rig, TWO_GROUPS, host=host)
        try:
            assert kv.worker.engine.pinned  # type: ignore[attr-defined]
            round_trip(kv, seed=6)
        finally:
            kv.worker.shutdown()
        assert rig.is_pinned(host.as_numpy()), "the engine unpinned memory it did not pin"
        unregister()
        host.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_a_buffer_over_the_chunk_size_is_registered_in_row_aligned_chunks(kind: str) -> None:
    with rig_for(kind) as rig:
        row = required_cpu_block_bytes(PAGES, 1)
        pins = PinRegistry(max_chunk_bytes=5 * row + 100, min_chunk_bytes=row)
        kv = KVRig(rig, TWO_GROUPS, strategy="kernel", device=rig.device_with_pins(pins))
        host = kv.host.as_numpy()
        try:
            pinned = pins.get(host.ctypes.data, host.nbytes)
            assert pinned is not None
            sizes = [n for _, n in pinned.chunks]
            assert sizes == [5 * row] * 4 + [4 * row]  # 24 rows, whole rows per chunk
            assert rig.is_pinned(host)
            round_trip(kv, seed=7)  # the kernels read the mapping across every chunk
        finally:
            kv.worker.shutdown()
        assert not rig.is_pinned(host) and pins.get(host.ctypes.data, host.nbytes) is None
        kv.host.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_a_shared_buffer_attached_by_the_worker_is_pinned_and_copied_through(kind: str) -> None:
    """As under vLLM: the scheduler creates the CPU tier in /dev/shm, the worker attaches."""
    row = required_cpu_block_bytes(PAGES, 1)
    name = f"kvtier-cudatest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with rig_for(kind) as rig, HostBuffer.create(CPU_BLOCKS, row, shared_name=name) as owner:
        try:
            owner.as_numpy()[:] = SENTINEL
            attached = HostBuffer.attach(name, CPU_BLOCKS, row)
            kv = KVRig(rig, TWO_GROUPS, host=attached)
            try:
                assert kv.worker.engine.pinned  # type: ignore[attr-defined]
                round_trip(kv, seed=10)
                # The owner's mapping sees what the engine wrote through the worker's.
                assert np.array_equal(owner.as_numpy(), attached.as_numpy())
                assert not np.all(owner.as_numpy() == SENTINEL)
            finally:
                kv.worker.shutdown()
                attached.close()
        finally:
            owner.unlink()


# -- ordering -----------------------------------------------------------------------------


def g0(ids: list[int]) -> GPULoadStoreSpec:
    """Blocks of group 0 only (the layout has two groups)."""
    return GPULoadStoreSpec(ids, group_sizes=[len(ids), 0], block_indices=[0, 0])


@pytest.mark.parametrize("strategy", ["dma", "kernel"])
@pytest.mark.parametrize("kind", RIG_KINDS)
def test_a_store_waits_for_the_compute_stream(kind: str, strategy: str) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, TWO_GROUPS, strategy=strategy)
        try:
            compute = rig.new_stream()
            with rig.on(compute):
                rig.slow_fill(kv.gpu[0][5], 77)  # the model still writing block 5
                rig.slow_fill(kv.gpu[1][5], 78)
                assert kv.worker.submit_store(1, g0([5]), CPULoadStoreSpec([2]))
            assert [r.success for r in wait_all(kv.worker, [1])] == [True]
            row = kv.host.as_numpy()[2]
            assert np.all(row[:2048] == 77) and np.all(row[2048 : 2048 + 3000] == 78)
        finally:
            kv.close()


@pytest.mark.parametrize("strategy", ["dma", "kernel"])
@pytest.mark.parametrize("kind", RIG_KINDS)
def test_a_load_after_a_store_of_the_same_cpu_blocks_sees_the_stored_bytes(
    kind: str, strategy: str
) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, TWO_GROUPS, strategy=strategy)
        try:
            for round_ in range(3):
                base = 1 + 10 * round_
                blocks = list(range(10))
                assert kv.worker.submit_store(base, g0(blocks), CPULoadStoreSpec(blocks))
                reverse = CPULoadStoreSpec(list(range(9, -1, -1)))
                assert kv.worker.submit_load(base + 1, reverse, g0(list(range(20, 30))))
                assert all(r.success for r in wait_all(kv.worker, [base, base + 1]))
                gpu = [rig.to_host(t) for t in kv.gpu]
                for t, n in ((0, 2048), (1, 3000)):
                    assert torch.equal(gpu[t][20:30, :n], gpu[t][list(range(9, -1, -1)), :n])
                # New bytes in the source blocks for the next round.
                for t in kv.gpu:
                    t[:10].random_(-128, 127)
        finally:
            kv.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
async def test_jobs_are_awaited_from_asyncio(kind: str) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, TWO_GROUPS)
        try:
            assert kv.worker.submit_store(1, g0([1, 2]), CPULoadStoreSpec([3, 4]))
            await asyncio.wait_for(kv.worker.wait_async([1]), timeout=60)
            assert [r.success for r in kv.worker.get_finished()] == [True]
        finally:
            kv.close()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_shutdown_lets_the_jobs_in_flight_finish(kind: str) -> None:
    with rig_for(kind) as rig:
        kv = KVRig(rig, TWO_GROUPS, factor=2)
        host = kv.host.as_numpy()
        rig.slow_fill(kv.gpu[0][0], 1)  # queued work ahead of every job on the current stream
        for job_id in range(1, 6):
            spec = g0([job_id * 2, job_id * 2 + 1])
            assert kv.worker.submit_store(job_id, spec, CPULoadStoreSpec([job_id]))
        kv.worker.shutdown(timeout=60)
        results = kv.worker.get_finished()
        assert sorted(r.job_id for r in results) == [1, 2, 3, 4, 5]
        assert all(r.success for r in results)
        assert kv.worker.engine.jobs_left_running == 0
        assert not rig.is_pinned(host)
        assert not kv.worker.submit_store(9, g0([0, 1]), CPULoadStoreSpec([9]))
        kv.host.close()


def test_an_untimed_wait_lets_other_python_threads_run() -> None:
    """The wait sleeps in the driver with the GIL released (a real GPU's blocking-sync event)."""
    with rig_for("cuda") as rig:
        kv = KVRig(rig, TWO_GROUPS)
        try:
            for _ in range(20):
                rig.slow_fill(kv.gpu[0][5], 77)  # about half a second of model work first
            plan = plan_transfer(kv.layout, g0([5]), CPULoadStoreSpec([2]), Lane.STORE)
            job = kv.worker.engine.submit(plan)
            stop, ticks = threading.Event(), list[float]()

            def tick() -> None:
                while not stop.is_set():
                    ticks.append(time.perf_counter())
                    time.sleep(0.001)

            ticker = threading.Thread(target=tick)
            ticker.start()
            begin = time.perf_counter()
            assert job.wait()
            end = time.perf_counter()
            stop.set()
            ticker.join()
            assert job.outcome().success
            assert end - begin > 0.15, "the store did not wait behind the model's work"
            during = [begin, *(t for t in ticks if begin < t < end), end]
            longest = max(b - a for a, b in itertools.pairwise(during))
            assert longest < 0.05, f"another thread stood still for {longest:.3f} s of the wait"
        finally:
            kv.close()


# -- misuse -------------------------------------------------------------------------------


def test_the_engine_names_what_does_not_fit_and_pins_nothing() -> None:
    sim = SimulatedCudaDevice(mode="manual")
    layout = make_layout(PAGES, GROUPS, gpu_blocks=40, cpu_blocks=24)
    gpu = [sim.alloc((40, p)) for p in PAGES]
    host = np.zeros((24, layout.cpu_block_bytes), np.uint8)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"strategy": "fast"}, "strategy must be 'auto', 'dma' or 'kernel', got 'fast'"),
        ({"gpu_tensors": gpu[:1]}, "1 KV-cache tensors but the layout describes 2"),
        (
            {"gpu_tensors": [gpu[0], sim.alloc((30, 4096))]},
            "KV-cache tensor 1 has 30 blocks, the layout says 40",
        ),
        ({"host": host[:23]}, "the host buffer is 23 x 8192 bytes, the layout says 24 x 8192"),
    ]
    for overrides, message in cases:
        kwargs: dict[str, Any] = {"gpu_tensors": gpu, "host": host, "device": sim, **overrides}
        with pytest.raises(ValueError, match=message):
            CudaCopyEngine(layout, **kwargs)
    assert sim.registered_bytes(0, 1 << 62) == 0


def test_a_job_reports_only_once_finished_and_a_closed_engine_refuses_jobs() -> None:
    sim = SimulatedCudaDevice(mode="manual")
    layout = make_layout(PAGES, GROUPS, gpu_blocks=40, cpu_blocks=24)
    gpu = [sim.alloc((40, p)) for p in PAGES]
    host = np.zeros((24, layout.cpu_block_bytes), np.uint8)
    engine = CudaCopyEngine(layout, gpu, host, device=sim)
    assert "CudaCopyEngine(SimulatedCudaDevice(mode=manual), strategy=auto" in repr(engine)
    job = engine.submit(plan_transfer(layout, g0([1]), CPULoadStoreSpec([1]), Lane.STORE))
    assert not job.done()
    with pytest.raises(RuntimeError, match="has not finished"):
        job.outcome()
    sim.drain()
    assert job.outcome().success and job.outcome().seconds >= 0
    engine.shutdown()
    engine.shutdown()  # idempotent
    with pytest.raises(TierClosedError, match="shut down"):
        engine.submit(plan_transfer(layout, g0([1]), CPULoadStoreSpec([1]), Lane.STORE))


def test_the_real_device_is_refused_clearly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the real device is what the other tests run on")
    with pytest.raises(TypeError, match="must be a CUDA tensor"):
        default_device([np.zeros((4, 16), np.uint8)])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        default_device([torch.zeros(4, 16)])
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        TorchCudaDevice("cuda:0")
    runtime = _CudaRuntime()  # no libcudart on a CPU-only install: everything "unavailable"
    if runtime.lib is None:
        runtime.clear_last_error()
        assert runtime.host_device_pointer(4096) is None
