"""The ``tiering`` command: ``replay`` a KV-cache workload through the real stack,
``sweep`` hit rate against capacity, ``generate`` the built-in workload as a trace.

Exit status: 0 success; 1 a loaded block did not hold the bytes stored; 2 bad input
(trace, config, tier, output path); 130 interrupted (the partial report is still printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.errors import ConfigError
from tiering.replay.console import consoles, logging_to, progress_bar, stop_on_sigint
from tiering.replay.units import parse_size

logger = logging.getLogger("tiering.cli")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

DEFAULT_BLOCK_BYTES = 32 * 1024


class UsageError(Exception):
    """Bad command-line input; the message says which argument and why."""


def _size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_tier_spec(text: str) -> dict[str, Any]:
    """One ``secondary_tiers`` entry from ``--tier``.

    Either a JSON object (``'{"type": "memory", "capacity_bytes": 1048576}'``) or
    ``TYPE[:KEY=VALUE,...]`` (``fs:root_dir=/mnt/kv,capacity_bytes=8GiB``), where
    each value is read as JSON when it parses (numbers, true/false) and as a string
    otherwise.
    """
    text = text.strip()
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--tier {text!r}: invalid JSON ({exc.msg})") from None
        if not isinstance(entry, dict):
            raise UsageError(f"--tier {text!r}: expected a JSON object")
        return entry
    tier_type, _, rest = text.partition(":")
    if not tier_type:
        raise UsageError(f"--tier {text!r}: expected TYPE[:KEY=VALUE,...] or a JSON object")
    entry = {"type": tier_type}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--tier {text!r}: {item!r} is not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        entry[key.strip()] = value
    return entry


def check_writable(path: Path, what: str) -> None:
    """Fail now, before any work, if ``path`` cannot be written later."""
    if path.is_dir():
        raise UsageError(f"{what} {path} is a directory; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: directory {parent} does not exist")
    try:
        if path.exists():
            with path.open("r+b"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".tiering-probe-"):
                pass
    except OSError as exc:
        raise UsageError(f"{what} {path} is not writable ({exc.strerror})") from None


# -- the parser ------------------------------------------------------------------------------


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    # Also accepted after the subcommand, where users tend to put it.
    parser.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help="more log output"
    )
    parser.add_argument(
        "trace",
        nargs="?",
        type=Path,
        help="Mooncake JSONL trace (timestamp, input_length, output_length, hash_ids); "
        "optionally .gz. Default: the built-in synthetic workload.",
    )
    parser.add_argument(
        "--requests",
        type=_positive_int,
        metavar="N",
        help="synthetic workload size (default 2000), or replay only a trace's first N requests",
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    parser.add_argument(
        "--system-prompts",
        type=_positive_int,
        metavar="N",
        help="synthetic workload: number of shared system prompts (default 8)",
    )
    parser.add_argument(
        "--mean-turns",
        type=_positive_float,
        metavar="T",
        help="synthetic workload: mean turns per conversation (default 5)",
    )
    parser.add_argument(
        "--block-tokens",
        type=_positive_int,
        default=512,
        metavar="N",
        help="tokens per trace block (default 512, as in the Mooncake traces)",
    )
    parser.add_argument(
        "--chunk-blocks",
        type=_positive_int,
        default=16,
        metavar="N",
        help="blocks offloaded per store call, one prefill chunk (default 16 = 8192 tokens)",
    )
    parser.add_argument(
        "--block-bytes",
        type=_size_arg,
        default=DEFAULT_BLOCK_BYTES,
        metavar="SIZE",
        help="bytes of KV data per block (default 32KiB; a real model's 512-token block is MBs)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiering",
        description="KV-cache tiering: replay workloads through the real stack, size tiers.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay = commands.add_parser(
        "replay",
        help="replay a trace (or the built-in workload) through the real tiering stack",
        description="Replay a KV-cache workload through a simulated GPU prefix cache, the CPU "
        "primary tier and the configured secondary tiers, verifying every loaded byte.",
    )
    _add_workload_args(replay)
    replay.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="JSON or YAML kv_connector_extra_config (cpu_bytes_to_use, eviction_policy, "
        "secondary_tiers, ...). Default: CPU 8%% of the workload's distinct blocks plus a "
        "filesystem tier of 30%% in a temporary directory.",
    )
    replay.add_argument(
        "--cpu-bytes",
        type=_size_arg,
        metavar="SIZE",
        help="cpu_bytes_to_use (overrides the config)",
    )
    replay.add_argument(
        "--eviction-policy",
        metavar="NAME",
        help="primary tier eviction policy: lru or arc (overrides the config)",
    )
    replay.add_argument(
        "--tier",
        action="append",
        metavar="SPEC",
        default=None,
        help="a secondary tier, TYPE[:KEY=VALUE,...] or a JSON object; repeat for more tiers "
        "(replaces the config's secondary_tiers). An fs tier without root_dir gets a "
        "temporary directory.",
    )
    replay.add_argument(
        "--no-secondary", action="store_true", help="no secondary tiers: the CPU primary tier only"
    )
    replay.add_argument(
        "--gpu-blocks",
        type=_non_negative_int,
        metavar="N",
        help="simulated GPU prefix cache size in blocks (0 disables it; default 2%% of the "
        "workload's distinct blocks)",
    )
    replay.add_argument(
        "--promotion-timeout",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds a request waits for promotions before loading what has landed",
    )
    replay.add_argument(
        "--store-wait",
        type=_non_negative_float,
        default=5.0,
        metavar="S",
        help="seconds a store refused for lack of room (every CPU block pinned by in-flight "
        "cascades) waits for them before its blocks are dropped (default 5; 0 drops at once, "
        "as an overloaded engine would)",
    )
    replay.add_argument(
        "--metrics-port",
        type=_metrics_port_arg,
        metavar="PORT",
        help="serve the kv_tiering_* Prometheus metrics on PORT during the run (0: any free "
        "port; the URL is printed); overrides the config's metrics_port",
    )
    replay.add_argument("--json", action="store_true", help="print the report as JSON")
    replay.add_argument(
        "--output", type=Path, metavar="FILE", help="also write the JSON report to FILE"
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")

    sweep = commands.add_parser(
        "sweep",
        help="hit rate against capacity for each eviction policy and Belady's optimum",
        description="Simulate a single offload cache at several capacities under each eviction "
        "policy and Belady's offline optimum; write a PNG plot, CSV and JSON.",
    )
    _add_workload_args(sweep)
    sweep.add_argument(
        "--capacities",
        metavar="LIST",
        help="comma-separated capacities: block counts, or sizes with a unit (8GiB) divided "
        "by --block-bytes. Default: 1%%..100%% of the workload's distinct blocks.",
    )
    sweep.add_argument(
        "--policies",
        default=None,
        metavar="LIST",
        help="comma-separated eviction policies (default: all: lru,arc)",
    )
    sweep.add_argument(
        "--out",
        type=Path,
        default=Path("tiering-sweep"),
        metavar="PREFIX",
        help="write PREFIX.png, PREFIX.csv and PREFIX.json (default ./tiering-sweep)",
    )
    sweep.add_argument("--json", action="store_true", help="print the results as JSON")
    sweep.add_argument("--no-progress", action="store_true", help="no progress bar")

    generate = commands.add_parser(
        "generate",
        help="write the built-in synthetic workload as a Mooncake JSONL trace",
    )
    generate.add_argument("output", type=Path, help="trace file to write ('-' for stdout)")
    generate.add_argument("--requests", type=_positive_int, metavar="N")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--system-prompts", type=_positive_int, metavar="N")
    generate.add_argument("--mean-turns", type=_positive_float, metavar="T")
    generate.add_argument("--block-tokens", type=_positive_int, default=512, metavar="N")
    return parser


# -- shared plumbing --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[Any]  # list[Request]; Any keeps the import lazy


def _synthetic(args: argparse.Namespace) -> Any:
    from tiering.replay.synthetic import SyntheticWorkload

    options: dict[str, Any] = {"seed": args.seed, "block_tokens": args.block_tokens}
    if args.requests is not None:
        options["num_requests"] = args.requests
    if args.system_prompts is not None:
        options["num_system_prompts"] = args.system_prompts
    if args.mean_turns is not None:
        options["mean_turns"] = args.mean_turns
    return SyntheticWorkload(**options)


def load_workload(args: argparse.Namespace) -> Workload:
    """The requests to replay: the trace file's, or the synthetic workload's."""
    from tiering.replay.trace import read_trace

    if args.trace is None:
        workload = _synthetic(args)
        return Workload(
            f"synthetic(seed={workload.seed}, requests={workload.num_requests})",
            workload.generate(),
        )
    if args.trace.is_dir():
        raise UsageError(f"trace {args.trace}: is a directory, not a trace file")
    if not args.trace.is_file():
        raise UsageError(f"trace {args.trace}: no such file")
    try:
        requests = read_trace(args.trace, args.block_tokens)
    except OSError as exc:  # unreadable (permissions, I/O error): not a traceback
        raise UsageError(f"trace {args.trace}: cannot read it ({exc.strerror or exc})") from None
    if args.requests is not None:
        requests = requests[: args.requests]
    return Workload(args.trace.name, requests)


# -- replay -------------------------------------------------------------------------------------


def _replay_config(
    args: argparse.Namespace, footprint_blocks: int, temp_root: Path
) -> dict[str, Any]:
    from tiering.replay.stack import default_extra_config, load_config_file

    if args.config is not None:
        extra = load_config_file(args.config)
    else:
        extra = default_extra_config(
            footprint_blocks=footprint_blocks,
            block_bytes=args.block_bytes,
            fs_root=temp_root / "fs",
        )
    if args.cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = args.cpu_bytes
    if args.eviction_policy is not None:
        extra["eviction_policy"] = args.eviction_policy
    if args.metrics_port is not None:
        extra["metrics_port"] = args.metrics_port
    if args.no_secondary:
        extra["secondary_tiers"] = []
    elif args.tier:
        extra["secondary_tiers"] = [parse_tier_spec(spec) for spec in args.tier]
    tiers = extra.get("secondary_tiers")
    if isinstance(tiers, list):
        for position, entry in enumerate(tiers):
            if isinstance(entry, dict) and entry.get("type") == "fs" and "root_dir" not in entry:
                entry["root_dir"] = str(temp_root / f"fs{position}")
    return extra


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


def _metrics_port_arg(text: str) -> int:
    from tiering.errors import ConfigError
    from tiering.metrics_server import check_metrics_port

    try:
        return check_metrics_port(int(text), "--metrics-port")
    except (ValueError, ConfigError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _print_metrics_url(extra: dict[str, Any], err: Any) -> None:
    from tiering.metrics_server import running_metrics_server

    port = extra.get("metrics_port")
    server = running_metrics_server(port) if isinstance(port, int) else None
    if server is not None:
        err.print(f"serving kv_tiering_* metrics at {server.url}", highlight=False)


def run_replay(args: argparse.Namespace) -> int:
    if args.output is not None:
        check_writable(args.output, "--output")
    out, err = consoles()
    with logging_to(err, args.verbose):
        workload = load_workload(args)
        run = _replay_workload(args, workload, err)
    report = _replay_report(args, workload, run)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from tiering.replay.report import render_report

        render_report(report, out)
    if run.totals.mismatches:
        return EXIT_FAILED
    if run.totals.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK


def _replay_workload(args: argparse.Namespace, workload: Workload, err: Any) -> _ReplayRun:
    """Build the stack, replay the workload with a progress bar, shut the stack down."""
    from tiering.replay.replayer import Replayer, ReplayTotals
    from tiering.replay.stack import build_stack, default_gpu_blocks
    from tiering.replay.trace import trace_footprint

    footprint = trace_footprint(workload.requests)
    gpu_blocks = args.gpu_blocks if args.gpu_blocks is not None else default_gpu_blocks(footprint)
    total = len(workload.requests)
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="tiering-replay-") as temp, stop_on_sigint(stop):
        extra = _replay_config(args, footprint, Path(temp))
        stack = build_stack(extra, block_bytes=args.block_bytes, block_tokens=args.block_tokens)
        _print_metrics_url(extra, err)
        try:
            replayer = Replayer(
                stack,
                gpu_blocks=gpu_blocks,
                block_tokens=args.block_tokens,
                promotion_timeout_s=args.promotion_timeout,
                should_stop=stop.is_set,
                store_chunk_blocks=args.chunk_blocks,
                store_wait_s=args.store_wait,
            )
            logger.info(
                "replaying %d requests of %s (Ctrl-C stops with a partial report)",
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
    )


def _replay_report(args: argparse.Namespace, workload: Workload, run: _ReplayRun) -> dict[str, Any]:
    from tiering.replay.offline import unlimited_hit_rate
    from tiering.replay.report import build_report
    from tiering.replay.stack import IGNORED_FOR_REPLAY, configured_capacity, tier_summary

    extra = run.extra_config
    tiers = extra.get("secondary_tiers") or []
    setup = {
        "block_bytes": args.block_bytes,
        "gpu_blocks": run.gpu_blocks,
        "cpu_bytes_to_use": extra.get("cpu_bytes_to_use"),
        "cpu_blocks": run.stats.primary.capacity_blocks,
        "eviction_policy": extra.get("eviction_policy", "lru"),
        "secondary_tiers": _jsonable(tiers),
        "secondary_summary": [tier_summary(t) for t in tiers],
        "promotion_timeout_s": args.promotion_timeout,
        "store_chunk_blocks": args.chunk_blocks,
        "store_wait_s": args.store_wait,
        "ignored_config_keys": [key for key in IGNORED_FOR_REPLAY if key in extra],
    }
    replayed = workload.requests[: run.totals.requests_done]
    return build_report(
        totals=run.totals,
        stats=run.stats,
        unlimited=unlimited_hit_rate(replayed, args.block_tokens),
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


def _runtime_stats(tier: object) -> Any:
    """The async facade's own snapshot of a secondary tier (None for other tier managers)."""
    from tiering.runtime import AsyncTierManager

    return tier.stats() if isinstance(tier, AsyncTierManager) else None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# -- sweep --------------------------------------------------------------------------------------


