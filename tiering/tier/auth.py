"""Authenticated blocks: a keyed MAC over (offload key, layout fingerprint, payload).

A tier shared between engines (Redis, a filesystem root on NFS or a PVC) can be
written by anyone with access to it. A checksum stored next to the bytes proves
only that the bytes are intact, not who wrote them: a forger writes a valid
checksum of its own payload. With a secret key that only trusted engines hold,
every stored block carries a 128-bit tag over the offload key, the layout
fingerprint and the payload, and a block whose tag does not match is a miss.

Three MACs (``auth_mac``), each named in what a tier stores with the tag, so a
tier reads blocks tagged any of these ways:

``"ghash-aes"``          (default) a universal hash then a PRF: GHASH, as AES-256-GCM
                         computes it (OpenSSL, through ``cryptography``), over the
                         payload (associated data) and the length-prefixed key and
                         fingerprint (plaintext), with a fixed nonce; its 16-byte
                         GCM tag, which never leaves this function, is then
                         encrypted by AES-256 under a second key (one block: a PRP
                         used as a PRF, as AES-GCM-SIV finishes its tag), and that
                         block is the tag. Both keys come from the secret by
                         BLAKE3's key derivation. About 19-23 GB/s on one core
                         here (AES-NI with VPCLMULQDQ; OpenSSL picks its code at
                         run time), the GIL released: 3x keyed BLAKE3, and what
                         makes an authenticated tier as fast as a plain one.
``"blake3"``             keyed BLAKE3: the key is ``derive_key(context, secret)``
                         (BLAKE3's key derivation mode), the tag the first 16
                         bytes of the keyed hash. About 6 GB/s on one core here
                         with AVX-512 (runtime CPU dispatch: AVX2, SSE4.1, SSE2 or
                         portable code on other CPUs), the GIL released while it
                         hashes; the default of the previous release, and the
                         faster choice on a CPU without AES and carry-less
                         multiply instructions.
``"hmac-sha256"``        HMAC-SHA256 truncated to 16 bytes, what earlier releases
                         wrote (about 1.7 GB/s here, with SHA extensions).

The key comes from a file (``auth_key_file``) or an environment variable
(``auth_key_env``); it never appears in a config, a log line or an error
message. ``docs/security.md`` says what the tag covers and why each
construction is sound.

Tags off the loop thread: :class:`OffLoopWork` hands per-block work (tag, verify,
checksum, copy) to a few process-wide hashing threads and lets the tier's loop
await it, so a tier's loop keeps parsing replies and completing I/O while the
tags of a batch are computed on the other cores. A batch of at least
:data:`OFFLOAD_MIN_BYTES`, on a machine with at least :data:`OFFLOAD_MIN_CPUS`
CPUs, is worth the hop (:func:`offload_pays`); others are tagged inline.
"""

from __future__ import annotations

import hmac
import os
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from tiering.core.errors import ConfigError
from tiering.tier.hashing_threads import (
    _HASH_THREADS,  # noqa: F401  # tests start and count them through this module
    OffLoopWork,
    slices,
    usable_cpus,
)

__all__ = [
    "AUTH_OPTION_NAMES",
    "BLAKE3",
    "DEFAULT_MAC",
    "GHASH_AES",
    "HMAC_SHA256",
    "MAC_NAMES",
    "OFFLOAD_MIN_BYTES",
    "OFFLOAD_MIN_CPUS",
    "OFFLOAD_SLICE_BYTES",
    "TAG_BYTES",
    "BlockAuthenticator",
    "OffLoopWork",
    "authenticator_from_options",
    "offload_pays",
    "slices",
    "usable_cpus",
]

