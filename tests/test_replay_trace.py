"""Reading and writing Mooncake JSONL traces, and what a malformed line reports."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from tiering.core.errors import TieringError
from tiering.replay.trace import Request, TraceError, iter_trace, read_trace, write_trace

SHARED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = '{"timestamp": 5, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 3]}'


def test_reads_requests_in_order_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD, "", '{"timestamp": 9.5, "input_length": 10, "hash_ids": [1]}'])
    requests = read_trace(path)
    assert requests == [
        Request(5.0, 1100, 7, (1, 2, 3)),
        Request(9.5, 10, 0, (1,)),
    ]
    assert requests[0].block_tokens() == [512, 512, 76]


def test_reads_gzipped_traces(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.write(GOOD + "\n")
    assert read_trace(path) == [Request(5.0, 1100, 7, (1, 2, 3))]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"timestamp": 0, "input_length": 10', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 10}', "missing field 'hash_ids'"),
        ('{"input_length": 10, "hash_ids": []}', "missing field 'timestamp'"),
        ('{"timestamp": -1, "input_length": 10, "hash_ids": [1]}', "'timestamp' must be"),
        ('{"timestamp": 0, "input_length": -3, "hash_ids": []}', "'input_length' must be"),
        ('{"timestamp": 0, "input_length": "9", "hash_ids": [1]}', "'input_length' must be"),
        (
            '{"timestamp": 0, "input_length": 9, "output_length": true, "hash_ids": [1]}',
            "'output_length' must be",
        ),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": 5}', "'hash_ids' must be a list"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1.5]}', "'hash_ids'[0] must be"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [-1]}', "'hash_ids'[0] must be in"),
        (
            '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2, 3]}',
            "'hash_ids' has 3 blocks but input_length 600 fills at most 2 blocks",
        ),
        (
            '{"timestamp": 0, "input_length": 1536, "hash_ids": [1, 1, 3]}',
            "'hash_ids' names block 1 twice",
        ),
    ],
)
def test_a_malformed_line_names_its_number_and_problem(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = _write(tmp_path, [GOOD, GOOD, line, GOOD])
    with pytest.raises(TraceError) as info:
        read_trace(path)
    error = info.value
    assert isinstance(error, TieringError)
    assert error.line_number == 3
    assert problem in str(error)
    assert f"{path} line 3: " in str(error)


def test_bytes_that_are_not_utf8_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes((GOOD + "\n" + GOOD).encode() + b'\n{"timestamp": \xff}\n')
    with pytest.raises(TraceError, match=r"line 3: not UTF-8 text \(byte 15 of the line\)"):
        read_trace(path)


def test_a_corrupt_gzip_trace_is_a_trace_error(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    whole = gzip.compress(("\n".join([GOOD] * 2000) + "\n").encode())
    path.write_bytes(whole[: len(whole) // 2])  # cut short: the stream ends mid-member
    with pytest.raises(TraceError, match="corrupt gzip data"):
        read_trace(path)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match=r"line 1: corrupt gzip data"):
        read_trace(path)


def test_the_error_comes_when_the_bad_line_is_reached(tmp_path: Path) -> None:
    path = _write(tmp_path, [GOOD, "not json"])
    lines = iter_trace(path)
    assert next(lines).hash_ids == (1, 2, 3)
    with pytest.raises(TraceError, match="line 2: invalid JSON"):
        next(lines)


def test_an_empty_trace_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, ["", ""])
    with pytest.raises(TraceError, match="holds no requests"):
        read_trace(path)


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    requests = [Request(0.0, 1024, 3, (7, 8)), Request(12.25, 5, 0, (9,))]
    buffer = io.StringIO()
    assert write_trace(requests, buffer) == 2
    first = json.loads(buffer.getvalue().splitlines()[0])
    assert first == {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]}
    path = tmp_path / "round.jsonl"
    path.write_text(buffer.getvalue(), encoding="utf-8")
    assert read_trace(path) == requests


def test_reads_the_shared_mooncake_trace() -> None:
    requests = read_trace(SHARED_TRACE)
    assert len(requests) == 3993
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)
