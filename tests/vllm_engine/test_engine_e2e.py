"""A real vLLM engine generating tokens with KV offloaded through our spec, copy engine and tiers.

Each scenario is one engine process (``tests.vllm_engine.engine_run``) on a
tiny local Llama, greedy decoding, the same prompt schedule:

    A1 (a long prompt) -> F1..F4 (distinct long prompts that evict A from the
    engine's KV cache and from the CPU tier) -> A2 (A again)

- baseline: no offloading (A2 is recomputed: 0 cached tokens);
- ours-fs: ``KVTieringOffloadingSpec`` (our copy engine on the worker side)
  with ``KVTieringFileSystemTier``: A2 comes back from disk; ``metrics_port``
  set, its kv_tiering_* endpoint scraped while the engine runs;
- restart: a fresh engine on the same filesystem root runs A alone: its first
  request is served from the blocks the previous engine left;
- redis: ``KVTieringRedisTier`` as the secondary tier; then a second engine on
  the same namespace is served the first's prefix, and an engine with another
  model gets no hit;
- admission: ``cascade_admission: "reuse"``: only the prompt asked twice reaches
  the fs tier;
- negative control: the same spec but every loaded block is zeroed in the
  engine: A2's tokens must change, proving the outputs depend on the loaded bytes;
  after its fs tier, a tier of ours throttled to a fifth or less of the offered
  store bandwidth (back-pressure drops and counts its cascades);
- hybrid: a Gemma-3-style model alternating sliding-window and full attention
  (two KV-cache groups of different kinds), block-size factor 1 and 2, with our
  filesystem tier: the same schedule, shorter prompts in a smaller engine;
- MLA: a DeepSeek-V2-style model with multi-head latent attention (one latent
  row per token and layer, no K/V split; vLLM's CPU MLA backend, 16-token engine
  blocks, its prefix cache off) with our filesystem tier: the same schedule,
  shorter prompts and 8 tokens per request.

Each run is its own OS process. The ours-fs and negative-control runs put the
engine core in a process of its own, as ``LLM`` and ``vllm serve`` do by default
(our metrics endpoint served from it, a slow tier shut down by vLLM's process
manager); the others keep it in the run's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the same scheduler, connector, worker and
tiers, started in about a fifth of the time.

Pass criteria: greedy tokens identical to the baseline for every request, the
repeated prompt served from offload (cached tokens reported by the engine),
bytes moved in each direction visible in vLLM's metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.redis_server import RedisServer
from tests.vllm_engine.engine_run import kv_bytes_per_block
from tests.vllm_engine.tiny_model import build, build_hybrid, build_mla

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
def workdir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """The engines' shared directory: removed when every test of the module passed.

    It holds the model and each run's fs roots (1 GiB slabs each), several GiB in all.
    """
    path = tmp_path_factory.mktemp("engine")
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed == failed_before:
        shutil.rmtree(path, ignore_errors=True)


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
    workdir: Path,
    name: str,
    model: str,
    kv_transfer_config: dict | None,
    schedule: list,
    **sizes: Any,
) -> dict[str, Any]:
    """One engine process; returns its results (fails with the log's tail if it fails).

    ``sizes`` override the engine's (``engine_blocks``, ``max_model_len``) or set other
    keys of ``engine_run``'s spec (``scrape_metrics``).
    """
    spec = {
        "model": model,
        "out": str(workdir / f"{name}.json"),
        "kv_transfer_config": kv_transfer_config,
        "schedule": schedule,
        "block_size": BLOCK_SIZE,
        "engine_blocks": ENGINE_BLOCKS,
        **sizes,
    }
    spec_path = workdir / f"{name}.run.json"
    spec_path.write_text(json.dumps(spec))
    sockets = workdir / "ipc"  # vLLM's ZMQ sockets, left behind by each engine: removed with it
    sockets.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "VLLM_RPC_BASE_PATH": str(sockets),
    }
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
    result["log"] = log.read_text()
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
    """Our fs tier under vLLM's manager, serving our metrics (scraped before the engine stops)."""
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(fs_root)}
    config = offload_config(model, [tier], metrics_port=0, metrics_host="127.0.0.1")
    # The deployment shape: the engine core in its own process, our tiers serving
    # metrics from it. The other runs keep the engine core in-process (faster starts).
    return run_engine(
        workdir, "ours-fs", model, config, SCHEDULE, scrape_metrics=True, engine_process=True
    )


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


