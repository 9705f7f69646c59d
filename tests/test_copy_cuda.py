"""The CUDA copy engine.

The copy functions are plain tensor indexing and ``copy_`` calls, so their
block arithmetic is checked on CPU tensors everywhere. Everything that needs a
device (streams, events, pinning, the device-mapped buffer) runs only where
CUDA exists and is skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.test_copy_layout import cpu_blocks_needed, expected_copies, make_layout
from tiering.copy import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CopyWorker,
    Lane,
    make_copy_worker,
    plan_transfer,
    required_cpu_block_bytes,
)
from tiering.host_buffer import HostBuffer
from tiering.specs import CPULoadStoreSpec, GPULoadStoreSpec

torch = pytest.importorskip("torch")
cuda_copy = pytest.importorskip("tiering.copy.cuda")

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (torch.cuda.is_available() is False on this machine)",
)
SENTINEL = 0x5A

PAGES = [2048, 4096]
GROUPS = [[(0, 2048), (1, 3000)], [(1, 4096)]]
SIZES, INDICES = [5, 3], [3, 1]
GPU_IDS = [7, 3, 30, 12, 0, 21, 22, 9]


def g0(ids: list[int]) -> GPULoadStoreSpec:
    """Blocks of group 0 only (the layout has two groups)."""
    return GPULoadStoreSpec(ids, group_sizes=[len(ids), 0], block_indices=[0, 0])


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos = [], 0
    for n in sizes:
        out.append(ids[pos : pos + n])
        pos += n
    return out


def check_host(layout: Any, gpu: list[Any], host: np.ndarray[Any, Any], cpu_ids: list[int]) -> None:
    written = np.zeros(host.shape, dtype=bool)
    for t, g, c, sub, n in expected_copies(layout, split(GPU_IDS, SIZES), INDICES, cpu_ids):
        start = layout.cpu_slot_offsets[t] + sub * layout.gpu_page_bytes[t]
        assert np.array_equal(host[c, start : start + n], gpu[t][g, :n].view(np.uint8))
        written[c, start : start + n] = True
    assert np.all(host[~written] == SENTINEL)


# -- the copy functions, on CPU tensors ---------------------------------------------------


@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("method", ["kernel", "dma"])
def test_copy_functions_move_the_right_bytes(factor: int, method: str) -> None:
    layout = make_layout(PAGES, GROUPS, factor=factor, gpu_blocks=40, cpu_blocks=24)
    gen = torch.Generator().manual_seed(0)
    gpu = [torch.randint(-128, 127, (40, p), dtype=torch.int8, generator=gen) for p in PAGES]
    host = np.full((24, layout.cpu_block_bytes), SENTINEL, dtype=np.uint8)
    host_flat = torch.from_numpy(host.view(np.int8)).reshape(-1)
    cpu_ids = list(range(23, 23 - cpu_blocks_needed(SIZES, INDICES, factor), -1))

    def run(lane: Lane, gpu_ids: list[int]) -> None:
        spec = GPULoadStoreSpec(gpu_ids, group_sizes=SIZES, block_indices=INDICES)
        plan = plan_transfer(layout, spec, CPULoadStoreSpec(cpu_ids), lane)
        for entry in plan.copies:
            rows = gpu[entry.tensor_idx]
            if method == "kernel":
                idx = [
                    torch.from_numpy(np.array(a))
                    for a in (entry.gpu_blocks, entry.cpu_blocks, entry.cpu_subblocks)
                ]
                cuda_copy.kernel_copy(entry, layout, rows, host_flat, *idx, lane.gpu_to_cpu)
            else:
                flat = cuda_copy._flat(rows)
                cuda_copy.dma_copy(entry, layout, rows, flat, host_flat, lane.gpu_to_cpu)

    run(Lane.STORE, GPU_IDS)
    check_host(layout, [t.numpy() for t in gpu], host, cpu_ids)
    before = [t.clone() for t in gpu]
    targets = list(range(31, 39))
    run(Lane.LOAD, targets)
    for g, (src, dst) in enumerate(zip(split(GPU_IDS, SIZES), split(targets, SIZES), strict=True)):
        for copy in layout.group_copies[g]:
            t, n = copy.tensor_idx, copy.nbytes
            assert torch.equal(gpu[t][dst, :n], before[t][src, :n])
            untouched = gpu[t][dst, n:]
            assert torch.equal(untouched, before[t][dst, n:])


def test_gpu_rows_view_a_cuda_shaped_tensor_without_copying() -> None:
    if torch.cuda.is_available():
        pytest.skip("covered by the CUDA tests")
    with pytest.raises(TypeError, match="must be a CUDA tensor"):
        cuda_copy.gpu_block_rows(torch.zeros(4, 16, dtype=torch.int8), 16, "KV-cache tensor 0")


# -- on a CUDA device ---------------------------------------------------------------------


@pytest.fixture
def cuda_rig(request: pytest.FixtureRequest) -> Iterator[tuple[CopyWorker, list[Any], HostBuffer]]:
    strategy, factor = request.param
    gen = torch.Generator(device="cuda").manual_seed(0)
    gpu = [
        torch.randint(-128, 127, (40, p), dtype=torch.int8, device="cuda", generator=gen)
        for p in PAGES
    ]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, p) for t, p in zip(gpu, PAGES, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in g] for g in GROUPS],
    )
    host = HostBuffer.create(24, required_cpu_block_bytes(PAGES, factor))
    host.as_numpy()[:] = SENTINEL
    worker = make_copy_worker(kv, host, block_size_factor=factor, strategy=strategy)
    yield worker, gpu, host
    worker.shutdown(timeout=30)
    host.close()


RIG_PARAMS = [(s, f) for s in ("dma", "kernel", "auto") for f in (1, 2)]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", RIG_PARAMS, indirect=True)
def test_cuda_round_trip(cuda_rig: tuple[CopyWorker, list[Any], HostBuffer]) -> None:
    worker, gpu, host = cuda_rig
    layout = worker.engine.layout
    factor = layout.block_size_factor
    cpu_ids = list(range(23, 23 - cpu_blocks_needed(SIZES, INDICES, factor), -1))
    spec = GPULoadStoreSpec(GPU_IDS, group_sizes=SIZES, block_indices=INDICES)
    assert worker.submit_store(1, spec, CPULoadStoreSpec(cpu_ids))
    worker.wait([1], timeout=60)
    (result,) = worker.get_finished()
    assert result.success and result.transfer_time > 0
    assert result.transfer_bytes == 5 * (2048 + 3000) + 3 * 4096
    check_host(layout, [t.cpu().numpy() for t in gpu], host.as_numpy(), cpu_ids)
    before = [t.clone() for t in gpu]
    targets = list(range(31, 39))
    load = GPULoadStoreSpec(targets, group_sizes=SIZES, block_indices=INDICES)
    assert worker.submit_load(2, CPULoadStoreSpec(cpu_ids), load, expedited=True)
    worker.wait([2], timeout=60)
    assert [r.success for r in worker.get_finished()] == [True]
    for g, (src, dst) in enumerate(zip(split(GPU_IDS, SIZES), split(targets, SIZES), strict=True)):
        for copy in layout.group_copies[g]:
            t, n = copy.tensor_idx, copy.nbytes
            assert torch.equal(gpu[t][dst, :n], before[t][src, :n])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", [("auto", 1)], indirect=True)
def test_cuda_primary_buffer_is_pinned_while_the_engine_lives(
    cuda_rig: tuple[CopyWorker, list[Any], HostBuffer],
) -> None:
    worker, _, host = cuda_rig
    view = torch.from_numpy(host.as_numpy())
    assert worker.engine.pinned  # type: ignore[attr-defined]
    assert view.is_pinned()
    worker.shutdown()
    assert not view.is_pinned()


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", [("dma", 1), ("kernel", 1)], indirect=True)
def test_cuda_store_waits_for_the_compute_stream(
    cuda_rig: tuple[CopyWorker, list[Any], HostBuffer],
) -> None:
    worker, gpu, host = cuda_rig
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of queued "model" work
        gpu[0][5].fill_(77)
        gpu[1][5].fill_(78)
        assert worker.submit_store(1, g0([5]), CPULoadStoreSpec([2]))
    worker.wait([1], timeout=60)
    assert worker.get_finished()[0].success
    row = host.as_numpy()[2]
    assert np.all(row[:2048] == 77) and np.all(row[2048 : 2048 + 3000] == 78)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", [("dma", 1), ("kernel", 1)], indirect=True)
def test_cuda_load_after_store_of_the_same_cpu_blocks_sees_the_stored_bytes(
    cuda_rig: tuple[CopyWorker, list[Any], HostBuffer],
) -> None:
    worker, gpu, _ = cuda_rig
    assert worker.submit_store(1, g0(list(range(10))), CPULoadStoreSpec(list(range(10))))
    assert worker.submit_load(2, CPULoadStoreSpec(list(range(9, -1, -1))), g0(list(range(20, 30))))
    worker.wait([1, 2], timeout=60)
    assert all(r.success for r in worker.get_finished())
    for t, n in ((0, 2048), (1, 3000)):
        assert torch.equal(gpu[t][20:30, :n], gpu[t][list(range(9, -1, -1)), :n])


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", [("auto", 1)], indirect=True)
async def test_cuda_jobs_are_awaited_from_asyncio(
    cuda_rig: tuple[CopyWorker, list[Any], HostBuffer],
) -> None:
    worker, _, _ = cuda_rig
    assert worker.submit_store(1, g0([1, 2]), CPULoadStoreSpec([3, 4]))
    await asyncio.wait_for(worker.wait_async([1]), timeout=60)
    assert [r.success for r in worker.get_finished()] == [True]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("cuda_rig", [("auto", 2)], indirect=True)
def test_cuda_shutdown_with_jobs_in_flight(
    cuda_rig: tuple[CopyWorker, list[Any], HostBuffer],
) -> None:
    worker, _, _ = cuda_rig
    torch.cuda._sleep(20_000_000)
    for job_id in range(1, 6):
        assert worker.submit_store(
            job_id, g0([job_id * 2, job_id * 2 + 1]), CPULoadStoreSpec([job_id])
        )
    worker.shutdown(timeout=60)
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == [1, 2, 3, 4, 5]
    assert all(r.success for r in results)
    assert not worker.submit_store(9, g0([0, 1]), CPULoadStoreSpec([9]))
