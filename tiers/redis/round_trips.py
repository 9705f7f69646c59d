"""Pipelined round trips to Redis or Redis Cluster, for one tier.

:class:`RoundTrips` runs the pipelines a tier fills: one round trip per node
(a cluster's nodes concurrently), within a time budget, at most
``max_connections`` at once, failing at once while the server is known to be
down (:class:`~tiers.redis.gate.ReconnectGate`). It owns the client and the
outage counters of :class:`~tiers.redis.stats.RedisTierStats`; the tier owns
what the commands mean. Loop-thread state, like the tier.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tiers.redis.config import RedisTierConfig
from tiers.redis.connection import RedisClient, is_unreachable, translate
from tiers.redis.errors import RedisTierTimeout, RedisTierUnavailable
from tiers.redis.gate import ReconnectGate
from tiers.redis.stats import RedisTierStats

logger = logging.getLogger(__name__)

#: What one pipeline command produced: a reply, or the error for that command.
Reply = Any
#: Queues a round trip's commands on the pipeline it is given.
FillPipeline = Callable[[Any], None]


class RoundTrips:
    """The client of one tier and the rules every round trip of it follows.

    ``name`` gives the tier's name for messages (known once it is opened).
    """

    def __init__(
        self, config: RedisTierConfig, stats: RedisTierStats, name: Callable[[], str]
    ) -> None:
        self.config = config
        self.stats = stats
        self._name = name
        self.gate = ReconnectGate(config.reconnect_interval_s, config.max_reconnect_interval_s)
        # Worst case for one round trip: re-dial a dead pooled connection, then wait
        # out the reply; redis-py's own timeouts normally end it well before this.
        self.budget_s = 2 * (config.connect_timeout_s + config.op_timeout_s)
        self.client: RedisClient | None = None
        self._connections: asyncio.Semaphore | None = None

    def start(self, client: RedisClient) -> None:
        """Use ``client`` from now on (on the tier's loop: the semaphore binds to it)."""
        self.client = client
        self._connections = asyncio.Semaphore(self.config.max_connections)

    async def aclose(self) -> None:
        """Close every connection. Idempotent.

        Cancellation: connections not yet closed are dropped with the client.
        """
        client, self.client = self.client, None
        if client is not None:
            await client.aclose()

    def where(self, op: str) -> str:
        return f"redis tier {self._name()!r} {op} on {self.config.safe_url()}"

    async def run(self, op: str, fill: FillPipeline) -> list[Reply]:
        """Run one pipeline filled by ``fill``: one round trip per node.

        Returns one reply per command; a command the server refused comes back
        as its exception. Raises (translated) when the whole round trip fails,
        and :class:`RedisTierUnavailable` at once while the server is known to
        be down. Never takes longer than :attr:`budget_s`. Cancellation: the
        connections in use are dropped; commands already sent may have run.
        """
        client = self.client
        if client is None or self._connections is None:
            raise RedisTierUnavailable(f"{self.where(op)}: the tier is closed")
        if not self.gate.admit():
            self.stats.refused_while_down += 1
            raise RedisTierUnavailable(
                f"{self.where(op)}: server unreachable; next connection attempt in "
                f"{self.gate.seconds_until_probe():.1f}s"
            )
        async with self._connections:
            try:
                async with asyncio.timeout(self.budget_s):
                    if self.config.cluster:
                        replies = await self._cluster_round_trip(client, fill)
                    else:
                        pipe = client.pipeline(transaction=False)
                        fill(pipe)
                        replies = await pipe.execute(raise_on_error=False)
            except Exception as exc:
                error = translate(exc, self.where(op))
                if isinstance(error, RedisTierTimeout):
                    self.stats.timeouts += 1
                if is_unreachable(exc):
                    self.note_unreachable()
                raise error from exc
        self.note_reachable()
        return replies

    async def _cluster_round_trip(self, client: Any, fill: FillPipeline) -> list[Reply]:
        """One pipeline per node, concurrently: a node that is down fails only its commands.

        (redis-py's cluster pipeline fails every command of the pipeline when
        one node cannot be reached.) Raises the first node's error when every
        node failed, so a cluster-wide outage still closes the gate.
        """
        commands = _Commands()
        fill(commands)
        groups: dict[str, list[int]] = {}
        replies: list[Reply] = [None] * len(commands.queue)
        for index, (args, _) in enumerate(commands.queue):
            try:
                node = client.get_node_from_key(_key_of(args))
            except Exception as exc:  # a slot no node covers (CLUSTERDOWN)
                replies[index] = exc
                continue
            groups.setdefault(node.name, []).append(index)
        pipes = []
        for indices in groups.values():
            pipe = client.pipeline()
            for index in indices:
                args, options = commands.queue[index]
                pipe.execute_command(*args, **options)
            pipes.append(pipe)
        outcomes = await asyncio.gather(
            *(pipe.execute(raise_on_error=False) for pipe in pipes), return_exceptions=True
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures and len(failures) == len(outcomes):
            raise failures[0]
        for indices, outcome in zip(groups.values(), outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if is_unreachable(outcome):
                    self.stats.unreachable_errors += 1
                for index in indices:
                    replies[index] = outcome
            else:
                for index, reply in zip(indices, outcome, strict=True):
                    replies[index] = reply
        return replies

    def note_unreachable(self, *, log: bool = True) -> None:
        """Count a failure to reach the server; the first of an outage closes the gate."""
        self.stats.unreachable_errors += 1
        if self.gate.record_unreachable():
            self.stats.outages += 1
            if not log:
                return
            logger.warning(
                "%s: Redis at %s is unreachable; failing operations at once and retrying "
                "the connection in %.1fs",
                self._name(),
                self.config.safe_url(),
                self.gate.seconds_until_probe(),
            )

    def note_reachable(self) -> None:
        if self.gate.record_success():
            self.stats.recoveries += 1
            logger.info("%s: Redis at %s is reachable again", self._name(), self.config.safe_url())


def _key_of(args: tuple[Any, ...]) -> Any:
    """The key a queued command acts on (``EVAL script numkeys key ...`` names it third)."""
    return args[3] if args[0] == "EVAL" else args[1]


class _Commands:
    """Records what a ``fill`` function queues, to be split over cluster nodes."""

    def __init__(self) -> None:
        self.queue: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        self.queue.append((args, options))

    def strlen(self, name: bytes) -> None:
        self.execute_command("STRLEN", name)

    def delete(self, name: bytes) -> None:
        self.execute_command("DEL", name)

    def touch(self, name: bytes) -> None:
        self.execute_command("TOUCH", name)

    def pexpire(self, name: bytes, ms: int) -> None:
        self.execute_command("PEXPIRE", name, ms)
