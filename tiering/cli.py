"""The ``tiering`` command: ``replay`` a KV-cache workload through the real stack,
``sweep`` hit rate against capacity, ``generate`` the built-in workload as a trace.

Exit statuses (:data:`EXIT_STATUS_HELP`; ``replay --json`` says ``"ok": true`` exactly
when the status is 0): 0 success; 1 a loaded block did not hold the bytes stored; 2 bad
input or a tier that cannot start; 3 more tier failures than ``--max-tier-failures``;
4 an internal error (a bug); 128 + the signal's number when stopped by SIGINT (130),
SIGTERM (143) or SIGHUP (129), after the partial report.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import tempfile
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.errors import ConfigError, TieringError
from tiering.replay.console import Interrupted, SignalStop, consoles, logging_to, progress_bar
from tiering.replay.tempdirs import ReplayTempDir
from tiering.units import parse_size

logger = logging.getLogger("tiering.cli")

EXIT_OK = 0
EXIT_WRONG_BYTES = 1
EXIT_FAILED = EXIT_WRONG_BYTES  # the name before tier failures had their own status
EXIT_BAD_INPUT = 2
EXIT_TIER_FAILURES = 3
EXIT_INTERNAL_ERROR = 4
EXIT_INTERRUPTED = 130  # SIGINT; SIGTERM gives 143 and SIGHUP 129 (128 + the signal)

EXIT_STATUS_HELP = """\
exit status:
  0    every loaded block held the bytes stored, and no more tier failures than
       --max-tier-failures
  1    a loaded block did not hold the bytes stored (wrong bytes served)
  2    bad input: arguments, trace, config, a tier that cannot start
  3    more tier failures than --max-tier-failures (default 0): failed tier jobs
       (not counting routine misses: blocks a bounded or shared tier dropped
       between the lookup and the read), tier timeouts and corrupt reads
  4    internal error (a bug; the traceback is printed)
  130  stopped by SIGINT (Ctrl-C), 143 by SIGTERM, 129 by SIGHUP: the partial
       report is printed, the run's temporary directory removed
Wrong bytes (1) outrank a signal, which outranks tier failures (3).
--json's "ok" is true exactly when the status is 0."""

