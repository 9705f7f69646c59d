"""A real vLLM engine generating tokens with KV offloaded through our spec, copy engine and tiers.

Each scenario is one engine process (``tests.vllm_engine.engine_run``) on a
tiny local Llama, greedy decoding, the same prompt schedule:

    A1 (a long prompt) -> F1..F4 (distinct long prompts that evict A from the
    engine's KV cache and from the CPU tier) -> A2 (A again)

- baseline: no offloading (A2 is recomputed: 0 cached tokens);
- ours-fs: ``KVTieringOffloadingSpec`` (our copy engine on the worker side)
  with ``KVTieringFileSystemTier``: A2 comes back from disk;
- restart: a fresh engine on the same filesystem root runs A alone: its first
  request is served from the blocks the previous engine left;
- redis: ``KVTieringRedisTier`` as the secondary tier;
- negative control: the same spec but every loaded block is zeroed in the
  engine: A2's tokens must change, proving the outputs depend on the loaded bytes.

Pass criteria: greedy tokens identical to the baseline for every request, the
repeated prompt served from offload (cached tokens reported by the engine),
bytes moved in each direction visible in vLLM's metrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.redis_server import RedisServer
from tests.vllm_engine.engine_run import kv_bytes_per_block
from tests.vllm_engine.tiny_model import build

REPO = Path(__file__).resolve().parents[2]
OURS = "tiering.integrations.vllm"
BLOCK_SIZE = 32  # tokens; the CPU backend wants a multiple of 32
ENGINE_BLOCKS = 96  # the engine's KV cache: 3 prompts of 1000 words
CPU_CHUNKS = 48  # the CPU tier: less than A + the fillers, so A leaves it
PROMPT_WORDS = 1000
SCHEDULE = [["A1", 0, PROMPT_WORDS, 16]] + [[f"F{i}", i, PROMPT_WORDS, 16] for i in range(1, 5)]
SCHEDULE.append(["A2", 0, PROMPT_WORDS, 16])
ENGINE_TIMEOUT_S = 300
OUR_TIER_LABEL = "1:"  # vLLM labels secondary tier metrics "<index>:<type>"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def model(workdir: Path) -> str:
    return str(build(workdir / "model"))


def offload_config(model: str, secondary_tiers: list[dict[str, Any]], **extra: Any) -> dict:
    """The ``--kv-transfer-config`` a vLLM user passes (see docs/vllm.md)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVTieringOffloadingSpec",
            "spec_module_path": OURS,
            "cpu_bytes_to_use": kv_bytes_per_block(model, BLOCK_SIZE) * CPU_CHUNKS,
            "block_size": BLOCK_SIZE,
            "secondary_tiers": secondary_tiers,
            **extra,
        },
    }


def run_engine(
    workdir: Path, name: str, model: str, kv_transfer_config: dict | None, schedule: list
) -> dict[str, Any]:
    """One engine process; returns its results (fails with the log's tail if it fails)."""
    spec = {
        "model": model,
        "out": str(workdir / f"{name}.json"),
        "kv_transfer_config": kv_transfer_config,
        "schedule": schedule,
        "block_size": BLOCK_SIZE,
        "engine_blocks": ENGINE_BLOCKS,
    }
    spec_path = workdir / f"{name}.run.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    log = workdir / f"{name}.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm_engine.engine_run", str(spec_path)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_TIMEOUT_S,
        )
    if done.returncode != 0:
        pytest.fail(f"engine run {name} failed ({done.returncode}):\n{log.read_text()[-6000:]}")
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    result["by_name"] = {r["name"]: r for r in result["results"]}
    return result


def metric(run: dict[str, Any], name: str, tier_label: str | None = None) -> float:
    """A counter from the engine's metrics (summed over this tier's series if given)."""
    total = 0.0
    for key, value in run["metrics"].items():
        base, _, labels = key.partition("{")
        if base != name or not isinstance(value, (int, float)):
            continue
        if tier_label is None or f"tier={tier_label}" in labels:
            total += value
    return total


@pytest.fixture(scope="module")
def baseline(workdir: Path, model: str) -> dict[str, Any]:
    return run_engine(workdir, "baseline", model, None, SCHEDULE)


