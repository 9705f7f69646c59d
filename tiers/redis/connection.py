"""Building the redis-py asyncio client and sorting its errors.

Only this module knows redis-py's constructors and exception classes; the
tier sees one client object with ``pipeline()`` and three kinds of failure:
unreachable, timed out, refused.
"""

from __future__ import annotations

import ssl
from typing import Any, TypeAlias

import redis.exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tiers.redis.config import RedisTierConfig
from tiers.redis.errors import RedisTierCommandError, RedisTierTimeout, RedisTierUnavailable

RedisClient: TypeAlias = "Redis | RedisCluster"

#: Large values arrive faster with bigger socket reads than redis-py's 32 KiB default.
_SOCKET_READ_SIZE = 1 << 20

#: Errors that mean "the server cannot be reached right now" (the gate closes).
_UNREACHABLE: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.ClusterDownError,
    rexc.RedisClusterException,
    OSError,
)
#: Errors that mean the server (or the network) did not answer in time.
_TIMEOUTS: tuple[type[BaseException], ...] = (rexc.TimeoutError, TimeoutError)
#: Connection-level refusals that are configuration mistakes, not outages.
_CREDENTIALS: tuple[type[BaseException], ...] = (
    rexc.AuthenticationError,
    rexc.AuthorizationError,
    rexc.AuthenticationWrongNumberOfArgsError,
    rexc.NoPermissionError,
)


def build_client(config: RedisTierConfig) -> RedisClient:
    """A client for ``config`` (standalone or cluster). Makes no connection yet."""
    common: dict[str, Any] = {
        "socket_timeout": config.op_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "socket_read_size": _SOCKET_READ_SIZE,
        # One immediate retry re-dials a pooled connection the server closed
        # (restart, idle timeout); a server that stays down fails at once.
        "retry": Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        "client_name": "kv-tiering",
        **config.tls_kwargs(),
    }
    if config.username is not None:
        common["username"] = config.username
    if config.password is not None:
        common["password"] = config.password
    if config.cluster:
        if config.uses_tls:
            common["ssl"] = True
        return RedisCluster.from_url(config.url, max_connections=config.max_connections, **common)
    if config.uses_tls:
        common["connection_class"] = SSLConnection
    pool = BlockingConnectionPool.from_url(
        config.url,
        max_connections=config.max_connections,
        timeout=config.op_timeout_s,
        **common,
    )
    return Redis.from_pool(pool)


def is_credentials_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the server rejecting who we are (not an outage)."""
    return isinstance(exc, _CREDENTIALS)


def tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind ``exc`` (redis-py wraps it in a ConnectionError), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the server cannot be reached or did not answer."""
    if is_credentials_error(exc):
        return False
    return isinstance(exc, _UNREACHABLE + _TIMEOUTS + (RedisTierUnavailable,))


def translate(exc: BaseException, where: str) -> BaseException:
    """The tier's own exception for a redis-py error (others are returned unchanged).

    ``where`` names the server and the operation, e.g. ``"SET on redis://h:6379/0"``.
    """
    if isinstance(exc, (RedisTierUnavailable, RedisTierTimeout, RedisTierCommandError)):
        return exc
    if isinstance(exc, _TIMEOUTS):
        return RedisTierTimeout(f"{where}: no answer in time ({exc})")
    if is_credentials_error(exc):
        return RedisTierCommandError(f"{where}: the server rejected the credentials ({exc})")
    if isinstance(exc, _UNREACHABLE):
        return RedisTierUnavailable(f"{where}: server unreachable ({type(exc).__name__}: {exc})")
    if isinstance(exc, rexc.OutOfMemoryError):
        return RedisTierCommandError(
            f"{where}: the server is out of memory (maxmemory reached and its policy "
            f"does not evict): {exc}",
            out_of_memory=True,
        )
    if isinstance(exc, rexc.ResponseError):
        return RedisTierCommandError(f"{where}: the server refused the command: {exc}")
    return exc
