"""``KVTieringOffloadingSpec``: which copy worker it runs, that tiers never mix row layouts,
and its start-up checks (sizes with units, host memory) under vLLM.

These machines have no GPU, so the GPU platform is answered by patching the
one function the spec asks (``tiering.integrations.vllm.platform.device_kind``)
and vLLM's worker class is replaced by a recorder: what is tested is the
selection, not vLLM's CUDA code.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, ClassVar

import pytest
import vllm
import vllm.v1.kv_offload.tiering.spec as vllm_tiering_spec

import tiering.integrations.vllm.platform as platform_probe
from tests.vllm.conftest import shut_down
from tests.vllm.test_vllm_tiers import ours, tier_of
from tiering.core.errors import ConfigError
from tiering.integrations.vllm.driver import (
    PatternChecker,
    build_manager,
    chained_keys,
    fill_pattern,
    offloading_config,
)
from tiering.integrations.vllm.spec import (
    OUR_ROW_LAYOUT,
    KVTieringOffloadingSpec,
    resolve_copy_engine,
)
from tiering.integrations.vllm.translate import layout_fingerprint, vllm_row_layout

OUR_SPEC = {"spec_name": "KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}


@pytest.mark.parametrize(
    ("requested", "platform", "chosen"),
    [
        ("auto", "cuda", "cuda"),  # ours passed the GPU check on an H100
        ("auto", "rocm", "vllm"),  # ours has never run on ROCm
        ("auto", "xpu", "vllm"),
        ("auto", "cpu", "host"),  # vLLM's worker refuses CPU platforms
        ("cuda", "cuda", "cuda"),
        ("cuda", "rocm", "cuda"),  # asked for by name
        ("vllm", "cuda", "vllm"),
        ("vllm", "xpu", "vllm"),
        ("host", "cpu", "host"),
    ],
)
def test_copy_engine_selection(requested: str, platform: Any, chosen: str) -> None:
    assert resolve_copy_engine(requested, platform=platform) == chosen


@pytest.mark.parametrize(
    ("requested", "platform", "message"),
    [
        ("fast", "cuda", "copy_engine must be one of 'auto', 'vllm', 'cuda', 'host', got 'fast'"),
        (None, "cpu", "copy_engine must be one of"),
        ("cuda", "cpu", "copy_engine 'cuda' needs a CUDA or ROCm GPU, .* is 'cpu'; .* or 'host'"),
        ("cuda", "xpu", "copy_engine 'cuda' needs a CUDA or ROCm GPU, .* is 'xpu'; .* or 'vllm'"),
        ("vllm", "cpu", "copy_engine 'vllm' needs a GPU"),
        ("host", "cuda", "copy_engine 'host' copies CPU KV tensors"),
        ("host", "xpu", "copy_engine 'host' copies CPU KV tensors"),
    ],
)
def test_copy_engine_that_cannot_run_is_refused_naming_it(
    requested: Any, platform: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_copy_engine(requested, platform=platform)


class RecordingVllmWorker:
    """Stands in for vLLM's CPUOffloadingWorker (its CUDA ops cannot run here)."""

    built: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        RecordingVllmWorker.built.append(kwargs)


def spec_for(extra: dict[str, Any], **fields: Any) -> KVTieringOffloadingSpec:
    """Our spec for ``extra`` (``kv_connector_extra_config``) and OffloadingConfig ``fields``."""
    config = offloading_config([], block_bytes=64 * 1024, num_chunks=8, extra_config=extra)
    return KVTieringOffloadingSpec(dataclasses.replace(config, **fields))


def test_auto_on_an_nvidia_gpu_is_our_cuda_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(platform_probe, "device_kind", lambda: "cuda")
    with caplog.at_level("INFO", logger="tiering.integrations.vllm"):
        spec = spec_for(OUR_SPEC)
    assert spec.copy_engine == "cuda" and spec.row_layout == OUR_ROW_LAYOUT
    assert any("passed the GPU check on real hardware" in m for m in caplog.messages)