def test_the_engine_serves_our_tiers_metrics(ours_fs: dict[str, Any]) -> None:
    """``metrics_port`` inside a real engine: the scheduler process serves the kv_tiering_*
    series of the tier vLLM's manager drives, with what it stored and loaded for A."""
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(ours_fs["scrape"])
        for sample in family.samples
        if sample.name.startswith("kv_tiering_secondary_")
    }

    def value(name: str, **labels: str) -> float:
        found = [
            v
            for (n, lbls), v in samples.items()
            if n == name and labels.items() <= dict(lbls).items()
        ]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {ours_fs['url']}"
        return found[0]

    assert value("kv_tiering_secondary_blocks") > 0
    assert value("kv_tiering_secondary_capacity_blocks") > 0
    assert value("kv_tiering_secondary_stored_bytes_total") > 0
    assert value("kv_tiering_secondary_loaded_bytes_total") > 0  # A came back from disk
    assert value("kv_tiering_secondary_job_seconds_count", direction="store") > 0
    assert value("kv_tiering_secondary_failed_jobs_total") == 0


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


@pytest.fixture(scope="module")
def redis_run(workdir: Path, model: str, redis_for_engines: RedisServer) -> dict[str, Any]:
    """The schedule on our Redis tier (a namespace a second engine shares later)."""
    tier = {
        "type": "KVTieringRedisTier",
        "module_path": OURS,
        "url": redis_for_engines.url,
        "namespace": "shared-by-engines",
    }
    return run_engine(workdir, "redis", model, offload_config(model, [tier]), SCHEDULE)


