"""The ``tiering`` entry point: parse the arguments, run the subcommand, and turn what it
raises into one error line and an exit status (bad input, a signal, an internal error)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from tiering.cli.exits import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    signal_name,
)
from tiering.cli.parser import build_parser
from tiering.cli.replay_command import run_replay
from tiering.cli.sweep_command import run_sweep_command
from tiering.cli.workload import run_generate
from tiering.core.errors import ConfigError, TieringError
from tiering.replay.console import Interrupted, SignalStop

#: Longest error line printed (a message can quote a hostile value).
MAX_ERROR_CHARS = 1000


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
            # Output piped into e.g. `head`: not an error of ours, and the run's own status
            # (wrong bytes, tier failures) stands.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return getattr(exc, "exit_status", EXIT_OK)
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
