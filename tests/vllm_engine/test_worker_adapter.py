"""KVTieringOffloadingSpec's worker adapter, without an engine (vLLM's connector types)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tiering.copy import TransferResult
from tiering.integrations.vllm.spec import CopyEngineOffloadingWorker


class FakeCopyWorker:
    """Stands in for tiering.copy.CopyWorker: scripted acceptance and results."""

    def __init__(self, *, accept: bool = True, results: list[TransferResult] | None = None):
        self.accept = accept
        self.results = results or []
        self.engine = SimpleNamespace(jobs_left_running=0)

    def submit_store(self, job_id: int, src: Any, dst: Any) -> bool:
        return self.accept

    def submit_load(self, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        return self.accept

    def get_finished(self) -> list[TransferResult]:
        done, self.results = self.results, []
        return done

    def shutdown(self) -> None:
        pass


class FakeRegion:
    def __init__(self) -> None:
        self.cleaned = False

    def cleanup(self) -> None:
        self.cleaned = True


def specs() -> tuple[Any, Any]:
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return GPULoadStoreSpec([0], group_sizes=[1], block_indices=[0]), CPULoadStoreSpec([0])


def test_a_rejected_submission_raises_naming_the_job() -> None:
    worker = CopyEngineOffloadingWorker(FakeCopyWorker(accept=False), FakeRegion())
    gpu, cpu = specs()
    with pytest.raises(RuntimeError, match=r"store job 3 was rejected.*cannot recover"):
        worker.submit_store(3, gpu, cpu)
    with pytest.raises(RuntimeError, match="load job 4 was rejected"):
        worker.submit_load(4, cpu, gpu)


def test_a_failed_copy_raises_with_its_error_and_successes_pass_through() -> None:
    ok = TransferResult(1, True, transfer_bytes=4096, transfer_time=0.001)
    copy = FakeCopyWorker(results=[ok])
    worker = CopyEngineOffloadingWorker(copy, FakeRegion())
    (result,) = worker.get_finished()
    assert result.job_id == 1 and result.success and result.transfer_size == 4096
    copy.results = [TransferResult(2, False, error="CUDA error: illegal address")]
    with pytest.raises(RuntimeError, match="copy job 2 failed: CUDA error: illegal address"):
        worker.get_finished()


@pytest.mark.parametrize("left_running", [0, 2])
def test_shutdown_unmaps_the_region_only_when_no_copy_still_runs(left_running: int) -> None:
    copy = FakeCopyWorker()
    copy.engine.jobs_left_running = left_running
    region = FakeRegion()
    worker = CopyEngineOffloadingWorker(copy, region)
    worker.shutdown()
    worker.shutdown()  # idempotent
    assert region.cleaned is (left_running == 0)
