"""``cascade_admission`` inside vLLM: our tiers admit what vLLM's manager offers them.

vLLM's ``TieringOffloadingManager`` cascades every block stored into its CPU
tier to every secondary tier; it has no admission step. Our manager asks an
:class:`~tiering.policies.admission.AdmissionPolicy` instead, at store time
(``admit``) and when a request uses a block still in the CPU tier
(``on_use``). Under vLLM each of our tiers runs that policy on the blocks
vLLM offers it:

* a block just stored into the CPU tier arrives in ``submit_store`` (vLLM's
  ``complete_store`` cascade): the policy's ``admit`` decides;
* a block a request reuses while it is still in the CPU tier: the tier asks
  for vLLM's request-level offload (``OffloadPolicy.REQUEST_LEVEL``), under
  which vLLM offers the tier every block of each request, prefix hits
  included, pinned in the CPU tier. Such an offer is the block's reuse, so it
  reaches the policy's ``admit`` again - which is how ``"reuse"`` already
  reads a second store. ``on_use`` is not called under vLLM.

Blocks the tier holds or is storing are taken out of an offer before the
policy sees it (they are not new stores, and a refused block would cut the
prefix short). Refused blocks are not copied; the job still completes, so vLLM
unpins them at once. Each tier keeps its own policy: every one of our tiers
sees the same offers (vLLM's own tiers in the same list are not affected).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tiering.config import _cascade_admission
from tiering.core.jobs import JobMetadata
from tiering.core.keys import OffloadKey
from tiering.core.specs import as_block_ids
from tiering.policies.admission import AdmissionPolicy


def admission_policy(extra: Mapping[str, Any], capacity: int) -> AdmissionPolicy[OffloadKey] | None:
    """The policy ``cascade_admission`` names, or None for ``"all"`` (no work per block).

    ``capacity`` is the CPU tier's number of chunks (the scale of the policy's
    history). Raises :class:`~tiering.core.errors.ConfigError` for a setting that
    names no policy, and what the policy raises for bad options.
    """
    choice = _cascade_admission(extra)
    if choice is None:
        return None
    policy: AdmissionPolicy[OffloadKey] = choice.build(max(1, capacity))
    return policy


class OfferAdmission:
    """One tier's admission policy applied to the store jobs vLLM's manager submits."""

    def __init__(self, policy: AdmissionPolicy[OffloadKey], holds: Callable[[OffloadKey], bool]):
        self._policy = policy
        self._holds = holds  # held or being stored by the tier: not a new offer
        self.offered = 0  # blocks offered to the policy
        self.refused = 0  # of those, blocks it did not admit

    def admit(self, job: JobMetadata) -> JobMetadata:
        """The job narrowed to the blocks the policy admits, in the offer's order.

        The narrowed job may have no keys: it still runs, so vLLM gets its
        result and releases the pins.
        """
        holds = self._holds
        positions = {key: i for i, key in enumerate(job.keys) if not holds(key)}
        if not positions:
            return dataclasses.replace(job, keys=(), block_ids=as_block_ids([]))
        admitted = self._policy.admit(list(positions))
        self.offered += len(positions)
        self.refused += len(positions) - len(admitted)
        if len(admitted) == len(job.keys):
            return job
        rows = job.block_ids
        return dataclasses.replace(
            job,
            keys=tuple(admitted),
            block_ids=as_block_ids([int(rows[positions[key]]) for key in admitted]),
        )
