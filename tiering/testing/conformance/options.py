"""What a conformance run is told and what it reports: options, outcomes, the report.

This module owns the kit's public value types: :class:`KitOptions` (how a run
exercises a tier, including the seed that makes its keys and bytes
reproducible), :class:`CheckOutcome` (one check's verdict) and
:class:`ConformanceReport` (every verdict of a run, printable). It holds no
behaviour beyond validating options and formatting results.
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any

#: Environment variable that fixes the seed of every run that does not set one.
SEED_ENV = "TIERING_CONFORMANCE_SEED"


@dataclass(frozen=True)
class KitOptions:
    """How the kit exercises a tier.

    ``block_bytes``: block size used by every check. ``layout_fingerprint``:
    given to ``open``. ``persistent``: run the ``persistence`` check (the
    factory must return tiers over the same medium).

    ``seed``: makes every key and every block's bytes reproducible; printed on
    failure. None picks one at random per run (or takes
    ``$TIERING_CONFORMANCE_SEED``), so runs against a shared medium never see
    each other's keys.

    ``capacity_blocks``: the most blocks the tier holds (a bounded tier that
    evicts). None takes the tier's own ``capacity_blocks`` attribute after
    ``open`` when it is an int, else the tier is treated as unbounded. A
    bounded tier gets the ``eviction_reported`` check, and the other checks
    keep their working set within the capacity.

    ``distinct_keys``: keys written and read back in full by
    ``many_distinct_keys`` (capped by the capacity); 4,096 distinct keys find a
    1-in-256 corruption or a hash-slot collision with a miss chance below 1e-7.

    ``concurrency``: parallel operations in the concurrency checks (default:
    the tier's ``max_concurrency``, at most 64).

    ``op_timeout_s``: the longest one tier operation may take before the check
    fails naming it and its key. ``check_timeout_s``: the longest a whole check
    may take.

    ``max_loop_lag_s``: the longest the tier may hold the event loop in one
    operation; ``loop_samples``: operations of each kind that
    ``loop_not_blocked`` samples (it fails only when nearly all of them stall
    the loop past the limit and far more often than idle control turns).

    ``late_write_window_s``: how long buffers are watched for writes after
    their operation ended (a thread pool under load may run late).

    ``job_timeout_s``: the deadline used in ``deadline_through_facade`` (the
    jobs that must succeed there get it too: keep it well above one job's time).
    """

    block_bytes: int = 16384
    layout_fingerprint: str = "conformance-kit"
    persistent: bool = False
    seed: int | None = None
    capacity_blocks: int | None = None
    distinct_keys: int = 4096
    concurrency: int | None = None
    op_timeout_s: float = 10.0
    check_timeout_s: float = 120.0
    max_loop_lag_s: float = 0.025
    loop_samples: int = 12
    late_write_window_s: float = 0.5
    job_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("block_bytes", "distinct_keys", "loop_samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KitOptions.{name} must be a positive integer, got {value!r}")
        for name in ("capacity_blocks", "concurrency"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ValueError(f"KitOptions.{name} must be a positive integer or None")
        for name in (
            "op_timeout_s",
            "check_timeout_s",
            "max_loop_lag_s",
            "late_write_window_s",
            "job_timeout_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"KitOptions.{name} must be a positive number, got {value!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"KitOptions.seed must be an integer or None, got {self.seed!r}")

    def with_seed(self) -> KitOptions:
        """These options with ``seed`` fixed (from the environment or at random when None)."""
        if self.seed is not None:
            return self
        from_env = os.environ.get(SEED_ENV)
        if from_env:
            try:
                seed = int(from_env)
            except ValueError:
                raise ValueError(f"${SEED_ENV} must be an integer, got {from_env!r}") from None
        else:
            seed = random.SystemRandom().randrange(1 << 32)
        return dataclasses.replace(self, seed=seed)


def make_options(options: KitOptions | None, overrides: dict[str, Any]) -> KitOptions:
    """``options`` (default: :class:`KitOptions`) with keyword ``overrides`` applied."""
    base = options or KitOptions()
    if not overrides:
        return base
    unknown = set(overrides) - {f.name for f in dataclasses.fields(KitOptions)}
    if unknown:
        raise TypeError(f"unknown conformance kit options: {sorted(unknown)}")
    return dataclasses.replace(base, **overrides)


@dataclass(frozen=True)
class CheckOutcome:
    """One check's result: ``passed``, or the failure's one-line reason and traceback.

    ``detail``'s last line is the reason (it names the check, the key when one
    is at fault, and the seed to reproduce it).
    """

    name: str
    passed: bool
    skipped: bool = False
    detail: str = ""
    seconds: float = 0.0
    seed: int | None = None

    @property
    def reason(self) -> str:
        """The last line of ``detail``: why the check failed or was skipped."""
        text = self.detail.strip()
        return text.splitlines()[-1] if text else ""


@dataclass
class ConformanceReport:
    """Outcomes of every check run (see :func:`check_tier`)."""

    tier_name: str
    seed: int | None = None
    outcomes: list[CheckOutcome] = field(default_factory=list)

    @property
    def failures(self) -> list[CheckOutcome]:
        return [o for o in self.outcomes if not o.passed]

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_for_failures(self) -> None:
        """Raise ``AssertionError`` listing every failed check (nothing if all passed)."""
        if self.failures:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        lines = [f"conformance of {self.tier_name} (seed {self.seed}):"]
        for o in self.outcomes:
            status = "skip" if o.skipped else ("ok" if o.passed else "FAIL")
            lines.append(f"  {status:4} {o.name:28} {o.seconds * 1e3:8.1f} ms  {o.reason}")
        if self.failures:
            lines.append(
                f"reproduce with check_tier(..., seed={self.seed}) or {SEED_ENV}={self.seed}"
            )
        return "\n".join(lines)