TAG_BYTES = 16
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
AUTH_OPTION_NAMES = ("auth_key_file", "auth_key_env", "auth_mac")
#: The MACs, by the name ``auth_mac`` takes.
HMAC_SHA256 = "hmac-sha256"
BLAKE3 = "blake3"
GHASH_AES = "ghash-aes"
MAC_NAMES = (GHASH_AES, BLAKE3, HMAC_SHA256)
DEFAULT_MAC = GHASH_AES
_DIGEST = "sha256"
_PREFIX = struct.Struct("<HI")  # offload key length, fingerprint length
#: BLAKE3 key derivation context (fixed, unique to this use: BLAKE3's rule for contexts).
_KDF_CONTEXT = "kv-tiering 2026-11 block authentication tag v1"
#: ``ghash-aes``'s two keys: the AES-256-GCM key (GHASH's key is AES of zero under it)
#: and the AES-256 key of the final PRF, each from its own context.
_GHASH_KDF_CONTEXT = "kv-tiering 2026-11 block authentication ghash-aes gcm key v1"
_FINISH_KDF_CONTEXT = "kv-tiering 2026-11 block authentication ghash-aes prf key v1"
#: The nonce is fixed: the GCM tag is only ever encrypted by the PRF, never shown (see
#: ``docs/security.md``), so it need not change.
_GHASH_NONCE = bytes(12)
#: OpenSSL's AES-GCM takes at most this many bytes of associated data in one call.
_GHASH_MAX_PAYLOAD = (1 << 31) - 1
#: The tagged stream's first piece: 16 BLAKE3 chunks (the widest SIMD degree).
_BLAKE3_HEAD_BYTES = 16 * 1024
#: Batches of at least this many bytes are tagged/verified off the loop thread
#: (a hop costs a queue put and one loop wake-up per batch, tens of microseconds;
#: smaller batches are tagged inline, in about that time).
OFFLOAD_MIN_BYTES = 256 << 10
#: Tags go to the hashing threads only where this process may use at least this many
#: CPUs. With fewer, the hashing threads compete with the loop, the scheduler (and a Redis
#: server) for the same cores and their hand-overs cost more than they free: on 2 vCPUs,
#: authenticated 64 KiB fs stores ran at 0.59x instead of 0.89x of plain and loads at 0.81x
#: instead of 0.93x, for 20-75 % more CPU per GB, and Redis at 0.81-1.16x of inline tagging.
OFFLOAD_MIN_CPUS = 4
#: Work handed to one hashing thread at a time: a batch is split in slices of
#: about this size (whole blocks), so the hashing threads share a large batch.
OFFLOAD_SLICE_BYTES = 1 << 20


