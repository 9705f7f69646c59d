"""Configuration of the Redis tier, validated at construction.

The keyword names are what users write in vLLM's ``secondary_tiers`` list, e.g.
``{"type": "redis", "url": "redis://cache:6379/0", "namespace": "llama3-70b"}``.
Every value is checked here, so a bad config fails when the engine starts,
not at the first store.
"""

from __future__ import annotations

import math
import ssl
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from tiering.core.errors import ConfigError
from tiering.tier.auth import BlockAuthenticator, authenticator_from_options
from tiers.redis.layout import NAMESPACE_PATTERN

StartBehaviour = Literal["fail", "degrade"]

_SCHEMES = ("redis", "rediss", "unix")
_CERT_REQS = ("required", "optional", "none")
_TLS_VERSIONS = {"TLSv1_2": ssl.TLSVersion.TLSv1_2, "TLSv1_3": ssl.TLSVersion.TLSv1_3}
#: TLS options redis-py's cluster client does not take.
_STANDALONE_ONLY_TLS = ("ssl_ca_path", "ssl_password")


def _err(key: str, problem: str) -> ConfigError:
    return ConfigError(f"redis tier: {key} {problem}")


def _positive_number(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _err(key, f"must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise _err(key, f"must be positive and finite, got {value!r}")
    return float(value)


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _err(key, f"must be a positive integer, got {value!r}")
    return value


def _optional_str(key: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _err(key, f"must be a string, got {type(value).__name__}")
    return value


def _bool(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _err(key, f"must be true or false, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class RedisTierConfig:
    """Every setting of a :class:`~tiers.redis.RedisTier` (see docs/redis-tier.md)."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    namespace: str = "kv-tiering"
    max_connections: int = 16
    max_blocks_in_flight: int = 256
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    ssl_ca_certs: str | None = None
    ssl_ca_data: str | None = None
    ssl_ca_path: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = None
    ssl_cert_reqs: str = "required"
    ssl_check_hostname: bool = True
    ssl_ciphers: str | None = None
    ssl_min_version: str | None = None
    op_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    on_start_unreachable: StartBehaviour = "fail"
    reconnect_interval_s: float = 0.5
    max_reconnect_interval_s: float = 10.0
    ttl_s: float | None = None
    max_pipeline_bytes: int = 64 << 20
    auth_key_file: str | None = None
    auth_key_env: str | None = None
    auth_mac: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise _err("url", f"must be a string, got {type(self.url).__name__}")
        parts = urlsplit(self.url)
        if parts.scheme not in _SCHEMES:
            raise _err(
                "url",
                f"{self.url!r} must start with redis://, rediss:// or unix:// "
                f"(got scheme {parts.scheme!r})",
            )
        _bool("cluster", self.cluster)
        if self.cluster:
            if parts.scheme == "unix":
                raise _err("url", "unix:// sockets cannot be used with cluster=true")
            db = parts.path.strip("/")
            if db not in ("", "0"):
                raise _err("url", f"Redis Cluster has only database 0, the url selects {db!r}")
            for key in _STANDALONE_ONLY_TLS:
                if getattr(self, key) is not None:
                    raise _err(key, "is not supported by redis-py's cluster client")
        if not isinstance(self.namespace, str) or not NAMESPACE_PATTERN.fullmatch(self.namespace):
            raise _err(
                "namespace",
                f"must be 1-128 characters from A-Z a-z 0-9 . _ / - (no braces), "
                f"got {self.namespace!r}",
            )
        _positive_int("max_connections", self.max_connections)
        _positive_int("max_blocks_in_flight", self.max_blocks_in_flight)
        _positive_int("max_pipeline_bytes", self.max_pipeline_bytes)
        for key in (
            "username",
            "password",
            "ssl_ca_certs",
            "ssl_ca_data",
            "ssl_ca_path",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_password",
            "ssl_ciphers",
            "ssl_min_version",
        ):
            _optional_str(key, getattr(self, key))
        _bool("ssl", self.ssl)
        _bool("ssl_check_hostname", self.ssl_check_hostname)
        if self.ssl_cert_reqs not in _CERT_REQS:
            raise _err("ssl_cert_reqs", f"must be one of {_CERT_REQS}, got {self.ssl_cert_reqs!r}")
        if self.ssl_min_version is not None and self.ssl_min_version not in _TLS_VERSIONS:
            raise _err(
                "ssl_min_version",
                f"must be one of {sorted(_TLS_VERSIONS)}, got {self.ssl_min_version!r}",
            )
        if self.uses_tls and parts.scheme == "unix":
            raise _err("url", "TLS options cannot be used with a unix:// socket")
        _positive_number("op_timeout_s", self.op_timeout_s)
        _positive_number("connect_timeout_s", self.connect_timeout_s)
        _positive_number("reconnect_interval_s", self.reconnect_interval_s)
        _positive_number("max_reconnect_interval_s", self.max_reconnect_interval_s)
        if self.max_reconnect_interval_s < self.reconnect_interval_s:
            raise _err(
                "max_reconnect_interval_s",
                f"({self.max_reconnect_interval_s}) must be >= reconnect_interval_s "
                f"({self.reconnect_interval_s})",
            )
        if self.on_start_unreachable not in ("fail", "degrade"):
            raise _err(
                "on_start_unreachable",
                f"must be 'fail' or 'degrade', got {self.on_start_unreachable!r}",
            )
        if self.ttl_s is not None:
            ttl = _positive_number("ttl_s", self.ttl_s)
            if ttl < 0.001:
                raise _err("ttl_s", f"must be at least 0.001 (one millisecond), got {ttl}")
        # Reads the key now: a missing, short or world-readable key fails the config.
        # The config keeps only where the key is, so dumping it never shows the key.
        self.authenticator()

    def authenticator(self) -> BlockAuthenticator | None:
        """The block authenticator ``auth_key_file`` / ``auth_key_env`` ask for (reads the key).

        None without either. Raises :class:`ConfigError` naming the option, never the key.
        """
        return authenticator_from_options(
            {
                "auth_key_file": self.auth_key_file,
                "auth_key_env": self.auth_key_env,
                "auth_mac": self.auth_mac,
            },
            "redis tier: ",
        )

    @property
    def uses_tls(self) -> bool:
        """Whether connections use TLS (a ``rediss://`` url, ``ssl`` or any ``ssl_*`` file)."""
        return (
            self.ssl
            or urlsplit(self.url).scheme == "rediss"
            or any(
                getattr(self, key) is not None
                for key in (
                    "ssl_ca_certs",
                    "ssl_ca_data",
                    "ssl_ca_path",
                    "ssl_certfile",
                    "ssl_keyfile",
                    "ssl_password",
                )
            )
        )

    @property
    def ttl_ms(self) -> int | None:
        """``ttl_s`` in whole milliseconds (what ``SET ... PX`` takes), or None."""
        return None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))

    def safe_url(self) -> str:
        """The url with any password masked, for messages and logs."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()

    def tls_kwargs(self) -> dict[str, Any]:
        """The ``ssl_*`` keyword arguments for redis-py (empty without TLS)."""
        if not self.uses_tls:
            return {}
        kwargs: dict[str, Any] = {
            "ssl_cert_reqs": self.ssl_cert_reqs,
            "ssl_check_hostname": self.ssl_check_hostname,
        }
        for key in (
            "ssl_ca_certs",
            "ssl_ca_data",
            "ssl_ca_path",
            "ssl_certfile",
            "ssl_keyfile",
            "ssl_password",
            "ssl_ciphers",
        ):
            value = getattr(self, key)
            if value is not None:
                kwargs[key] = value
        if self.ssl_min_version is not None:
            kwargs["ssl_min_version"] = _TLS_VERSIONS[self.ssl_min_version]
        return kwargs
