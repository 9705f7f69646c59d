"""Terminal plumbing for the ``tiering`` command: consoles, logging, progress, Ctrl-C.

The report goes to stdout and everything else (progress bar, log lines) to stderr,
so ``--json`` output stays machine-readable. A replay drives thousands of tier
operations; a tier that logs the same complaint for each would bury the report, so
repeated log messages are shown a few times and then counted.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from types import FrameType

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: Width of the report when stdout is not a terminal (its tables are wider than 80).
REDIRECTED_WIDTH = 120


def consoles() -> tuple[Console, Console]:
    """The report's console (stdout) and the console for progress and logs (stderr)."""
    out = Console()
    if not out.is_terminal:
        out = Console(width=REDIRECTED_WIDTH)
    return out, Console(stderr=True)


class RepeatLimiter(logging.Filter):
    """Lets each distinct message (logger, level, format string) through ``limit`` times."""

    def __init__(self, limit: int = 3) -> None:
        super().__init__()
        self.limit = limit
        self._seen: Counter[tuple[str, int, str]] = Counter()
        self._examples: dict[tuple[str, int, str], str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        self._seen[key] += 1
        if self._seen[key] <= self.limit:
            return True
        self._examples.setdefault(key, record.getMessage())
        return False

    def suppressed(self) -> list[tuple[int, str, str]]:
        """``(count, logger name, an example message)`` for every message held back."""
        return [
            (self._seen[key] - self.limit, key[0], example)
            for key, example in self._examples.items()
        ]


@contextlib.contextmanager
def logging_to(console: Console, verbose: int) -> Iterator[RepeatLimiter]:
    """Route log records to ``console`` (WARNING, or INFO/DEBUG with ``-v``/``-vv``),
    limiting repeats; on exit, log how many of each repeated message were held back."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = RichHandler(console=console, show_path=False)
    limiter = RepeatLimiter()
    handler.addFilter(limiter)
    logging.basicConfig(level=level, format="%(name)s: %(message)s", handlers=[handler], force=True)
    try:
        yield limiter
    finally:
        handler.removeFilter(limiter)
        for count, name, example in limiter.suppressed():
            logging.getLogger(name).warning(
                "... and %d more messages like this one: %s", count, example
            )


def progress_bar(console: Console, disable: bool) -> Progress:
    """A progress bar with a free ``status`` field; hidden when stderr is not a terminal."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=disable or not console.is_terminal,
    )


#: The signals that stop a run the way Ctrl-C does: ``timeout``, systemd and ``docker
#: stop`` send SIGTERM, a closed terminal SIGHUP.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived where the run cannot stop cleanly (or a second one arrived)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalStop:
    """SIGINT, SIGTERM and SIGHUP, handled alike for the whole command.

    While a :meth:`clean_stop` block runs (the replay or the sweep loop), the
    first signal only sets its event, so the loop ends after the current step and
    the partial report is still printed; outside such a block, and for a second
    signal, :class:`Interrupted` is raised at once, so ``with`` blocks (the temp
    directory, the stack) still clean up on the way out. ``signum`` is the first
    signal received (for the exit status, 128 + signum).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._stop: threading.Event | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalStop:
        try:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._restore()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if first and self._stop is not None:
            self._stop.set()
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def clean_stop(self, stop: threading.Event) -> Iterator[None]:
        """Within the block, a first signal sets ``stop`` instead of raising."""
        self._stop = stop
        if self.signum is not None:
            stop.set()
        try:
            yield
        finally:
            self._stop = None

    @property
    def exit_status(self) -> int:
        """128 + the signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP), as shells report."""
        return 128 + (self.signum if self.signum is not None else signal.SIGINT)
