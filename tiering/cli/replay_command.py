"""``tiering replay``: the run's config from the file and flags, the replay through the real
stack with a progress bar, and its report, printed and written with the run's exit status."""

from __future__ import annotations

import argparse
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from tiering.cli.arguments import check_writable, parse_tier_spec, policy_setting
from tiering.cli.exits import EXIT_OK, replay_exit_status, signal_name
from tiering.cli.workload import Workload, load_workload
from tiering.replay.console import SignalStop, consoles, logging_to, progress_bar
from tiering.replay.tempdirs import ReplayTempDir

# The name prefixes the command's log lines (the format is "%(name)s: %(message)s").
logger = logging.getLogger("tiering.cli")


def _replay_config(
    args: argparse.Namespace, footprint_blocks: int, temp: ReplayTempDir
) -> dict[str, Any]:
    """The run's ``kv_connector_extra_config``: the file's or the default, then the flags.

    ``temp`` is made only if an fs tier has no ``root_dir`` of its own.
    """
    from tiering.replay.stack import default_extra_config, load_config_file

    if args.config is not None:
        extra = load_config_file(args.config)
    else:
        extra = default_extra_config(
            footprint_blocks=footprint_blocks,
            block_bytes=args.block_bytes,
            fs_root=None,
        )
    if args.cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = args.cpu_bytes
    if args.eviction_policy is not None:
        extra["eviction_policy"] = policy_setting(args.eviction_policy, "--eviction-policy")
    if args.cascade_admission is not None:
        extra["cascade_admission"] = policy_setting(args.cascade_admission, "--cascade-admission")
    if args.metrics_port is not None:
        extra["metrics_port"] = args.metrics_port
    if args.no_secondary:
        extra["secondary_tiers"] = []
    elif args.tier:
        extra["secondary_tiers"] = [parse_tier_spec(spec) for spec in args.tier]
    tiers = extra.get("secondary_tiers")
    if isinstance(tiers, list):
        for position, entry in enumerate(tiers):
            if isinstance(entry, dict) and entry.get("type") == "fs" and not _has_root(entry):
                entry["root_dir"] = str(temp.path / ("fs" if position == 0 else f"fs{position}"))
    return extra


def _has_root(entry: dict[str, Any]) -> bool:
    return "root_dir" in entry or "root_dirs" in entry


@dataclass(frozen=True, slots=True)
class _ReplayRun:
    """What a finished (or stopped) replay leaves behind for its report."""

    totals: Any  # ReplayTotals
    stats: Any  # ManagerStats, taken after shutdown
    extra_config: dict[str, Any]
    footprint_blocks: int
    gpu_blocks: int
    gpu_evictions: int
    gpu_held: int
    secondary_names: list[str]
    runtime_stats: list[Any]
    warm_blocks: set[int]  # the workload's blocks the secondary tiers held at the start
    held_at_start: int  # blocks the secondary tiers held at the start


def _print_metrics_url(extra: dict[str, Any], err: Any) -> None:
    from tiering.metrics.server import running_metrics_server

    port = extra.get("metrics_port")
    server = running_metrics_server(port) if isinstance(port, int) else None
    if server is not None:
        err.print(f"serving kv_tiering_* metrics at {server.url}", highlight=False)


def run_replay(args: argparse.Namespace, signals: SignalStop) -> int:
    from tiering.replay.tempdirs import remove_stale

    if args.output is not None:
        check_writable(args.output, "--output")
    out, err = consoles()
    with logging_to(err, args.verbose):
        remove_stale()
        workload = load_workload(args)
        run = _replay_workload(args, workload, err, signals)
    with signals.clean_stop(threading.Event()):  # a first signal now: the report still prints
        report = _replay_report(args, workload, run)
    status = replay_exit_status(report, args.max_tier_failures, signals.signum)
    report["ok"] = status == EXIT_OK
    report["exit_status"] = status
    if signals.signum is not None:
        report["stopped_by"] = signal_name(signals.signum)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    try:
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            from tiering.replay.report import render_report

            render_report(report, out)
    except BrokenPipeError as exc:  # piped into `head`: the run's status still stands
        exc.exit_status = status  # type: ignore[attr-defined]
        raise
    return status


