"""Workload traces: the Mooncake JSONL format, read strictly and written back.

One request per line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [ids...]}``. ``hash_ids[i]`` names the ``i``-th prefix block of
``block_tokens`` tokens (512 in the Mooncake release); equal ids are equal prefixes,
so a block can be reused only when every block before it is too.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tiering.core.errors import TieringError
from tiering.support.units import NumberTooLongError, loads_json

#: Tokens per trace block in the Mooncake release.
DEFAULT_BLOCK_TOKENS = 512

_MAX_HASH_ID = 2**64 - 1
#: Longest trace line read (a real request's line is a few KiB); a longer one is refused
#: before it fills memory (a file of zeros has no line end at all).
MAX_LINE_BYTES = 16 << 20


class TraceError(TieringError, ValueError):
    """A trace line is malformed. The message names the file, the line and what is wrong."""

    def __init__(self, source: str, line_number: int | None, problem: str) -> None:
        where = source if line_number is None else f"{source} line {line_number}"
        super().__init__(f"{where}: {problem}")
        self.source = source
        self.line_number = line_number
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: when it arrived, its lengths and its prefix blocks."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[int]:
        """Tokens of the input covered by each block (the last block may be partial)."""
        remaining = self.input_length
        sizes = []
        for _ in self.hash_ids:
            sizes.append(max(0, min(block_tokens, remaining)))
            remaining -= block_tokens
        return sizes

    def to_json(self) -> dict[str, Any]:
        timestamp: float | int = self.timestamp_ms
        if float(timestamp).is_integer():
            timestamp = int(timestamp)
        return {
            "timestamp": timestamp,
            "input_length": self.input_length,
            "output_length": self.output_length,
            "hash_ids": list(self.hash_ids),
        }


def _non_negative_int(record: dict[str, Any], field: str) -> int:
    value = record[field]
    # bool is an int subclass; a JSON true is not a length.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field!r} must be a non-negative integer, got {value!r}")
    return value


def parse_request(record: object, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Request:
    """Validate one decoded JSON line and build its :class:`Request`.

    Raises ``ValueError`` with a message naming the offending field.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [f for f in ("timestamp", "input_length", "hash_ids") if f not in record]
    if missing:
        raise ValueError(f"missing field {missing[0]!r}")
    timestamp = record["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, int | float)
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise ValueError(f"'timestamp' must be a non-negative number of ms, got {timestamp!r}")
    input_length = _non_negative_int(record, "input_length")
    output_length = _non_negative_int(record, "output_length") if "output_length" in record else 0
    raw_ids = record["hash_ids"]
    if not isinstance(raw_ids, list):
        raise ValueError(f"'hash_ids' must be a list of integers, got {type(raw_ids).__name__}")
    for position, hash_id in enumerate(raw_ids):
        if isinstance(hash_id, bool) or not isinstance(hash_id, int):
            raise ValueError(f"'hash_ids'[{position}] must be an integer, got {hash_id!r}")
        if not 0 <= hash_id <= _MAX_HASH_ID:
            raise ValueError(f"'hash_ids'[{position}] must be in [0, 2**64), got {hash_id}")
    if len(set(raw_ids)) != len(raw_ids):
        # An id names a whole prefix: one prefix cannot be two lengths of one request.
        # (Belady's optimum would then not bound the policies.)
        seen: set[int] = set()
        twice = 0
        for twice in raw_ids:
            if twice in seen:
                break
            seen.add(twice)
        raise ValueError(
            f"'hash_ids' names block {twice} twice: equal ids mean equal prefixes, so one "
            "request cannot repeat one"
        )
    needed = -(-input_length // block_tokens)
    if len(raw_ids) > needed:
        raise ValueError(
            f"'hash_ids' has {len(raw_ids)} blocks but input_length {input_length} fills at "
            f"most {needed} blocks of {block_tokens} tokens (is the trace's block size "
            f"{block_tokens} tokens?)"
        )
    return Request(float(timestamp), input_length, output_length, tuple(raw_ids))


def _open_binary(path: Path) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.GzipFile(path, "rb")
    return path.open("rb")


def iter_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Iterator[Request]:
    """Yield the requests of a Mooncake JSONL trace (optionally gzipped), in file order.

    Blank lines are skipped. A malformed line (bad JSON, bad fields, bytes that are
    not UTF-8) or a corrupt gzip stream raises :class:`TraceError` naming the
    file, the line number and what is wrong.
    """
    path = Path(path)
    source = str(path)
    line_number = 0
    with _open_binary(path) as lines:
        try:
            # Lines are decoded one by one so an encoding error can name its line.
            while raw := lines.readline(MAX_LINE_BYTES + 1):
                line_number += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(
                        source,
                        line_number,
                        f"longer than {MAX_LINE_BYTES >> 20} MiB: not a trace line",
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(
                        source, line_number, f"not UTF-8 text (byte {exc.start + 1} of the line)"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = loads_json(line)
                except NumberTooLongError as exc:
                    raise TraceError(source, line_number, str(exc)) from None
                except json.JSONDecodeError as exc:
                    raise TraceError(
                        source, line_number, f"invalid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                except RecursionError:
                    raise TraceError(
                        source, line_number, "JSON nested too deeply: not a trace line"
                    ) from None
                try:
                    yield parse_request(record, block_tokens)
                except ValueError as exc:
                    raise TraceError(source, line_number, str(exc)) from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise TraceError(
                source, line_number + 1, f"corrupt gzip data ({exc or type(exc).__name__})"
            ) from None


def read_trace(path: str | Path, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> list[Request]:
    """All requests of a trace file (see :func:`iter_trace`); raises if it has none."""
    requests = list(iter_trace(path, block_tokens))
    if not requests:
        raise TraceError(str(path), None, "the trace holds no requests")
    return requests


def write_trace(requests: Iterable[Request], out: IO[str]) -> int:
    """Write requests as Mooncake JSONL; returns the number written."""
    count = 0
    for request in requests:
        out.write(json.dumps(request.to_json(), separators=(", ", ": ")))
        out.write("\n")
        count += 1
    return count


def trace_footprint(requests: Sequence[Request]) -> int:
    """Number of distinct blocks the trace touches."""
    seen: set[int] = set()
    for request in requests:
        seen.update(request.hash_ids)
    return len(seen)
