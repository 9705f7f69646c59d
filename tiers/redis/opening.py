"""Why the Redis tier could not reach its server at open, and whether it may start anyway.

:func:`start_error` judges the failure of the first contact (the ``PING`` of
:meth:`~tiers.redis.RedisTier.open`): rejected credentials and failed TLS
handshakes are always errors, naming what to check; an unreachable server is
one too, unless ``on_start_unreachable="degrade"`` lets the tier start
without it. The tier decides what to do with the answer.
"""

from __future__ import annotations

import ssl

from tiers.redis.config import RedisTierConfig
from tiers.redis.connection import (
    diagnose_tls_refusal,
    is_credentials_error,
    is_unreachable,
    tls_failure,
    translate,
)
from tiers.redis.errors import RedisTierCommandError, RedisTierUnavailable


async def start_error(exc: Exception, config: RedisTierConfig, name: str) -> Exception | None:
    """The error ``open`` raises for ``exc``, or None where the tier starts degraded.

    A TLS refusal after the handshake reads as a reset: the server is then
    asked why (see :func:`~tiers.redis.connection.diagnose_tls_refusal`).
    """
    tls_error = tls_failure(exc)
    if tls_error is None and config.uses_tls and is_unreachable(exc):
        tls_error = await diagnose_tls_refusal(config, config.connect_timeout_s)
    degrade = config.on_start_unreachable == "degrade" and is_unreachable(exc) and tls_error is None
    if degrade:
        return None
    return _open_error(exc, tls_error, config, name)


def _open_error(
    exc: Exception, tls_error: ssl.SSLError | None, config: RedisTierConfig, name: str
) -> Exception:
    where = f"redis tier {name!r}: cannot use {config.safe_url()}"
    if is_credentials_error(exc):
        return RedisTierCommandError(
            f"{where}: the server rejected the credentials ({exc}); check username/password"
        )
    if tls_error is not None:
        return RedisTierCommandError(
            f"{where}: the TLS handshake failed ({tls_error}); check ssl_ca_certs, "
            "ssl_certfile, ssl_keyfile and the server's tls-* settings"
        )
    if is_unreachable(exc):
        return RedisTierUnavailable(
            f"{where}: the server is unreachable ({type(exc).__name__}: {exc}). Start it, "
            "fix the url, or set on_start_unreachable='degrade' to start without it"
        )
    error = translate(exc, where)
    return error if isinstance(error, Exception) else exc
