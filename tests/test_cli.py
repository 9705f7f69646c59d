"""The ``tiering`` command, in-process and as a subprocess: output, exit codes, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiering.cli import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_TIER_FAILURES,
    EXIT_WRONG_BYTES,
    main,
    parse_tier_spec,
)
from tiering.replay.trace import read_trace
from tiering.replay.units import format_bytes, parse_size

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--requests", "60", "--block-bytes", "8KiB", "--no-progress"]


def _run_module(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiering", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- pure helpers --------------------------------------------------------------------------------


def test_sizes_and_tier_specs_parse() -> None:
    assert parse_size("32KiB") == 32768
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="not a size"):
        parse_size("12 parsecs")
    assert format_bytes(3 * 2**30 // 2) == "1.5 GiB" and format_bytes(100) == "100 B"
    assert parse_tier_spec("fs:root_dir=/tmp/x,capacity_bytes=8GiB,n_read_threads=4") == {
        "type": "fs",
        "root_dir": "/tmp/x",
        "capacity_bytes": "8GiB",
        "n_read_threads": 4,
    }
    assert parse_tier_spec('{"type": "memory", "capacity_blocks": 10}') == {
        "type": "memory",
        "capacity_blocks": 10,
    }
    assert parse_tier_spec("memory") == {"type": "memory"}
    assert parse_tier_spec("pkg.tiers:S3Tier") == {"type": "pkg.tiers:S3Tier"}
    assert parse_tier_spec("pkg.tiers:S3Tier:bucket=kv,n=2") == {
        "type": "pkg.tiers:S3Tier",
        "bucket": "kv",
        "n": 2,
    }


# -- generate and sweep (no tiers needed) --------------------------------------------------------


def test_generate_writes_a_trace_that_reads_back(tmp_path: Path) -> None:
    out = tmp_path / "w.jsonl"
    assert main(["generate", str(out), "--requests", "40", "--seed", "5"]) == EXIT_OK
    requests = read_trace(out)
    assert len(requests) == 40


def test_sweep_prints_json_and_writes_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "sweep"
    code = main(["sweep", *SMALL, "--out", str(prefix), "--capacities", "10,50,4MiB", "--json"])
    assert code == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    # 4 MiB of 8 KiB blocks is 512 blocks.
    assert [p["capacity_blocks"] for p in data["points"]] == [10, 50, 512]
    for point in data["points"]:
        rates = point["token_hit_rate"]
        assert rates["belady"] >= max(rates["lru"], rates["arc"]) - 1e-12
    for ext in ("png", "csv", "json"):
        assert (tmp_path / f"sweep.{ext}").stat().st_size > 0


def test_sweep_table_on_the_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", *SMALL, "--out", str(tmp_path / "s"), "--policies", "lru"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "Belady" in out and "LRU" in out and "ARC" not in out


# -- bad input -----------------------------------------------------------------------------------


def test_a_malformed_trace_line_is_reported_with_its_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": 600, "hash_ids": [1, "x"]}\n'
    )
    for command in ("replay", "sweep"):
        extra = ["--out", str(tmp_path / "s")] if command == "sweep" else []
        assert main([command, str(trace), "--no-progress", *extra]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert "bad.jsonl line 2" in err and "'hash_ids'[1] must be an integer" in err


def test_a_missing_trace_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(tmp_path / "nope.jsonl")]) == EXIT_BAD_INPUT
    assert "no such file" in capsys.readouterr().err
    assert main(["replay", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "is a directory, not a trace file" in capsys.readouterr().err


def test_an_unreadable_trace_is_bad_input_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import tiering.replay.trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("")

    def refuse(path: object, block_tokens: int) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(tiering.replay.trace, "read_trace", refuse)  # root reads anything
    assert main(["replay", str(trace), "--no-progress"]) == EXIT_BAD_INPUT
    assert "t.jsonl: cannot read it (Permission denied)" in capsys.readouterr().err


def test_an_unwritable_output_fails_before_reading_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text("this is not json\n")
    missing_dir = tmp_path / "no" / "such" / "dir"
    code = main(["replay", str(trace), "--output", str(missing_dir / "r.json")])
    assert code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--output" in err and "does not exist" in err and "line 1" not in err
    assert main(["sweep", str(trace), "--out", str(missing_dir / "s")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--out" in err and "line 1" not in err
    # Workload families too: before their sweep, not after it.
    from tiering.replay import sweep as sweeping

    def no_sweep(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sweep ran before --out was checked")

    monkeypatch.setattr(sweeping, "run_sweep", no_sweep)
    family = ["sweep", "family:builtin", "--requests", "30", "--no-progress"]
    assert main([*family, "--out", str(missing_dir / "f")]) == EXIT_BAD_INPUT
    assert "--out" in capsys.readouterr().err
    # A directory is not a file to write a report into.
    assert main(["replay", "--output", str(tmp_path)]) == EXIT_BAD_INPUT
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({"eviction_policy": "fifo", "cpu_bytes_to_use": 1 << 20}, "eviction_policy"),
        ({"cpu_bytes_to_use": 1 << 20, "secondary_tiers": {"type": "fs"}}, "secondary_tiers"),
        (
            {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [{"root_dir": "/x"}]},
            "secondary_tiers[0].type",
        ),
    ],
)
def test_a_bad_config_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object], named: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["replay", *SMALL, "--config", str(path)]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


def test_config_files_that_are_not_mappings_or_not_parseable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_json = tmp_path / "c.json"
    bad_json.write_text('{"cpu_bytes_to_use": 1,}')
    assert main(["replay", *SMALL, "--config", str(bad_json)]) == EXIT_BAD_INPUT
    assert "invalid JSON at line 1" in capsys.readouterr().err
    a_list = tmp_path / "c.yaml"
    a_list.write_text("- 1\n- 2\n")
    assert main(["replay", *SMALL, "--config", str(a_list)]) == EXIT_BAD_INPUT
    assert "expected a mapping" in capsys.readouterr().err
    assert main(["replay", *SMALL, "--config", str(tmp_path / "none.yaml")]) == EXIT_BAD_INPUT
    assert "cannot read it" in capsys.readouterr().err


def test_argument_errors_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "--block-bytes", "lots"])
    assert info.value.code == 2
    assert "not a size" in capsys.readouterr().err


# -- replay through the real stack ---------------------------------------------------------------


def _assert_the_ceiling_is_reached_or_a_loss_counted(report: dict[str, Any]) -> None:
    """Every hit the unlimited count promises arrives unless a loss was counted.

    Losses: a tier failure; on a loaded machine a tier behind its back-pressure
    share answering its hits as misses (``promotion_no_room``) or dropping its
    cascades (a tier's ``dropped_blocks``); a store refused for room.
    """
    hit = report["hit_rate"]
    lost = (
        report["tier_failures"]["count"]
        + sum(report["failures"].values())
        + sum(tier.get("dropped_blocks", 0) for tier in report["tiers"])
    )
    if lost == 0:
        assert hit["total"] == pytest.approx(hit["unlimited"], abs=0.001)
    else:
        assert hit["total"] <= hit["unlimited"] + 1e-9


def test_replay_json_in_process_matches_the_file_and_the_offline_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "report.json"
    code = main(
        [
            "replay",
            *SMALL,
            "--tier",
            "memory",
            "--cpu-bytes",
            "1MiB",
            "--json",
            "--output",
            str(report_path),
        ]
    )
    assert code == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(report_path.read_text())
    assert report["ok"] and not report["interrupted"]
    assert [t["name"] for t in report["tiers"]] == ["gpu", "cpu", "memory"]
    hit = report["hit_rate"]
    # An unbounded memory tier forgets nothing: the total reaches the offline ceiling
    # unless back-pressure (a loaded machine) counted a loss.
    _assert_the_ceiling_is_reached_or_a_loss_counted(report)
    assert hit["gpu"] + hit["cpu"] + hit["secondary"]["memory"] == pytest.approx(hit["total"])
    assert report["verification"]["mismatches"] == 0
    assert report["verification"]["verified_blocks"] == report["blocks"]["loaded_cpu_to_gpu"] > 0
    assert report["tiers"][2]["stored_blocks"] == report["blocks"]["stored_gpu_to_cpu"] > 0
    overhead = report["overhead"]
    assert overhead["gpu_side_s"] + overhead["tier_work_s"] <= overhead["wall_s"]
    assert report["setup"]["block_bytes"] == 8192


def test_replay_prints_the_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", *SMALL, "--no-secondary", "--gpu-blocks", "0"]) == EXIT_OK
    out = capsys.readouterr().out
    for text in (
        "Prefix hits by tier",
        "Blocks moved",
        "promotion wait",
        "Replay overhead",
        "verified byte for byte",
        "unlimited",
    ):
        assert text in out


def test_replay_of_a_trace_file_as_a_subprocess(tmp_path: Path) -> None:
    trace = tmp_path / "w.jsonl"
    assert main(["generate", str(trace), "--requests", "80"]) == EXIT_OK
    done = _run_module(
        "replay",
        str(trace),
        "--requests",
        "50",
        "--block-bytes",
        "8KiB",
        "--tier",
        "memory:capacity_blocks=64",
        "--json",
        "--no-progress",
        # A bounded tier may evict a block between lookup and promotion: a missing read.
        "--max-tier-failures",
        "1000000",
    )
    assert done.returncode == EXIT_OK, done.stderr
    report = json.loads(done.stdout)
    assert report["trace"] == {**report["trace"], "name": "w.jsonl", "requests": 50}
    assert report["tiers"][2]["capacity_blocks"] == 64


def test_replay_exits_non_zero_when_a_loaded_block_is_wrong() -> None:
    # The runtime's own verification is off, so the corrupted bytes reach the replay's check.
    done = _run_module(
        "replay",
        *SMALL,
        "--tier",
        '{"type": "tests.replay_faults:CorruptingMemoryTier", "corrupt_rate": 1.0,'
        ' "verify": false}',
    )
    assert done.returncode == 1, done.stderr
    assert "DATA MISMATCH" in done.stdout


@pytest.mark.parametrize(
    ("tier", "named"),
    [
        ("no_such_tier", "no_such_tier"),
        ("memory:capacity_blockz=10", "capacity_blockz"),
        ('{"type": "memory", "capacity_blocks": -1}', "capacity_blocks"),
    ],
)
def test_a_bad_tier_names_its_position_type_and_key(
    capsys: pytest.CaptureFixture[str], tier: str, named: str
) -> None:
    assert main(["replay", *SMALL, "--tier", tier]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert named in err and "secondary_tiers[0]" in err


def test_null_in_a_config_file_means_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/configuration.md: JSON/YAML null means "use the default", for the runtime's keys
    and a tier's own options alike (the same rule as through the spec and the vLLM adapter)."""
    config = tmp_path / "kv.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1048576\n"
        "secondary_tiers:\n"
        "  - {type: memory, job_timeout_s: null, eviction_policy: null, capacity_blocks: null}\n"
    )
    assert main(["replay", *SMALL, "--config", str(config), "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["ok"]


def test_a_yaml_config_in_vllms_shape_builds_the_stack(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kv.yaml"
    config.write_text(
        "kv_connector: OffloadingConnector\n"
        "kv_connector_extra_config:\n"
        "  cpu_bytes_to_use: 1048576\n"
        "  block_size: 16\n"
        "  eviction_policy: arc\n"
        "  secondary_tiers:\n"
        "    - {type: memory, capacity_blocks: 100, name: warm}\n"
        "    - {type: memory}\n"
    )
    # A bounded tier may evict a block between lookup and promotion: allowed here.
    allowed = ["--max-tier-failures", "1000000"]
    assert main(["replay", *SMALL, "--config", str(config), *allowed, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    setup = report["setup"]
    assert setup["eviction_policy"] == "arc" and setup["cpu_blocks"] == 128
    assert setup["ignored_config_keys"] == ["block_size"]
    # The report uses a tier's configured name; the other one keeps its type and position.
    assert [t["name"] for t in report["tiers"]][1:] == ["cpu", "warm", "memory#1"]
    assert set(report["hit_rate"]["secondary"]) == {"warm", "memory#1"}
    assert report["tiers"][2]["capacity_blocks"] == 100
    # "warm" may evict a block between lookup and promotion (a tier failure).
    _assert_the_ceiling_is_reached_or_a_loss_counted(report)


def test_repeated_log_messages_are_shown_three_times_then_counted() -> None:
    import io
    import logging

    from rich.console import Console

    from tiering.replay.console import logging_to

    buffer = io.StringIO()
    console = Console(file=buffer, width=200)
    noisy = logging.getLogger("tiering.test.noisy")
    with logging_to(console, verbose=0):
        for key in range(10):
            noisy.error("a tier kept buffer %d", key)
        noisy.warning("something else")
    text = buffer.getvalue()
    assert text.count("a tier kept buffer") == 4  # three shown, one summary
    assert "and 7 more messages like this one: a tier kept buffer 3" in text
    assert "something else" in text


def test_capacities_read_from_tier_configs() -> None:
    from tiering.replay.stack import configured_capacity

    assert configured_capacity({"type": "memory", "capacity_blocks": 7}, 4096) == 7
    assert configured_capacity({"type": "fs", "capacity_bytes": "1MiB"}, 4096) == 256
    assert configured_capacity({"type": "fs", "capacity_bytes": 40960}, 4096) == 10
    assert configured_capacity({"type": "redis"}, 4096) is None
    assert configured_capacity({"type": "fs", "capacity_bytes": "lots"}, 4096) is None


def test_the_default_stack_is_cpu_plus_a_filesystem_tier_in_a_temporary_directory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A bounded fs tier this small may lose a block between lookup and promotion: allowed here.
    args = ["--requests", "150", "--block-bytes", "8KiB", "--max-tier-failures", "1000000"]
    code = main(["replay", *args, "--json"])
    assert code == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    fs = report["tiers"][2]
    assert fs["name"] == "fs" and fs["stored_blocks"] > 0
    root = Path(report["setup"]["secondary_tiers"][0]["root_dir"])
    assert root.name == "fs" and not root.parent.exists()  # cleaned up after the run
    assert report["ok"] and report["verification"]["mismatches"] == 0
    assert report["hit_rate"]["total"] <= report["hit_rate"]["unlimited"] + 1e-9


@pytest.mark.parametrize("width", [80, 120])
def test_the_report_fits_the_console_without_cutting_cells(
    width: int, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from rich.console import Console

    from tiering.replay.report import render_report

    tier = json.dumps({"type": "memory", "name": "a-rather-long-tier-name-for-a-table"})
    assert main(["replay", *SMALL, "--tier", tier, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    buffer = io.StringIO()
    render_report(report, Console(file=buffer, width=width))
    text = buffer.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    assert "\u2026" not in text  # no cell cut off with an ellipsis
    for label in ("store GPU->CPU", "load CPU->GPU", "promotion wait", "operation"):
        assert label in text


# -- exit statuses ------------------------------------------------------------------------------


def test_tier_failures_beyond_the_limit_exit_3_and_json_ok_agrees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A Redis tier that is down, started in degraded mode: every job fails.
    from tests.support.redis_server import free_port

    tier = json.dumps(
        {
            "type": "redis",
            "url": f"redis://127.0.0.1:{free_port()}/0",
            "on_start_unreachable": "degrade",
            "connect_timeout_s": 0.5,
        }
    )
    args = ["replay", *SMALL, "--cpu-bytes", "512KiB", "--tier", tier, "--json"]
    assert main(args) == EXIT_TIER_FAILURES
    report = json.loads(capsys.readouterr().out)
    assert report["failures"]["tier_job_failures"] > 0
    assert report["tier_failures"]["count"] > 0 and report["tier_failures"]["exceeded"]
    assert not report["ok"] and report["exit_status"] == EXIT_TIER_FAILURES
    # The same run allowed that many failures: status 0 and "ok".
    allowed = str(report["tier_failures"]["count"] * 10)
    assert main([*args, "--max-tier-failures", allowed]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["exit_status"] == EXIT_OK
    assert report["tier_failures"]["max_allowed"] == int(allowed)


def test_tier_failures_are_named_in_the_printed_report(capsys: pytest.CaptureFixture[str]) -> None:
    tier = '{"type": "tests.replay_faults:FailingReadsMemoryTier"}'
    assert main(["replay", *SMALL, "--cpu-bytes", "512KiB", "--tier", tier]) == EXIT_TIER_FAILURES
    out = " ".join(capsys.readouterr().out.split())
    assert "more than --max-tier-failures 0: exit status 3" in out
    # What the count adds up, as tier_failure_count and --help say.
    assert "not counting routine misses, + tier timeouts + corrupt reads" in out


def test_the_status_stands_when_the_output_is_piped_into_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tiering replay ... | head` under pipefail: a failed run must not read as success."""
    import builtins

    real_print = builtins.print

    def reader_gone(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("file") is None:  # the report on stdout: `head` has exited
            raise BrokenPipeError(32, "Broken pipe")
        real_print(*args, **kwargs)

    tier = '{"type": "tests.replay_faults:FailingReadsMemoryTier"}'
    monkeypatch.setattr(builtins, "print", reader_gone)
    args = ["replay", *SMALL, "--cpu-bytes", "512KiB", "--tier", tier, "--json"]
    assert main(args) == EXIT_TIER_FAILURES


def test_wrong_bytes_outrank_tier_failures() -> None:
    from tiering.cli import replay_exit_status

    def report(
        mismatches: int, job_failures: int, interrupted: bool = False, routine: int = 0
    ) -> dict[str, Any]:
        failures = {
            "tier_job_failures": job_failures,
            "routine_job_failures": routine,
            "missing_reads": routine,
            "tier_timeouts": 0,
            "corrupt_reads": 0,
        }
        return {
            "verification": {"mismatches": mismatches},
            "failures": failures,
            "interrupted": interrupted,
        }

    assert replay_exit_status(report(0, 0), 0, None) == EXIT_OK
    assert replay_exit_status(report(0, 5), 0, None) == EXIT_TIER_FAILURES
    assert replay_exit_status(report(0, 5), 5, None) == EXIT_OK
    # blocks a bounded tier dropped between lookup and read are reported, not counted
    assert replay_exit_status(report(0, 5, routine=5), 0, None) == EXIT_OK
    assert replay_exit_status(report(0, 6, routine=5), 0, None) == EXIT_TIER_FAILURES
    assert replay_exit_status(report(1, 5), 0, None) == EXIT_WRONG_BYTES
    assert replay_exit_status(report(0, 5, True), 0, signal.SIGTERM) == 143
    assert replay_exit_status(report(2, 5, True), 0, signal.SIGHUP) == EXIT_WRONG_BYTES


def test_the_exit_statuses_are_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    help_text = capsys.readouterr().out
    for line in ("0    every loaded block", "1    a loaded block", "2    bad input", "3    more"):
        assert line in help_text
    assert "130  stopped by SIGINT (Ctrl-C), 143 by SIGTERM, 129 by SIGHUP" in help_text
    assert "--promotion-timeout S" in help_text and "(default 10)" in help_text


# -- papercuts ----------------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tiering

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"tiering {tiering.__version__}"
    assert tiering.__version__ and tiering.__version__[0].isdigit()


def test_generate_help_describes_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for option, words in (
        ("--requests N", "number of requests (default 2000)"),
        ("--seed SEED", "same seed writes the same trace"),
        ("--system-prompts N", "shared system prompts"),
        ("--mean-turns T", "mean turns per conversation"),
        ("--block-tokens N", "tokens per trace block"),
    ):
        assert f"{option} {words}" in help_text or (option in help_text and words in help_text)


def test_a_module_class_tier_in_the_working_directory_loads_from_the_script(
    tmp_path: Path,
) -> None:
    # The installed ``tiering`` script's sys.path[0] is its bin directory, not the working
    # directory: run main() the way the script does, from a directory holding the tier module.
    (tmp_path / "my_local_tier.py").write_text(
        "from tiers.memory import MemoryTier\n\nclass LocalTier(MemoryTier):\n    pass\n"
    )
    tier_args = [*SMALL, "--tier", "my_local_tier:LocalTier", "--json"]
    script = (
        "import sys; sys.path[0] = sys.argv[1]; "  # what a console script's path looks like
        "from tiering.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(sys.executable).parent), "replay", *tier_args],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    assert json.loads(done.stdout)["tiers"][2]["name"] == "my_local_tier:LocalTier"


def test_a_run_on_a_warm_persistent_root_says_so_and_compares_fairly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = f"fs:root_dir={tmp_path / 'fs'},capacity_bytes=4MiB"
    args = ["replay", *SMALL, "--tier", tier, "--max-tier-failures", "1000000", "--json"]
    assert main(args) == EXIT_OK
    cold = json.loads(capsys.readouterr().out)
    assert cold["setup"]["warm_start"]["blocks_held"] == 0
    assert cold["hit_rate"]["unlimited"] == cold["setup"]["warm_start"]["unlimited_from_cold"]

    assert main(args) == EXIT_OK
    warm = json.loads(capsys.readouterr().out)
    start = warm["setup"]["warm_start"]
    assert 0 < start["blocks_held"] <= cold["tiers"][2]["blocks_held"]
    assert 0 < start["workload_blocks_held"] <= start["blocks_held"]
    hit = warm["hit_rate"]
    # The reference starts with the same blocks: the run can never beat it.
    assert hit["unlimited"] > start["unlimited_from_cold"] == cold["hit_rate"]["unlimited"]
    assert hit["total"] <= hit["unlimited"] + 1e-9 and hit["fraction_of_unlimited"] <= 1 + 1e-9

    assert main(args[:-1]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "The cache started warm" in out and "an unlimited cache starting with the same" in out


def test_the_printed_report_names_the_signal_that_stopped_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import io

    from rich.console import Console

    from tiering.replay.report import render_report

    assert main(["replay", *SMALL, "--no-secondary", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    report.update(interrupted=True, stopped_by="SIGTERM")
    buffer = io.StringIO()
    render_report(report, Console(file=buffer, width=120))
    assert "Interrupted by SIGTERM: partial report" in buffer.getvalue()


def test_output_piped_into_a_reader_that_stops_early_is_not_an_error() -> None:
    # Several MB of trace into a pipe whose reader leaves after one line: EPIPE, status 0.
    process = subprocess.Popen(
        [sys.executable, "-m", "tiering", "generate", "-", "--requests", "5000"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    assert json.loads(process.stdout.readline())["hash_ids"]
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=120) == EXIT_OK, err
    assert "Traceback" not in err and "error" not in err


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("units.yaml", "cpu_bytes_to_use: 16MiB\n"),
        ("units.json", '{"cpu_bytes_to_use": "16 MiB"}'),
        ("float.json", '{"cpu_bytes_to_use": 1.6777216e7}'),
        ("bytes.yaml", "cpu_bytes_to_use: 16777216\n"),
        ("si.json", '{"cpu_bytes_to_use": "16.777216MB"}'),
    ],
)
def test_every_documented_size_spelling_runs_a_replay_and_its_report(
    tmp_path: Path, name: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/configuration.md's sizes: bytes, a unit (binary or SI), an integral float."""
    config = tmp_path / name
    config.write_text(text)
    tier = "memory:capacity_bytes=8MiB"
    assert main(["replay", *SMALL, "--config", str(config), "--tier", tier, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["cpu_bytes_to_use"] == 16 * 2**20
    assert main(["replay", *SMALL, "--config", str(config), "--tier", tier]) == 0
    assert "CPU primary 16.0 MiB" in capsys.readouterr().out


def test_back_pressure_and_tier_identity_keys_work_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The keys this round documented, as a config file and as --tier options."""
    config = tmp_path / "keys.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        "cascade_max_pinned_fraction: 0.5\n"
        "secondary_tiers:\n"
        "  - {type: memory, medium: storage, locality: remote, enable_kv_events: false}\n"
    )
    assert main(["replay", *SMALL, "--config", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setup"]["secondary_tiers"][0]["locality"] == "remote"
    tier = "memory:medium=cpu,locality=LOCAL,enable_kv_events=true"
    assert main(["replay", *SMALL, "--cpu-bytes", "1MiB", "--tier", tier]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tier", "memory:locality=nearby"], "locality must be 'LOCAL' or 'REMOTE'"),
        (["--tier", "memory:medium=gpu"], "medium must be 'STORAGE' or 'CPU'"),
        (["--tier", "memory:enable_kv_events=yes"], "enable_kv_events must be true or false"),
    ],
)
def test_bad_tier_identity_options_are_one_line_naming_the_key(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", *SMALL, "--cpu-bytes", "1MiB", *args]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_a_pinned_fraction_outside_0_1_is_refused_in_a_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.json"
    config.write_text('{"cpu_bytes_to_use": 1048576, "cascade_max_pinned_fraction": 2}')
    assert main(["replay", *SMALL, "--config", str(config)]) == EXIT_BAD_INPUT
    assert "cascade_max_pinned_fraction must be a number in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(("fraction", "budget"), [(None, 64), (0.5, 128), (1, 256)])
def test_the_spec_gives_the_manager_its_share(fraction: float | None, budget: int) -> None:
    from tiering.spec import build_manager

    config: dict[str, object] = {"cpu_bytes_to_use": 256 * 4096, "secondary_tiers": []}
    if fraction is not None:
        config["cascade_max_pinned_fraction"] = fraction
    manager = build_manager(config, block_bytes=4096)
    try:
        assert manager._cascade_budget == budget
    finally:
        manager.shutdown()


def test_auth_mac_works_through_the_cli_and_the_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auth_mac`` as a config file key, a ``--tier`` option and through our spec."""
    from tiering.spec import build_manager

    monkeypatch.setenv("KVT_CLI_AUTH_KEY", "k" * 32)
    config = tmp_path / "auth.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        "secondary_tiers:\n"
        f"  - {{type: fs, root_dir: {tmp_path / 'a'}, auth_key_env: KVT_CLI_AUTH_KEY,"
        " auth_mac: hmac-sha256, capacity_bytes: 16MiB}\n"
    )
    assert main(["replay", *SMALL, "--config", str(config)]) == 0
    assert "verified byte for byte" in capsys.readouterr().out
    for mac in ("blake3", "ghash-aes"):
        tier = (
            f"fs:root_dir={tmp_path / mac},auth_key_env=KVT_CLI_AUTH_KEY,auth_mac={mac},"
            "capacity_bytes=16MiB"
        )
        assert main(["replay", *SMALL, "--cpu-bytes", "1MiB", "--tier", tier]) == 0
        assert "verified byte for byte" in capsys.readouterr().out
    bad = f"fs:root_dir={tmp_path / 'c'},auth_key_env=KVT_CLI_AUTH_KEY,auth_mac=md5"
    assert main(["replay", *SMALL, "--cpu-bytes", "1MiB", "--tier", bad]) == EXIT_BAD_INPUT
    assert "auth_mac must be one of 'ghash-aes', 'blake3', 'hmac-sha256'" in (
        capsys.readouterr().err
    )
    for mac in ("ghash-aes", "blake3", "hmac-sha256"):
        entry = {
            "type": "fs",
            "root_dir": str(tmp_path / mac),
            "auth_key_env": "KVT_CLI_AUTH_KEY",
            "auth_mac": mac,
            "capacity_bytes": 1 << 20,
        }
        manager = build_manager(
            {"cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [entry]}, block_bytes=4096
        )
        try:
            authenticator = manager.secondary_tiers[0].tier.config.authenticator
            assert authenticator is not None and authenticator.mac == mac
        finally:
            manager.shutdown()