@dataclass(frozen=True)
class BlockAuthenticator:
    """Computes and checks block tags. Pure and thread-safe: tiers call it from any thread.

    ``mac`` is what :meth:`tag` writes (one of :data:`MAC_NAMES`);
    :meth:`verify` checks a tag with the MAC it was stored with.
    """

    _secret: bytes = field(repr=False)
    source: str  # where the key came from, for messages ("file /etc/...", "env KV_KEY")
    mac: str = DEFAULT_MAC
    _blake3_key: bytes = field(init=False, repr=False, compare=False)
    _finish_key: bytes = field(init=False, repr=False, compare=False)
    _gcm_key: bytes = field(init=False, repr=False, compare=False)
    #: Per thread that tags (the loop, the hashing threads): ``ghash-aes``'s AES-256-GCM
    #: seal and its one-block AES-256 finish (ECB: one block, no state between calls).
    #: Neither object's thread safety is documented.
    _per_thread: threading.local = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self._secret) < MIN_KEY_BYTES:
            raise ConfigError(
                f"the authentication key from {self.source} is {len(self._secret)} bytes; "
                f"at least {MIN_KEY_BYTES} are needed (e.g. `head -c 32 /dev/urandom | "
                "base64`)"
            )
        if self.mac not in MAC_NAMES:
            raise ConfigError(
                f"auth_mac must be one of {', '.join(map(repr, MAC_NAMES))}, got {self.mac!r}"
            )
        derived = blake3.blake3(self._secret, derive_key_context=_KDF_CONTEXT).digest(32)
        object.__setattr__(self, "_blake3_key", derived)
        for name, context in (
            ("_gcm_key", _GHASH_KDF_CONTEXT),
            ("_finish_key", _FINISH_KDF_CONTEXT),
        ):
            key = blake3.blake3(self._secret, derive_key_context=context).digest(32)
            object.__setattr__(self, name, key)
        object.__setattr__(self, "_per_thread", threading.local())

    def __reduce__(self) -> tuple[type[BlockAuthenticator], tuple[bytes, str, str]]:
        # Pickled (a tier configured in one process, built in another) as what it was made
        # of: the derived keys and the per-thread AES-GCM instances are rebuilt there.
        return (BlockAuthenticator, (self._secret, self.source, self.mac))

    def tag(self, key: bytes, fingerprint: bytes, payload: object, mac: str | None = None) -> bytes:
        """The 16-byte tag of ``payload`` (any buffer) stored under ``key`` (with ``mac``,
        default this authenticator's).

        Binding the key and the layout fingerprint means a valid block cannot be
        replayed under another key or into a cache of another layout; their
        lengths come first, so no two (key, fingerprint) pairs hash alike.
        """
        mac = mac or self.mac
        if mac == GHASH_AES:  # first and inline: the default, paid once per block moved
            sized = payload if type(payload) is memoryview else memoryview(payload)  # type: ignore[arg-type]
            if sized.format != "B" or sized.ndim != 1:
                sized = sized.cast("B")  # cryptography takes byte buffers only
            if sized.nbytes > _GHASH_MAX_PAYLOAD:
                raise ValueError(
                    f"auth_mac {GHASH_AES!r} tags blocks of at most {_GHASH_MAX_PAYLOAD} "
                    f"bytes, not {sized.nbytes}: use auth_mac 'blake3' for blocks this large"
                )
            try:
                seal, finish = self._per_thread.ghash_aes
            except AttributeError:
                seal, finish = self._per_thread.ghash_aes = _ghash_aes_functions(
                    self._gcm_key, self._finish_key
                )
            # AES-GCM takes any contiguous buffer as associated data. Only the GCM tag
            # (the last 16 bytes) is used, and only through the PRF: the ciphertext of the
            # key and fingerprint is dropped.
            sealed = seal(
                _GHASH_NONCE, _PREFIX.pack(len(key), len(fingerprint)) + key + fingerprint, sized
            )
            tag: bytes = finish(sealed[-16:])
            return tag
        prefix = _PREFIX.pack(len(key), len(fingerprint))
        view = memoryview(payload)  # type: ignore[arg-type]  # any C-contiguous buffer
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # BLAKE3 takes bytes only; HMAC is indifferent
        if mac == BLAKE3:
            head = _BLAKE3_HEAD_BYTES - len(prefix) - len(key) - len(fingerprint)
            if 0 < head < view.nbytes:
                # The same bytes in the same order, the first 16 KiB of them in one
                # piece: the rest then starts on a 16-chunk boundary, where BLAKE3
                # hashes 16 chunks at once (AVX-512) instead of ramping up from one
                # chunk after a short first update (about 20% of a 64 KiB tag).
                hasher = blake3.blake3(
                    b"".join((prefix, key, fingerprint, view[:head])), key=self._blake3_key
                )
                hasher.update(view[head:])
                return hasher.digest(TAG_BYTES)
            hasher = blake3.blake3(prefix, key=self._blake3_key)
            hasher.update(key)
            hasher.update(fingerprint)
            hasher.update(view)
            return hasher.digest(TAG_BYTES)
        mac_ = hmac.new(self._secret, prefix, _DIGEST)
        mac_.update(key)
        mac_.update(fingerprint)
        mac_.update(view)
        return mac_.digest()[:TAG_BYTES]

    def verify(
        self, key: bytes, fingerprint: bytes, payload: object, tag: bytes, mac: str | None = None
    ) -> bool:
        """Whether ``tag`` is this key's ``mac`` tag of ``payload`` (constant-time comparison)."""
        return hmac.compare_digest(self.tag(key, fingerprint, payload, mac), tag)