def test_auto_on_rocm_runs_vllms_worker_and_names_its_layout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(platform_probe, "device_kind", lambda: "rocm")
    monkeypatch.setattr(vllm_tiering_spec, "CPUOffloadingWorker", RecordingVllmWorker)
    RecordingVllmWorker.built.clear()
    with caplog.at_level("INFO", logger="tiering.integrations.vllm"):
        spec = spec_for(OUR_SPEC)
    assert spec.copy_engine == "vllm"
    assert any("never run on ROCm" in m for m in caplog.messages)
    major_minor = ".".join(vllm.__version__.split(".")[:2])
    assert spec.row_layout == f"vllm-{major_minor}-worker/direct"
    worker = spec.get_worker(kv_caches=object())
    assert isinstance(worker, RecordingVllmWorker)
    assert spec.get_worker(kv_caches=object()) is worker  # built once
    (kwargs,) = RecordingVllmWorker.built
    assert kwargs["blocks_per_chunk"] == spec.blocks_per_chunk
    kwargs["mmap_region"].cleanup()


def test_the_nvidia_default_copies_through_vllms_shared_region_on_the_simulated_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``auto`` runs on an NVIDIA GPU, end to end under vLLM: its shared CPU region,
    its spec objects, our CUDA engine (on the simulated device: no GPU here)."""
    import torch
    from vllm.v1.kv_offload import base as vbase
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as VllmCPUSpec

    from tiering.copy.cuda import engine as cuda_engine
    from tiering.copy.cuda.simulated import SimulatedCudaDevice

    monkeypatch.setattr(platform_probe, "device_kind", lambda: "cuda")
    sim = SimulatedCudaDevice(seed=3)
    monkeypatch.setattr(cuda_engine, "default_device", lambda tensors: sim)
    try:
        spec = spec_for(OUR_SPEC)
        assert spec.copy_engine == "cuda"
        page = spec.kv_bytes_per_chunk  # one 64 KiB page per block, one block per chunk
        gpu = sim.to_device(torch.randint(-128, 127, (16, page), dtype=torch.int8))
        kv = vbase.CanonicalKVCaches(
            tensors=[vbase.CanonicalKVCacheTensor(gpu, page)],
            group_data_refs=[[vbase.CanonicalKVCacheRef(0, page)]],
        )
        worker = spec.get_worker(kv)
        assert type(worker.copy_worker.engine).__name__ == "CudaCopyEngine"
        assert worker.copy_worker.engine.pinned  # vLLM's /dev/shm region, registered
        blocks = vbase.GPULoadStoreSpec([3, 5], group_sizes=[2], block_indices=[0])
        assert worker.submit_store(1, blocks, VllmCPUSpec([0, 6]))
        worker.wait({1})
        (stored,) = worker.get_finished()
        assert stored.job_id == 1 and stored.transfer_size == 2 * page
        elsewhere = vbase.GPULoadStoreSpec([10, 11], group_sizes=[2], block_indices=[0])
        assert worker.submit_load(2, VllmCPUSpec([0, 6]), elsewhere)
        worker.wait({2})
        assert [r.job_id for r in worker.get_finished()] == [2]
        sim.drain()
        assert torch.equal(gpu[10], gpu[3]) and torch.equal(gpu[11], gpu[5])
        worker.shutdown()
        assert sim.registered_bytes(0, 1 << 62) == 0  # unpinned at shutdown
    finally:
        sim.close()


def test_copy_engine_vllm_selects_vllms_worker_on_an_nvidia_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform_probe, "device_kind", lambda: "cuda")
    spec = spec_for({**OUR_SPEC, "copy_engine": "vllm"})
    assert spec.copy_engine == "vllm" and spec.row_layout != OUR_ROW_LAYOUT


def test_on_this_cpu_platform_auto_is_our_host_engine() -> None:
    spec = spec_for(OUR_SPEC)
    assert spec.copy_engine == "host" and spec.row_layout == OUR_ROW_LAYOUT
    assert not hasattr(spec, "_worker") or not spec._worker
    with pytest.raises(ValueError, match="copy_engine 'cuda' needs a CUDA or ROCm GPU"):
        spec_for({**OUR_SPEC, "copy_engine": "cuda"})


def test_canonical_layout_is_refused_for_our_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU platform: auto is our host engine, and the only fix is to drop the key
    # (vLLM's worker, which writes canonical rows, needs a GPU).
    refused = r"copy_engine 'auto' \(here: 'host'\) does not write"
    with pytest.raises(ValueError, match=refused) as info:
        spec_for(OUR_SPEC, canonical_layout=True)
    assert "needs a GPU" in str(info.value) and "use copy_engine 'vllm'" not in str(info.value)
    monkeypatch.setattr(platform_probe, "device_kind", lambda: "cuda")
    with pytest.raises(ValueError, match=r"copy_engine 'cuda' .*use copy_engine 'vllm'"):
        spec_for({**OUR_SPEC, "copy_engine": "cuda"}, canonical_layout=True)


def test_the_fingerprint_names_the_row_layout_of_the_worker() -> None:
    ours_spec = spec_for(OUR_SPEC)
    vllms = vllm_tiering_spec.TieringOffloadingSpec(
        offloading_config([], block_bytes=64 * 1024, num_chunks=8)
    )
    assert layout_fingerprint(ours_spec, 65536) != layout_fingerprint(vllms, 65536)
    assert vllm_row_layout(False) != vllm_row_layout(True) != OUR_ROW_LAYOUT


def test_blocks_written_under_one_row_layout_are_misses_under_another(tmp_path: Any) -> None:
    entry = ours("KVTieringFileSystemTier", root_dir=str(tmp_path / "fs"))
    keys = chained_keys("row-layout", 10)

    def manager(extra: dict[str, Any] | None) -> tuple[Any, Any]:
        from tiering.integrations.vllm.driver import SchedulerDriver

        config = offloading_config(
            [entry], block_bytes=64 * 1024, num_chunks=32, extra_config=extra
        )
        built = build_manager(config)
        return built, SchedulerDriver(built)

    # Written by our worker's layout (KVTieringOffloadingSpec, host engine here).
    m, driver = manager(OUR_SPEC)
    driver.store("ours", keys, fill_pattern)
    driver.run_until_idle()
    assert tier_of(m).stats().blocks_held == 10
    shut_down(m, driver)

    # The same root under vLLM's worker layout (vLLM's own spec): misses, no bytes served.
    m, driver = manager(None)
    checker = PatternChecker()
    assert driver.load("vllms-worker", keys, checker) == 0
    assert checker.good == 0 and checker.bad == []
    shut_down(m, driver)


def test_vllms_worker_may_write_canonical_rows_and_the_fingerprint_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform_probe, "device_kind", lambda: "cuda")
    canonical = spec_for(OUR_SPEC, canonical_layout=True)  # auto: vLLM's worker writes them
    assert canonical.copy_engine == "vllm"
    direct = spec_for({**OUR_SPEC, "copy_engine": "vllm"})
    assert canonical.row_layout.endswith("/canonical") and direct.row_layout.endswith("/direct")
    assert layout_fingerprint(canonical, 65536) != layout_fingerprint(direct, 65536)


# -- the spec's start-up checks ---------------------------------------------------------------


@pytest.mark.parametrize("size", [2 * 2**20, "2MiB", "2 MiB", 2097152.0, "2.097152MB"])
def test_every_documented_size_spelling_works_under_vllm(size: object) -> None:
    spec = spec_for({**OUR_SPEC, "cpu_bytes_to_use": size})
    assert spec.num_chunks == 32  # 2 MiB of 64 KiB chunks
    assert spec.extra_config["cpu_bytes_to_use"] == 2 * 2**20


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("lots", "cpu_bytes_to_use: not a size: 'lots'"),
        (True, "cpu_bytes_to_use must be an integer number of bytes"),
        (-4096, "cpu_bytes_to_use must be positive, got -4096"),
        (10**6000, "cpu_bytes_to_use=<an integer of about"),
    ],
    ids=["text", "bool", "negative", "huge"],
)
def test_a_bad_size_is_refused_naming_the_key(size: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        spec_for({**OUR_SPEC, "cpu_bytes_to_use": size})


def test_a_cpu_tier_larger_than_the_host_is_refused_before_the_region_exists() -> None:
    spec = spec_for({**OUR_SPEC, "cpu_bytes_to_use": "64TiB"})
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=64.0 TiB .* is more memory than"):
        spec.get_manager()
    assert set(os.listdir("/dev/shm")) == before


@pytest.mark.parametrize(
    ("cores", "env", "warned"), [(2, None, True), (8, None, False), (2, "1", False)]
)
def test_a_cpu_host_with_no_core_left_for_the_scheduler_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cores: int,
    env: str | None,
    warned: bool,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if env is None:
        monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", env)
    spec = spec_for(OUR_SPEC)
    with caplog.at_level("WARNING", logger="tiering.integrations.vllm"):
        manager = spec.get_manager()
    try:
        found = [m for m in caplog.messages if "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in m]
        assert bool(found) is warned
    finally:
        manager.shutdown()
