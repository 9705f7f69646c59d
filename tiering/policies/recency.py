"""Recency over two resident lists, each in use order, each key's value its use stamp.

ARC (``T1``, ``T2``) and ``kvaware`` (probation, protected) keep their resident keys
in two ordered dicts, oldest use first. When every use also stamps the key with one
counter, the least-recently-used order of the whole resident set is the merge of the
two lists by stamp: the adaptive policy's LRU expert reads it from the reuse expert
instead of keeping a third order, which cost a dict operation per use plus the cache
misses of one more structure (half of its per-insert cost at 100k keys).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import pairwise
from operator import itemgetter

from tiering.policies.base import K

_STAMP = itemgetter(1)


def least_recent(
    first: OrderedDict[K, int], second: OrderedDict[K, int], n: int, can_evict: Callable[[K], bool]
) -> list[K]:
    """Remove and return up to ``n`` evictable keys of both lists, least recent use first."""
    victims: list[K] = []
    if n <= 0:
        return victims
    first_items, second_items = iter(first.items()), iter(second.items())
    a = next(first_items, None)
    b = next(second_items, None)
    from_first: list[K] = []
    from_second: list[K] = []
    while a is not None or b is not None:
        if b is None or (a is not None and a[1] < b[1]):
            assert a is not None
            key, taken = a[0], from_first
            a = next(first_items, None)
        else:
            key, taken = b[0], from_second
            b = next(second_items, None)
        if can_evict(key):
            taken.append(key)
            victims.append(key)
            if len(victims) == n:
                break
    # Deleted after the walk: an OrderedDict cannot change while iterated.
    for key in from_first:
        del first[key]
    for key in from_second:
        del second[key]
    return victims


def restamp(key: K, lists: tuple[OrderedDict[K, int], ...], stamp: int) -> bool:
    """Move ``key`` to the end of the first of ``lists`` holding it, stamped ``stamp``;
    whether one did (a refresh: the most recent use, in the list it is in)."""
    for resident in lists:
        if key in resident:
            resident.move_to_end(key)
            resident[key] = stamp
            return True
    return False


def by_recency(first: OrderedDict[K, int], second: OrderedDict[K, int]) -> Iterator[K]:
    """Both lists' keys, least recent use first (O(n); introspection and tests)."""
    return (key for key, _ in heapq.merge(first.items(), second.items(), key=_STAMP))


def check_use_order(keys: OrderedDict[K, int], name: str) -> None:
    """Assert that ``keys`` is in use order (stamps strictly increasing): O(n)."""
    assert all(a < b for a, b in pairwise(keys.values())), f"{name} is not in use order"
