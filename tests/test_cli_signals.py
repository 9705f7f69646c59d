"""``tiering replay`` as a real process, stopped by signals: SIGINT, SIGTERM and SIGHUP each give
the partial report, remove the run's temporary directory and exit 128 + the signal's number;
a run killed with SIGKILL leaves its directory, and the next run removes it.

Deterministic: each test waits for the line the replay logs once every signal handler is in
place and the stack (with its temporary directory) is built, then signals; nothing sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiering.replay.tempdirs import OWNER_FILE, PREFIX, ReplayTempDir, process_start_time
from tiering.replay.tempdirs import remove_stale as remove_stale_dirs

REPO = Path(__file__).resolve().parents[1]
READY = "replaying 20000 requests"
#: Long enough that no run finishes before the signal reaches it.
LONG_RUN = ["--requests", "20000", "--block-bytes", "4KiB", "--json", "--no-progress"]


def _start(temp: Path, *args: str) -> subprocess.Popen[str]:
    # COLUMNS: log lines are not wrapped, so the readiness line is whole.
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": str(REPO), "COLUMNS": "1000"}
    return subprocess.Popen(
        [sys.executable, "-m", "tiering", "-v", "replay", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until_ready(process: subprocess.Popen[str]) -> list[str]:
    """Read stderr up to the readiness line; returns the lines read."""
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if READY in line:
            return seen
    raise AssertionError("the replay ended before it was ready:\n" + "".join(seen))


def _replay_dirs(temp: Path) -> list[Path]:
    return sorted(temp.glob(f"{PREFIX}*"))


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
)
def test_a_stop_signal_gives_the_partial_report_and_removes_the_temp_dir(
    tmp_path: Path, signum: int, status: int
) -> None:
    # The default stack: a filesystem tier in the run's temporary directory.
    process = _start(tmp_path, *LONG_RUN)
    try:
        _wait_until_ready(process)
        [temp_dir] = _replay_dirs(tmp_path)
        assert (temp_dir / "fs").is_dir()
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == status, err
    report = json.loads(out)
    assert report["interrupted"] and not report["ok"]
    assert report["exit_status"] == status
    assert report["stopped_by"] == signal.Signals(signum).name
    assert report["trace"]["requests_replayed"] < report["trace"]["requests"] == 20000
    assert report["overhead"]["drained"]
    assert report["verification"]["mismatches"] == 0
    assert _replay_dirs(tmp_path) == []


def test_a_run_killed_with_sigkill_leaves_its_dir_and_the_next_run_removes_it(
    tmp_path: Path,
) -> None:
    process = _start(tmp_path, *LONG_RUN)
    try:
        _wait_until_ready(process)
        process.kill()
        process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait()
    [left] = _replay_dirs(tmp_path)
    assert (left / OWNER_FILE).read_text().split()[0] == str(process.pid)
    # The next run (which needs no temporary directory of its own) removes it.
    done = _start(tmp_path, "--requests", "20", "--no-secondary", "--json", "--no-progress")
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert json.loads(out)["ok"]
    assert _replay_dirs(tmp_path) == []
    assert f"removed {left}, left behind by process {process.pid}" in err


def test_no_temp_dir_when_every_tier_has_its_own_root_dir(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    tier = json.dumps({"type": "fs", "root_dir": str(tmp_path / "fs")})
    process = _start(temp, "--requests", "20000", "--tier", tier, "--json", "--no-progress")
    try:
        _wait_until_ready(process)
        assert _replay_dirs(temp) == []  # the stack is built and running: nothing was made
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 143, err
    assert json.loads(out)["setup"]["secondary_tiers"][0]["root_dir"] == str(tmp_path / "fs")


# -- the stale-directory sweep in-process --------------------------------------------------------


def test_only_directories_whose_owner_is_gone_are_removed(tmp_path: Path) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    me = os.getpid()
    my_start = process_start_time(me)
    assert my_start

    def make(name: str, owner: str | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "fs").mkdir()
        (path / "fs" / "slab-000000.bin").write_bytes(b"x" * 4096)
        if owner is not None:
            (path / OWNER_FILE).write_text(owner)
        return path

    gone = make(f"{PREFIX}{pid_max + 1}-abc", f"{pid_max + 1} 12345\n")  # never a live pid
    gone_no_record = make(f"{PREFIX}{pid_max + 2}-def", None)
    reused = make(f"{PREFIX}{me}-ghi", f"{me} {int(my_start) + 1}\n")  # my pid, not my start
    alive = make(f"{PREFIX}{me}-jkl", f"{me} {my_start}\n")
    being_made = make(f"{PREFIX}{me}-mno", None)  # its owner has not written the record yet
    older_version = make(f"{PREFIX}pqr", None)  # no pid in the name: cannot tell, kept
    older_digits = make(f"{PREFIX}{pid_max + 3}", None)  # an older name that is all digits
    not_ours = make("something-else-1", None)
    (tmp_path / f"{PREFIX}1-link").symlink_to(alive)  # a symlink is never followed

    removed = remove_stale_dirs(tmp_path)
    # This process's own directories are kept whatever they record (it is running).
    assert sorted(removed) == sorted([gone, gone_no_record])
    for kept in (reused, alive, being_made, older_version, older_digits, not_ours):
        assert kept.is_dir()
    assert (tmp_path / f"{PREFIX}1-link").is_symlink()


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path: Path) -> None:
    # pid 1 is always running, and it is not the process that recorded this start time.
    one_start = process_start_time(1)
    if one_start is None:
        pytest.skip("pid 1 is not visible here")
    reused = tmp_path / f"{PREFIX}1-abc"
    reused.mkdir()
    (reused / OWNER_FILE).write_text(f"1 {int(one_start or 0) + 12345}\n")
    same = tmp_path / f"{PREFIX}1-def"
    same.mkdir()
    (same / OWNER_FILE).write_text(f"1 {one_start}\n")
    assert remove_stale_dirs(tmp_path) == [reused]
    assert same.is_dir()


def test_the_temp_dir_is_made_on_first_use_and_removed(tmp_path: Path) -> None:
    with ReplayTempDir(tmp_path) as temp:
        assert not temp.created and _replay_dirs(tmp_path) == []
        path = temp.path
        assert path.parent == tmp_path and path.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert (path / OWNER_FILE).read_text().split() == [
            str(os.getpid()),
            process_start_time(os.getpid()),
        ]
    assert not path.exists()
