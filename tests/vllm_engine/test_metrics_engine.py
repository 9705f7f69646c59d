"""Inside a real vLLM engine, ``metrics_port`` serves our tiers' kv_tiering_* series.

One engine process (``tests.vllm_engine.metrics_run``) with our filesystem tier
under vLLM's manager and ``metrics_port: 0``: the scheduler process serves the
endpoint, and a scrape taken while the engine runs shows the blocks and bytes the
tier stored and loaded for the schedule of ``test_engine_e2e`` (A, four fillers
that push A out of the CPU tier, A again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.vllm_engine.test_engine_e2e import (
    ENGINE_BLOCKS,
    OURS,
    REPO,
    SCHEDULE,
    offload_config,
)
from tests.vllm_engine.tiny_model import build

#: One engine start, six requests and a scrape; generous for a loaded machine.
ENGINE_TIMEOUT_S = 800


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 60)
def test_the_engine_serves_our_tiers_metrics(tmp_path: Path) -> None:
    model = str(build(tmp_path / "model"))
    tier = {
        "type": "KVTieringFileSystemTier",
        "module_path": OURS,
        "root_dir": str(tmp_path / "fs"),
    }
    config = offload_config(model, [tier], metrics_port=0, metrics_host="127.0.0.1")
    spec = {
        "model": model,
        "out": str(tmp_path / "out.json"),
        "kv_transfer_config": config,
        "schedule": SCHEDULE,
        "engine_blocks": ENGINE_BLOCKS,
    }
    (tmp_path / "run.json").write_text(json.dumps(spec))
    log = tmp_path / "engine.log"
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tests.vllm_engine.metrics_run", str(tmp_path / "run.json")],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_TIMEOUT_S,
        )
    if done.returncode != 0:
        pytest.fail(f"engine run failed ({done.returncode}):\n{log.read_text()[-6000:]}")
    result = json.loads((tmp_path / "out.json").read_text())
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(result["scrape"])
        for sample in family.samples
        if sample.name.startswith("kv_tiering_secondary_")
    }

    def value(name: str, **labels: str) -> float:
        found = [
            v
            for (n, lbls), v in samples.items()
            if n == name and labels.items() <= dict(lbls).items()
        ]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples in {result['url']}"
        return found[0]

    assert value("kv_tiering_secondary_blocks") > 0
    assert value("kv_tiering_secondary_capacity_blocks") > 0
    assert value("kv_tiering_secondary_stored_bytes_total") > 0
    assert value("kv_tiering_secondary_loaded_bytes_total") > 0  # A came back from disk
    assert value("kv_tiering_secondary_job_seconds_count", direction="store") > 0
    assert value("kv_tiering_secondary_failed_jobs_total") == 0
    assert result["results"][-1]["num_cached_tokens"] > 0
