"""The host copy engine and the worker-side handlers, with byte-exact verification.

CPU arrays (numpy, or CPU torch tensors) stand in for the GPU KV cache; the
primary buffer is a real :class:`HostBuffer` (shared memory where it matters).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_copy_layout import cpu_blocks_needed, expected_copies
from tiering.copy import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CopyWorker,
    HostCopyEngine,
    KVLayout,
    Lane,
    TransferHandler,
    make_copy_worker,
    required_cpu_block_bytes,
)
from tiering.copy.plan import TransferPlan, plan_transfer
from tiering.core.errors import ContractError, TierClosedError
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.primary.host_buffer import HostBuffer

REPO = Path(__file__).resolve().parents[1]
SENTINEL = 0xA5
Groups = list[list[tuple[int, int]]]


@dataclass
class Rig:
    """Simulated GPU KV tensors, a primary buffer, and a worker over them."""

    gpu: list[np.ndarray[Any, np.dtype[np.uint8]]]
    host: HostBuffer
    worker: CopyWorker
    groups: Groups
    factor: int

    @property
    def layout(self) -> KVLayout:
        return self.worker.engine.layout

    @property
    def host_bytes(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.host.as_numpy()


def build_rig(
    pages: list[int],
    groups: Groups,
    *,
    factor: int = 1,
    gpu_blocks: int = 32,
    cpu_blocks: int = 16,
    seed: int = 0,
    read_only: tuple[int, ...] = (),
) -> Rig:
    rng = np.random.default_rng(seed)
    gpu = [rng.integers(0, 256, (gpu_blocks, p), dtype=np.uint8) for p in pages]
    for t in read_only:
        gpu[t].flags.writeable = False
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, p) for t, p in zip(gpu, pages, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in g] for g in groups],
    )
    host = HostBuffer.create(
        cpu_blocks, required_cpu_block_bytes(pages, factor, alignment=1), require_alignment=False
    )
    host.as_numpy()[:] = SENTINEL
    worker = make_copy_worker(kv, host, block_size_factor=factor)
    return Rig(gpu, host, worker, groups, factor)


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    """Rigs built by a test, shut down and closed afterwards."""
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.worker.shutdown(timeout=10)
        rig.host.close()


def finish(worker: CopyWorker, *job_ids: int) -> dict[int, Any]:
    worker.wait(job_ids, timeout=30)
    results = {r.job_id: r for r in worker.get_finished()}
    assert set(results) == set(job_ids)
    return results


def split_groups(gpu_ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos = [], 0
    for n in sizes:
        out.append(gpu_ids[pos : pos + n])
        pos += n
    return out


def check_store(
    rig: Rig, group_ids: list[list[int]], indices: list[int], cpu_ids: list[int]
) -> None:
    """Every stored sub-block holds the GPU page's bytes; every other byte is untouched."""
    host = rig.host_bytes
    written = np.zeros(host.shape, dtype=bool)
    layout = rig.layout
    for t, gpu_block, cpu_block, sub, nbytes in expected_copies(
        layout, group_ids, indices, cpu_ids
    ):
        start = layout.cpu_slot_offsets[t] + sub * layout.gpu_page_bytes[t]
        assert np.array_equal(
            host[cpu_block, start : start + nbytes], rig.gpu[t][gpu_block, :nbytes]
        ), (
            t,
            gpu_block,
            cpu_block,
            sub,
        )
        written[cpu_block, start : start + nbytes] = True
    assert np.all(host[~written] == SENTINEL)


