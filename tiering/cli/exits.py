"""Exit statuses of the ``tiering`` command: the ``EXIT_*`` numbers, their help text, the
bad-input error (:class:`UsageError`) and how a replay's report maps to its status."""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_WRONG_BYTES = 1
EXIT_FAILED = EXIT_WRONG_BYTES  # the name before tier failures had their own status
EXIT_BAD_INPUT = 2
EXIT_TIER_FAILURES = 3
EXIT_INTERNAL_ERROR = 4
EXIT_INTERRUPTED = 130  # SIGINT; SIGTERM gives 143 and SIGHUP 129 (128 + the signal)

EXIT_STATUS_HELP = """\
exit status:
  0    every loaded block held the bytes stored, and no more tier failures than
       --max-tier-failures
  1    a loaded block did not hold the bytes stored (wrong bytes served)
  2    bad input: arguments, trace, config, a tier that cannot start
  3    more tier failures than --max-tier-failures (default 0): failed tier jobs
       (not counting routine misses: blocks a bounded or shared tier dropped
       between the lookup and the read), tier timeouts and corrupt reads
  4    internal error (a bug; the traceback is printed)
  130  stopped by SIGINT (Ctrl-C), 143 by SIGTERM, 129 by SIGHUP: the partial
       report is printed, the run's temporary directory removed
Wrong bytes (1) outrank a signal, which outranks tier failures (3).
--json's "ok" is true exactly when the status is 0."""


class UsageError(Exception):
    """Bad command-line input; the message says which argument and why."""


def signal_name(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def tier_failure_count(report: dict[str, Any]) -> int:
    """What ``--max-tier-failures`` bounds: failed tier jobs, tier timeouts, corrupt reads.

    Routine failures are not counted: a load whose blocks left a bounded or
    shared tier between the lookup and the read (evicted, or dropped by another
    engine) is a miss the tier reports correctly, as every bounded tier does.
    """
    failures = report["failures"]
    return int(
        failures["tier_job_failures"]
        - failures["routine_job_failures"]
        + failures["tier_timeouts"]
        + failures["corrupt_reads"]
    )


def replay_exit_status(report: dict[str, Any], max_tier_failures: int, signum: int | None) -> int:
    """The run's exit status (see :data:`EXIT_STATUS_HELP`); also records the tier failures
    against their limit in ``report["tier_failures"]``."""
    count = tier_failure_count(report)
    report["tier_failures"] = {
        "count": count,
        "max_allowed": max_tier_failures,
        "exceeded": count > max_tier_failures,
    }
    if report["verification"]["mismatches"]:
        return EXIT_WRONG_BYTES
    if signum is not None:
        return 128 + signum
    if report["interrupted"]:
        return EXIT_INTERRUPTED
    if count > max_tier_failures:
        return EXIT_TIER_FAILURES
    return EXIT_OK
