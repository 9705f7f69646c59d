"""The workload a command runs on: a trace file (checked to be one) or the built-in synthetic
workload, loaded for ``replay`` and ``sweep`` and written as a trace by ``generate``."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.cli.arguments import check_writable
from tiering.cli.exits import EXIT_OK, UsageError
from tiering.replay.console import SignalStop


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
