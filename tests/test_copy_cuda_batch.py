"""Copy runs: the bounds check, ``cudaMemcpyBatchAsync``'s two signatures, the per-run default.

The batch call's arguments are checked against a stand-in runtime library
(both ABIs: CUDA 12.8/12.9 with ``failIdx``, 13.0 without), everywhere; the
call itself runs on a real GPU in ``test_copy_cuda.py``'s DMA round trips
and below where CUDA is present.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from tests.cuda_rigs import TWO_GROUPS, KVRig, rig_for
from tests.test_copy_cuda import round_trip
from tiering.copy.cuda.memcpy_batch import MemcpyBatch, check_runs, run_addresses
from tiering.copy.cuda.simulated import SimulatedCudaDevice


class FakeRuntime:
    """A ``libcudart`` stand-in: a version, and a batch call that records what it was given."""

    def __init__(self, version: int, answer: int = 0) -> None:
        self.version, self.answer = version, answer
        self.calls: list[tuple[Any, ...]] = []
        self.cleared = False

    def cudaRuntimeGetVersion(self, out: Any) -> int:
        out._obj.value = self.version
        return 0 if self.version else 35  # cudaErrorInsufficientDriver

    def cudaMemcpyBatchAsync(self, *args: Any) -> int:
        self.calls.append(args)
        return self.answer

    def cudaGetLastError(self) -> int:
        self.cleared = True
        return 0


def read_u64(pointer: Any, count: int) -> list[int]:
    return list((ctypes.c_uint64 * count).from_address(pointer.value))


def test_check_runs_names_the_first_run_outside_its_buffers() -> None:
    d, s, n = check_runs(100, 50, [0, 60], [10, 0], [40, 40])
    assert d.tolist() == [0, 60] and s.tolist() == [10, 0] and n.tolist() == [40, 40]
    with pytest.raises(ValueError, match=r"run 1 \(40 bytes from offset 20 to offset 70\)"):
        check_runs(100, 100, [0, 70], [0, 20], [40, 40])  # 70 + 40 > 100
    with pytest.raises(ValueError, match=r"run 0 .* outside its buffers"):
        check_runs(100, 100, [0], [80], [40])  # the source's end
    with pytest.raises(ValueError, match=r"run 0 .* is empty"):
        check_runs(100, 100, [0], [0], [0])
    with pytest.raises(ValueError, match="run 0"):
        check_runs(100, 100, [-8], [0], [8])
    with pytest.raises(ValueError, match="2 destination offsets, 1 source offsets and 2 lengths"):
        check_runs(100, 100, [0, 8], [0], [8, 8])


def test_run_addresses_add_the_offsets_to_the_bases() -> None:
    d, s, n = check_runs(1 << 40, 1 << 40, [0, 4096], [8192, 0], [4096, 4096])
    dsts, srcs, sizes = run_addresses(1 << 39, 7 << 32, d, s, n)
    assert dsts.tolist() == [1 << 39, (1 << 39) + 4096]
    assert srcs.tolist() == [(7 << 32) + 8192, 7 << 32]
    assert sizes.dtype == np.uint64 and sizes.tolist() == [4096, 4096]


@pytest.mark.parametrize(
    ("version", "with_fail_index"), [(12080, True), (12090, True), (13000, False)]
)
def test_the_batch_call_passes_the_signature_of_its_runtime(
    version: int, with_fail_index: bool
) -> None:
    runtime = FakeRuntime(version)
    batch = MemcpyBatch(runtime)
    assert batch.unavailable is None and batch.runtime_version == version
    dsts, srcs, sizes = (np.array(v, dtype=np.uint64) for v in ([16, 32], [48, 64], [8, 4]))
    assert batch(dsts, srcs, sizes, stream_handle=0xABC) == 0
    (args,) = runtime.calls
    assert len(args) == (9 if with_fail_index else 8)
    assert read_u64(args[0], 2) == [16, 32] and read_u64(args[1], 2) == [48, 64]
    assert read_u64(args[2], 2) == [8, 4] and args[3].value == 2
    attributes = args[4]._obj
    assert attributes.srcAccessOrder == 1 and ctypes.sizeof(attributes) == 24  # stream order
    assert list(args[5]) == [0] and args[6].value == 1  # one attribute set, for copy 0 on
    assert args[-1].value == 0xABC
    runtime.answer = 1
    assert batch(dsts, srcs, sizes, stream_handle=0xABC) == 1  # an error code, not an exception


def test_copy_runs_checks_then_enqueues_all_runs_in_one_call() -> None:
    runtime = FakeRuntime(13000)
    batch = MemcpyBatch(runtime)
    batch.copy_runs((1 << 30, 8192), (1 << 20, 4096), [4096, 0], [0, 2048], [2048, 2048], 7)
    (args,) = runtime.calls
    assert read_u64(args[0], 2) == [(1 << 30) + 4096, 1 << 30]
    assert read_u64(args[1], 2) == [1 << 20, (1 << 20) + 2048]
    assert read_u64(args[2], 2) == [2048, 2048] and args[-1].value == 7
    batch.copy_runs((1 << 30, 8192), (1 << 20, 4096), [], [], [], 7)  # nothing: no call
    assert len(runtime.calls) == 1
    with pytest.raises(ValueError, match="run 0"):
        batch.copy_runs((1 << 30, 8192), (1 << 20, 4096), [0], [4000], [2048], 7)
    assert len(runtime.calls) == 1 and not runtime.cleared
    runtime.answer = 700
    with pytest.raises(RuntimeError, match="of 1 runs failed: CUDA error 700"):
        batch.copy_runs((1 << 30, 8192), (1 << 20, 4096), [0], [0], [2048], 7)
    assert runtime.cleared  # the thread's last error does not linger


def test_without_the_call_the_batch_says_why_and_refuses_to_run() -> None:
    class Old:
        def cudaRuntimeGetVersion(self, out: Any) -> int:
            out._obj.value = 12040
            return 0

    cases = [
        (None, "no CUDA runtime library"),
        (Old(), "has no cudaMemcpyBatchAsync"),
        (FakeRuntime(0), "cudaRuntimeGetVersion failed"),
        (FakeRuntime(12040), "CUDA runtime 12040 predates"),
    ]
    for lib, why in cases:
        batch = MemcpyBatch(lib)
        assert batch.unavailable is not None and why in batch.unavailable
    empty = np.zeros(0, dtype=np.uint64)
    with pytest.raises(RuntimeError, match="unavailable: CUDA runtime 12040 predates"):
        batch(empty, empty, empty, 0)


def test_copy_runs_checks_every_run_before_enqueuing_any() -> None:
    with SimulatedCudaDevice(mode="manual") as sim:
        dst, src = sim.alloc((64,)), torch.arange(64, dtype=torch.int8)
        with pytest.raises(ValueError, match="run 1"):
            sim.copy_runs_async(dst, src, [0, 40], [0, 0], [16, 32], host_pinned=True)
        assert sim.runnable_streams() == []  # not even run 0 was enqueued
        sim.copy_runs_async(dst, src, [32, 0], [0, 48], [16, 16], host_pinned=False)
        sim.drain()
        assert dst[32:48].tolist() == list(range(16)) and dst[0:16].tolist() == list(range(48, 64))


@pytest.mark.parametrize("memcpy_batch", [True, False])
def test_dma_round_trips_with_and_without_the_batch_call(memcpy_batch: bool) -> None:
    with rig_for("cuda") as rig:
        from tiering.copy.cuda.torch_device import TorchCudaDevice, _cuda_runtime

        device = TorchCudaDevice("cuda", memcpy_batch=memcpy_batch)
        kv = KVRig(rig, TWO_GROUPS, factor=2, strategy="dma", device=device)
        try:
            round_trip(kv, seed=4)
            runtime = MemcpyBatch(_cuda_runtime().lib)
            batched = memcpy_batch and runtime.unavailable is None
            assert (device._batch is not None) == batched, runtime.unavailable
        finally:
            kv.close()
