"""What the replay counts itself: hits by place, blocks moved, latencies, phases of wall time.

This module owns :class:`ReplayTotals`, the tally :class:`~tiering.replay.replayer.Replayer`
keeps as it drives the stack and :func:`~tiering.replay.report.build_report` reads
(the tiers' own figures come from the manager's statistics), with the names of the
places a block can be served from (:data:`GPU`, :data:`CPU`, or a secondary tier's
name) and of the phases its wall time is split into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiering.replay.metrics import LatencySamples, PhaseClock

GPU = "gpu"
CPU = "cpu"

# Phases of the replay's wall time.
PHASE_GPU = "gpu_side"
PHASE_TIER = "tier_work"
PHASE_PROMOTION_WAIT = "promotion_wait"  # part of the tier work
PHASE_STORE_STALL = "store_stall"  # part of the tier work
PHASE_DRAIN = "drain"


@dataclass(slots=True)
class HitTally:
    """Tokens and blocks served by one place (GPU, CPU or a secondary tier)."""

    tokens: int = 0
    blocks: int = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.blocks += 1


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A loaded block whose bytes were not the bytes stored."""

    request_index: int
    hash_id: int
    source: str


@dataclass(slots=True)
class ReplayTotals:
    """Everything the replay counted itself (the tiers' own figures come from stats)."""

    requests_total: int = 0
    requests_done: int = 0
    total_tokens: int = 0
    total_blocks: int = 0
    hits: dict[str, HitTally] = field(default_factory=dict)
    blocks_stored: int = 0  # GPU -> CPU
    blocks_loaded: int = 0  # CPU -> GPU
    blocks_promoted_used: int = 0  # promoted from a secondary tier and loaded
    store_rejected_blocks: int = 0  # prepare_store returned None
    # The manager counts each refused prepare_store as dropped; the replay retries a
    # refused chunk while tier jobs free rows: these refusals dropped nothing.
    retried_refusal_blocks: int = 0
    promotion_timeouts: int = 0  # blocks still in flight at the promotion timeout
    lost_before_load: int = 0  # answered True, gone by the time of prepare_load
    load_errors: int = 0  # prepare_load refused blocks the lookup found
    verified_blocks: int = 0
    mismatches: int = 0
    mismatch_examples: list[Mismatch] = field(default_factory=list)
    store_latency: LatencySamples = field(default_factory=LatencySamples)
    load_latency: LatencySamples = field(default_factory=LatencySamples)
    promotion_latency: LatencySamples = field(default_factory=LatencySamples)
    store_stalls: LatencySamples = field(default_factory=LatencySamples)
    clock: PhaseClock = field(default_factory=PhaseClock)
    wall_s: float = 0.0
    interrupted: bool = False
    draining: bool = False  # the requests are done; waiting for tier jobs in flight
    drained: bool = True

    def hit(self, place: str) -> HitTally:
        tally = self.hits.get(place)
        if tally is None:
            tally = self.hits[place] = HitTally()
        return tally
