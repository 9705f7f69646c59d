"""A negative control: our offloading spec, but every block loaded into the engine is zeroed.

Used only by the end-to-end tests, to prove that a request served from offload
really computes with the bytes that came back (its tokens must change). Loaded
by the engine as ``spec_name: "ZeroLoadedBlocksSpec"``, ``spec_module_path:
"tests.vllm_engine.corrupting_spec"``.
"""

from __future__ import annotations

from typing import Any

from tiering.integrations.vllm.spec import KVTieringOffloadingSpec


class _ZeroingWorker:
    """Forwards to the real worker; zeroes a load's engine blocks before reporting it done."""

    def __init__(self, inner: Any, kv_caches: Any) -> None:
        self._inner = inner
        self._tensors = [t.tensor.view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        self._loads: dict[int, list[int]] = {}

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return bool(self._inner.submit_store(job_id, src_spec, dst_spec))

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self._loads[job_id] = [int(b) for b in dst_spec.block_ids]
        return bool(self._inner.submit_load(job_id, src_spec, dst_spec, expedited=expedited))

    def get_finished(self) -> list[Any]:
        results = self._inner.get_finished()
        for result in results:
            for block in self._loads.pop(result.job_id, ()):
                for tensor in self._tensors:
                    tensor[block].zero_()
        return list(results)

    def wait(self, job_ids: Any) -> None:
        self._inner.wait(job_ids)

    def shutdown(self) -> None:
        self._tensors = []
        self._inner.shutdown()


class ZeroLoadedBlocksSpec(KVTieringOffloadingSpec):
    def create_worker(self, kv_caches: Any) -> Any:
        return _ZeroingWorker(super().create_worker(kv_caches), kv_caches)
