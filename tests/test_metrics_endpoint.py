"""The live Prometheus endpoint (metrics_port), scraped over HTTP, and the Grafana dashboard.

Every scrape here is a real HTTP GET of a server bound to 127.0.0.1 on a port
the OS chose; values come from a real stack replaying a small workload.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tiering.cli import main  # noqa: E402
from tiering.core.errors import ConfigError  # noqa: E402
from tiering.core.jobs import JobMetadata  # noqa: E402
from tiering.core.keys import make_offload_key  # noqa: E402
from tiering.metrics.secondary import SecondaryTierExport  # noqa: E402
from tiering.metrics.server import (  # noqa: E402
    MetricsServer,
    running_metrics_server,
    serve_metrics,
)
from tiering.replay.replayer import Replayer, ReplayStack, ReplayTotals  # noqa: E402
from tiering.replay.stack import build_stack  # noqa: E402
from tiering.replay.synthetic import SyntheticWorkload  # noqa: E402
from tiering.runtime import AsyncTierManager  # noqa: E402
from tiering.spec import TieringOffloadingSpec  # noqa: E402
from tiers.memory import MemoryTier  # noqa: E402

BLOCK = 4096
LOCAL = "127.0.0.1"
TIER = "memory"  # the secondary tier's label (its type)
DOCS = Path(__file__).resolve().parent.parent / "docs"
DASHBOARD = DOCS / "grafana" / "kv-tiering-dashboard.json"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


def samples_of(text: str, manager: str) -> Samples:
    """Every sample of ``manager``'s series: (name, sorted labels) -> value."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("manager") == manager:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(samples: Samples, name: str, **labels: str) -> float:
    matches = [
        v
        for (n, lbls), v in samples.items()
        if n == name and all(dict(lbls).get(k) == want for k, want in labels.items())
    ]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


def replay_config(**extra: Any) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 48 * BLOCK,
        "secondary_tiers": [{"type": "memory", "capacity_blocks": 4000}],
        "metrics_port": 0,
        "metrics_host": LOCAL,
        **extra,
    }


def tier_samples(text: str, tier: str) -> Samples:
    """Every ``kv_tiering_secondary_*`` sample of the runtime tier called ``tier``."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kv_tiering_secondary_") and sample.labels["tier"] == tier:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


@pytest.fixture
def runtime_tier() -> Iterator[AsyncTierManager]:
    """A secondary tier run by the runtime, as vLLM's manager drives ours: 4 stores, 2 loads."""
    rows = np.zeros((8, BLOCK), dtype=np.uint8)
    runtime = AsyncTierManager(
        MemoryTier(capacity_blocks=64), rows.data, "memory", name="vllm-memory-0"
    )
    export = SecondaryTierExport(runtime)
    try:
        keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
        rows[:4] = np.arange(4, dtype=np.uint8)[:, None]
        runtime.submit_store(JobMetadata(1, tuple(keys), np.arange(4), is_promotion=False))
        runtime.drain(30.0)
        runtime.submit_load(JobMetadata(2, tuple(keys[:2]), np.arange(4, 6), is_promotion=True))
        runtime.drain(30.0)
        assert all(result.success for result in runtime.get_finished())
        yield runtime
    finally:
        export.close()
        runtime.shutdown()


def test_runtime_tiers_driven_by_another_engine_are_served(
    runtime_tier: AsyncTierManager,
) -> None:
    """What vLLM's scheduler process serves: our tiers under vLLM's own manager."""
    server = serve_metrics(0, LOCAL)
    samples = tier_samples(scrape(server.url), "vllm-memory-0")
    assert value(samples, "kv_tiering_secondary_capacity_blocks") == 64
    assert value(samples, "kv_tiering_secondary_blocks") == 4
    assert value(samples, "kv_tiering_secondary_stored_bytes_total") == 4 * BLOCK
    assert value(samples, "kv_tiering_secondary_loaded_bytes_total") == 2 * BLOCK
    assert value(samples, "kv_tiering_secondary_failed_jobs_total") == 0
    assert value(samples, "kv_tiering_secondary_jobs_in_flight") == 0
    for direction in ("store", "load"):
        count = value(samples, "kv_tiering_secondary_job_seconds_count", direction=direction)
        assert count == 1
        inf = value(
            samples, "kv_tiering_secondary_job_seconds_bucket", direction=direction, le="+Inf"
        )
        assert inf == 1
    runtime_tier.shutdown()
    # The stats of a shut-down tier stay readable until its export is closed.
    assert tier_samples(scrape(server.url), "vllm-memory-0")


