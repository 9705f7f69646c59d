"""The block tags of :mod:`tiering.tier.auth`: both MACs as specified, and what they bind."""

from __future__ import annotations

import array
import hmac
import struct

import blake3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.errors import ConfigError
from tiering.tier.auth import BlockAuthenticator, authenticator_from_options

SECRET = b"s" * 32


def expected_input(key: bytes, fingerprint: bytes, payload: bytes) -> bytes:
    return struct.pack("<HI", len(key), len(fingerprint)) + key + fingerprint + payload


def test_keyed_blake3_is_the_documented_construction() -> None:
    derived = blake3.blake3(
        SECRET, derive_key_context="kv-tiering 2026-11 block authentication tag v1"
    ).digest(32)
    data = expected_input(b"key", b"fp", b"payload" * 1000)
    tag = BlockAuthenticator(SECRET, "test").tag(b"key", b"fp", b"payload" * 1000)
    assert tag == blake3.blake3(data, key=derived).digest(16)


def test_hmac_sha256_is_what_earlier_releases_wrote() -> None:
    data = expected_input(b"key", b"fp", b"payload" * 1000)
    tag = BlockAuthenticator(SECRET, "test", "hmac-sha256").tag(b"key", b"fp", b"payload" * 1000)
    assert tag == hmac.new(SECRET, data, "sha256").digest()[:16]


@pytest.mark.parametrize("mac", ["blake3", "hmac-sha256"])
def test_a_tag_binds_the_key_the_fingerprint_and_every_byte(mac: str) -> None:
    auth = BlockAuthenticator(SECRET, "test", mac)
    payload = bytes(range(256)) * 16
    tag = auth.tag(b"ab", b"c", payload)
    assert auth.verify(b"ab", b"c", payload, tag, mac)
    assert tag != auth.tag(b"a", b"bc", payload)  # the lengths come first: no ambiguity
    assert tag != auth.tag(b"ab", b"d", payload)
    assert not auth.verify(b"ab", b"c", payload[:-1] + b"\x00", tag, mac)
    other = "hmac-sha256" if mac == "blake3" else "blake3"
    assert not auth.verify(b"ab", b"c", payload, tag, other)  # a tag is one MAC's
    assert tag != BlockAuthenticator(b"t" * 32, "other", mac).tag(b"ab", b"c", payload)


@given(st.binary(min_size=1, max_size=4096), st.data())
def test_any_bit_flipped_fails_verification(payload: bytes, data: st.DataObject) -> None:
    auth = BlockAuthenticator(SECRET, "test")
    tag = auth.tag(b"k", b"f", payload)
    bit = data.draw(st.integers(0, len(payload) * 8 - 1))
    flipped = bytearray(payload)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert auth.verify(b"k", b"f", payload, tag)
    assert not auth.verify(b"k", b"f", bytes(flipped), tag)


@pytest.mark.parametrize("mac", ["blake3", "hmac-sha256"])
def test_any_buffer_format_tags_its_bytes(mac: str) -> None:
    words = array.array("H", range(2048))
    auth = BlockAuthenticator(SECRET, "test", mac)
    assert auth.tag(b"k", b"f", memoryview(words)) == auth.tag(b"k", b"f", words.tobytes())


def test_options_name_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVT_AUTH_TEST_KEY", "k" * 32)
    made = authenticator_from_options({"auth_key_env": "KVT_AUTH_TEST_KEY"})
    assert made is not None and made.mac == "blake3"
    made = authenticator_from_options(
        {"auth_key_env": "KVT_AUTH_TEST_KEY", "auth_mac": "hmac-sha256"}
    )
    assert made is not None and made.mac == "hmac-sha256"
    with pytest.raises(ConfigError, match="auth_mac must be one of 'blake3', 'hmac-sha256'"):
        authenticator_from_options({"auth_key_env": "KVT_AUTH_TEST_KEY", "auth_mac": "sha1"})
    with pytest.raises(ConfigError, match="auth_mac needs a key"):
        authenticator_from_options({"auth_mac": "blake3"})
    assert authenticator_from_options({}) is None
    assert "k" * 32 not in repr(made)