@pytest.fixture(scope="module")
def fs_root(workdir: Path) -> Path:
    return workdir / "fs"


@pytest.fixture(scope="module")
def ours_fs(workdir: Path, model: str, fs_root: Path) -> dict[str, Any]:
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(fs_root)}
    return run_engine(workdir, "ours-fs", model, offload_config(model, [tier]), SCHEDULE)


@pytest.fixture(scope="module")
def redis_for_engines(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def assert_same_tokens(run: dict[str, Any], baseline: dict[str, Any]) -> None:
    for name, expected in baseline["by_name"].items():
        got = run["by_name"][name]
        assert got["token_ids"] == expected["token_ids"], f"request {name} generated other tokens"


def assert_served_from_offload(run: dict[str, Any], baseline: dict[str, Any]) -> None:
    assert baseline["by_name"]["A2"]["num_cached_tokens"] == 0, "the baseline kept A cached"
    cached = run["by_name"]["A2"]["num_cached_tokens"]
    # Every full block of A (the last, partial one is always recomputed).
    assert cached >= (PROMPT_WORDS // BLOCK_SIZE) * BLOCK_SIZE - BLOCK_SIZE, cached


def test_fs_tier_tokens_identical_and_repeated_prompt_from_disk(
    baseline: dict[str, Any], ours_fs: dict[str, Any]
) -> None:
    assert_same_tokens(ours_fs, baseline)
    assert_served_from_offload(ours_fs, baseline)
    # Bytes in each direction, as vLLM's own metrics report them.
    assert metric(ours_fs, "vllm:kv_offload_store_bytes") > 0  # engine -> CPU tier (our copies)
    assert metric(ours_fs, "vllm:kv_offload_load_bytes") > 0  # CPU tier -> engine (our copies)
    written = metric(ours_fs, "vllm:kv_offload_tiering_write_bytes", OUR_TIER_LABEL)
    read = metric(ours_fs, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL)
    assert written > 0 and read > 0  # CPU tier <-> our filesystem tier
    assert metric(ours_fs, "vllm:external_prefix_cache_hits") >= 31 * BLOCK_SIZE


def test_fresh_engine_reuses_the_blocks_after_a_restart(
    workdir: Path, model: str, fs_root: Path, baseline: dict[str, Any], ours_fs: dict[str, Any]
) -> None:
    assert any(fs_root.iterdir()), "the first engine left nothing on disk"
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(fs_root)}
    restart = run_engine(
        workdir, "restart", model, offload_config(model, [tier]), [["A1", 0, PROMPT_WORDS, 16]]
    )
    first = restart["by_name"]["A1"]
    assert first["token_ids"] == baseline["by_name"]["A1"]["token_ids"]
    assert first["num_cached_tokens"] >= (PROMPT_WORDS // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert metric(restart, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0


def test_redis_tier_as_the_secondary_tier(
    workdir: Path, model: str, baseline: dict[str, Any], redis_for_engines: RedisServer
) -> None:
    tier = {
        "type": "KVTieringRedisTier",
        "module_path": OURS,
        "url": redis_for_engines.url,
        "namespace": "e2e",
    }
    run = run_engine(workdir, "redis", model, offload_config(model, [tier]), SCHEDULE)
    assert_same_tokens(run, baseline)
    assert_served_from_offload(run, baseline)
    assert metric(run, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0
    assert redis_for_engines.client().dbsize() > 0


def test_outputs_depend_on_the_loaded_bytes(
    workdir: Path, model: str, baseline: dict[str, Any]
) -> None:
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(workdir / "z")}
    config = offload_config(model, [tier])
    config["kv_connector_extra_config"].update(
        spec_name="ZeroLoadedBlocksSpec", spec_module_path="tests.vllm_engine.corrupting_spec"
    )
    run = run_engine(workdir, "negative-control", model, config, SCHEDULE)
    assert run["by_name"]["A2"]["num_cached_tokens"] > 0  # it was served from offload...
    assert run["by_name"]["A2"]["token_ids"] != baseline["by_name"]["A2"]["token_ids"]  # ...so
    # zeroed KV must change the tokens; and requests that loaded nothing are untouched.
    assert run["by_name"]["A1"]["token_ids"] == baseline["by_name"]["A1"]["token_ids"]
