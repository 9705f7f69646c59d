"""The block tags of :mod:`tiering.tier.auth`: every MAC as specified, and what it binds."""

from __future__ import annotations

import array
import copy
import hmac
import pathlib
import pickle
import struct

import blake3
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.errors import ConfigError
from tiering.tier import auth as auth_module
from tiering.tier.auth import MAC_NAMES, BlockAuthenticator, authenticator_from_options

SECRET = b"s" * 32


def expected_input(key: bytes, fingerprint: bytes, payload: bytes) -> bytes:
    return struct.pack("<HI", len(key), len(fingerprint)) + key + fingerprint + payload


def test_keyed_blake3_is_the_documented_construction() -> None:
    derived = blake3.blake3(
        SECRET, derive_key_context="kv-tiering 2026-11 block authentication tag v1"
    ).digest(32)
    data = expected_input(b"key", b"fp", b"payload" * 1000)
    tag = BlockAuthenticator(SECRET, "test", "blake3").tag(b"key", b"fp", b"payload" * 1000)
    assert tag == blake3.blake3(data, key=derived).digest(16)


def _gf128_mul(x: int, y: int) -> int:
    """Multiplication in GCM's GF(2^128) (NIST SP 800-38D, algorithm 1; bit 0 is the MSB)."""
    r, z, v = 0xE1 << 120, 0, y
    for i in range(127, -1, -1):
        if (x >> i) & 1:
            z ^= v
        v = (v >> 1) ^ r if v & 1 else v >> 1
    return z


def _reference_gcm_tag(key: bytes, nonce: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM's tag written out from SP 800-38D with AES-ECB only (no GCM code)."""
    aes = Cipher(algorithms.AES(key), modes.ECB()).encryptor()

    def block(data: bytes) -> int:
        return int.from_bytes(aes.update(data), "big")

    h = block(bytes(16))
    j0 = nonce + b"\x00\x00\x00\x01"
    counter = int.from_bytes(j0[12:], "big")
    stream = b"".join(
        aes.update(nonce + ((counter + 1 + i) % 2**32).to_bytes(4, "big"))
        for i in range((len(plaintext) + 15) // 16)
    )
    ciphertext = bytes(a ^ b for a, b in zip(plaintext, stream, strict=False))

    def padded(data: bytes) -> bytes:
        return data + bytes(-len(data) % 16)

    lengths = struct.pack(">QQ", 8 * len(aad), 8 * len(ciphertext))
    ghash = 0
    stream_in = padded(aad) + padded(ciphertext) + lengths
    for i in range(0, len(stream_in), 16):
        ghash = _gf128_mul(ghash ^ int.from_bytes(stream_in[i : i + 16], "big"), h)
    return (ghash ^ block(j0)).to_bytes(16, "big")


def test_ghash_aes_is_the_documented_construction() -> None:
    """The default tag: AES-256 (one block, the PRF) of the AES-256-GCM tag of the payload
    (associated data) and the length-prefixed key and fingerprint (plaintext) under a zero
    nonce, both keys by BLAKE3's key derivation; checked against GCM written out by hand."""
    gcm_key = blake3.blake3(
        SECRET, derive_key_context="kv-tiering 2026-11 block authentication ghash-aes gcm key v1"
    ).digest(32)
    prf_key = blake3.blake3(
        SECRET, derive_key_context="kv-tiering 2026-11 block authentication ghash-aes prf key v1"
    ).digest(32)
    payload = bytes(range(251)) * 5  # not a whole number of 16-byte blocks
    header = struct.pack("<HI", 3, 2) + b"key" + b"fp"
    inner = _reference_gcm_tag(gcm_key, bytes(12), header, payload)
    auth = BlockAuthenticator(SECRET, "test")
    assert auth.mac == "ghash-aes"  # the default
    assert auth.tag(b"key", b"fp", payload) == _aes256_block(prf_key, inner)


def _aes256_block(key: bytes, block: bytes) -> bytes:
    aes = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    return bytes(aes.update(block))


def test_the_aes_block_of_the_reference_is_aes_256() -> None:
    """FIPS-197 appendix C.3: what the reference (and the tag's finish) computes is AES-256."""
    key = bytes(range(32))
    plaintext = bytes.fromhex("00112233445566778899aabbccddeeff")
    assert _aes256_block(key, plaintext).hex() == "8ea2b7ca516745bfeafc49904b496089"


def test_ghash_aes_tags_agree_across_threads() -> None:
    """Each thread that tags gets its own AES-GCM and AES: tags are the same on every thread."""
    import concurrent.futures

    auth = BlockAuthenticator(SECRET, "test", "ghash-aes")
    payloads = [bytes([i]) * (4096 + i) for i in range(64)]
    expected = [auth.tag(b"k", b"f", p) for p in payloads]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: auth.tag(b"k", b"f", p), payloads))
    assert got == expected


