"""Building the redis-py asyncio client and sorting its errors.

Only this module knows redis-py's constructors and exception classes; the
tier sees one client object with ``pipeline()`` and three kinds of failure:
unreachable, timed out, refused.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis.exceptions as rexc
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster, SSLConnection
from redis.asyncio.connection import RedisSSLContext
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
        # No retry in a cluster: redis-py's cluster pipeline retries by closing the whole
        # client, every node's connections with it, so one dead node failed the keys of
        # the healthy nodes in flight too (docs/redis-tier.md: a node that is down fails
        # only its own keys). A connection a node closed fails once, then is dialled anew.
        common["retry"] = Retry(NoBackoff(), 0)
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


async def diagnose_tls_refusal(config: RedisTierConfig, timeout_s: float) -> ssl.SSLError | None:
    """The TLS alert the server sends a client like ours, if it refuses us; None otherwise.

    With TLS 1.3 a server that requires a client certificate rejects a client
    without one only after the handshake: redis-py has already written its
    first command, so the server's close arrives as a bare connection reset
    and looks like an outage. This opens one connection with the same TLS
    settings, completes the handshake and only listens: the server's alert
    (``certificate required``, ``unknown ca``, ...) then arrives intact. A
    server that accepts us stays silent until ``timeout_s`` (None), as does
    one that cannot be reached at all (None).
    """
    parts = urlsplit(config.url)
    tls = config.tls_kwargs()
    context = RedisSSLContext(
        keyfile=tls.get("ssl_keyfile"),
        certfile=tls.get("ssl_certfile"),
        cert_reqs=tls.get("ssl_cert_reqs"),
        ca_certs=tls.get("ssl_ca_certs"),
        ca_data=tls.get("ssl_ca_data"),
        ca_path=tls.get("ssl_ca_path"),
        check_hostname=bool(tls.get("ssl_check_hostname")),
        min_version=tls.get("ssl_min_version"),
        ciphers=tls.get("ssl_ciphers"),
        password=tls.get("ssl_password"),
    ).get()
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                parts.hostname or "localhost", parts.port or 6379, ssl=context
            )
            try:
                await reader.read(1)
            finally:
                writer.close()
    except ssl.SSLError as exc:
        return exc
    except (OSError, TimeoutError):
        return None
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