def store(
    rig: Rig,
    job_id: int,
    gpu_ids: list[int],
    sizes: list[int],
    indices: list[int],
    cpu_ids: list[int],
) -> None:
    spec = GPULoadStoreSpec(gpu_ids, group_sizes=sizes, block_indices=indices)
    assert rig.worker.submit_store(job_id, spec, CPULoadStoreSpec(cpu_ids))


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [1, 2, 4])
def test_store_and_load_round_trip_several_tensors_and_groups(rigs: list[Rig], factor: int) -> None:
    # Three tensors; group 0 uses tensors 0 and 1 (tensor 1 padded: 3000 of 4096
    # bytes are real); group 1 uses tensors 1 and 2.
    groups: Groups = [[(0, 2048), (1, 3000)], [(1, 4096), (2, 1024)]]
    rig = build_rig([2048, 4096, 1024], groups, factor=factor, gpu_blocks=40, cpu_blocks=24)
    rigs.append(rig)
    sizes, indices = [5, 3], [3, 1]  # both groups unaligned for factor 2 and 4
    gpu_ids = [7, 3, 30, 12, 0, 21, 22, 9]
    group_ids = split_groups(gpu_ids, sizes)
    cpu_ids = list(range(23, 23 - cpu_blocks_needed(sizes, indices, factor), -1))
    store(rig, 1, gpu_ids, sizes, indices, cpu_ids)
    (result,) = finish(rig.worker, 1).values()
    assert result.success and result.error is None
    assert result.transfer_bytes == 5 * (2048 + 3000) + 3 * (4096 + 1024)
    assert result.transfer_time > 0
    check_store(rig, group_ids, indices, cpu_ids)

    # Load the same CPU blocks back into other GPU blocks (same logical positions).
    before = [t.copy() for t in rig.gpu]
    targets = [31, 32, 33, 34, 35, 36, 37, 38]
    load_spec = GPULoadStoreSpec(targets, group_sizes=sizes, block_indices=indices)
    assert rig.worker.submit_load(2, CPULoadStoreSpec(cpu_ids), load_spec)
    assert finish(rig.worker, 2)[2].success
    touched = [np.zeros(t.shape, dtype=bool) for t in rig.gpu]
    for g, (src_ids, dst_ids) in enumerate(
        zip(group_ids, split_groups(targets, sizes), strict=True)
    ):
        for copy in rig.layout.group_copies[g]:
            t, n = copy.tensor_idx, copy.nbytes
            assert np.array_equal(rig.gpu[t][dst_ids, :n], before[t][src_ids, :n])
            touched[t][dst_ids, :n] = True
    for t in range(3):
        assert np.array_equal(rig.gpu[t][~touched[t]], before[t][~touched[t]])


@settings(max_examples=25)
@given(
    data=st.data(),
    factor=st.sampled_from([1, 2, 4]),
    pages=st.lists(st.sampled_from([256, 512, 1024]), min_size=1, max_size=3),
    num_groups=st.integers(1, 2),
)
def test_round_trip_property_random_layouts(
    data: st.DataObject, factor: int, pages: list[int], num_groups: int
) -> None:
    groups: Groups = [
        [
            (t, min(pages[t], n))
            for t, n in data.draw(
                st.lists(
                    st.tuples(st.integers(0, len(pages) - 1), st.integers(1, 1024)),
                    min_size=1,
                    max_size=3,
                )
            )
        ]
        for _ in range(num_groups)
    ]
    rig = build_rig(
        pages,
        groups,
        factor=factor,
        gpu_blocks=48,
        cpu_blocks=40,
        seed=data.draw(st.integers(0, 9)),
    )
    try:
        sizes = data.draw(st.lists(st.integers(0, 8), min_size=num_groups, max_size=num_groups))
        indices = data.draw(st.lists(st.integers(0, 20), min_size=num_groups, max_size=num_groups))
        gpu_ids = list(data.draw(st.permutations(range(24))))[: sum(sizes)]
        cpu_ids = list(data.draw(st.permutations(range(40))))[
            : cpu_blocks_needed(sizes, indices, factor)
        ]
        store(rig, 1, gpu_ids, sizes, indices, cpu_ids)
        assert finish(rig.worker, 1)[1].success
        check_store(rig, split_groups(gpu_ids, sizes), indices, cpu_ids)
        targets = [24 + i for i in range(sum(sizes))]
        before = [t.copy() for t in rig.gpu]
        spec = GPULoadStoreSpec(targets, group_sizes=sizes, block_indices=indices)
        assert rig.worker.submit_load(2, CPULoadStoreSpec(cpu_ids), spec)
        assert finish(rig.worker, 2)[2].success
        for g, (src, dst) in enumerate(
            zip(split_groups(gpu_ids, sizes), split_groups(targets, sizes), strict=True)
        ):
            for copy in rig.layout.group_copies[g]:
                n = copy.nbytes
                assert np.array_equal(
                    rig.gpu[copy.tensor_idx][dst, :n], before[copy.tensor_idx][src, :n]
                )
    finally:
        rig.worker.shutdown(timeout=10)
        rig.host.close()