def _replay_workload(
    args: argparse.Namespace, workload: Workload, err: Any, signals: SignalStop
) -> _ReplayRun:
    """Build the stack, replay the workload with a progress bar, shut the stack down."""
    from tiering.replay.replayer import Replayer, ReplayTotals
    from tiering.replay.stack import build_stack, default_gpu_blocks
    from tiering.replay.trace import trace_footprint
    from tiering.replay.warm import blocks_held_at_start, cached_at_start

    footprint = trace_footprint(workload.requests)
    gpu_blocks = args.gpu_blocks if args.gpu_blocks is not None else default_gpu_blocks(footprint)
    total = len(workload.requests)
    stop = threading.Event()
    with ReplayTempDir() as temp, signals.clean_stop(stop):
        extra = _replay_config(args, footprint, temp)
        stack = build_stack(extra, block_bytes=args.block_bytes, block_tokens=args.block_tokens)
        _print_metrics_url(extra, err)
        try:
            held_at_start = blocks_held_at_start(stack)
            warm = (
                cached_at_start(stack, {h for r in workload.requests for h in r.hash_ids})
                if held_at_start
                else set()
            )
            if held_at_start:
                logger.info(
                    "the cache starts warm: the secondary tiers hold %d blocks, %d of them "
                    "this workload's",
                    held_at_start,
                    len(warm),
                )
            replayer = Replayer(
                stack,
                gpu_blocks=gpu_blocks,
                block_tokens=args.block_tokens,
                promotion_timeout_s=args.promotion_timeout,
                should_stop=stop.is_set,
                store_chunk_blocks=args.chunk_blocks,
                store_wait_s=args.store_wait,
            )
            # Tests wait for this line before signalling: every handler is in place by now.
            logger.info(
                "replaying %d requests of %s (Ctrl-C, SIGTERM or SIGHUP stop with a partial "
                "report)",
                total,
                workload.name,
            )
            with progress_bar(err, args.no_progress) as progress:
                task = progress.add_task("replay", total=total, status="")

                def on_progress(totals: ReplayTotals) -> None:
                    hit = sum(t.tokens for t in totals.hits.values())
                    rate = hit / totals.total_tokens if totals.total_tokens else 0.0
                    status = f"hit rate {rate:6.1%}"
                    if totals.draining:
                        status += ", waiting for tier jobs in flight"
                    progress.update(task, completed=totals.requests_done, status=status)

                totals = replayer.run(
                    workload.requests, on_progress, progress_every=max(1, total // 400)
                )
        finally:
            stack.shutdown()
    return _ReplayRun(
        totals=totals,
        stats=stack.stats(),
        extra_config=extra,
        footprint_blocks=footprint,
        gpu_blocks=gpu_blocks,
        gpu_evictions=replayer.gpu.evictions,
        gpu_held=len(replayer.gpu),
        secondary_names=[name for name, _ in stack.secondary],
        runtime_stats=[_runtime_stats(tier) for _, tier in stack.secondary],
        warm_blocks=warm,
        held_at_start=held_at_start,
    )


def _replay_report(args: argparse.Namespace, workload: Workload, run: _ReplayRun) -> dict[str, Any]:
    from tiering.replay.offline import unlimited_hit_rate
    from tiering.replay.report import build_report
    from tiering.replay.stack import IGNORED_FOR_REPLAY, configured_capacity, tier_summary
    from tiering.replay.warm import unlimited_hit_rate_from
    from tiering.support.units import config_bytes

    extra = run.extra_config
    tiers = extra.get("secondary_tiers") or []
    setup = {
        "block_bytes": args.block_bytes,
        "gpu_blocks": run.gpu_blocks,
        # As the spec read it: the config may spell it with a unit ("16MiB").
        "cpu_bytes_to_use": config_bytes("cpu_bytes_to_use", extra["cpu_bytes_to_use"]),
        "cpu_blocks": run.stats.primary.capacity_blocks,
        "eviction_policy": extra.get("eviction_policy", "lru"),
        "cascade_admission": extra.get("cascade_admission", "all"),
        "secondary_tiers": _jsonable(tiers),
        "secondary_summary": [tier_summary(t) for t in tiers],
        "promotion_timeout_s": args.promotion_timeout,
        "store_chunk_blocks": args.chunk_blocks,
        "store_wait_s": args.store_wait,
        "ignored_config_keys": [key for key in IGNORED_FOR_REPLAY if key in extra],
    }
    replayed = workload.requests[: run.totals.requests_done]
    cold = unlimited_hit_rate(replayed, args.block_tokens)
    setup["warm_start"] = {
        "blocks_held": run.held_at_start,
        "workload_blocks_held": len(run.warm_blocks),
        # A cache that starts warm is compared with an unlimited one starting the same.
        "unlimited_from_cold": cold.token_hit_rate,
    }
    report = build_report(
        totals=run.totals,
        stats=run.stats,
        unlimited=unlimited_hit_rate_from(replayed, run.warm_blocks, args.block_tokens)
        if run.warm_blocks
        else cold,
        trace_name=workload.name,
        footprint_blocks=run.footprint_blocks,
        block_tokens=args.block_tokens,
        block_bytes=args.block_bytes,
        gpu_blocks=run.gpu_blocks,
        gpu_evictions=run.gpu_evictions,
        gpu_held=run.gpu_held,
        setup=setup,
        secondary_names=run.secondary_names,
        runtime_stats=run.runtime_stats,
        configured_capacities=[configured_capacity(t, args.block_bytes) for t in tiers],
    )
    return report


def _runtime_stats(tier: object) -> Any:
    """The async facade's own snapshot of a secondary tier (None for other tier managers)."""
    from tiering.runtime import AsyncTierManager

    return tier.stats() if isinstance(tier, AsyncTierManager) else None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))