def _ghash_aes_functions(
    gcm_key: bytes, finish_key: bytes
) -> tuple[Callable[[bytes, bytes, Any], bytes], Callable[[bytes], bytes]]:
    """``ghash-aes``'s AES-256-GCM seal and one-block AES-256 encryption, for one thread
    (``cryptography`` imported on first use: only tags need it)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    finish = Cipher(algorithms.AES(finish_key), modes.ECB()).encryptor()
    return AESGCM(gcm_key).encrypt, finish.update


def _read_key_file(path_text: str, where: str) -> bytes:
    path = Path(path_text).expanduser()
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(
            f"{where}auth_key_file {str(path)!r} cannot be read: {exc.strerror or exc}"
        ) from None
    if not path.is_file():
        raise ConfigError(f"{where}auth_key_file {str(path)!r} is not a regular file")
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"{where}auth_key_file {str(path)!r} is {info.st_size} bytes; a key file holds "
            f"at most {MAX_KEY_FILE_BYTES}"
        )
    if info.st_mode & 0o077:
        raise ConfigError(
            f"{where}auth_key_file {str(path)!r} is readable by other users "
            f"(mode {info.st_mode & 0o777:o}); make it 0600 (chmod 600)"
        )
    try:
        return path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"{where}auth_key_file {str(path)!r} cannot be read: {exc.strerror or exc}"
        ) from None


def authenticator_from_options(
    options: Mapping[str, Any], where: str = ""
) -> BlockAuthenticator | None:
    """The authenticator ``auth_key_file`` / ``auth_key_env`` ask for (None when neither is set),
    writing ``auth_mac`` tags (default ``"ghash-aes"``).

    ``where`` prefixes messages (e.g. ``"secondary_tiers[1] (type 'redis'): "``). Raises
    :class:`ConfigError` naming the option, never the key, when the key is missing,
    unreadable, too short or readable by other users, and for an ``auth_mac`` it does not
    know or without a key.
    """
    key_file = options.get("auth_key_file")
    key_env = options.get("auth_key_env")
    mac = options.get("auth_mac")
    if mac is not None and mac not in MAC_NAMES:
        raise ConfigError(
            f"{where}auth_mac must be one of {', '.join(map(repr, MAC_NAMES))}, got {mac!r}"
        )
    if key_file is None and key_env is None:
        if mac is not None:
            raise ConfigError(f"{where}auth_mac needs a key: set auth_key_file or auth_key_env")
        return None
    mac = mac or DEFAULT_MAC
    if key_file is not None and key_env is not None:
        raise ConfigError(f"{where}set one of auth_key_file and auth_key_env, not both")
    if key_file is not None:
        if not isinstance(key_file, str | os.PathLike) or not str(key_file):
            raise ConfigError(f"{where}auth_key_file must be a path, not {type(key_file).__name__}")
        secret = _read_key_file(str(key_file), where)
        return BlockAuthenticator(secret, f"file {str(key_file)!r}", mac)
    if not isinstance(key_env, str) or not key_env:
        raise ConfigError(
            f"{where}auth_key_env must be the name of an environment variable, "
            f"not {type(key_env).__name__}"
        )
    value = os.environ.get(key_env)
    if not value:
        raise ConfigError(f"{where}auth_key_env names {key_env!r}, which is not set or empty")
    # The variable's bytes as they are: os.fsencode undoes the surrogates that stand for
    # bytes that are not UTF-8 (value.encode() raised on them, the key in the exception).
    secret = os.fsencode(value).strip()
    return BlockAuthenticator(secret, f"environment variable {key_env!r}", mac)


# -- tags off the loop thread -----------------------------------------------------------------


def offload_pays(nbytes: int) -> bool:
    """Whether a batch of ``nbytes`` is tagged or verified on the hashing threads: at least
    :data:`OFFLOAD_MIN_BYTES`, on a machine with at least :data:`OFFLOAD_MIN_CPUS` CPUs for
    this process (else inline, on the tier's loop thread)."""
    return nbytes >= OFFLOAD_MIN_BYTES and usable_cpus() >= OFFLOAD_MIN_CPUS
