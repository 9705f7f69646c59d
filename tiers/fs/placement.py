"""Which root of a striped fs tier a new block goes to: weighted rendezvous hashing.

Each root scores every key with a hash seeded by the root's path; the key goes
to the live root with the best score, the score weighted by the root's
capacity (Schindelhauer and Schomaker's weighted rendezvous hashing: root *i*
wins with probability ``w_i / sum(w)``). So the placement is a stable
function of the key and the set of roots: a restart puts every key where it
was, the order of ``root_dirs`` does not matter, and a root that leaves (or
is out of service) moves only its own keys, each to its next-best root.

Placement decides only where a *new* block is written: lookups consult every
root's index, so a block stays reachable on the root that holds it whatever
the set of roots has become since.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

_TWO_52 = float(1 << 52)


def _uniform(key: bytes, seed: int) -> float:
    """A draw strictly inside (0, 1) per (key, root): 52 bits, so it never rounds to 1."""
    return ((xxhash.xxh3_64_intdigest(key, seed) >> 12) + 0.5) / _TWO_52


def root_seed(root: str) -> int:
    """The hash seed of a root, from its path (stable across processes and restarts)."""
    return xxhash.xxh3_64_intdigest(root.encode("utf-8", "surrogateescape"))


def place(
    key: bytes, seeds: Sequence[int], weights: Sequence[float], live: Sequence[bool]
) -> int | None:
    """The best live root for ``key``, or None when no root is live."""
    best, best_score = None, -1.0
    for i, (seed, weight) in enumerate(zip(seeds, weights, strict=True)):
        if not live[i]:
            continue
        score = -weight / math.log(_uniform(key, seed))
        if score > best_score:
            best, best_score = i, score
    return best