def _parse_capacities(text: str, block_bytes: int) -> list[int]:
    capacities = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            blocks = int(item) if item.isdigit() else parse_size(item) // block_bytes
        except ValueError as exc:
            raise UsageError(f"--capacities: {exc}") from None
        if blocks <= 0:
            raise UsageError(f"--capacities: {item!r} is less than one block ({block_bytes} bytes)")
        capacities.append(blocks)
    if not capacities:
        raise UsageError("--capacities: give at least one capacity")
    return capacities


def run_sweep_command(args: argparse.Namespace) -> int:
    from tiering.policies import POLICY_NAMES
    from tiering.replay import sweep as sweeping
    from tiering.replay.trace import trace_footprint

    policies = list(POLICY_NAMES)
    if args.policies:
        policies = [p.strip().lower() for p in args.policies.split(",") if p.strip()]
        unknown = [p for p in policies if p not in POLICY_NAMES]
        if unknown or not policies:
            raise UsageError(
                f"--policies: unknown eviction policy {unknown[0] if unknown else ''!r}; "
                f"known: {', '.join(POLICY_NAMES)}"
            )
    outputs = {ext: Path(f"{args.out}.{ext}") for ext in ("png", "csv", "json")}
    for path in outputs.values():
        check_writable(path, "--out")
    try:  # the plot is written last: find out now, not after the whole sweep
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "tiering sweep writes a PNG plot with matplotlib, which is not installed: "
            "pip install 'kv-tiering[plot]'"
        ) from None
    out, err = consoles()
    with logging_to(err, args.verbose):
        workload = load_workload(args)
    footprint = trace_footprint(workload.requests)
    capacities = (
        _parse_capacities(args.capacities, args.block_bytes)
        if args.capacities
        else sweeping.default_capacities(footprint)
    )
    stop = threading.Event()
    steps = len(set(capacities)) * (len(policies) + 1)
    with progress_bar(err, args.no_progress) as progress, stop_on_sigint(stop):
        task = progress.add_task("sweep", total=steps, status="")

        def on_step(name: str, capacity: int) -> None:
            progress.update(task, advance=1, status=f"{name} @ {capacity:,} blocks")

        result = sweeping.run_sweep(
            workload.requests,
            capacities,
            policies=policies,
            block_tokens=args.block_tokens,
            block_bytes=args.block_bytes,
            store_chunk_blocks=args.chunk_blocks,
            trace_name=workload.name,
            on_step=on_step,
            should_stop=stop.is_set,
        )
    if result.points:
        sweeping.write_csv(result, outputs["csv"])
        sweeping.write_json(result, outputs["json"])
        sweeping.plot_png(result, outputs["png"])
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        sweeping.render_table(result, out)
        if result.points:
            out.print("Wrote " + ", ".join(str(p) for p in outputs.values()))
        else:
            out.print("Interrupted before the first capacity finished: nothing written.")
    return EXIT_INTERRUPTED if stop.is_set() else EXIT_OK


# -- generate -----------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    from tiering.replay.trace import write_trace

    if str(args.output) != "-":
        check_writable(args.output, "output")
    requests = _synthetic(args).generate()
    if str(args.output) == "-":
        write_trace(requests, sys.stdout)
    else:
        with args.output.open("w", encoding="utf-8") as out:
            write_trace(requests, out)
        print(f"wrote {len(requests)} requests to {args.output}", file=sys.stderr)
    return EXIT_OK


# -- entry point --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tiering`` command; returns the exit status."""
    from tiering.replay.trace import TraceError

    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"replay": run_replay, "sweep": run_sweep_command, "generate": run_generate}
    try:
        return commands[args.command](args)
    except (UsageError, ConfigError, TraceError) as exc:
        print(f"tiering {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"tiering {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Output piped into e.g. `head`: not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