def test_torch_cpu_tensors_of_any_dtype_and_shape_are_used_in_place(rigs: list[Rig]) -> None:
    torch = pytest.importorskip("torch")
    # A bf16 cache of shape (num_blocks, 2, block_size, heads, head_dim) and a
    # pre-flattened int8 one; pages of 2*16*2*8*2 = 1024 bytes and 512 bytes.
    kv0 = torch.randn(20, 2, 16, 2, 8, dtype=torch.bfloat16)
    kv1 = torch.randint(-128, 127, (20, 512), dtype=torch.int8)
    caches = CanonicalKVCaches(
        [CanonicalKVCacheTensor(kv0, 1024), CanonicalKVCacheTensor(kv1, 512)],
        [[CanonicalKVCacheRef(0, 1024), CanonicalKVCacheRef(1, 512)]],
    )
    with HostBuffer.create(8, required_cpu_block_bytes([1024, 512], 2)) as host:
        worker = make_copy_worker(caches, host, block_size_factor=2)
        try:
            assert worker.submit_store(1, GPULoadStoreSpec([4, 5, 6]), CPULoadStoreSpec([2, 7]))
            assert finish(worker, 1)[1].success
            assert worker.submit_load(2, CPULoadStoreSpec([2, 7]), GPULoadStoreSpec([10, 11, 12]))
            assert finish(worker, 2)[2].success
        finally:
            worker.shutdown()
    assert torch.equal(kv0[10:13].view(torch.int16), kv0[4:7].view(torch.int16))
    assert torch.equal(kv1[10:13], kv1[4:7])


def test_two_workers_share_one_buffer_in_their_own_areas(rigs: list[Rig]) -> None:
    pages = [1024, 2048]
    block_bytes = required_cpu_block_bytes(pages, 1, num_workers=2)
    rng = np.random.default_rng(1)
    with HostBuffer.create(4, block_bytes) as host:
        host.as_numpy()[:] = SENTINEL
        workers, tensors = [], []
        for rank in range(2):
            gpu = [rng.integers(0, 256, (8, p), dtype=np.uint8) for p in pages]
            kv = CanonicalKVCaches(
                [CanonicalKVCacheTensor(t, p) for t, p in zip(gpu, pages, strict=True)]
            )
            workers.append(make_copy_worker(kv, host, worker_index=rank))
            tensors.append(gpu)
        try:
            for rank, worker in enumerate(workers):
                assert worker.submit_store(rank, GPULoadStoreSpec([3]), CPULoadStoreSpec([1]))
                assert finish(worker, rank)[rank].success
        finally:
            for worker in workers:
                worker.shutdown()
        row = host.as_numpy()[1]
        area = sum(pages)
        for rank in range(2):
            base = rank * area
            assert np.array_equal(row[base : base + 1024], tensors[rank][0][3])
            assert np.array_equal(row[base + 1024 : base + area], tensors[rank][1][3])
        assert np.all(host.as_numpy()[[0, 2, 3]] == SENTINEL)


# -- ordering -----------------------------------------------------------------------------


def big_rig(rigs: list[Rig]) -> Rig:
    # Jobs of 48 x 256 KiB take long enough that an unordered second lane would
    # overtake them.
    rig = build_rig([256 * 1024], [[(0, 256 * 1024)]], gpu_blocks=160, cpu_blocks=64)
    rigs.append(rig)
    return rig


# Each pair below walks the shared blocks in opposite orders, so that without
# ordering the second job would touch first what the first job touches last.


def test_a_load_submitted_after_a_store_of_the_same_cpu_blocks_reads_the_stored_bytes(
    rigs: list[Rig],
) -> None:
    rig = big_rig(rigs)
    src, cpu, dst = list(range(48)), list(range(63, 15, -1)), list(range(100, 148))
    store_job = rig.worker.store_handler.submit(1, GPULoadStoreSpec(src), CPULoadStoreSpec(cpu))
    load_job = rig.worker.load_handler.submit(2, CPULoadStoreSpec(cpu[::-1]), GPULoadStoreSpec(dst))
    assert store_job in load_job.depends_on or store_job.done()  # type: ignore[attr-defined]
    results = finish(rig.worker, 1, 2)
    assert results[1].success and results[2].success
    assert np.array_equal(rig.gpu[0][dst], rig.gpu[0][src[::-1]])


