"""The CUDA copy engine's ordering, as a Hypothesis state machine on the simulated device.

The device runs in manual mode: nothing moves until the machine steps a
stream, and Hypothesis chooses which, so every completion order the CUDA
rules allow is reachable (and shrinks to a short one on failure). The
machine interleaves the model writing GPU blocks on the compute stream,
stores, loads and expedited loads of overlapping blocks, and checks that
each job, when it completes, moved the bytes a sequential execution in
submission order would have moved: a store sees every model write and load
submitted before it, a load every store submitted before it. At the end the
whole GPU and host memory must equal that sequential model.

The one rule the worker's caller keeps (vLLM does): the model does not write
a GPU block while a job still reads or writes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.cuda_rigs import TWO_GROUPS
from tests.test_copy_layout import cpu_blocks_needed
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
from tiering.copy.cuda.simulated import SimulatedCudaDevice
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

GPU_BLOCKS = 10
CPU_BLOCKS = 6
PAGES, GROUPS = TWO_GROUPS


def pattern(page: int, value: int) -> np.ndarray[Any, Any]:
    """A page of bytes no other (page, value) pair shares at the same offsets."""
    return ((np.arange(page, dtype=np.int64) * 7 + value * 13 + 1) % 256).astype(np.uint8)


class CopyEngineOrdering(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim: SimulatedCudaDevice | None = None
        self.worker: CopyWorker | None = None

    @initialize(
        strategy=st.sampled_from(["dma", "kernel", "auto"]),
        factor=st.sampled_from([1, 2]),
    )
    def build(self, strategy: str, factor: int) -> None:
        self.sim = SimulatedCudaDevice(mode="manual")
        self.compute = self.sim.new_stream()
        self.factor = factor
        self.gpu = [
            self.sim.to_device(
                torch.from_numpy(np.stack([pattern(p, b + 100 * t) for b in range(GPU_BLOCKS)]))
            )
            for t, p in enumerate(PAGES)
        ]
        self.host = np.zeros((CPU_BLOCKS, required_cpu_block_bytes(PAGES, factor)), np.uint8)
        kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, p) for t, p in zip(self.gpu, PAGES, strict=True)],
            [[CanonicalKVCacheRef(t, n) for t, n in g] for g in GROUPS],
        )
        # A 2,500-byte switch: under auto, tensor 0's copies go by kernel, tensor 1's by DMA.
        self.worker = make_copy_worker(
            kv,
            self.host,
            block_size_factor=factor,
            device=self.sim,
            strategy=strategy,
            dma_min_bytes=2500,
        )
        self.layout = self.worker.engine.layout
        # The sequential model: what memory holds once everything submitted so far ran.
        self.model_gpu = [t.numpy().view(np.uint8).copy() for t in self.gpu]
        self.model_host = self.host.copy()
        self.in_flight: dict[int, tuple[Lane, Any, Any]] = {}  # id -> lane, plan, expected
        self.next_job = 1
        self.writes = 0

    # -------------------------------------------------------------- what the model knows

    def busy_gpu_blocks(self) -> set[int]:
        return {int(b) for _, plan, _ in self.in_flight.values() for b in plan.gpu_block_ids}

    def apply(self, plan: Any) -> None:
        """Run ``plan`` on the sequential model."""
        for entry in plan.copies:
            t, n = entry.tensor_idx, entry.nbytes
            page = self.layout.gpu_page_bytes[t]
            offset = self.layout.cpu_slot_offsets[t]
            for g, c, s in zip(
                entry.gpu_blocks, entry.cpu_blocks, entry.cpu_subblocks, strict=True
            ):
                row = slice(offset + int(s) * page, offset + int(s) * page + n)
                if plan.lane.gpu_to_cpu:
                    self.model_host[c, row] = self.model_gpu[t][g, :n]
                else:
                    self.model_gpu[t][g, :n] = self.model_host[c, row]

    def draw_specs(self, data: st.DataObject) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        sizes = [data.draw(st.integers(0, 3)), data.draw(st.integers(0, 2))]
        if sum(sizes) == 0:
            sizes[0] = 1
        starts = [data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))]
        order = data.draw(st.permutations(range(GPU_BLOCKS)))
        gpu_ids = list(order[: sum(sizes)])
        needed = cpu_blocks_needed(sizes, starts, self.factor)
        cpu_ids = list(data.draw(st.permutations(range(CPU_BLOCKS)))[:needed])
        return (
            GPULoadStoreSpec(gpu_ids, group_sizes=sizes, block_indices=starts),
            CPULoadStoreSpec(cpu_ids),
        )

    def submit(self, lane: Lane, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec) -> None:
        assert self.sim is not None and self.worker is not None
        plan = plan_transfer(self.layout, gpu, cpu, lane)
        job_id = self.next_job
        self.next_job += 1
        with self.sim.on_stream(self.compute):  # the worker submits from the compute stream
            if lane is Lane.STORE:
                accepted = self.worker.submit_store(job_id, gpu, cpu)
            else:
                accepted = self.worker.submit_load(
                    job_id, cpu, gpu, expedited=lane is Lane.LOAD_EXPEDITED
                )
        assert accepted
        self.apply(plan)
        if lane is Lane.STORE:
            rows = sorted({int(c) for c in cpu.block_ids})
            expected = (rows, self.model_host[rows].copy())
        else:
            blocks = sorted({int(g) for g in gpu.block_ids})
            expected = (blocks, [m[blocks].copy() for m in self.model_gpu])
        self.in_flight[job_id] = (lane, plan, expected)

    # -------------------------------------------------------------- rules

    @rule(data=st.data(), value=st.integers(0, 255))
    def model_writes(self, data: st.DataObject, value: int) -> None:
        assert self.sim is not None
        free = sorted(set(range(GPU_BLOCKS)) - self.busy_gpu_blocks())
        if not free:
            return
        block = data.draw(st.sampled_from(free))
        for t, page in enumerate(PAGES):
            new = torch.from_numpy(pattern(page, value + 1000 * self.writes + t).view(np.int8))
            rows = self.gpu[t][block]
            with self.sim.on_stream(self.compute):
                self.sim.launch(rows.copy_, new)
            self.model_gpu[t][block] = new.numpy().view(np.uint8)
        self.writes += 1

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        self.submit(Lane.STORE, *self.draw_specs(data))

    @rule(data=st.data(), expedited=st.booleans())
    def load(self, data: st.DataObject, expedited: bool) -> None:
        lane = Lane.LOAD_EXPEDITED if expedited else Lane.LOAD
        self.submit(lane, *self.draw_specs(data))

    @precondition(lambda self: self.sim is not None)
    @rule(choice=st.integers(0, 7), steps=st.integers(1, 4))
    def device_runs(self, choice: int, steps: int) -> None:
        """The device runs a few operations of one stream Hypothesis picks."""
        assert self.sim is not None
        for _ in range(steps):
            ready = self.sim.runnable_streams()
            if not ready:
                return
            self.sim.step(ready[choice % len(ready)])
            # Right after the step that completed it, before a later job may touch its blocks.
            self.completed_jobs_moved_the_sequential_bytes()

    @invariant()
    def completed_jobs_moved_the_sequential_bytes(self) -> None:
        if self.worker is None:
            return
        for result in self.worker.get_finished():
            lane, _, (where, expected) = self.in_flight.pop(result.job_id)
            assert result.success, result.error
            if lane is Lane.STORE:
                assert np.array_equal(self.host[where], expected), (
                    f"store {result.job_id}: CPU rows {where} differ from the sequential model"
                )
            else:
                for t, rows in enumerate(expected):
                    actual = self.gpu[t].numpy().view(np.uint8)[where]
                    assert np.array_equal(actual, rows), (
                        f"{lane.value} {result.job_id}: GPU blocks {where} of tensor {t} "
                        "differ from the sequential model"
                    )

    def teardown(self) -> None:
        if self.sim is None or self.worker is None:
            return
        try:
            while ready := self.sim.runnable_streams():
                self.sim.step(ready[0])
                self.completed_jobs_moved_the_sequential_bytes()
            assert not self.in_flight, f"jobs never completed: {sorted(self.in_flight)}"
            assert np.array_equal(self.host, self.model_host)
            for t, model in enumerate(self.model_gpu):
                assert np.array_equal(self.gpu[t].numpy().view(np.uint8), model)
            self.worker.shutdown(timeout=0)
            assert self.worker.engine.jobs_left_running == 0
        finally:
            self.sim.close()


TestCopyEngineOrdering = CopyEngineOrdering.TestCase
