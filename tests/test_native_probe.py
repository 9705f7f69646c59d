"""Child-process probes of native fast paths: a crash there never reaches the caller."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiering import native_probe
from tiering.support.native_probe import probe_in_child

TARGETS = "tests.support.probe_targets"
ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "support" / "sigill_standin"


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KV_TIERING_CACHE_DIR", str(cache))
    native_probe.forget_verdicts()
    yield cache
    native_probe.forget_verdicts()


def test_working_path_is_ok_and_cached_for_the_next_process(private_cache: Path) -> None:
    first = probe_in_child("fake", f"{TARGETS}:succeeds")
    assert first.ok and first.reason is None and not first.cached
    assert (private_cache / "native-probes.json").is_file()
    native_probe.forget_verdicts()  # as a new process would start
    second = probe_in_child("fake", f"{TARGETS}:succeeds")
    assert second.ok and second.cached


def test_sigill_in_the_child_is_a_verdict_not_a_crash() -> None:
    verdict = probe_in_child("fake-accelerator", f"{TARGETS}:crashes_with_sigill")
    assert not verdict.ok
    assert verdict.reason is not None
    assert verdict.reason.startswith("fake-accelerator: ")
    assert "SIGILL" in verdict.reason and "illegal instruction" in verdict.reason


def test_exception_in_the_child_names_its_last_line() -> None:
    verdict = probe_in_child("fake", f"{TARGETS}:raises")
    assert not verdict.ok
    assert verdict.reason is not None and "not supported by this fake accelerator" in verdict.reason


def test_hung_self_test_fails_and_is_not_cached(private_cache: Path) -> None:
    verdict = probe_in_child("fake", f"{TARGETS}:hangs", timeout_s=0.5)
    assert not verdict.ok and verdict.reason is not None
    assert "did not finish in 0.5 s" in verdict.reason
    assert not (private_cache / "native-probes.json").exists()


def test_a_self_test_killed_midway_leaves_no_files_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where the child would make its own
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # and this process
    verdict = probe_in_child("fake", f"{TARGETS}:crashes_leaving_a_temporary_directory")
    assert not verdict.ok and verdict.reason is not None and "SIGKILL" in verdict.reason
    assert list(temp.iterdir()) == []  # the child's directory went with the probe's


def test_a_verdict_is_remembered_for_the_process() -> None:
    first = probe_in_child("fake", f"{TARGETS}:raises")
    assert probe_in_child("fake", f"{TARGETS}:raises") is first


def test_corrupt_cache_is_ignored(private_cache: Path) -> None:
    private_cache.mkdir()
    (private_cache / "native-probes.json").write_text("{not json")
    assert probe_in_child("fake", f"{TARGETS}:succeeds").ok


def run_with_standin(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STANDIN), str(ROOT)])
    env["KV_TIERING_CACHE_DIR"] = str(cache)
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_standin_really_crashes_a_process_that_builds_a_ring(private_cache: Path) -> None:
    """The stand-in is faithful: building a ring without the probe kills the process."""
    done = run_with_standin(
        ["-c", "from tiers.fs.io.kernel_ring import KernelRing; KernelRing(4)"], private_cache
    )
    assert done.returncode == -4  # SIGILL


def test_replay_survives_a_binding_that_crashes_with_sigill(private_cache: Path) -> None:
    """`tiering replay` falls back to threads with one warning; every byte is verified."""
    done = run_with_standin(["-m", "tiering", "replay", "--requests", "200"], private_cache)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert output.count("io_uring is not usable here") == 1
    assert "SIGILL" in output
    assert "loaded blocks verified byte for byte" in output


def test_explicit_uring_with_a_crashing_binding_is_one_config_error(private_cache: Path) -> None:
    done = run_with_standin(
        ["-m", "tiering", "replay", "--requests", "50", "--tier", "fs:io_backend=uring"],
        private_cache,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "io_backend='uring' is not available here" in done.stderr
    assert "SIGILL" in done.stderr
    assert "Traceback" not in done.stderr


def test_explicit_uring_is_refused_when_the_spec_is_built(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At spec construction, before any memory is allocated: not at engine start."""
    from tiering.core.errors import ConfigError
    from tiering.spec import TieringOffloadingSpec
    from tiers.fs.io import uring as uring_module

    uring_module.uring_unavailable_reason.cache_clear()
    monkeypatch.setattr(
        uring_module,
        "probe_in_child",
        lambda name, target: native_probe.ProbeVerdict(False, f"{name}: crashed with SIGILL"),
    )
    try:
        with pytest.raises(ConfigError) as caught:
            TieringOffloadingSpec(
                {
                    "cpu_bytes_to_use": 1 << 20,
                    "secondary_tiers": [
                        {"type": "fs", "root_dir": str(private_cache), "io_backend": "uring"}
                    ],
                },
                block_bytes=4096,
            )
        message = str(caught.value)
        assert message.startswith("secondary_tiers[0] (type 'fs'): ")
        assert "io_backend='uring' is not available here" in message and "SIGILL" in message
        assert not private_cache.exists()  # nothing was created
    finally:
        uring_module.uring_unavailable_reason.cache_clear()