def test_a_store_submitted_after_a_load_does_not_overwrite_what_the_load_reads(
    rigs: list[Rig],
) -> None:
    rig = big_rig(rigs)
    cpu = list(range(48))
    old = rig.host_bytes[cpu].copy()
    assert rig.worker.submit_load(1, CPULoadStoreSpec(cpu), GPULoadStoreSpec(list(range(100, 148))))
    assert rig.worker.submit_store(
        2, GPULoadStoreSpec(list(range(48))), CPULoadStoreSpec(cpu[::-1])
    )
    results = finish(rig.worker, 1, 2)
    assert results[1].success and results[2].success
    assert np.array_equal(rig.gpu[0][100:148], old)
    assert np.array_equal(rig.host_bytes[cpu[::-1]], rig.gpu[0][:48])


def test_a_load_into_gpu_blocks_waits_for_a_store_still_reading_them(rigs: list[Rig]) -> None:
    rig = big_rig(rigs)
    original = rig.gpu[0][:48].copy()
    src = list(range(47, -1, -1))
    assert rig.worker.submit_store(1, GPULoadStoreSpec(src), CPULoadStoreSpec(list(range(48))))
    assert rig.worker.submit_load(
        2, CPULoadStoreSpec(list(range(48, 64))), GPULoadStoreSpec(list(range(16))), expedited=True
    )
    results = finish(rig.worker, 1, 2)
    assert results[1].success and results[2].success
    assert np.array_equal(rig.host_bytes[:48], original[::-1])


def test_jobs_of_one_lane_run_in_submission_order(rigs: list[Rig]) -> None:
    rig = big_rig(rigs)
    for job_id, src in enumerate((range(0, 48), range(48, 96), range(96, 144)), start=1):
        assert rig.worker.submit_store(
            job_id, GPULoadStoreSpec(list(src)), CPULoadStoreSpec(list(range(48)))
        )
    assert all(r.success for r in finish(rig.worker, 1, 2, 3).values())
    assert np.array_equal(rig.host_bytes[:48], rig.gpu[0][96:144])


# -- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (GPULoadStoreSpec([40]), CPULoadStoreSpec([0])),  # GPU id out of range
        (GPULoadStoreSpec([1]), CPULoadStoreSpec([16])),  # CPU id out of range
        (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0])),  # too few CPU blocks
        (CPULoadStoreSpec([1]), CPULoadStoreSpec([0])),  # wrong source type
        (GPULoadStoreSpec([1, 2], group_sizes=[1, 1]), CPULoadStoreSpec([0, 1])),  # 2 groups
    ],
)
def test_bad_specs_are_rejected_and_change_nothing(rigs: list[Rig], src: Any, dst: Any) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    assert not rig.worker.submit_store(1, src, dst)
    assert rig.worker.num_in_flight == 0
    assert rig.worker.get_finished() == []
    assert np.all(rig.host_bytes == SENTINEL)
    # The id is free again: a good job with it runs.
    assert rig.worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    assert finish(rig.worker, 1)[1].success


def test_submit_raises_contract_errors_with_the_job_id(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    handler = rig.worker.store_handler
    with pytest.raises(ContractError, match=r"job 5: .*GPU block 99 is out of range"):
        handler.submit(5, GPULoadStoreSpec([99]), CPULoadStoreSpec([0]))
    with pytest.raises(ContractError, match="source must be a GPULoadStoreSpec"):
        handler.submit(5, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    with pytest.raises(ContractError, match="job_id must be an int"):
        handler.submit("5", GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))  # type: ignore[arg-type]
    assert not rig.worker.load_handler.transfer_async(6, (GPULoadStoreSpec([1]),))  # type: ignore[arg-type]


def test_an_engine_error_at_submission_is_a_rejected_job_not_a_crash(rigs: list[Rig]) -> None:
    # A CUDA engine can raise RuntimeError while setting up streams and events.
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)

    def broken_submit(plan: object) -> object:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rig.worker.engine.submit = broken_submit  # type: ignore[assignment,method-assign]
    handler = rig.worker.store_handler
    assert not handler.transfer_async(8, (GPULoadStoreSpec([1]), CPULoadStoreSpec([0])))
    assert rig.worker.num_in_flight == 0 and rig.worker.get_finished() == []


