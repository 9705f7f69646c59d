"""The canonical layout and the GPU -> CPU block mapping (pure, no engine)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.copy import (
    CanonicalKVCacheRef,
    KVLayout,
    Lane,
    plan_transfer,
    required_cpu_block_bytes,
)
from tiering.copy.plan import byte_runs
from tiering.core.errors import ContractError
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec


def make_layout(
    pages: list[int],
    groups: list[list[tuple[int, int]]],
    factor: int = 1,
    gpu_blocks: int = 64,
    cpu_blocks: int = 32,
    worker_index: int = 0,
    num_workers: int = 1,
) -> KVLayout:
    return KVLayout.build(
        gpu_page_bytes=pages,
        gpu_num_blocks=[gpu_blocks] * len(pages),
        group_data_refs=[[CanonicalKVCacheRef(t, n) for t, n in g] for g in groups],
        block_size_factor=factor,
        cpu_num_blocks=cpu_blocks,
        cpu_block_bytes=required_cpu_block_bytes(pages, factor, num_workers),
        worker_index=worker_index,
    )


def expected_copies(
    layout: KVLayout,
    group_ids: list[list[int]],
    block_indices: list[int],
    cpu_ids: list[int],
) -> set[tuple[int, int, int, int, int]]:
    """Oracle, written request-first: ``(tensor, gpu_block, cpu_block, sub, nbytes)``.

    Request block ``b`` lives in offloaded chunk ``b // f`` at sub-block
    ``b % f``; a group's CPU blocks are its chunks in order, starting with the
    chunk of its first block.
    """
    f = layout.block_size_factor
    out = set()
    cursor = 0
    for g, ids in enumerate(group_ids):
        if not ids:
            continue
        first = block_indices[g]
        chunks = list(range(first // f, (first + len(ids) - 1) // f + 1))
        chunk_to_cpu = dict(zip(chunks, cpu_ids[cursor : cursor + len(chunks)], strict=True))
        cursor += len(chunks)
        for k, gpu in enumerate(ids):
            b = first + k
            for copy in layout.group_copies[g]:
                out.add((copy.tensor_idx, gpu, chunk_to_cpu[b // f], b % f, copy.nbytes))
    assert cursor == len(cpu_ids)
    return out


def planned_copies(plan_obj: object) -> set[tuple[int, int, int, int, int]]:
    out = set()
    for entry in plan_obj.copies:  # type: ignore[attr-defined]
        for g, c, s in zip(
            entry.gpu_blocks.tolist(),
            entry.cpu_blocks.tolist(),
            entry.cpu_subblocks.tolist(),
            strict=True,
        ):
            out.add((entry.tensor_idx, g, c, s, entry.nbytes))
    return out


def cpu_blocks_needed(sizes: list[int], indices: list[int], factor: int) -> int:
    return sum(-(-(n + i % factor) // factor) for n, i in zip(sizes, indices, strict=True) if n)


# -- layout -------------------------------------------------------------------------------


def test_required_cpu_block_bytes_packs_every_tensor_times_factor_and_aligns() -> None:
    assert required_cpu_block_bytes([4096, 8192], 1) == 12288
    assert required_cpu_block_bytes([4096, 8192], 4) == 49152
    assert required_cpu_block_bytes([4096], 2, num_workers=3) == 24576
    assert required_cpu_block_bytes([1000], 1) == 4096
    assert required_cpu_block_bytes([1000], 1, alignment=1) == 1000


@pytest.mark.parametrize(
    ("pages", "factor", "workers"),
    [([], 1, 1), ([4096], 0, 1), ([4096], 1, 0), ([0], 1, 1), ([-4096], 1, 1)],
)
def test_required_cpu_block_bytes_rejects_bad_geometry(
    pages: list[int], factor: int, workers: int
) -> None:
    with pytest.raises(ValueError):
        required_cpu_block_bytes(pages, factor, workers)


def test_slots_are_packed_per_worker_and_tensor() -> None:
    layout = make_layout(
        [4096, 8192], [[(0, 4096), (1, 8192)]], factor=2, worker_index=1, num_workers=2
    )
    area = (4096 + 8192) * 2
    assert layout.cpu_block_bytes == 2 * area
    assert layout.cpu_slot_offsets == (area, area + 8192)
    assert layout.cpu_slot_bytes(1) == 16384
    assert layout.bytes_per_gpu_block(0) == 4096 + 8192


def test_aliased_references_of_one_tensor_merge_keeping_the_larger_size() -> None:
    layout = make_layout([4096], [[(0, 1000), (0, 3000)]])
    assert [(c.tensor_idx, c.nbytes) for c in layout.group_copies[0]] == [(0, 3000)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group_data_refs": [[CanonicalKVCacheRef(2, 10)]]}, "reference to tensor 2"),
        ({"group_data_refs": [[CanonicalKVCacheRef(0, 5000)]]}, "page_size_bytes=5000"),
        ({"group_data_refs": [[CanonicalKVCacheRef(0, 0)]]}, "page_size_bytes=0"),
        ({"group_data_refs": []}, "at least one KV-cache group"),
        ({"cpu_block_bytes": 4095}, "cannot hold worker 0"),
        ({"worker_index": 1}, "cannot hold worker 1"),
        ({"block_size_factor": 0}, "block_size_factor"),
        ({"cpu_num_blocks": 0}, "must have blocks"),
        ({"gpu_page_bytes": [0]}, "must be positive"),
        ({"gpu_num_blocks": [0]}, "num_blocks must be positive"),
        ({"gpu_num_blocks": [8, 8]}, "block counts"),
    ],
)
def test_layout_rejects_inconsistent_geometry(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "gpu_page_bytes": [4096],
        "gpu_num_blocks": [8],
        "group_data_refs": [[CanonicalKVCacheRef(0, 4096)]],
        "block_size_factor": 1,
        "cpu_num_blocks": 4,
        "cpu_block_bytes": 4096,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        KVLayout.build(**args)  # type: ignore[arg-type]


# -- mapping ------------------------------------------------------------------------------


def test_unaligned_first_block_starts_part_way_into_the_first_cpu_block() -> None:
    layout = make_layout([4096], [[(0, 4096)]], factor=4)
    # Request blocks 6..10: chunk 1 (subs 2, 3) then chunk 2 (subs 0, 1, 2).
    plan = plan_transfer(
        layout,
        GPULoadStoreSpec([20, 21, 22, 23, 24], block_indices=[6]),
        CPULoadStoreSpec([9, 5]),
        Lane.STORE,
    )
    (entry,) = plan.copies
    assert entry.gpu_blocks.tolist() == [20, 21, 22, 23, 24]
    assert entry.cpu_blocks.tolist() == [9, 9, 5, 5, 5]
    assert entry.cpu_subblocks.tolist() == [2, 3, 0, 1, 2]
    assert plan.total_bytes == 5 * 4096
    assert plan.cpu_block_ids.tolist() == [5, 9]
    offsets = entry.cpu_offsets(layout).tolist()
    assert offsets == [
        9 * 16384 + 2 * 4096,
        9 * 16384 + 3 * 4096,
        5 * 16384,
        5 * 16384 + 4096,
        5 * 16384 + 8192,
    ]


def test_groups_consume_cpu_blocks_in_order_and_empty_groups_none() -> None:
    layout = make_layout([4096, 2048], [[(0, 4096)], [(1, 2048)], [(0, 4000), (1, 2048)]], factor=2)
    gpu = GPULoadStoreSpec([1, 2, 3, 4, 5], group_sizes=[2, 0, 3], block_indices=[0, 7, 3])
    # group 0: 2 blocks aligned -> 1 CPU block; group 2: starts at sub 1 -> 2 CPU blocks.
    plan = plan_transfer(layout, gpu, CPULoadStoreSpec([10, 11, 12]), Lane.STORE)
    assert planned_copies(plan) == expected_copies(
        layout, [[1, 2], [], [3, 4, 5]], [0, 7, 3], [10, 11, 12]
    )
    assert plan.total_bytes == 2 * 4096 + 3 * (4000 + 2048)


@given(
    data=st.data(),
    factor=st.sampled_from([1, 2, 4]),
    num_groups=st.integers(1, 3),
    pages=st.lists(st.sampled_from([64, 128, 256]), min_size=1, max_size=3),
)
def test_mapping_matches_the_request_level_oracle(
    data: st.DataObject, factor: int, num_groups: int, pages: list[int]
) -> None:
    groups = [
        data.draw(
            st.lists(
                st.tuples(st.integers(0, len(pages) - 1), st.integers(1, 64)),
                min_size=1,
                max_size=3,
            )
        )
        for _ in range(num_groups)
    ]
    groups = [[(t, min(n, pages[t])) for t, n in g] for g in groups]
    layout = make_layout(pages, groups, factor=factor, gpu_blocks=200, cpu_blocks=200)
    sizes = data.draw(st.lists(st.integers(0, 9), min_size=num_groups, max_size=num_groups))
    indices = data.draw(st.lists(st.integers(0, 30), min_size=num_groups, max_size=num_groups))
    gpu_ids = data.draw(st.permutations(range(200)))[: sum(sizes)]
    cpu_ids = data.draw(st.permutations(range(200)))[: cpu_blocks_needed(sizes, indices, factor)]
    group_ids, pos = [], 0
    for n in sizes:
        group_ids.append(list(gpu_ids[pos : pos + n]))
        pos += n
    spec = GPULoadStoreSpec(gpu_ids, group_sizes=sizes, block_indices=indices)
    lane = data.draw(st.sampled_from(list(Lane)))
    plan = plan_transfer(layout, spec, CPULoadStoreSpec(cpu_ids), lane)
    assert planned_copies(plan) == expected_copies(layout, group_ids, indices, list(cpu_ids))
    assert plan.total_bytes == sum(
        n for *_, n in expected_copies(layout, group_ids, indices, list(cpu_ids))
    )


@pytest.mark.parametrize(
    ("gpu", "cpu", "message"),
    [
        (
            GPULoadStoreSpec([1, 2]),
            CPULoadStoreSpec([0, 1, 2]),
            "has 3 blocks but the GPU spec maps onto 2",
        ),
        (GPULoadStoreSpec([1]), CPULoadStoreSpec([]), "only 0 left"),
        (GPULoadStoreSpec([64]), CPULoadStoreSpec([0]), "GPU block 64 is out of range"),
        (GPULoadStoreSpec([1]), CPULoadStoreSpec([32]), "CPU block 32 is out of range"),
        (
            GPULoadStoreSpec([1, 2], group_sizes=[1, 1]),
            CPULoadStoreSpec([0, 1]),
            "2 KV-cache group",
        ),
        (GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([0, 0]), "same CPU sub-block"),
    ],
)
def test_specs_that_do_not_fit_are_rejected(
    gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec, message: str
) -> None:
    layout = make_layout([4096], [[(0, 4096)]])
    with pytest.raises(ContractError, match=message):
        plan_transfer(layout, gpu, cpu, Lane.STORE)


def test_a_load_may_not_write_one_gpu_block_twice_but_may_read_a_cpu_block_twice() -> None:
    layout = make_layout([4096], [[(0, 4096)]])
    with pytest.raises(ContractError, match="same GPU block"):
        plan_transfer(layout, GPULoadStoreSpec([3, 3]), CPULoadStoreSpec([0, 1]), Lane.LOAD)
    plan = plan_transfer(layout, GPULoadStoreSpec([3, 4]), CPULoadStoreSpec([0, 0]), Lane.LOAD)
    assert set(plan.cpu_block_ids.tolist()) == {0}  # read twice: listed twice, harmless


def test_spec_types_are_checked() -> None:
    layout = make_layout([4096], [[(0, 4096)]])
    with pytest.raises(ContractError, match="GPULoadStoreSpec"):
        plan_transfer(layout, CPULoadStoreSpec([1]), CPULoadStoreSpec([1]), Lane.STORE)  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="CPULoadStoreSpec"):
        plan_transfer(layout, GPULoadStoreSpec([1]), GPULoadStoreSpec([1]), Lane.STORE)  # type: ignore[arg-type]


def test_conflicts_follow_reads_and_writes() -> None:
    layout = make_layout([4096], [[(0, 4096)]])

    def plan(lane: Lane, gpu: list[int], cpu: list[int]) -> object:
        return plan_transfer(layout, GPULoadStoreSpec(gpu), CPULoadStoreSpec(cpu), lane)

    store = plan(Lane.STORE, [1, 2], [5, 6])
    assert store.conflicts_with(plan(Lane.LOAD, [7], [6]))  # type: ignore[attr-defined]  # reads what the store writes
    assert store.conflicts_with(plan(Lane.LOAD, [2], [9]))  # type: ignore[attr-defined]  # overwrites what it reads
    assert not store.conflicts_with(plan(Lane.LOAD, [7], [9]))  # type: ignore[attr-defined]
    load = plan(Lane.LOAD, [1], [5])
    assert not load.conflicts_with(plan(Lane.LOAD_EXPEDITED, [2], [5]))  # type: ignore[attr-defined]  # both only read 5
    assert load.conflicts_with(plan(Lane.LOAD_EXPEDITED, [1], [6]))  # type: ignore[attr-defined]  # both write GPU 1


ids = st.lists(st.integers(0, 40), max_size=12, unique=True)


@given(
    jobs=st.lists(st.tuples(ids, ids), min_size=2, max_size=2),
    lanes=st.tuples(st.sampled_from(list(Lane)), st.sampled_from(list(Lane))),
)
def test_conflicts_match_set_intersections(
    jobs: list[tuple[list[int], list[int]]], lanes: tuple[Lane, Lane]
) -> None:
    """Two jobs conflict exactly when one writes a block the other reads or writes."""
    layout = make_layout([4096], [[(0, 4096)]], gpu_blocks=64, cpu_blocks=64)
    jobs = [(g[: len(c)], c[: len(g)]) for g, c in jobs]  # one CPU block per GPU block
    a, b = (
        plan_transfer(layout, GPULoadStoreSpec(g), CPULoadStoreSpec(c), lane)
        for (g, c), lane in zip(jobs, lanes, strict=True)
    )
    shared_gpu = bool(set(jobs[0][0]) & set(jobs[1][0]))
    shared_cpu = bool(set(jobs[0][1]) & set(jobs[1][1]))
    stores = [lane.gpu_to_cpu for lane in lanes]  # a store reads GPU blocks, writes CPU ones
    if not any(stores):
        want = shared_gpu  # two loads: only the GPU blocks both write
    elif all(stores):
        want = shared_cpu  # two stores: only the CPU blocks both write
    else:
        want = shared_gpu or shared_cpu
    assert a.conflicts_with(b) == want == b.conflicts_with(a)


# -- runs ---------------------------------------------------------------------------------


@given(
    pairs=st.lists(
        st.tuples(st.integers(0, 15), st.integers(0, 15)), max_size=12, unique_by=lambda p: p[1]
    ),
    nbytes=st.sampled_from([1, 3, 8]),
)
def test_coalesced_runs_copy_exactly_what_per_block_copies_would(
    pairs: list[tuple[int, int]], nbytes: int
) -> None:
    src = np.arange(16 * nbytes, dtype=np.int64) % 251
    src_off = np.array([s * nbytes for s, _ in pairs], dtype=np.int64)
    dst_off = np.array([d * nbytes for _, d in pairs], dtype=np.int64)
    expect = np.full(16 * nbytes, -1, dtype=np.int64)
    for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
        expect[d : d + nbytes] = src[s : s + nbytes]
    got = np.full(16 * nbytes, -1, dtype=np.int64)
    starts_s, starts_d, lengths = byte_runs(src_off, dst_off, nbytes)
    for s, d, n in zip(starts_s.tolist(), starts_d.tolist(), lengths.tolist(), strict=True):
        got[d : d + n] = src[s : s + n]
    assert np.array_equal(got, expect)
    assert int(lengths.sum()) == len(pairs) * nbytes


def test_adjacent_blocks_become_one_run() -> None:
    starts_s, starts_d, lengths = byte_runs(
        np.array([0, 10, 20, 50], dtype=np.int64),
        np.array([100, 110, 120, 130], dtype=np.int64),
        10,
    )
    assert starts_s.tolist() == [0, 50]
    assert starts_d.tolist() == [100, 130]
    assert lengths.tolist() == [30, 10]
