"""Small measurement helpers for the replay: latency samples and phase timers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles of a set of durations, in seconds."""

    count: int
    total_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "count": self.count,
            "total_s": self.total_s,
            "p50_ms": self.p50_s * 1e3,
            "p90_ms": self.p90_s * 1e3,
            "p99_ms": self.p99_s * 1e3,
            "max_ms": self.max_s * 1e3,
        }


@dataclass(slots=True)
class LatencySamples:
    """Durations (seconds) of one kind of operation, kept whole for exact percentiles."""

    samples: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def summary(self) -> LatencySummary:
        if not self.samples:
            return LatencySummary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        values = np.asarray(self.samples)
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return LatencySummary(
            len(self.samples),
            float(values.sum()),
            float(p50),
            float(p90),
            float(p99),
            float(values.max()),
        )


@dataclass(slots=True)
class PhaseClock:
    """Wall time spent in named phases of the replay loop (seconds)."""

    totals: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def get(self, name: str) -> float:
        return self.totals.get(name, 0.0)