def test_a_job_id_in_flight_cannot_be_reused_by_any_direction(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    gate = threading.Event()
    rig.worker.engine.run_plan = _gated(rig.worker.engine.run_plan, gate)  # type: ignore[method-assign]
    assert rig.worker.submit_store(7, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    assert not rig.worker.submit_store(7, GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))
    assert not rig.worker.submit_load(7, CPULoadStoreSpec([3]), GPULoadStoreSpec([4]))
    gate.set()
    assert finish(rig.worker, 7)[7].success
    assert rig.worker.submit_load(7, CPULoadStoreSpec([0]), GPULoadStoreSpec([4]))
    assert finish(rig.worker, 7)[7].success


def _gated(fn: Any, gate: threading.Event) -> Any:
    def run(*args: Any) -> Any:
        assert gate.wait(30)
        return fn(*args)

    return run


def test_a_tensor_error_mid_job_fails_the_job_and_the_lane_goes_on(rigs: list[Rig]) -> None:
    # Group 0 lives in tensor 0 only; group 1 in tensors 0 and 1. Tensor 1 is
    # read-only, so a load of group 1 copies tensor 0 and then fails.
    rig = build_rig([1024, 1024], [[(0, 1024)], [(0, 1024), (1, 1024)]], read_only=(1,))
    rigs.append(rig)
    two_groups = GPULoadStoreSpec([1, 2], group_sizes=[0, 2], block_indices=[0, 0])
    assert rig.worker.submit_store(1, two_groups, CPULoadStoreSpec([0, 1]))
    assert finish(rig.worker, 1)[1].success  # reading a read-only tensor is fine
    load = GPULoadStoreSpec([5, 6], group_sizes=[0, 2], block_indices=[0, 0])
    assert rig.worker.submit_load(2, CPULoadStoreSpec([0, 1]), load)
    result = finish(rig.worker, 2)[2]
    assert not result.success
    assert result.error is not None and "read-only" in result.error
    # The job's regions are all checked before any byte moves: tensor 0 is untouched too.
    assert not np.array_equal(rig.gpu[0][[5, 6]], rig.gpu[0][[1, 2]])
    # The load lane goes on: a job that only writes tensor 0 succeeds.
    only_group_0 = GPULoadStoreSpec([7], group_sizes=[1, 0], block_indices=[0, 0])
    assert rig.worker.submit_load(3, CPULoadStoreSpec([0]), only_group_0)
    assert finish(rig.worker, 3)[3].success
    assert np.array_equal(rig.gpu[0][7], rig.gpu[0][1])


class FailingEngine(HostCopyEngine):
    """Fails while building a job's region table."""

    def region_table(self, plan: TransferPlan) -> Any:
        raise OSError("injected copy failure")


def _layout(pages: list[int], gpu_blocks: int, cpu_blocks: int) -> KVLayout:
    return KVLayout.build(
        gpu_page_bytes=pages,
        gpu_num_blocks=[gpu_blocks] * len(pages),
        group_data_refs=[[CanonicalKVCacheRef(t, p) for t, p in enumerate(pages)]],
        block_size_factor=1,
        cpu_num_blocks=cpu_blocks,
        cpu_block_bytes=required_cpu_block_bytes(pages),
    )


def test_an_injected_failure_is_reported_once_with_its_reason() -> None:
    layout = _layout([2048, 2048], 8, 4)
    gpu = [np.ones((8, 2048), np.uint8), np.ones((8, 2048), np.uint8)]
    with HostBuffer.create(4, layout.cpu_block_bytes) as host:
        worker = CopyWorker(FailingEngine(layout, gpu, host))
        try:
            assert worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
            worker.wait([1])
            (result,) = worker.get_finished()
            assert (result.job_id, result.success) == (1, False)
            assert result.error == "OSError: injected copy failure"
            assert worker.get_finished() == []
        finally:
            worker.shutdown()


# -- the region table ------------------------------------------------------------------


def _canonical_runs(src: Any, dst: Any, lengths: Any) -> list[tuple[int, int, int]]:
    """Regions sorted and merged where both sides continue: one form for one set of copies."""
    out: list[tuple[int, int, int]] = []
    for s, d, n in sorted(zip(map(int, src), map(int, dst), map(int, lengths), strict=True)):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((s, d, n))
    return out


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    factor=st.sampled_from([1, 2, 4]),
    pages=st.lists(st.sampled_from([256, 512, 1024]), min_size=1, max_size=4),
    interleaved=st.booleans(),
)
def test_the_region_table_is_every_block_copy_in_source_order(
    data: st.DataObject, factor: int, pages: list[int], interleaved: bool
) -> None:
    """Whichever way it is laid out (tensor by tensor, run by run, or sorted), the table
    moves exactly the oracle's bytes, with sources ascending."""
    num_tensors = len(pages)
    if interleaved:  # one packed array (blocks, tensors, page): every tensor's rows are strided
        pages = [pages[0]] * num_tensors
        packed = np.zeros((48, num_tensors, pages[0]), np.uint8)
        gpu = [packed[:, t, :] for t in range(num_tensors)]
    else:
        gpu = [np.zeros((48, p), np.uint8) for p in pages]
    group = [(t, data.draw(st.sampled_from([pages[t], pages[t] // 2]))) for t in range(num_tensors)]
    groups: Groups = [group, group[: data.draw(st.integers(1, num_tensors))]]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, p) for t, p in zip(gpu, pages, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in g] for g in groups],
    )
    with HostBuffer.create(40, required_cpu_block_bytes(pages, factor)) as host:
        worker = make_copy_worker(kv, host, block_size_factor=factor)
        try:
            engine = worker.engine
            assert isinstance(engine, HostCopyEngine)
            sizes = data.draw(st.lists(st.integers(0, 10), min_size=2, max_size=2))
            indices = data.draw(st.lists(st.integers(0, 9), min_size=2, max_size=2))
            # In order as well as shuffled: ordered ids make runs of adjacent blocks.
            gpu_ids = list(data.draw(st.permutations(range(48)) | st.just(range(48))))[: sum(sizes)]
            cpu_ids = list(data.draw(st.permutations(range(40)) | st.just(range(40))))[
                : cpu_blocks_needed(sizes, indices, factor)
            ]
            spec = GPULoadStoreSpec(gpu_ids, group_sizes=sizes, block_indices=indices)
            host_base = int(host.as_numpy().ctypes.data)
            layout = engine.layout
            for lane in (Lane.STORE, Lane.LOAD):
                plan = plan_transfer(layout, spec, CPULoadStoreSpec(cpu_ids), lane)
                src, dst, lengths = engine.region_table(plan)
                assert bool((src[1:] >= src[:-1]).all()), "regions not in source order"
                expected = []
                for t, gpu_block, cpu_block, sub, nbytes in expected_copies(
                    layout, split_groups(gpu_ids, sizes), indices, cpu_ids
                ):
                    gpu_addr = int(gpu[t].ctypes.data) + gpu_block * gpu[t].strides[0]
                    cpu_addr = (
                        host_base
                        + cpu_block * layout.cpu_block_bytes
                        + layout.cpu_slot_offsets[t]
                        + sub * layout.gpu_page_bytes[t]
                    )
                    pair = (gpu_addr, cpu_addr) if lane is Lane.STORE else (cpu_addr, gpu_addr)
                    expected.append((*pair, nbytes))
                want = [[s for s, _, _ in expected], [d for _, d, _ in expected]]
                want_runs = _canonical_runs(*want, [n for _, _, n in expected])
                assert _canonical_runs(src, dst, lengths) == want_runs
        finally:
            worker.shutdown(timeout=10)


def test_a_load_table_run_by_run_keeps_each_runs_length() -> None:
    """Loads of two tensors, factor 2, from request block 1: runs of one and two sub-blocks."""
    pages = [256, 256]
    gpu = [np.zeros((8, p), np.uint8) for p in pages]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, p) for t, p in zip(gpu, pages, strict=True)],
        [[CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(1, 256)]],
    )
    with HostBuffer.create(4, required_cpu_block_bytes(pages, 2)) as host:
        worker = make_copy_worker(kv, host, block_size_factor=2)
        try:
            engine = worker.engine
            assert isinstance(engine, HostCopyEngine)
            spec = GPULoadStoreSpec(list(range(5)), block_indices=[1])
            plan = plan_transfer(engine.layout, spec, CPULoadStoreSpec([0, 1, 2]), Lane.LOAD)
            src, dst, lengths = engine.region_table(plan)
            block, slot = engine.layout.cpu_block_bytes, engine.layout.cpu_slot_offsets[1]
            base = int(host.as_numpy().ctypes.data)
            assert (src - base).tolist() == [
                256,
                slot + 256,
                block,
                block + slot,
                2 * block,
                2 * block + slot,
            ]
            assert lengths.tolist() == [256, 256, 512, 512, 512, 512]
            assert (dst - [gpu[t].ctypes.data for t in (0, 1, 0, 1, 0, 1)]).tolist() == [
                0,
                0,
                256,
                256,
                768,
                768,
            ]
        finally:
            worker.shutdown(timeout=10)