@pytest.mark.parametrize("mac", MAC_NAMES)
def test_an_authenticator_pickles_and_copies_as_what_it_was_made_of(mac: str) -> None:
    """A tier configured in one process and built in another carries its authenticator."""
    auth = BlockAuthenticator(SECRET, "test", mac)
    tag = auth.tag(b"k", b"f", b"payload")  # its per-thread state exists by now
    for copied in (pickle.loads(pickle.dumps(auth)), copy.deepcopy(auth), copy.copy(auth)):
        assert copied == auth and copied.mac == mac
        assert copied.tag(b"k", b"f", b"payload") == tag


def test_ghash_aes_refuses_what_aes_gcm_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenSSL's AES-GCM takes under 2 GiB of associated data: a larger block is refused with
    the way out, before anything is hashed (the limit lowered here: no 2 GiB allocated)."""
    auth = BlockAuthenticator(SECRET, "test", "ghash-aes")
    assert auth_module._GHASH_MAX_PAYLOAD == 2**31 - 1
    monkeypatch.setattr(auth_module, "_GHASH_MAX_PAYLOAD", 100)
    assert auth.verify(b"k", b"f", bytes(100), auth.tag(b"k", b"f", bytes(100)))
    with pytest.raises(ValueError, match=r"at most 100 bytes, not 101: use auth_mac 'blake3'"):
        auth.tag(b"k", b"f", bytes(101))


def test_hmac_sha256_is_what_earlier_releases_wrote() -> None:
    data = expected_input(b"key", b"fp", b"payload" * 1000)
    tag = BlockAuthenticator(SECRET, "test", "hmac-sha256").tag(b"key", b"fp", b"payload" * 1000)
    assert tag == hmac.new(SECRET, data, "sha256").digest()[:16]


@pytest.mark.parametrize("mac", MAC_NAMES)
def test_a_tag_binds_the_key_the_fingerprint_and_every_byte(mac: str) -> None:
    auth = BlockAuthenticator(SECRET, "test", mac)
    payload = bytes(range(256)) * 16
    tag = auth.tag(b"ab", b"c", payload)
    assert auth.verify(b"ab", b"c", payload, tag, mac)
    assert tag != auth.tag(b"a", b"bc", payload)  # the lengths come first: no ambiguity
    assert tag != auth.tag(b"ab", b"d", payload)
    assert not auth.verify(b"ab", b"c", payload[:-1] + b"\x00", tag, mac)
    for other in MAC_NAMES:
        if other != mac:
            assert not auth.verify(b"ab", b"c", payload, tag, other)  # a tag is one MAC's
    assert tag != BlockAuthenticator(b"t" * 32, "other", mac).tag(b"ab", b"c", payload)


@given(st.binary(min_size=1, max_size=4096), st.data(), st.sampled_from(MAC_NAMES))
def test_any_bit_flipped_fails_verification(payload: bytes, data: st.DataObject, mac: str) -> None:
    auth = BlockAuthenticator(SECRET, "test", mac)
    tag = auth.tag(b"k", b"f", payload)
    bit = data.draw(st.integers(0, len(payload) * 8 - 1))
    flipped = bytearray(payload)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert auth.verify(b"k", b"f", payload, tag)
    assert not auth.verify(b"k", b"f", bytes(flipped), tag)


@pytest.mark.parametrize("mac", MAC_NAMES)
def test_any_buffer_format_tags_its_bytes(mac: str) -> None:
    words = array.array("H", range(2048))
    auth = BlockAuthenticator(SECRET, "test", mac)
    assert auth.tag(b"k", b"f", memoryview(words)) == auth.tag(b"k", b"f", words.tobytes())


def test_a_key_in_the_environment_is_its_bytes_as_they_are(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Random bytes that are not UTF-8 (what the docs recommend) work as in a key file."""
    import os

    raw = b"\xff\xfe" + bytes(range(1, 31))
    monkeypatch.setitem(os.environb, b"KVT_AUTH_BIN_KEY", raw)
    from_env = authenticator_from_options({"auth_key_env": "KVT_AUTH_BIN_KEY"})
    key_file = tmp_path / "key"
    key_file.write_bytes(raw)
    key_file.chmod(0o600)
    from_file = authenticator_from_options({"auth_key_file": str(key_file)})
    assert from_env is not None and from_file is not None
    assert from_env.tag(b"k", b"f", b"data") == from_file.tag(b"k", b"f", b"data")


def test_options_name_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVT_AUTH_TEST_KEY", "k" * 32)
    made = authenticator_from_options({"auth_key_env": "KVT_AUTH_TEST_KEY"})
    assert made is not None and made.mac == "ghash-aes"
    made = authenticator_from_options(
        {"auth_key_env": "KVT_AUTH_TEST_KEY", "auth_mac": "hmac-sha256"}
    )
    assert made is not None and made.mac == "hmac-sha256"
    with pytest.raises(
        ConfigError, match="auth_mac must be one of 'ghash-aes', 'blake3', 'hmac-sha256'"
    ):
        authenticator_from_options({"auth_key_env": "KVT_AUTH_TEST_KEY", "auth_mac": "sha1"})
    with pytest.raises(ConfigError, match="auth_mac needs a key"):
        authenticator_from_options({"auth_mac": "blake3"})
    assert authenticator_from_options({}) is None
    assert "k" * 32 not in repr(made)
