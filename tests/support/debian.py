"""Debian packages a test needs, installed on first use where the test runs as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import pytest

_LOCK = threading.Lock()


def debian_binary(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` when it is missing.

    Fails the test (never skips) with the command to run when it cannot be
    installed here (not root, no apt-get): CI runs every test.
    """
    with _LOCK:
        found = shutil.which(binary)
        if found:
            return found
        hint = f"install it with: apt-get update && apt-get install -y {package}"
        apt = shutil.which("apt-get")
        if apt is None or os.geteuid() != 0:
            pytest.fail(f"{binary} is not installed and cannot be installed here; {hint}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

        def apt_get(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [apt, *args], env=env, capture_output=True, text=True, timeout=900, check=False
            )

        # The package lists may be missing or stale on a fresh machine: update, then retry.
        if apt_get("install", "-y", "-qq", package).returncode != 0:
            apt_get("update", "-qq")
            done = apt_get("install", "-y", "-qq", package)
            if done.returncode != 0:
                pytest.fail(f"apt-get install {package} failed: {done.stderr[-2000:]}")
        found = shutil.which(binary)
        if not found:
            pytest.fail(f"{binary} still missing after apt-get install {package}; {hint}")
        return found
