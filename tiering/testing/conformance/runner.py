"""Running checks: the registry of checks, time limits, reports and pytest test generation.

This module owns how checks are run, not what they check: :data:`CHECKS`
(every check by name, in order), :func:`run_check` (one check under
``check_timeout_s``, its failure turned into a :class:`CheckOutcome` that
names the check, the key and the seed), :func:`check_tier` (all of them, one
seed for the run) and :func:`conformance_tests` (one pytest test per check).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from tiering.testing.conformance import checks_cancel, checks_capacity, checks_data
from tiering.testing.conformance import checks_runtime as runtime_checks
from tiering.testing.conformance.kit import Kit, KitFailure, Skip, TierFactory
from tiering.testing.conformance.options import (
    SEED_ENV,
    CheckOutcome,
    ConformanceReport,
    KitOptions,
    make_options,
)
from tiering.tier import AsyncTier

#: Every check, by name, in the order they run.
CHECKS: dict[str, Callable[[Kit], Awaitable[None]]] = {
    "round_trip": checks_data.round_trip,
    "missing_key": checks_data.missing_key,
    "overwrite": checks_data.overwrite,
    "concurrent_distinct_keys": checks_data.concurrent_distinct_keys,
    "many_distinct_keys": checks_data.many_distinct_keys,
    "batch_partial_failure": checks_data.batch_partial_failure,
    "delete": checks_data.delete,
    "eviction_reported": checks_capacity.eviction_reported,
    "cancelled_write": checks_cancel.cancelled_write,
    "cancelled_read": checks_cancel.cancelled_read,
    "buffers_released_after_write": checks_cancel.buffers_released_after_write,
    "touch_and_list": checks_data.touch_and_list,
    "close_idempotent": checks_data.close_idempotent,
    "persistence": checks_data.persistence,
    "layouts_kept_apart": checks_data.layouts_kept_apart,
    "loop_not_blocked": runtime_checks.loop_not_blocked,
    "deadline_through_facade": runtime_checks.deadline_through_facade,
}

#: How long a check that overran its time limit gets to unwind after being cancelled.
_UNWIND_S = 5.0


async def run_check(
    name: str, factory: TierFactory, options: KitOptions | None = None, **option_kwargs: Any
) -> CheckOutcome:
    """Run the one check called ``name`` (see :data:`CHECKS`) and return its outcome.

    The check gets at most ``check_timeout_s`` (each tier call at most
    ``op_timeout_s``); a failure's last detail line names the check, the key
    at fault and the seed. Cancellation: cancels the check; tiers it opened
    are closed on the way out.
    """
    if name not in CHECKS:
        raise KeyError(f"no conformance check {name!r}; checks: {', '.join(CHECKS)}")
    opts = make_options(options, option_kwargs).with_seed()
    kit = Kit(name, factory, opts)
    started = time.perf_counter()

    def outcome(passed: bool, skipped: bool = False, detail: str = "") -> CheckOutcome:
        return CheckOutcome(name, passed, skipped, detail, time.perf_counter() - started, kit.seed)

    def failed(reason: str, trace: str = "") -> CheckOutcome:
        return outcome(
            False,
            detail=f"{trace}conformance check {name!r} failed (seed {kit.seed}; "
            f"reproduce with seed={kit.seed} or {SEED_ENV}={kit.seed}): {reason}",
        )

    task = asyncio.ensure_future(CHECKS[name](kit))
    try:
        done, _ = await asyncio.wait({task}, timeout=opts.check_timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise
    if not done:
        pending = sorted(set(kit.pending.values()))
        task.cancel()
        await asyncio.wait({task}, timeout=_UNWIND_S)
        still = "" if task.done() else f"; it ignored cancellation for {_UNWIND_S:g} s"
        return failed(
            f"did not finish within {opts.check_timeout_s:g} s (check_timeout_s); tier calls "
            f"still running: {', '.join(pending) or 'none'}{still}"
        )
    error = task.exception()
    if error is None:
        return outcome(True)
    if isinstance(error, Skip):
        return outcome(True, True, str(error))
    trace = "".join(traceback.format_exception(error))
    if isinstance(error, KitFailure):
        return failed(str(error), trace)
    return failed(f"{type(error).__name__}: {error}", trace)


async def check_tier(
    factory: TierFactory,
    options: KitOptions | None = None,
    *,
    only: Iterable[str] | None = None,
    raise_on_failure: bool = True,
    **option_kwargs: Any,
) -> ConformanceReport:
    """Run the conformance suite against tiers made by ``factory``.

    ``options`` (or the same fields as keywords, e.g. ``block_bytes=4096``)
    tune the run; ``only`` restricts it to some checks. Every check uses the
    same seed (printed in the report). Raises ``AssertionError`` listing every
    failed check unless ``raise_on_failure`` is False; returns the report
    either way. Cancellation: stops after closing the tiers of the running check.
    """
    opts = make_options(options, option_kwargs).with_seed()
    names = list(CHECKS) if only is None else list(only)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise KeyError(f"no conformance checks {unknown}; checks: {', '.join(CHECKS)}")
    report = ConformanceReport(tier_name=_factory_name(factory), seed=opts.seed)
    for name in names:
        report.outcomes.append(await run_check(name, factory, opts))
    if raise_on_failure:
        report.raise_for_failures()
    return report


def conformance_tests(
    factory: Callable[..., AsyncTier | Awaitable[AsyncTier]],
    options: KitOptions | None = None,
    *,
    prefix: str = "test_conformance_",
    skip: Sequence[str] = (),
    **option_kwargs: Any,
) -> dict[str, Callable[..., None]]:
    """One pytest test function per check, keyed by test name; ``globals().update(...)`` them.

    The factory's parameters (e.g. ``tmp_path``) become each test's
    parameters, so pytest injects those fixtures. ``skip`` leaves checks out.
    Each test runs under ``asyncio.run`` (no pytest-asyncio needed).
    """
    opts = make_options(options, option_kwargs)
    unknown = [n for n in skip if n not in CHECKS]
    if unknown:
        raise KeyError(f"skip names no conformance checks {unknown}; checks: {', '.join(CHECKS)}")
    signature = inspect.signature(factory)
    tests: dict[str, Callable[..., None]] = {}
    for name in CHECKS:
        if name in skip:
            continue

        def test(*args: Any, _name: str = name, **kwargs: Any) -> None:
            bound = functools.partial(factory, *args, **kwargs)
            outcome = asyncio.run(run_check(_name, bound, opts))
            if outcome.skipped:
                _pytest_skip(outcome.detail)
            if not outcome.passed:
                raise AssertionError(outcome.detail)

        test.__name__ = test.__qualname__ = prefix + name
        test.__doc__ = f"Conformance check {name!r} of {_factory_name(factory)}."
        test.__signature__ = signature  # type: ignore[attr-defined]
        tests[prefix + name] = test
    return tests


def _pytest_skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


def _factory_name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)
