"""The bottom layer: the scheduler-facing contract's types, which everything else speaks.

``errors`` (every exception the framework raises), ``keys`` (``OffloadKey``,
``ReqContext``), ``specs`` (``LoadStoreSpec`` and its family), ``jobs``
(``JobMetadata``/``JobResult`` and the seed's ``SecondaryTierManager``),
``contract`` (``OffloadingManager`` and its result types) and ``stats`` (the
statistics snapshots managers and tiers return). Nothing here imports any
other part of ``tiering``; the names users need are re-exported by ``tiering``.
"""
