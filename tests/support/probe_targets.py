"""Self-test functions for tests of :mod:`tiering.support.native_probe` (run in its child)."""

from __future__ import annotations

import os
import signal
import tempfile
import time


def succeeds() -> None:
    """A path that works."""


def raises() -> None:
    raise OSError(95, "operation not supported by this fake accelerator")


def crashes_with_sigill() -> None:
    """What a binding built for AVX-512 does on a CPU without it."""
    os.kill(os.getpid(), signal.SIGILL)


def hangs() -> None:
    time.sleep(3600)


def crashes_leaving_a_temporary_directory() -> None:
    """A self-test killed in the middle of its work, its temporary files left behind."""
    scratch = tempfile.mkdtemp(prefix="self-test-")
    with open(os.path.join(scratch, "probe.bin"), "wb") as f:
        f.write(bytes(4096))
    os.kill(os.getpid(), signal.SIGKILL)
