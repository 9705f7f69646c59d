"""The read and write paths of a striped fs tier: a batch split by root, the roots at once.

A batch's blocks are grouped by the root that holds them (reads) or that
they go to (writes, :meth:`RootSet.destination`), and each group runs the
one-root path (:func:`~tiers.fs.reads.read_blocks`,
:func:`~tiers.fs.writes.write_blocks`) on its root, all groups at once. A
root taken out of service during a write sends that write's failed blocks to
the next live root in one more round; what fails then is dropped (the error
is the caller's to count), never waited for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey
from tiers.fs.reads import read_blocks
from tiers.fs.roots import NoRootInServiceError, Root, RootSet
from tiers.fs.state import OpenState
from tiers.fs.writes import write_blocks

Errors = dict[bytes, BaseException]
_RootPath = Callable[[OpenState, Sequence[OffloadKey], Sequence[memoryview]], Awaitable[Errors]]


async def read_striped(
    roots: RootSet, keys: Sequence[OffloadKey], into: Sequence[memoryview]
) -> Errors:
    """Read ``keys`` into ``into`` from the roots holding them; the errors by key."""
    if len(keys) != len(into):
        raise ValueError(f"{len(keys)} keys but {len(into)} buffers")
    groups: dict[Root, list[int]] = {}
    errors: Errors = {}
    for i, key in enumerate(keys):
        root = roots.holder(key)
        if root is None:
            errors[key] = BlockNotFound(key)
        else:
            groups.setdefault(root, []).append(i)
    for found in await _on_roots(roots, groups, keys, into, read_blocks, stores=False):
        errors.update(found)
    return errors


async def write_striped(
    roots: RootSet, keys: Sequence[OffloadKey], data: Sequence[memoryview]
) -> Errors:
    """Store ``data`` as ``keys``' blocks, each on its destination root; the errors by key."""
    if len(keys) != len(data):
        raise ValueError(f"{len(keys)} keys but {len(data)} buffers")
    if len(set(keys)) != len(keys):
        raise ValueError("a write batch names the same key twice")
    pending = list(range(len(keys)))
    errors: Errors = {}
    for _ in range(2):  # the second round only for blocks of a root taken out in the first
        round_errors: Errors = {}
        groups: dict[Root, list[int]] = {}
        for i in pending:
            root = roots.destination(keys[i])
            if root is None:
                round_errors[keys[i]] = NoRootInServiceError(len(roots.roots))
            else:
                groups.setdefault(root, []).append(i)
        states = {root: root.state for root in groups}
        for found in await _on_roots(roots, groups, keys, data, write_blocks, stores=True):
            round_errors.update(found)
        errors.update(round_errors)
        retry = [  # the failed blocks of roots taken out of service meanwhile
            i
            for root, positions in groups.items()
            if root.state is not states[root]
            for i in positions
            if keys[i] in round_errors
        ]
        if not retry or not roots.in_service():
            break
        for i in retry:
            del errors[keys[i]]
        pending = retry
    return errors


async def _on_roots(
    roots: RootSet,
    groups: dict[Root, list[int]],
    keys: Sequence[OffloadKey],
    views: Sequence[memoryview],
    run: _RootPath,
    *,
    stores: bool,
) -> list[Errors]:
    """``run`` on each root's share of the batch, the roots at once; each one's errors.

    An exception of one root's call cancels the others and is raised as it
    is (not in an ``ExceptionGroup``) once they have returned. Cancellation:
    every root's call is cancelled, and this returns only once each has
    returned (no buffer is used after it).
    """
    calls = []
    for root, positions in groups.items():
        share = [keys[i] for i in positions]
        share_views = [views[i] for i in positions]

        def on_state(
            state: OpenState,
            share: list[OffloadKey] = share,
            share_views: list[memoryview] = share_views,
        ) -> Awaitable[Errors]:
            return run(state, share, share_views)

        calls.append(roots.call(root, on_state, share, stores=stores))
    if len(calls) == 1:
        return [await calls[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except BaseExceptionGroup as failed:
        first = failed.exceptions[0]
        if len(failed.exceptions) == 1 and isinstance(first, Exception):
            raise first from None  # its own type, as a tier of one root raises it
        raise
    return [task.result() for task in tasks]
