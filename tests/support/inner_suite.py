"""Run a test suite inside an environment a script builds (the vLLM suites), in the background.

vLLM is not installed in the project's virtualenv (its dependencies would pull
CUDA); each vLLM suite runs in its own environment, built once by a script in
``scripts/`` and reused while its pins are unchanged. The outer test fails,
never skips, when the environment cannot be built, any inner test fails, or
the inner suite skipped or deselected anything: it is the project's evidence.

The inner suites are processes of their own and take minutes, while the rest
of the suite is one pytest process on one core. So when the session collects
outer tests (``INNER_SUITE`` in their modules), :func:`start_selected` starts
one driver process (``python -m tests.support.inner_suite``, at ``nice`` 10)
that builds their environments (all at once) and runs their suites one after
another, writing each verdict to a file; the other tests run meanwhile on the other core and keep
precedence, and each outer test waits for the driver. No thread is added to
the pytest process (tests compare its threads before and after), and the
driver's process group is killed if the session ends first.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: Added niceness of the background suites (the other tests keep precedence).
NICENESS = 10


@dataclass(eq=False)
class InnerSuite:
    """One inner suite: the script that builds its environment, the tests, the limits."""

    builder: str
    suite: str
    build_timeout_s: float
    inner_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)

    def run(self, python: str | None = None) -> str:
        """Run the suite (building its environment unless ``python`` is given): its output.

        AssertionError if the build fails or the suite is not a clean pass.
        """
        if python is None:
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
        """The suite's output once it passed: from the background driver, or run now."""
        driver = _driver
        if driver is None or self.suite not in driver.suites:
            return self.run()
        return driver.verdict(self.suite)


def build_environment(builder: str, timeout_s: float) -> str:
    """Run ``scripts/<builder>`` and return the python it prints last."""
    code, stdout, stderr = _run(["bash", str(REPO / "scripts" / builder)], timeout_s, None)
    if code != 0:
        raise AssertionError(f"scripts/{builder} failed ({code}); its log:\n{stderr[-6000:]}")
    python = stdout.strip().splitlines()[-1]
    assert Path(python).is_file(), f"scripts/{builder} printed {python!r}, not a python"
    return python


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None) -> tuple[int, str, str]:
    """Run ``command``; (exit code, stdout, stderr). Killed on timeout."""
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return -9, out, f"(killed after {timeout_s:.0f} s)"
    return done.returncode, done.stdout, done.stderr


class _Driver:
    """The background process running the selected suites, and where it writes verdicts."""

    def __init__(self, suites: list[InnerSuite]) -> None:
        self.suites = {suite.suite: suite for suite in suites}
        self._dir = Path(tempfile.mkdtemp(prefix="kvt-inner-suites-"))
        (self._dir / "suites.json").write_text(json.dumps([asdict(s) for s in suites]))
        self._timeout_s = sum(s.build_timeout_s + s.inner_timeout_s for s in suites)
        self._process = subprocess.Popen(
            [*("nice", "-n", str(NICENESS), sys.executable), "-m", __name__, str(self._dir)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killed as one
        )

    def verdict(self, suite: str) -> str:
        try:
            self._process.wait(timeout=self._timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"the inner suites did not finish in {self._timeout_s:.0f} s"
            ) from None
        result = self._dir / f"{_file_name(suite)}.json"
        if not result.exists():
            raise AssertionError(f"the inner-suite driver exited {self._process.returncode}")
        verdict = json.loads(result.read_text())
        if not verdict["passed"]:
            raise AssertionError(verdict["output"])
        output: str = verdict["output"]
        return output

    def kill(self) -> None:
        """Kill the driver's process group if it still runs; remove its directory."""
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_driver: _Driver | None = None


def _file_name(suite: str) -> str:
    return suite.replace("/", "_")


def start_selected(items: Iterable[object]) -> None:
    """Start the driver for the inner suites of the selected outer tests (in their order)."""
    global _driver
    suites: list[InnerSuite] = []
    for item in items:
        suite = getattr(getattr(item, "module", None), "INNER_SUITE", None)
        if isinstance(suite, InnerSuite) and suite not in suites:
            suites.append(suite)
    if suites:
        _driver = _Driver(suites)


def stop_children() -> None:
    """Kill the driver and its suites if still running (the session is ending)."""
    if _driver is not None:
        _driver.kill()


def _main(directory: Path) -> None:
    """The driver: run each suite in ``directory/suites.json``, one verdict file each.

    The environments are built first, all at once (downloads and installs, on a fresh
    machine), then the suites run one after another (each keeps a core busy).
    """
    suites = [InnerSuite(**spec) for spec in json.loads((directory / "suites.json").read_text())]
    with ThreadPoolExecutor(len(suites)) as pool:
        builds = [pool.submit(build_environment, s.builder, s.build_timeout_s) for s in suites]
    for suite, build in zip(suites, builds, strict=True):
        try:
            verdict = {"passed": True, "output": suite.run(build.result())}
        except AssertionError as exc:
            verdict = {"passed": False, "output": str(exc)}
        (directory / f"{_file_name(suite.suite)}.json").write_text(json.dumps(verdict))


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