@pytest.fixture
def replayed() -> Iterator[tuple[ReplayStack, ReplayTotals, list[str]]]:
    """A small replay with metrics_port: 0, scraped mid-run; the stack is still live after."""
    requests = SyntheticWorkload(num_requests=150, seed=5).generate()
    stack = build_stack(replay_config(), block_bytes=BLOCK, block_tokens=512)
    server = running_metrics_server(0)
    assert server is not None and server.host == LOCAL
    mid_run: list[str] = []

    def on_progress(totals: ReplayTotals) -> None:
        if totals.requests_done >= 50 and not mid_run:
            mid_run.append(scrape(server.url))

    try:
        totals = Replayer(stack, gpu_blocks=8).run(requests, on_progress, progress_every=10)
        yield stack, totals, mid_run
    finally:
        stack.shutdown()


def test_a_live_replay_is_scraped_with_every_per_tier_series(
    replayed: tuple[ReplayStack, ReplayTotals, list[str]],
) -> None:
    stack, totals, mid_run = replayed
    manager = stack.manager.metrics_name
    assert mid_run and samples_of(mid_run[0], manager), "nothing served during the run"
    stack.manager.publish_metrics()  # the latest figures, not the ones of up to 1 s ago
    server = running_metrics_server(0)
    assert server is not None
    samples = samples_of(scrape(server.url), manager)
    stats = stack.manager.stats()
    mem = stats.tier(TIER)
    assert value(samples, "kv_tiering_tier_capacity_blocks", tier=TIER) == 4000
    assert value(samples, "kv_tiering_tier_blocks", tier=TIER) == mem.blocks_held > 0
    assert value(samples, "kv_tiering_tier_hits_total", tier=TIER) == mem.hits > 0
    assert value(samples, "kv_tiering_tier_misses_total", tier=TIER) == mem.misses > 0
    assert value(samples, "kv_tiering_tier_moved_bytes_total", tier=TIER) == mem.bytes_moved > 0
    assert value(samples, "kv_tiering_tier_failed_jobs_total", tier=TIER) == 0
    assert value(samples, "kv_tiering_tier_jobs_in_flight", tier=TIER) == mem.jobs_in_flight
    assert value(samples, "kv_tiering_lookups_total") == stats.lookups > 0
    primary = stats.primary.name
    assert value(samples, "kv_tiering_tier_capacity_blocks", tier=primary) == 48
    # The latency histogram: cumulative buckets ending at +Inf == count, and the sum.
    jobs = sum(mem.job_seconds_counts)
    assert jobs > 0 and totals.mismatches == 0
    assert value(samples, "kv_tiering_tier_job_seconds_count", tier=TIER) == jobs
    assert value(samples, "kv_tiering_tier_job_seconds_bucket", tier=TIER, le="+Inf") == jobs
    assert value(samples, "kv_tiering_tier_job_seconds_sum", tier=TIER) == pytest.approx(
        mem.seconds_moved
    )
    buckets = sorted(
        (float(dict(lbls)["le"]), v)
        for (n, lbls), v in samples.items()
        if n == "kv_tiering_tier_job_seconds_bucket" and dict(lbls)["tier"] == TIER
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    # Once the manager shuts down, its series leave the endpoint.
    stack.shutdown()
    assert not samples_of(scrape(server.url), manager)


def test_the_endpoint_is_started_once_per_port_and_a_taken_port_is_a_clear_error() -> None:
    first = serve_metrics(0, LOCAL)
    assert serve_metrics(0, LOCAL) is first  # idempotent: a second spec in the process
    with pytest.raises(ConfigError, match="already served on"):
        serve_metrics(0, "localhost")
    with socket.socket() as taken:
        taken.bind((LOCAL, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics_port {port}: the port is already in use"):
            serve_metrics(port, LOCAL)
    assert running_metrics_server(port) is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"metrics_port": 70000}, "metrics_port must be a port number in 0..65535"),
        ({"metrics_port": "9400"}, "metrics_port must be a port number"),
        ({"metrics_host": LOCAL}, "metrics_host is set but metrics_port is not"),
        ({"metrics_port": 0, "metrics_host": ""}, "metrics_host must be a host name"),
    ],
)
def test_bad_metrics_options_are_refused_at_spec_construction(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TieringOffloadingSpec({"cpu_bytes_to_use": 64 * BLOCK, **extra}, block_bytes=BLOCK)


def test_replay_metrics_port_serves_and_prints_the_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "config.json"  # the config names the host; --metrics-port the port
    config.write_text(json.dumps({"cpu_bytes_to_use": 64 * BLOCK, "metrics_host": LOCAL}))
    argv = ["replay", "--requests", "30", "--no-progress", "--no-secondary"]
    assert main([*argv, "--config", str(config), "--metrics-port", "0"]) == 0
    server = running_metrics_server(0)
    assert isinstance(server, MetricsServer)
    assert f"serving kv_tiering_* metrics at {server.url}" in capsys.readouterr().err
    assert "# HELP kv_tiering_tier_blocks" in scrape(server.url)


def test_replay_refuses_a_bad_metrics_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--metrics-port", "-1"])
    assert "--metrics-port must be a port number" in capsys.readouterr().err


# -- the dashboard ----------------------------------------------------------------------------


def _queries(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: panel targets and template variables."""
    if isinstance(node, dict):
        for key, item in node.items():
            if key in ("expr", "definition") and isinstance(item, str):
                yield item
            else:
                yield from _queries(item)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def test_every_dashboard_query_names_series_the_code_exports(
    replayed: tuple[ReplayStack, ReplayTotals, list[str]], runtime_tier: AsyncTierManager
) -> None:
    stack, _, _ = replayed
    stack.manager.publish_metrics()
    server = running_metrics_server(0)
    assert server is not None
    text = scrape(server.url)
    exported = {name for name, _ in samples_of(text, stack.manager.metrics_name)}
    exported |= {name for name, _ in tier_samples(text, runtime_tier.name)}
    queries = list(_queries(json.loads(DASHBOARD.read_text())))
    assert len(queries) >= 20
    used: set[str] = set()
    for query in queries:
        names = set(re.findall(r"\bkv_tiering_[a-z0-9_]+", query))
        assert names, f"a dashboard query names no kv_tiering_* series: {query}"
        assert names <= exported, f"{sorted(names - exported)} are not exported: {query}"
        used |= names
    # The PromQL examples of docs/metrics.md, too.
    page = (DOCS / "metrics.md").read_text()
    examples = re.findall(r"```promql\n(.*?)```", page, flags=re.DOTALL)
    assert examples
    for query in "".join(examples).splitlines():
        names = set(re.findall(r"\bkv_tiering_[a-z0-9_]+", query))
        assert names and names <= exported, f"docs/metrics.md: {query}"
    # The dashboard shows every per-tier series the issue asks for.
    for wanted in (
        "kv_tiering_tier_capacity_blocks",
        "kv_tiering_tier_blocks",
        "kv_tiering_tier_hits_total",
        "kv_tiering_tier_misses_total",
        "kv_tiering_tier_moved_bytes_total",
        "kv_tiering_tier_job_seconds_bucket",
        "kv_tiering_tier_failed_jobs_total",
        "kv_tiering_tier_jobs_in_flight",
    ):
        assert wanted in used, f"the dashboard does not show {wanted}"