#: Longest error line printed (a message can quote a hostile value).
MAX_ERROR_CHARS = 1000

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
            raise UsageError(f"--tier {text[:80]!r}: invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise UsageError(f"--tier {text[:40]!r}...: JSON nested too deeply") from None
        if not isinstance(entry, dict):
            raise UsageError(f"--tier {text!r}: expected a JSON object")
        return entry
    tier_type, _, rest = text.partition(":")
    head, _, tail = rest.partition(":")
    if head and "=" not in head and all(part.isidentifier() for part in head.split(".")):
        # A "package.module:Class" type, optionally followed by ":KEY=VALUE,...".
        tier_type, rest = f"{tier_type}:{head}", tail
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
    from tiering import __version__

    parser = argparse.ArgumentParser(
        prog="tiering",
        description="KV-cache tiering: replay workloads through the real stack, size tiers.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more log output (-v: INFO and tracebacks of errors, -vv: DEBUG)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    replay = commands.add_parser(
        "replay",
        help="replay a trace (or the built-in workload) through the real tiering stack",
        description="Replay a KV-cache workload through a simulated GPU prefix cache, the CPU "
        "primary tier and the configured secondary tiers, verifying every loaded byte.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        help="primary tier eviction policy (overrides the config): lru, arc, kvaware, "
        "pkg.mod:Class or an entry point, with options as NAME(key=value,...)",
    )
    replay.add_argument(
        "--cascade-admission",
        metavar="NAME",
        help="which stored blocks are cascaded to the secondary tiers (overrides the config): "
        "all (default) or reuse (only blocks that showed reuse), or pkg.mod:Class",
    )
    replay.add_argument(
        "--tier",
        action="append",
        metavar="SPEC",
        default=None,
        help="a secondary tier, TYPE[:KEY=VALUE,...] (TYPE may be module:Class, imported from "
        "the working directory too) or a JSON object; repeat for more tiers (replaces the "
        "config's secondary_tiers). An fs tier without root_dir gets a temporary directory.",
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
        help="seconds a request waits for promotions before loading what has landed (default 10)",
    )
    replay.add_argument(
        "--max-tier-failures",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="tier failures (failed tier jobs, not counting blocks a bounded or shared tier "
        "dropped between lookup and read; tier timeouts; corrupt reads) a run may have and "
        "still exit 0; more exit with status 3 (default 0)",
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
        help="comma-separated eviction policies: built-in names, pkg.mod:Class paths or entry "
        "points, with options as NAME(key=value,...) (default: every built-in policy)",
    )
    sweep.add_argument(
        "--admission",
        default=None,
        metavar="LIST",
        help="also compare cascade admission policies (e.g. all,reuse): each --policies "
        "primary over an LRU secondary tier, reporting hit rate and bytes written below",
    )
    sweep.add_argument(
        "--secondary-factor",
        type=_positive_float,
        default=4.0,
        metavar="F",
        help="with --admission: the secondary tier's capacity as a multiple of the primary's "
        "(default 4)",
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
        description="Write the built-in synthetic chat workload (the one replay and sweep use "
        "without a trace) as a Mooncake JSONL trace, one request per line.",
    )
    generate.add_argument("output", type=Path, help="trace file to write ('-' for stdout)")
    generate.add_argument(
        "--requests", type=_positive_int, metavar="N", help="number of requests (default 2000)"
    )
    generate.add_argument(
        "--seed", type=int, default=0, help="seed: the same seed writes the same trace (default 0)"
    )
    generate.add_argument(
        "--system-prompts",
        type=_positive_int,
        metavar="N",
        help="number of shared system prompts conversations start from (default 8)",
    )
    generate.add_argument(
        "--mean-turns",
        type=_positive_float,
        metavar="T",
        help="mean turns per conversation (default 5)",
    )
    generate.add_argument(
        "--block-tokens",
        type=_positive_int,
        default=512,
        metavar="N",
        help="tokens per trace block (default 512, as in the Mooncake traces)",
    )
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
    check_trace_path(args.trace)
    try:
        requests = read_trace(args.trace, args.block_tokens)
    except OSError as exc:  # unreadable (permissions, I/O error): not a traceback
        raise UsageError(f"trace {args.trace}: cannot read it ({exc.strerror or exc})") from None
    if args.requests is not None:
        requests = requests[: args.requests]
    return Workload(args.trace.name, requests)


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def check_trace_path(path: Path) -> None:
    """Refuse what cannot be a trace, saying what it is: a missing path, a directory, a
    device (``/dev/zero`` would be read forever), a socket. Regular files and pipes pass."""
    try:
        info = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise UsageError(
                f"trace {path}: is a symlink to {os.readlink(path)!r}, which does not exist"
            ) from None
        raise UsageError(f"trace {path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"trace {path}: cannot read it ({exc.strerror or exc})") from None
    for is_kind, kind in _FILE_KINDS:
        if is_kind(info.st_mode):
            target = f" (a symlink to {os.path.realpath(path)})" if path.is_symlink() else ""
            raise UsageError(f"trace {path}{target}: is {kind}, not a trace file")


# -- replay -------------------------------------------------------------------------------------


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
        extra["eviction_policy"] = _policy_setting(args.eviction_policy, "--eviction-policy")
    if args.cascade_admission is not None:
        extra["cascade_admission"] = _policy_setting(args.cascade_admission, "--cascade-admission")
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
                entry["root_dir"] = str(temp.path / ("fs" if position == 0 else f"fs{position}"))
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
    warm_blocks: set[int]  # the workload's blocks the secondary tiers held at the start
    held_at_start: int  # blocks the secondary tiers held at the start


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


def run_replay(args: argparse.Namespace, signals: SignalStop) -> int:
    from tiering.replay.tempdirs import remove_stale

    if args.output is not None:
        check_writable(args.output, "--output")
    out, err = consoles()
    with logging_to(err, args.verbose):
        remove_stale()
        workload = load_workload(args)
        run = _replay_workload(args, workload, err, signals)
    report = _replay_report(args, workload, run)
    status = replay_exit_status(report, args.max_tier_failures, signals.signum)
    report["ok"] = status == EXIT_OK
    report["exit_status"] = status
    if signals.signum is not None:
        report["stopped_by"] = signal_name(signals.signum)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from tiering.replay.report import render_report

        render_report(report, out)
    return status


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def tier_failure_count(report: dict[str, Any]) -> int:
    """What ``--max-tier-failures`` bounds: failed tier jobs, tier timeouts, corrupt reads.

    Routine failures are not counted: a load whose blocks left a bounded or
    shared tier between the lookup and the read (evicted, or dropped by another
    engine) is a miss the tier reports correctly, as every bounded tier does.
    """
    failures = report["failures"]
    return int(
        failures["tier_job_failures"]
        - failures["routine_job_failures"]
        + failures["tier_timeouts"]
        + failures["corrupt_reads"]
    )


def replay_exit_status(report: dict[str, Any], max_tier_failures: int, signum: int | None) -> int:
    """The run's exit status (see :data:`EXIT_STATUS_HELP`); also records the tier failures
    against their limit in ``report["tier_failures"]``."""
    count = tier_failure_count(report)
    report["tier_failures"] = {
        "count": count,
        "max_allowed": max_tier_failures,
        "exceeded": count > max_tier_failures,
    }
    if report["verification"]["mismatches"]:
        return EXIT_WRONG_BYTES
    if signum is not None:
        return 128 + signum
    if report["interrupted"]:
        return EXIT_INTERRUPTED
    if count > max_tier_failures:
        return EXIT_TIER_FAILURES
    return EXIT_OK


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

    extra = run.extra_config
    tiers = extra.get("secondary_tiers") or []
    setup = {
        "block_bytes": args.block_bytes,
        "gpu_blocks": run.gpu_blocks,
        "cpu_bytes_to_use": extra.get("cpu_bytes_to_use"),
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


def _admission_choices(args: argparse.Namespace) -> list[Any]:
    """``--admission``, resolved before any simulation runs (empty without the option)."""
    from tiering.policies import resolve_admission, split_policy_list

    if not args.admission:
        return []
    try:
        return [
            resolve_admission(_policy_setting(text, "--admission"), key="--admission")
            for text in split_policy_list(args.admission)
        ]
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def _admission_sweep(
    args: argparse.Namespace,
    requests: Any,
    result: Any,
    policies: Any,
    admissions: list[Any],
    stop: threading.Event,
) -> list[Any]:
    from tiering.replay import sweep as sweeping

    return sweeping.run_admission_sweep(
        requests,
        [point.capacity_blocks for point in result.points],
        policies=policies,
        admissions=admissions,
        secondary_factor=args.secondary_factor,
        block_tokens=args.block_tokens,
        store_chunk_blocks=args.chunk_blocks,
        should_stop=stop.is_set,
    )


def _policy_setting(text: str, option: str) -> Any:
    """A policy given on the command line: ``NAME`` or ``NAME(key=value,...)``."""
    from tiering.policies import parse_policy_text

    if "(" not in text:
        return text.strip()
    try:
        return parse_policy_text(text, key=option)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def run_sweep_command(args: argparse.Namespace, signals: SignalStop) -> int:
    from tiering.policies import POLICY_NAMES, PolicyChoice, resolve_policy, split_policy_list
    from tiering.replay import sweep as sweeping
    from tiering.replay.trace import trace_footprint

    texts = split_policy_list(args.policies) if args.policies else list(POLICY_NAMES)
    if not texts:
        raise UsageError("--policies: give at least one eviction policy")
    policies: list[PolicyChoice] = []
    for text in texts:
        try:
            policies.append(resolve_policy(_policy_setting(text, "--policies"), key="--policies"))
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    labels = [choice.label for choice in policies]
    if len(set(labels)) != len(labels):
        raise UsageError(f"--policies: a policy is listed twice: {', '.join(labels)}")
    admissions = _admission_choices(args)
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
    with progress_bar(err, args.no_progress) as progress, signals.clean_stop(stop):
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
    admission: list[Any] = []
    if admissions and result.points and not stop.is_set():
        admission = _admission_sweep(args, workload.requests, result, policies, admissions, stop)
    if result.points:
        sweeping.write_csv(result, outputs["csv"])
        sweeping.write_json(result, outputs["json"], admission)
        sweeping.plot_png(result, outputs["png"])
    if args.json:
        print(json.dumps(sweeping.sweep_json(result, admission), indent=2))
    else:
        sweeping.render_table(result, out)
        if admission:
            sweeping.render_admission_table(admission, footprint, args.block_bytes, out)
        if result.points:
            out.print("Wrote " + ", ".join(str(p) for p in outputs.values()))
        else:
            out.print("Interrupted before the first capacity finished: nothing written.")
    return signals.exit_status if signals.signum is not None else EXIT_OK


# -- generate -----------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace, signals: SignalStop) -> int:
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
    """Run the ``tiering`` command; returns the exit status (see :data:`EXIT_STATUS_HELP`)."""
    from tiering.replay.trace import TraceError

    _put_working_directory_on_path()
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"replay": run_replay, "sweep": run_sweep_command, "generate": run_generate}
    with SignalStop() as signals:
        try:
            return commands[args.command](args, signals)
        except (UsageError, ConfigError, TraceError, TieringError) as exc:
            return _error(args, exc)
        except RecursionError as exc:  # a hostile input nested deeper than any real one
            return _error(args, exc, "input nested too deeply to read")
        except MemoryError as exc:
            return _error(
                args, exc, "out of memory (make cpu_bytes_to_use or the workload smaller)"
            )
        except BrokenPipeError as exc:
            if _tier_start_failure(exc) is not None:  # a tier's connection, not our stdout
                return _error(args, exc)
            # Output piped into e.g. `head`: not an error of ours.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_OK
        except OSError as exc:  # e.g. the disk filled up writing --output
            return _error(
                args,
                exc,
                f"{exc.strerror or exc}"
                + (f": {exc.filename}" if getattr(exc, "filename", None) else ""),
            )
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Interrupted) else signals.signum
            what = signal_name(signum) if signum is not None else "SIGINT"
            print(f"tiering {args.command}: interrupted by {what}", file=sys.stderr)
            return 128 + signum if signum is not None else EXIT_INTERRUPTED
        except Exception as exc:
            if _tier_start_failure(exc) is not None:
                return _error(args, exc)
            traceback.print_exc()
            print(
                f"tiering {args.command}: internal error (a bug: please report it with the "
                "traceback above)",
                file=sys.stderr,
            )
            return EXIT_INTERNAL_ERROR


def _error(args: argparse.Namespace, exc: BaseException, message: str | None = None) -> int:
    """Print one line for ``exc`` (its traceback first with ``-v``); the bad-input status."""
    if args.verbose:
        traceback.print_exception(exc)
    tier_failure = _tier_start_failure(exc)
    if tier_failure is not None:  # the tier, the cause and the fix
        message = tier_failure + ("" if args.verbose else " (-v shows the traceback)")
    text = " ".join((message or str(exc) or type(exc).__name__).split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + f"... ({len(text) - MAX_ERROR_CHARS} more characters)"
    print(f"tiering {args.command}: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _tier_start_failure(exc: BaseException) -> str | None:
    from tiering.registry import tier_start_failure

    return tier_start_failure(exc)


def _put_working_directory_on_path() -> None:
    """Make ``module:Class`` tiers in the working directory importable, as ``python -m
    tiering`` does (the ``tiering`` script's ``sys.path[0]`` is the script's directory)."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)


if __name__ == "__main__":
    sys.exit(main())