# -- shutdown and waiting -----------------------------------------------------------------


def test_shutdown_with_jobs_in_flight_finishes_them_and_stops_the_threads(rigs: list[Rig]) -> None:
    rig = big_rig(rigs)
    for job_id in range(1, 5):
        cpu = list(range(16 * (job_id - 1), 16 * job_id))
        assert rig.worker.submit_store(
            job_id, GPULoadStoreSpec(list(range(16))), CPULoadStoreSpec(cpu)
        )
    assert rig.worker.submit_load(9, CPULoadStoreSpec([0]), GPULoadStoreSpec([150]))
    rig.worker.shutdown(timeout=30)
    results = {r.job_id: r for r in rig.worker.get_finished()}
    assert set(results) == {1, 2, 3, 4, 9} and all(r.success for r in results.values())
    assert not any(lane.thread.is_alive() for lane in rig.worker.engine._lanes.values())  # type: ignore[attr-defined]
    assert not rig.worker.submit_store(10, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    with pytest.raises(TierClosedError):
        rig.worker.store_handler.submit(10, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    rig.worker.shutdown()  # idempotent


def test_shutdown_past_its_deadline_fails_the_stuck_jobs_for_good(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    gate = threading.Event()
    rig.worker.engine.run_plan = _gated(rig.worker.engine.run_plan, gate)  # type: ignore[method-assign]
    assert rig.worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    assert rig.worker.submit_store(2, GPULoadStoreSpec([2]), CPULoadStoreSpec([1]))
    rig.worker.shutdown(timeout=0.2)
    results = {r.job_id: r for r in rig.worker.get_finished()}
    assert set(results) == {1, 2}
    assert not any(r.success for r in results.values())
    assert all("shut down before the job finished" in (r.error or "") for r in results.values())
    gate.set()  # the stuck copy completes late: it must not turn into a success
    rig.worker.engine._lanes[Lane.STORE].thread.join(10)  # type: ignore[attr-defined]
    assert rig.worker.get_finished() == []


def test_wait_times_out_with_a_clear_error(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    gate = threading.Event()
    rig.worker.engine.run_plan = _gated(rig.worker.engine.run_plan, gate)  # type: ignore[method-assign]
    assert rig.worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    with pytest.raises(TimeoutError, match="store job 1 still running"):
        rig.worker.wait([1], timeout=0.05)
    gate.set()
    rig.worker.wait([1, 12345])  # unknown ids are ignored, as in vLLM
    assert finish(rig.worker, 1)[1].success


async def test_jobs_are_awaited_without_blocking_the_loop(rigs: list[Rig]) -> None:
    rig = big_rig(rigs)
    assert rig.worker.submit_store(
        1, GPULoadStoreSpec(list(range(48))), CPULoadStoreSpec(list(range(48)))
    )
    assert rig.worker.submit_load(
        2, CPULoadStoreSpec(list(range(48))), GPULoadStoreSpec(list(range(100, 148)))
    )
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await rig.worker.wait_async([1, 2])
    task.cancel()
    assert ticks > 0  # the loop kept running while the copies did
    assert {r.job_id: r.success for r in rig.worker.get_finished()} == {1: True, 2: True}
    assert np.array_equal(rig.gpu[0][100:148], rig.gpu[0][:48])


async def test_cancelling_a_wait_leaves_the_job_running(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    gate = threading.Event()
    rig.worker.engine.run_plan = _gated(rig.worker.engine.run_plan, gate)  # type: ignore[method-assign]
    assert rig.worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([0]))
    waiter = asyncio.create_task(rig.worker.wait_async([1]))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.set()
    await rig.worker.wait_async([1])
    assert finish(rig.worker, 1)[1].success
    assert np.array_equal(rig.host_bytes[0, :1024], rig.gpu[0][1])


def test_handler_shape_matches_vllm(rigs: list[Rig]) -> None:
    rig = build_rig([1024], [[(0, 1024)]])
    rigs.append(rig)
    handlers = {(src, dst): h for src, dst, h in rig.worker.get_handlers()}
    assert set(handlers) == {
        (GPULoadStoreSpec, CPULoadStoreSpec),
        (CPULoadStoreSpec, GPULoadStoreSpec),
    }
    store_handler = handlers[GPULoadStoreSpec, CPULoadStoreSpec]
    assert isinstance(store_handler, TransferHandler)
    assert store_handler.transfer_async(3, (GPULoadStoreSpec([4]), CPULoadStoreSpec([2])))
    store_handler.wait({3})
    (result,) = store_handler.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (3, True, 1024)


# -- processes and imports ----------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tiering.copy import CanonicalKVCaches, CanonicalKVCacheTensor, make_copy_worker
    from tiering.primary.host_buffer import HostBuffer
    from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

    name, num_blocks, block_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    host = HostBuffer.attach(name, num_blocks, block_bytes)
    gpu = np.random.default_rng(5).integers(0, 256, (16, 4096), dtype=np.uint8)
    worker = make_copy_worker(
        CanonicalKVCaches([CanonicalKVCacheTensor(gpu, 4096)]), host, block_size_factor=2
    )
    # Store request blocks 1..4 (unaligned: starts at sub-block 1) into CPU blocks 3, 1, 2.
    assert worker.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3], block_indices=[1]),
                               CPULoadStoreSpec([3, 1, 2]))
    # Load the parent's CPU block 0 into GPU blocks 8 and 9.
    assert worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([8, 9]))
    worker.wait([1, 2])
    results = {r.job_id: r.success for r in worker.get_finished()}
    worker.shutdown()
    expected = (np.arange(8192) % 251).astype(np.uint8).reshape(2, 4096)
    print(results[1], results[2], bool(np.array_equal(gpu[8:10], expected)))
    """
)


def test_a_worker_process_attaches_to_the_primary_buffer_by_name(tmp_path: Path) -> None:
    name = f"kvtier-copytest-{os.getpid()}"
    with HostBuffer.create(4, 8192, shared_name=name) as host:
        host.as_numpy()[:] = SENTINEL
        host.as_numpy()[0] = np.arange(8192) % 251
        script = tmp_path / "child.py"
        script.write_text(CHILD)
        proc = subprocess.run(
            [sys.executable, str(script), name, "4", "8192"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True", "True", "True"]
        gpu = np.random.default_rng(5).integers(0, 256, (16, 4096), dtype=np.uint8)
        rows = host.as_numpy()
        assert np.array_equal(rows[3, 4096:], gpu[0])
        assert np.array_equal(rows[1, :4096], gpu[1])
        assert np.array_equal(rows[1, 4096:], gpu[2])
        assert np.array_equal(rows[2, :4096], gpu[3])
        assert np.all(rows[3, :4096] == SENTINEL) and np.all(rows[2, 4096:] == SENTINEL)


def test_importing_the_copy_package_does_not_import_torch() -> None:
    code = (
        "import sys, tiering, tiering.copy, tiering.copy.host, tiering.copy.handlers\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr


def test_the_cuda_engine_refuses_to_start_without_cuda_with_a_clear_message() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: covered by tests/test_copy_cuda.py")
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(np.zeros((4, 1024), np.uint8), 1024)])
    with (
        HostBuffer.create(2, 4096) as host,
        pytest.raises(TypeError, match="must be a CUDA tensor"),
    ):
        make_copy_worker(kv, host, engine="cuda")
    from tiering.copy.cuda import CudaCopyEngine

    layout = _layout([1024], 4, 2)
    with (
        HostBuffer.create(2, 4096) as host,
        pytest.raises(RuntimeError, match="needs a CUDA device"),
    ):
        CudaCopyEngine(layout, [torch.zeros(4, 1024, dtype=torch.int8)], host)
