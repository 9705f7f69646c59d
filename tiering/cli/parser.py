"""The ``tiering`` argument parser: its global options and the ``replay``, ``sweep`` and
``generate`` subcommands with their options and help text."""

from __future__ import annotations

import argparse
from pathlib import Path

from tiering.cli.arguments import (
    metrics_port_arg,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    size_arg,
)
from tiering.cli.exits import EXIT_STATUS_HELP

DEFAULT_BLOCK_BYTES = 32 * 1024


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
        "optionally .gz. Default: the built-in synthetic workload. `tiering sweep` also takes "
        "workload families: family:all, or family:NAME[@SEED],... (builtin, chat-long, "
        "scan-heavy, trace; docs/policies.md).",
    )
    parser.add_argument(
        "--requests",
        type=positive_int,
        metavar="N",
        help="synthetic workload size (default 2000), or replay only a trace's first N requests",
    )
    parser.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    parser.add_argument(
        "--system-prompts",
        type=positive_int,
        metavar="N",
        help="synthetic workload: number of shared system prompts (default 8)",
    )
    parser.add_argument(
        "--mean-turns",
        type=positive_float,
        metavar="T",
        help="synthetic workload: mean turns per conversation (default 5)",
    )
    parser.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        metavar="N",
        help="tokens per trace block (default 512, as in the Mooncake traces)",
    )
    parser.add_argument(
        "--chunk-blocks",
        type=positive_int,
        default=16,
        metavar="N",
        help="blocks offloaded per store call, one prefill chunk (default 16 = 8192 tokens)",
    )
    parser.add_argument(
        "--block-bytes",
        type=size_arg,
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
        type=size_arg,
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
        type=non_negative_int,
        metavar="N",
        help="simulated GPU prefix cache size in blocks (0 disables it; default 2%% of the "
        "workload's distinct blocks)",
    )
    replay.add_argument(
        "--promotion-timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="seconds a request waits for promotions before loading what has landed (default 10)",
    )
    replay.add_argument(
        "--max-tier-failures",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="tier failures (failed tier jobs, not counting blocks a bounded or shared tier "
        "dropped between lookup and read; tier timeouts; corrupt reads) a run may have and "
        "still exit 0; more exit with status 3 (default 0)",
    )
    replay.add_argument(
        "--store-wait",
        type=non_negative_float,
        default=5.0,
        metavar="S",
        help="seconds a store refused for lack of room (every CPU block pinned by in-flight "
        "cascades) waits for them before its blocks are dropped (default 5; 0 drops at once, "
        "as an overloaded engine would)",
    )
    replay.add_argument(
        "--metrics-port",
        type=metrics_port_arg,
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
        type=positive_float,
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
        "--requests", type=positive_int, metavar="N", help="number of requests (default 2000)"
    )
    generate.add_argument(
        "--seed", type=int, default=0, help="seed: the same seed writes the same trace (default 0)"
    )
    generate.add_argument(
        "--system-prompts",
        type=positive_int,
        metavar="N",
        help="number of shared system prompts conversations start from (default 8)",
    )
    generate.add_argument(
        "--mean-turns",
        type=positive_float,
        metavar="T",
        help="mean turns per conversation (default 5)",
    )
    generate.add_argument(
        "--block-tokens",
        type=positive_int,
        default=512,
        metavar="N",
        help="tokens per trace block (default 512, as in the Mooncake traces)",
    )
    return parser
