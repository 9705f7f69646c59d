"""Hostile or broken input to ``tiering replay`` gets one clear line and exit status 2:
no traceback, in bounded time and memory (issue 16 item 5, issue 19 item 3)."""

from __future__ import annotations

import errno
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import free_port
from tiering.cli import EXIT_BAD_INPUT, main
from tiering.replay.stack import MAX_CONFIG_DEPTH, MAX_YAML_ALIASES, build_stack

SMALL = ["--requests", "30", "--block-bytes", "8KiB", "--no-progress"]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr, checked to be exactly one error line (no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tiering replay: error: "), err
    assert "Traceback" not in err
    return lines[0]


def replay(*args: str) -> int:
    return main(["replay", *SMALL, *args])


# -- configs ------------------------------------------------------------------------------------

ALIAS_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
cpu_bytes_to_use: 1048576
secondary_tiers:
  - {type: memory, name: *i}
"""


def test_a_yaml_alias_bomb_is_refused_quickly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bomb.yaml"
    config.write_text(ALIAS_BOMB)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.process_time()
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert f"more than {MAX_YAML_ALIASES} YAML aliases" in line and "bomb.yaml" in line
    # Bounded: the 1.3 KB file stood for ~1.5 GB of strings; CPU time, not wall time.
    assert time.process_time() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100_000  # KiB


def test_a_few_aliases_still_work_and_long_values_are_cut(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Within the alias budget the structure loads; the error about it quotes its start only.
    config = tmp_path / "aliases.yaml"
    config.write_text(
        'a: &a ["' + "x" * 5000 + '", "y"]\nb: &b [*a, *a, *a, *a]\ncpu_bytes_to_use: *b\n'
    )
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "cpu_bytes_to_use must be" in line and len(line) < 500


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_a_deeply_nested_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    config = tmp_path / f"deep{suffix}"
    depth = 100_000
    config.write_text('{"cpu_bytes_to_use": 1048576, "x": ' + "[" * depth + "]" * depth + "}")
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    assert f"nested more than {MAX_CONFIG_DEPTH} levels deep" in one_error_line(capsys)


def test_a_config_nested_just_too_deep_for_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Deeper than the limit but not deep enough for Python's recursion limit.
    config = tmp_path / "deep.json"
    depth = MAX_CONFIG_DEPTH + 5
    config.write_text('{"cpu_bytes_to_use": 1048576, "x": ' + "[" * depth + "]" * depth + "}")
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    assert "levels deep" in one_error_line(capsys)


def test_a_config_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "latin1.yaml"
    config.write_bytes("# caché\ncpu_bytes_to_use: 1048576\n".encode("latin-1"))
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "latin1.yaml: not UTF-8 text (byte 0xe9 on line 1)" in line


def test_a_config_that_is_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert replay("--config", "/dev/zero") == EXIT_BAD_INPUT
    assert "/dev/zero: not a regular file" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("suffix", "text", "named"),
    [
        (".json", '{"cpu_bytes_to_use": 1e30}', "larger than any machine"),
        (".yaml", "cpu_bytes_to_use: 1.0e+30\n", "larger than any machine"),
        (".yaml", "cpu_bytes_to_use: 1e30\n", "cpu_bytes_to_use must be"),  # YAML 1.1: a string
        (".json", '{"cpu_bytes_to_use": "99999TiB"}', "more memory than this machine"),
    ],
)
def test_an_impossible_cpu_bytes_to_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str, text: str, named: str
) -> None:
    config = tmp_path / f"c{suffix}"
    config.write_text(text)
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "cpu_bytes_to_use" in line and named in line


# -- traces -------------------------------------------------------------------------------------


def test_a_deeply_nested_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "deep.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
        + "[" * 100_000
        + "]" * 100_000
        + "\n"
    )
    assert replay(str(trace)) == EXIT_BAD_INPUT
    assert "deep.jsonl line 2: JSON nested too deeply" in one_error_line(capsys)


def test_a_symlink_to_dev_zero_as_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.symlink_to("/dev/zero")
    assert replay(str(trace)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "(a symlink to /dev/zero): is a character device, not a trace file" in line
    dangling = tmp_path / "gone.jsonl"
    dangling.symlink_to(tmp_path / "nowhere.jsonl")
    assert replay(str(dangling)) == EXIT_BAD_INPUT
    assert "is a symlink to" in one_error_line(capsys)


def test_a_trace_line_without_an_end_is_cut_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiering.replay.trace

    monkeypatch.setattr(tiering.replay.trace, "MAX_LINE_BYTES", 1024)
    trace = tmp_path / "zeros.jsonl"
    trace.write_bytes(b"\0" * 10_000)
    assert replay(str(trace)) == EXIT_BAD_INPUT
    assert "zeros.jsonl line 1: longer than" in one_error_line(capsys)


# -- tiers that cannot start ----------------------------------------------------------------------


def test_a_redis_server_down_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = json.dumps(
        {"type": "redis", "url": url, "on_start_unreachable": "fail", "connect_timeout_s": 0.5}
    )
    assert replay("--tier", "memory", "--tier", tier) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "secondary_tiers[1] (type 'redis'): cannot start" in line
    assert "unreachable" in line and "on_start_unreachable='degrade'" in line
    assert line.endswith("(-v shows the traceback)")


def test_a_custom_tier_whose_open_raises_and_its_traceback_with_v(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tier = "tests.replay_faults:OpenFailsTier"
    assert replay("--tier", tier) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert f"secondary_tiers[0] (type '{tier}'): cannot start: RuntimeError" in line
    assert "the license server said no" in line
    assert main(["-v", "replay", *SMALL, "--tier", tier]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "Traceback" in err and "the license server said no" in err
    assert err.strip().splitlines()[-1].startswith("tiering replay: error: secondary_tiers[0]")


def test_open_timeout_too_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = json.dumps({"type": "fs", "root_dir": str(tmp_path / "fs"), "open_timeout_s": 1e-9})
    assert replay("--tier", tier) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "secondary_tiers[0] (type 'fs'): did not open within open_timeout_s=1e-09 s" in line
    assert "raise open_timeout_s" in line


@pytest.fixture
def running_fs_stack(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "fs"
    stack = build_stack(
        {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"type": "fs", "root_dir": str(root)}]},
        block_bytes=8192,
        block_tokens=512,
    )
    try:
        yield root
    finally:
        stack.shutdown()


def test_a_second_replay_on_a_root_dir_in_use(
    running_fs_stack: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = json.dumps({"type": "fs", "root_dir": str(running_fs_stack)})
    assert replay("--tier", tier) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "secondary_tiers[0] (type 'fs'): cannot start: RootInUseError" in line
    assert "in use by another fs tier" in line and "its own root_dir" in line


def test_a_restart_whose_journal_rewrite_meets_a_full_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier keeps its intact journal and appends to it: the run goes on, one warning."""
    import tiers.fs.opening

    tier = json.dumps({"type": "fs", "root_dir": str(tmp_path / "fs")})
    assert replay("--tier", tier, "--max-tier-failures", "1000000", "--json") == 0
    capsys.readouterr()

    def disk_full(root: object, *args: object) -> tuple[int, int]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), ".index.journal.tmp")

    monkeypatch.setattr(tiers.fs.opening, "write_snapshot_for_append", disk_full)
    # A journal that needs compacting (a small intact one is appended to as it is anyway).
    monkeypatch.setattr(tiers.fs.opening, "_compact", lambda result, live: False)
    assert replay("--tier", tier, "--max-tier-failures", "1000000") == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    # rich wraps the log line: compare it with its whitespace folded
    assert "not compacted at open (no space left)" in " ".join(captured.err.split())


