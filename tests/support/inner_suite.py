"""Run a test suite inside an environment a script builds (the vLLM suites), in the background.

vLLM is not installed in the project's virtualenv (its dependencies would pull
CUDA); each vLLM suite runs in its own environment, built once by a script in
``scripts/`` and reused while its pins are unchanged. The outer test fails,
never skips, when the environment cannot be built, any inner test fails, or
the inner suite skipped or deselected anything: it is the project's evidence.

The inner suites are processes of their own and take minutes, while the rest
of the suite is one pytest process on one core. So when the session collects
an outer test (``INNER_SUITE`` in its module), :func:`start_selected` starts its
suite as soon as collection ends, one suite after another on a background
thread and at a lower CPU priority (``nice``): the other tests run meanwhile on
the other core and keep precedence, and the outer test only waits for its
suite's verdict. Children still running when the session ends are killed.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Added niceness of the background suites' processes (the other tests keep precedence).
NICENESS = 10


@dataclass(eq=False)
class InnerSuite:
    """One inner suite: the script that builds its environment, the tests, the limits."""

    builder: str
    suite: str
    build_timeout_s: float
    inner_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    _result: Future[str] | None = None

    def run(self) -> str:
        """Build the environment and run the suite: its output; AssertionError if not clean."""
        python = build_environment(self.builder, self.build_timeout_s)
        inner_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **self.env,
        }
        inner_env.pop("VIRTUAL_ENV", None)
        code, stdout, stderr = _run(
            [python, "-m", "pytest", self.suite, "-q", "-p", "no:cacheprovider", "-rfE"],
            self.inner_timeout_s,
            inner_env,
        )
        output = stdout + stderr
        assert code == 0, f"the inner suite {self.suite} failed:\n{output[-12000:]}"
        # pytest's summary is the last line of its stdout (stderr may carry later warnings).
        summary = (stdout.strip().splitlines() or [""])[-1]
        assert " passed" in summary and "no tests ran" not in summary, output[-2000:]
        assert "skipped" not in summary and "deselected" not in summary, summary
        return output

    def verdict(self) -> str:
        """The suite's output once it passed (started now if it was not in the background)."""
        if self._result is None:
            return self.run()
        return self._result.result()


def build_environment(builder: str, timeout_s: float) -> str:
    """Run ``scripts/<builder>`` and return the python it prints last."""
    code, stdout, stderr = _run(["bash", str(REPO / "scripts" / builder)], timeout_s, None)
    if code != 0:
        raise AssertionError(f"scripts/{builder} failed ({code}); its log:\n{stderr[-6000:]}")
    python = stdout.strip().splitlines()[-1]
    assert Path(python).is_file(), f"scripts/{builder} printed {python!r}, not a python"
    return python


_children: set[subprocess.Popen[str]] = set()
_children_lock = threading.Lock()


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None) -> tuple[int, str, str]:
    """Run ``command`` at lower priority; (exit code, stdout, stderr). Killed on timeout."""
    process = subprocess.Popen(
        ["nice", "-n", str(NICENESS), *command],  # not preexec_fn: this runs beside threads
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with _children_lock:
        _children.add(process)
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += f"\n(killed after {timeout_s:.0f} s)"
        return -9, stdout, stderr
    finally:
        with _children_lock:
            _children.discard(process)
    return process.returncode, stdout, stderr


def start_selected(items: Iterable[pytest.Item]) -> None:
    """Start the inner suites of the selected outer tests, in order, on one background thread."""
    suites: list[InnerSuite] = []
    for item in items:
        suite = getattr(getattr(item, "module", None), "INNER_SUITE", None)
        if isinstance(suite, InnerSuite) and suite not in suites:
            suites.append(suite)
    if not suites:
        return
    for suite in suites:
        suite._result = Future()

    def run_all() -> None:
        for suite in suites:
            assert suite._result is not None
            if not suite._result.set_running_or_notify_cancel():
                continue
            try:
                suite._result.set_result(suite.run())
            except BaseException as exc:  # the outer test re-raises it
                suite._result.set_exception(exc)

    threading.Thread(target=run_all, name="inner-suites", daemon=True).start()


def stop_children() -> None:
    """Kill inner suites still running (the session is ending)."""
    with _children_lock:
        running = list(_children)
    for process in running:
        process.kill()
