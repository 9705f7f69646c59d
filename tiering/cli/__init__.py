"""The ``tiering`` command: ``replay`` a KV-cache workload through the real stack,
``sweep`` hit rate against capacity, ``generate`` the built-in workload as a trace.

Exit statuses (:data:`EXIT_STATUS_HELP`; ``replay --json`` says ``"ok": true`` exactly
when the status is 0): 0 success; 1 a loaded block did not hold the bytes stored; 2 bad
input or a tier that cannot start; 3 more tier failures than ``--max-tier-failures``;
4 an internal error (a bug); 128 + the signal's number when stopped by SIGINT (130),
SIGTERM (143) or SIGHUP (129), after the partial report.

The modules: ``entry`` (:func:`main` and its error handling), ``parser`` (the arguments),
``arguments`` (reading their values), ``exits`` (the statuses), ``workload`` (the trace or
synthetic workload, and ``generate``), ``replay_command`` and ``sweep_command``.
"""

from tiering.cli.arguments import check_writable, parse_tier_spec
from tiering.cli.entry import MAX_ERROR_CHARS, main
from tiering.cli.exits import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_STATUS_HELP,
    EXIT_TIER_FAILURES,
    EXIT_WRONG_BYTES,
    UsageError,
    replay_exit_status,
    signal_name,
    tier_failure_count,
)
from tiering.cli.parser import DEFAULT_BLOCK_BYTES, build_parser
from tiering.cli.replay_command import run_replay
from tiering.cli.sweep_command import run_sweep_command
from tiering.cli.workload import Workload, check_trace_path, load_workload, run_generate

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INTERNAL_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_STATUS_HELP",
    "EXIT_TIER_FAILURES",
    "EXIT_WRONG_BYTES",
    "MAX_ERROR_CHARS",
    "UsageError",
    "Workload",
    "build_parser",
    "check_trace_path",
    "check_writable",
    "load_workload",
    "main",
    "parse_tier_spec",
    "replay_exit_status",
    "run_generate",
    "run_replay",
    "run_sweep_command",
    "signal_name",
    "tier_failure_count",
]