def test_a_deeply_nested_tier_given_on_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tier = '{"type": "memory", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert replay("--tier", tier) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert '--tier \'{"type": "memory", "x": [[[' in line and "JSON nested too deeply" in line


# -- numbers longer than Python converts --------------------------------------------------------

HUGE = "9" * 5000  # past Python's 4,300-digit conversion limit


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("long.json", '{"cpu_bytes_to_use": ' + HUGE + "}"),
        ("long.yaml", "cpu_bytes_to_use: " + HUGE + "\n"),
        (
            "tier.json",
            '{"cpu_bytes_to_use": 1048576, "secondary_tiers": '
            '[{"type": "memory", "capacity_blocks": ' + HUGE + "}]}",
        ),
    ],
)
def test_a_config_number_of_thousands_of_digits_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    config = tmp_path / name
    config.write_text(text)
    assert replay("--config", str(config)) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert str(config) in line and "digits" in line and HUGE[:30] not in line


def test_a_tier_option_of_thousands_of_digits_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert replay("--tier", f"memory:capacity_blocks={HUGE}") == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert "--tier memory: capacity_blocks: a number of 5000 digits" in line
    assert replay("--tier", '{"type": "memory", "capacity_blocks": ' + HUGE + "}") == EXIT_BAD_INPUT
    assert "a number of 5000 digits" in one_error_line(capsys)


def test_a_trace_number_of_thousands_of_digits_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}'
    bad = '{"timestamp": 1, "input_length": ' + HUGE + ', "output_length": 1, "hash_ids": [3]}'
    trace.write_text(good + "\n" + bad + "\n")
    assert main(["replay", str(trace), "--no-progress"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys)
    assert f"{trace} line 2: a number of 5000 digits" in line


def test_a_huge_python_integer_in_a_config_dict_is_named_not_printed() -> None:
    from tiering.config import TieringConfig
    from tiering.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=<an integer of about \d+ digits>"):
        TieringConfig.from_extra_config({"cpu_bytes_to_use": 10**6000})
