"""Deletes that remove only the value this tier judged, never one written since.

Other engines share the keys: between this tier's read of a value and its
delete, another engine may rewrite the key with a valid block. So a delete
names the value it means, and a Lua script on the server deletes the key only
if it still holds that value (scripts run atomically there). Loop-thread
code of one tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiering.core.keys import OffloadKey
from tiers.redis.errors import RejectedValue
from tiers.redis.layout import BlockLayout
from tiers.redis.rejections import RejectionLog
from tiers.redis.round_trips import FillPipeline, RoundTrips
from tiers.redis.stats import RedisTierStats

#: Deletes KEYS[1] only if its value still starts with the header ARGV[1] (the header
#: holds the payload's checksum or tag, so it names the value). Returns 1 when deleted.
DELETE_IF_HEADER = """
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then return 0 end
if redis.call('GETRANGE', KEYS[1], 0, string.len(ARGV[1]) - 1) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Deletes KEYS[1] only if it still holds the value whose SHA-1 is ARGV[1] (an
#: empty ARGV[1]: only if it still holds a non-string). Returns 1 when deleted.
DELETE_IF_SAME = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind ~= 'string' then
  if ARGV[1] == '' then return redis.call('DEL', KEYS[1]) end
  return 0
end
if ARGV[1] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def delete_if_header(name: bytes, header: bytes) -> FillPipeline:
    """A pipeline fill deleting ``name`` only while its value starts with ``header``."""
    return lambda pipe: pipe.execute_command("EVAL", DELETE_IF_HEADER, 1, name, header)


async def delete_rejected(
    round_trips: RoundTrips,
    layout: BlockLayout,
    rejected: Sequence[RejectedValue],
    stats: RedisTierStats,
    log: RejectionLog | None,
) -> None:
    """Delete values that failed verification, so no engine finds them again.

    Each is deleted only if the key still holds that same value (compared on
    the server by its SHA-1), so a valid block another engine wrote since our
    read is kept. Best effort: a failure is logged (rate limited) and the
    value stays a miss for this tier either way. Cancellation: some of the
    values may have been deleted.
    """
    commands = [(layout.redis_key(OffloadKey(r.key)), r.value_sha1 or "") for r in rejected]

    def fill(pipe: Any) -> None:
        for name, digest in commands:
            pipe.execute_command("EVAL", DELETE_IF_SAME, 1, name, digest)

    def note_failure(count: int, error: BaseException) -> None:
        if log is not None:
            log.note_delete_failure(round_trips.where("DEL"), count, error)

    try:
        replies = await round_trips.run("DEL", fill)
    except Exception as exc:
        note_failure(len(rejected), exc)
        return
    stats.rejected_deleted += sum(1 for reply in replies if reply == 1)
    failures = [reply for reply in replies if isinstance(reply, BaseException)]
    if failures:
        note_failure(len(failures), failures[0])
