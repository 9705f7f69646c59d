"""``tiering replay`` as a real process, stopped by signals: SIGINT, SIGTERM and SIGHUP each give
the partial report, remove the run's temporary directory and exit 128 + the signal's number;
a run killed with SIGKILL leaves its directory, and the next run removes it.

Deterministic: each test waits for the line the replay logs once every signal handler is in
place and the stack (with its temporary directory) is built, then signals; nothing sleeps.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiering.replay.tempdirs import OWNER_FILE, PREFIX, ReplayTempDir
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

    def make(name: str, owner: str | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "fs").mkdir()
        (path / "fs" / "slab-000000.bin").write_bytes(b"x" * 4096)
        if owner is not None:
            (path / OWNER_FILE).write_text(owner)
        return path

    gone = make(f"{PREFIX}{pid_max + 1}-abc", f"{pid_max + 1}\n")  # nobody holds its lock
    gone_no_record = make(f"{PREFIX}{pid_max + 2}-def", None)  # never a live pid
    mine = make(f"{PREFIX}{me}-jkl", f"{me}\n")  # this process's own: kept, locked or not
    being_made = make(f"{PREFIX}1-mno", None)  # pid 1 runs: its record may be on its way
    older_version = make(f"{PREFIX}pqr", None)  # no pid in the name: cannot tell, kept
    older_digits = make(f"{PREFIX}{pid_max + 3}", None)  # an older name that is all digits
    not_ours = make("something-else-1", None)
    (tmp_path / f"{PREFIX}1-link").symlink_to(mine)  # a symlink is never followed

    removed = remove_stale_dirs(tmp_path)
    assert sorted(removed) == sorted([gone, gone_no_record])
    for kept in (mine, being_made, older_version, older_digits, not_ours):
        assert kept.is_dir()
    assert (tmp_path / f"{PREFIX}1-link").is_symlink()


def test_a_directory_is_kept_exactly_while_its_owner_lock_is_held(tmp_path: Path) -> None:
    """A live pid is not enough (pids are reused; emulators report start times of their
    own): only the lock its run holds keeps a directory."""
    held = tmp_path / f"{PREFIX}1-abc"  # pid 1 is always running
    held.mkdir()
    (held / OWNER_FILE).write_text("1\n")
    unheld = tmp_path / f"{PREFIX}1-def"
    unheld.mkdir()
    (unheld / OWNER_FILE).write_text("1\n")
    fd = os.open(held / OWNER_FILE, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the owning run does, through its own descriptor
        assert remove_stale_dirs(tmp_path) == [unheld]
        assert held.is_dir()
    finally:
        os.close(fd)
    assert remove_stale_dirs(tmp_path) == [held]


def test_the_temp_dir_is_made_on_first_use_and_removed(tmp_path: Path) -> None:
    with ReplayTempDir(tmp_path) as temp:
        assert not temp.created and _replay_dirs(tmp_path) == []
        path = temp.path
        assert path.parent == tmp_path and path.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert (path / OWNER_FILE).read_text().split() == [str(os.getpid())]
        # A sweep by another run finds it locked, even though the pid in its name is
        # not the sweeper's own.
        other = tmp_path / f"{PREFIX}1-copy"
        other.mkdir()
        os.link(path / OWNER_FILE, other / OWNER_FILE)
        assert remove_stale_dirs(tmp_path) == []
    assert not path.exists()


def test_a_signal_while_the_report_is_computed_still_prints_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every request replayed, then SIGTERM: the report, and the signal's status."""
    import tiering.cli.replay_command as replay_command
    from tiering.cli import main

    compute = replay_command._replay_report

    def signalled(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the command, in this thread
        return compute(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(replay_command, "_replay_report", signalled)
    assert main(["replay", "--requests", "30", "--no-progress", "--json"]) == 128 + signal.SIGTERM
    report = json.loads(capsys.readouterr().out)
    assert report["stopped_by"] == "SIGTERM" and report["trace"]["requests_replayed"] == 30