def test_redis_tier_as_the_secondary_tier(
    redis_run: dict[str, Any], baseline: dict[str, Any], redis_for_engines: RedisServer
) -> None:
    assert_same_tokens(redis_run, baseline)
    assert_served_from_offload(redis_run, baseline)
    assert metric(redis_run, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0
    assert redis_for_engines.client().dbsize() > 0


#: The throttled tier writes one block per this many seconds, one at a time: a 31-block
#: prompt takes it 6.2 s, while the engine offers one every second or two.
THROTTLED_WRITE_S = 0.2
#: The negative control's CPU tier: room for the next prompt while the throttled tier's one
#: admitted job pins a whole prompt's chunks (a job is admitted whole when the tier is idle).
NEGATIVE_CONTROL_CPU_CHUNKS = 80


@pytest.fixture(scope="module")
def negative_control(workdir: Path, model: str) -> dict[str, Any]:
    """Every block loaded into the engine zeroed; our fs tier, then a throttled tier of ours."""
    tiers = [
        {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(workdir / "z")},
        {
            "type": "KVTieringTier",
            "module_path": OURS,
            "tier": "tests.vllm.faulty:SlowMemoryTier",
            "medium": "CPU",
            "write_delay_s": THROTTLED_WRITE_S,
            # vLLM gives its engine core a few seconds to stop, then kills it
            "shutdown_timeout_s": 2.0,
        },
    ]
    config = offload_config(model, tiers)
    config["kv_connector_extra_config"].update(
        spec_name="ZeroLoadedBlocksSpec",
        spec_module_path="tests.vllm_engine.corrupting_spec",
        cpu_bytes_to_use=kv_bytes_per_block(model, BLOCK_SIZE) * NEGATIVE_CONTROL_CPU_CHUNKS,
    )
    # The throttled tier's backlog (at most two prompts' jobs: 12.4 s) drains before shutdown.
    return run_engine(
        workdir,
        "negative-control",
        model,
        config,
        SCHEDULE,
        final_pause_s=13.0,
        engine_process=True,  # the slow tier shuts down under vLLM's process manager
    )


def test_outputs_depend_on_the_loaded_bytes(
    negative_control: dict[str, Any], baseline: dict[str, Any]
) -> None:
    run = negative_control
    assert run["by_name"]["A2"]["num_cached_tokens"] > 0  # it was served from offload...
    assert run["by_name"]["A2"]["token_ids"] != baseline["by_name"]["A2"]["token_ids"]  # ...so
    # zeroed KV must change the tokens; and requests that loaded nothing are untouched.
    assert run["by_name"]["A1"]["token_ids"] == baseline["by_name"]["A1"]["token_ids"]


def test_a_throttled_tier_drops_and_counts_instead_of_stalling_the_engine(
    negative_control: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """Back-pressure on by default: a tier that cannot keep up (a fifth or less of the offered
    store bandwidth) gets no new cascade while it is behind; vLLM drops those blocks for it
    and counts them, and every block offered is either stored by it or counted dropped. The
    engine never waited for it: every request that loaded nothing has the baseline's tokens."""
    run = negative_control
    for name in ("A1", "F1", "F2", "F3", "F4"):
        assert run["by_name"][name]["token_ids"] == baseline["by_name"][name]["token_ids"]
    stored = blocks_stored(run, "KVTieringTier")
    dropped = metric(run, "vllm:kv_offload_tiering_backpressure_blocks_dropped", "2:")
    # Both tiers were offered the same blocks (the fast one, if ever behind, counts its own).
    offered = blocks_stored(run, "KVTieringFileSystemTier") + metric(
        run, "vllm:kv_offload_tiering_backpressure_blocks_dropped", "1:"
    )
    assert dropped > 0 and stored > 0, (stored, dropped, offered)
    assert stored + dropped == offered


# -- a hybrid model: sliding-window and full-attention layers, two KV-cache groups ------------

HYBRID_WORDS = 600
HYBRID_SCHEDULE = [["A1", 0, HYBRID_WORDS, 16]] + [
    [f"F{i}", i, HYBRID_WORDS, 16] for i in range(1, 5)
]
HYBRID_SCHEDULE.append(["A2", 0, HYBRID_WORDS, 16])
# One request fills the engine (so A leaves it), and A leaves the CPU tier too.
HYBRID_SIZES = {"engine_blocks": 24, "max_model_len": 704}
HYBRID_CPU_CHUNKS = 24


@pytest.fixture(scope="module")
def hybrid_model(workdir: Path) -> str:
    return str(build_hybrid(workdir / "hybrid-model"))


@pytest.fixture(scope="module")
def hybrid_baseline(workdir: Path, hybrid_model: str) -> dict[str, Any]:
    return run_engine(
        workdir, "hybrid-baseline", hybrid_model, None, HYBRID_SCHEDULE, **HYBRID_SIZES
    )


@pytest.mark.parametrize("factor", [1, 2])
def test_a_hybrid_model_with_two_kv_groups_is_served_from_our_tier(
    workdir: Path, hybrid_model: str, hybrid_baseline: dict[str, Any], factor: int
) -> None:
    root = workdir / f"hybrid-fs-{factor}"
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(root)}
    config = offload_config(hybrid_model, [tier])
    config["kv_connector_extra_config"].update(
        block_size=BLOCK_SIZE * factor,
        cpu_bytes_to_use=kv_bytes_per_block(hybrid_model, BLOCK_SIZE) * HYBRID_CPU_CHUNKS,
    )
    run = run_engine(
        workdir, f"hybrid-{factor}", hybrid_model, config, HYBRID_SCHEDULE, **HYBRID_SIZES
    )
    # Our worker copied both groups' blocks (the worker says how many groups it was given).
    assert f"2 KV-cache group(s), {factor} GPU block(s) per chunk" in run["log"]
    assert_same_tokens(run, hybrid_baseline)
    assert hybrid_baseline["by_name"]["A2"]["num_cached_tokens"] == 0, "the baseline kept A"
    full_blocks = (HYBRID_WORDS // BLOCK_SIZE) * BLOCK_SIZE
    assert run["by_name"]["A2"]["num_cached_tokens"] >= full_blocks - BLOCK_SIZE * factor
    assert metric(run, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0  # from disk
    assert metric(run, "vllm:kv_offload_tiering_chunk_hits", OUR_TIER_LABEL) > 0


# -- two engines, one shared tier ---------------------------------------------------------------


def test_a_second_engine_gets_the_firsts_prefixes_and_another_model_gets_none(
    workdir: Path,
    model: str,
    hybrid_model: str,
    baseline: dict[str, Any],
    hybrid_baseline: dict[str, Any],
    redis_for_engines: RedisServer,
    redis_run: dict[str, Any],
) -> None:
    tier = {
        "type": "KVTieringRedisTier",
        "module_path": OURS,
        "url": redis_for_engines.url,
        "namespace": "shared-by-engines",
    }
    first_a = [["A1", 0, PROMPT_WORDS, 16]]
    assert redis_run["by_name"]["A1"]["num_cached_tokens"] == 0  # the first engine computed A
    second = run_engine(workdir, "redis-second", model, offload_config(model, [tier]), first_a)
    served = second["by_name"]["A1"]
    assert served["token_ids"] == baseline["by_name"]["A1"]["token_ids"]
    assert served["num_cached_tokens"] >= (PROMPT_WORDS // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert metric(second, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0
    # Another model on the same namespace: its layout fingerprint differs, so no hit and no
    # bytes of the first model's (which would change its tokens).
    config = offload_config(hybrid_model, [tier])
    config["kv_connector_extra_config"]["cpu_bytes_to_use"] = (
        kv_bytes_per_block(hybrid_model, BLOCK_SIZE) * HYBRID_CPU_CHUNKS
    )
    other = run_engine(
        workdir,
        "redis-other-model",
        hybrid_model,
        config,
        [["A1", 0, HYBRID_WORDS, 16]],
        **HYBRID_SIZES,
    )
    assert other["by_name"]["A1"]["num_cached_tokens"] == 0
    assert other["by_name"]["A1"]["token_ids"] == hybrid_baseline["by_name"]["A1"]["token_ids"]
    assert metric(other, "vllm:kv_offload_tiering_chunk_hits", OUR_TIER_LABEL) == 0


# -- cascade admission inside the engine ----------------------------------------------------------


def test_reuse_admission_writes_only_reused_prompts_to_the_fs_tier(
    workdir: Path, model: str, baseline: dict[str, Any], ours_fs: dict[str, Any]
) -> None:
    """``cascade_admission: "reuse"``: A is asked twice (its second request reuses it in the
    CPU tier), each filler once; only A reaches the disk, and A3 is served from there."""
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(workdir / "r")}
    config = offload_config(model, [tier], cascade_admission="reuse")
    schedule = [["A1", 0, PROMPT_WORDS, 16], ["A2", 0, PROMPT_WORDS, 16]]
    schedule += [[f"F{i}", i, PROMPT_WORDS, 16] for i in range(1, 5)]
    schedule.append(["A3", 0, PROMPT_WORDS, 16])
    run = run_engine(workdir, "admission", model, config, schedule)
    expected = {"A3": baseline["by_name"]["A2"], **baseline["by_name"]}
    for name, record in run["by_name"].items():
        assert record["token_ids"] == expected[name]["token_ids"], f"{name} changed its tokens"
    full_blocks = (PROMPT_WORDS // BLOCK_SIZE) * BLOCK_SIZE
    assert run["by_name"]["A3"]["num_cached_tokens"] >= full_blocks - BLOCK_SIZE
    assert metric(run, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0  # from disk
    # One prompt of five reached the disk; without admission (ours_fs) all five did. (vLLM's
    # write_bytes counts the blocks offered to a tier, not those it wrote: our tier says.)
    stored, stored_without = blocks_stored(run), blocks_stored(ours_fs)
    assert 0 < stored * 3 < stored_without, (stored, stored_without)
    assert stored <= PROMPT_WORDS // BLOCK_SIZE + 1  # A's blocks, nothing else


def blocks_stored(run: dict[str, Any], tier_type: str = r"\w+") -> int:
    """What our tier (of this type) wrote, from the line it logs when vLLM shuts it down."""
    found = re.findall(rf"kv-tiering tier '{tier_type}' shut down: (\d+) blocks stored", run["log"])
    assert len(found) == 1, f"the engine did not shut our tier {tier_type} down"
    return int(found[0])


# -- an MLA model: one latent row per token and layer, no K/V split -------------------------------

MLA_BLOCK_SIZE = 16  # vLLM's CPU MLA kernel takes no other engine block size (vLLM forces it)
MLA_WORDS = 200
MLA_TOKENS = 8  # build_mla's docstring: its margins over the first 8 tokens are measured
MLA_SCHEDULE = [["A1", 0, MLA_WORDS, MLA_TOKENS]] + [
    [f"F{i}", i, MLA_WORDS, MLA_TOKENS] for i in range(1, 5)
]
MLA_SCHEDULE.append(["A2", 0, MLA_WORDS, MLA_TOKENS])
MLA_MAX_MODEL_LEN = 256
MLA_ENGINE_BLOCKS = MLA_MAX_MODEL_LEN // MLA_BLOCK_SIZE + 1  # one request (+ vLLM's null block)
MLA_CPU_CHUNKS = 12  # two prompts' chunks: A leaves the CPU tier before A2


def mla_kv_bytes_per_block(model: str, block_size: int) -> int:
    """Engine KV bytes of one block of an MLA model: a latent row per token and layer, bf16."""
    config = json.loads((Path(model) / "config.json").read_text())
    row = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    return config["num_hidden_layers"] * row * 2 * block_size


def mla_sizes(model: str) -> dict[str, int]:
    """``run_engine`` sizes for the MLA model (``engine_run`` sizes the KV cache in blocks of
    the K/V layout, from the config's ``num_key_value_heads`` and ``head_dim``)."""
    kv_layout_bytes = kv_bytes_per_block(model, MLA_BLOCK_SIZE)
    engine_bytes = mla_kv_bytes_per_block(model, MLA_BLOCK_SIZE) * MLA_ENGINE_BLOCKS
    return {
        "block_size": MLA_BLOCK_SIZE,
        "engine_blocks": -(-engine_bytes // kv_layout_bytes),
        "max_model_len": MLA_MAX_MODEL_LEN,
    }


@pytest.fixture(scope="module")
def mla_model(workdir: Path) -> str:
    return str(build_mla(workdir / "mla-model"))


@pytest.fixture(scope="module")
def mla_baseline(workdir: Path, mla_model: str) -> dict[str, Any]:
    return run_engine(
        workdir, "mla-baseline", mla_model, None, MLA_SCHEDULE, **mla_sizes(mla_model)
    )


def test_an_mla_model_is_served_from_our_tier(
    workdir: Path, mla_model: str, mla_baseline: dict[str, Any]
) -> None:
    """DeepSeek-V2-style multi-head latent attention: vLLM's KV cache is one [blocks, 16, 576]
    tensor per layer; our worker copies those rows (two engine blocks per 32-token chunk) and
    our filesystem tier stores them."""
    tier = {"type": "KVTieringFileSystemTier", "module_path": OURS, "root_dir": str(workdir / "m")}
    config = offload_config(mla_model, [tier])
    chunk_bytes = mla_kv_bytes_per_block(mla_model, BLOCK_SIZE)
    config["kv_connector_extra_config"]["cpu_bytes_to_use"] = chunk_bytes * MLA_CPU_CHUNKS
    run = run_engine(workdir, "mla", mla_model, config, MLA_SCHEDULE, **mla_sizes(mla_model))
    for engine in (mla_baseline, run):
        assert re.search(r"Using (CPU|AMX)_MLA backend", engine["log"]), "not served as MLA"
    factor = BLOCK_SIZE // MLA_BLOCK_SIZE
    assert f"1 KV-cache group(s), {factor} GPU block(s) per chunk" in run["log"]
    assert f"{chunk_bytes}-byte blocks" in run["log"]  # our tier: latent rows, no K/V halves
    assert_same_tokens(run, mla_baseline)
    assert mla_baseline["by_name"]["A2"]["num_cached_tokens"] == 0, "the baseline kept A"
    full_chunks = (MLA_WORDS // BLOCK_SIZE) * BLOCK_SIZE
    assert run["by_name"]["A2"]["num_cached_tokens"] >= full_chunks - BLOCK_SIZE
    assert metric(run, "vllm:kv_offload_tiering_read_bytes", OUR_TIER_LABEL) > 0  # from disk
    assert metric(run, "vllm:kv_offload_tiering_chunk_hits", OUR_TIER_LABEL) > 0
