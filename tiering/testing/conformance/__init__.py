"""The tier conformance kit: the generic behaviour suite every tier must pass.

This package is the kit's public face; its modules own one part each:
``options`` (options, outcomes, the report), ``kit`` (seeded keys and bytes,
tracked tier calls with deadlines, full-content verification),
``checks_data`` / ``checks_cancel`` / ``checks_capacity`` /
``checks_runtime`` (the checks) and ``runner`` (time limits, reports, pytest
generation).

One call runs it against any tier factory (a callable returning a fresh,
unopened :class:`~tiering.tier.AsyncTier`, sync or async)::

    report = await check_tier(lambda: MyTier(root=tmp_dir))
    report.raise_for_failures()        # AssertionError listing every failed check

or, in a pytest module, one line generates one test function per check::

    from tiering.testing.conformance import conformance_tests
    globals().update(conformance_tests(lambda tmp_path: MyTier(root=tmp_path)))

The factory's parameters become the generated tests' parameters, so pytest
fixtures (``tmp_path``, a server fixture...) are injected by name. Generated
tests are plain synchronous functions (each runs its check under
``asyncio.run``), so they need no pytest-asyncio.

Keys and bytes come from a seed (``KitOptions.seed``, else
``$TIERING_CONFORMANCE_SEED``, else random per run) and the check's name:
a failure prints the seed, and the same seed reproduces it exactly. Each
check gets fresh tiers from the factory and its own keys, so checks never see
each other's blocks even on a shared medium. Every tier call has a deadline
(``op_timeout_s``) and every check a time limit (``check_timeout_s``): a hung
tier fails, naming the call and the key, instead of hanging the suite. A
bounded tier (``KitOptions.capacity_blocks``, or its own ``capacity_blocks``
attribute) gets working sets that fit and the ``eviction_reported`` check.

The checks (:data:`CHECKS`, in order):

``round_trip``            bytes written are the bytes read; ``contains`` agrees.
``missing_key``           a key never written: ``contains`` False, ``read``
                          raises ``BlockNotFound``.
``overwrite``             a second write replaces the block.
``concurrent_distinct_keys``  ``max_concurrency`` writes and reads at once, and
                          the batch forms, all keep every key's own bytes.
``many_distinct_keys``    ``distinct_keys`` (4,096) keys written and read back in
                          full, and keys never written stay absent: catches
                          rare corruption and keys colliding in a hash table.
``batch_partial_failure`` ``read_many`` with an absent key raises
                          ``PartialBatchError`` naming what succeeded and failed.
``delete``                a deleted block is gone; deleting an absent key is no
                          error (skipped when the tier does not support delete).
``eviction_reported``     (bounded tiers) overfilled, the tier holds at most its
                          capacity and reports every block it evicted with
                          ``report_removed``; evicted keys read as absent.
``cancelled_write``       a write cancelled at any point leaves the block absent
                          or complete, never readable with partial bytes (also
                          for an overwrite: old or new bytes, nothing else).
``cancelled_read``        a read cancelled at any point leaves the stored block
                          intact, and nothing writes into its buffer afterwards
                          (watched for ``late_write_window_s``).
``buffers_released_after_write``  once a write returned or was cancelled, its
                          source buffer is the caller's: reusing it at once never
                          changes what the tier stores.
``touch_and_list``        ``touch`` of present and absent keys is no error;
                          ``list_keys`` returns keys.
``close_idempotent``      ``aclose`` twice is no error.
``persistence``           (with ``persistent=True``) blocks written before
                          ``aclose`` are listed and readable by a new tier.
``layouts_kept_apart``    (with ``persistent=True``) a tier opened under another
                          layout fingerprint never lists, contains or serves them.
``loop_not_blocked``      sampled with a 1 ms ticker, no kind of operation holds
                          the event loop past ``max_loop_lag_s`` (25 ms) in nearly
                          all of its calls while idle control turns do not.
``deadline_through_facade``  through :class:`~tiering.runtime.AsyncTierManager`,
                          a job whose operation hangs fails cleanly at its
                          deadline, and the next jobs still round-trip bytes.
"""

from __future__ import annotations

from tiering.testing.conformance.kit import KitFailure, TierFactory
from tiering.testing.conformance.options import (
    SEED_ENV,
    CheckOutcome,
    ConformanceReport,
    KitOptions,
)
from tiering.testing.conformance.runner import (
    CHECKS,
    check_tier,
    conformance_tests,
    run_check,
)

__all__ = [
    "CHECKS",
    "SEED_ENV",
    "CheckOutcome",
    "ConformanceReport",
    "KitFailure",
    "KitOptions",
    "TierFactory",
    "check_tier",
    "conformance_tests",
    "run_check",
]
