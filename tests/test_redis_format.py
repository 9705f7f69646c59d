"""The Redis tier's pure parts: value format, key names, config validation, reconnect gate."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.errors import ConfigError, CorruptBlock
from tiering.core.keys import make_offload_key
from tiering.tier.auth import BlockAuthenticator
from tiers.redis import HEADER_LEN, BlockLayout, RedisTier, RedisTierConfig
from tiers.redis import layout as layout_module
from tiers.redis.errors import RejectedValue
from tiers.redis.gate import ReconnectGate
from tiers.redis.layout import AUTH_HEADER_LEN, MAGIC, ValueBuffers

BLOCK = 256
KEY = make_offload_key(b"\x01" * 32, 3)
OTHER_KEY = make_offload_key(b"\x02" * 32, 3)


def layout(namespace: str = "ns", fingerprint: str = "fp", block_bytes: int = BLOCK) -> BlockLayout:
    return BlockLayout(namespace, fingerprint, block_bytes)


def payload(seed: int = 7) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(BLOCK))


# -- value format ------------------------------------------------------------------------------


def test_value_round_trip_and_layout() -> None:
    value = layout().encode(KEY, memoryview(payload()))
    assert len(value) == HEADER_LEN + BLOCK
    assert value[:4] == MAGIC
    assert value[HEADER_LEN:] == payload()
    into = bytearray(BLOCK)
    layout().decode_into(KEY, value, memoryview(into))
    assert into == payload()


def test_decode_into_accepts_a_non_byte_destination_view() -> None:
    value = layout().encode(KEY, memoryview(payload()))
    into = bytearray(BLOCK)
    layout().decode_into(KEY, value, memoryview(into).cast("I"))
    assert into == payload()


@given(position=st.integers(0, HEADER_LEN + BLOCK - 1), flip=st.integers(1, 255))
def test_any_single_byte_change_is_detected(position: int, flip: int) -> None:
    value = bytearray(layout().encode(KEY, memoryview(payload())))
    value[position] ^= flip
    into = bytearray(b"\xee" * BLOCK)
    with pytest.raises(CorruptBlock):
        layout().decode_into(KEY, bytes(value), memoryview(into))
    assert into == b"\xee" * BLOCK, "a rejected value must leave the destination untouched"


@given(cut=st.integers(0, HEADER_LEN + BLOCK - 1))
def test_truncated_values_are_corrupt(cut: int) -> None:
    value = layout().encode(KEY, memoryview(payload()))[:cut]
    with pytest.raises(CorruptBlock):
        layout().decode_into(KEY, value, memoryview(bytearray(BLOCK)))


def test_extra_trailing_bytes_are_corrupt() -> None:
    value = layout().encode(KEY, memoryview(payload())) + b"x"
    with pytest.raises(CorruptBlock, match="length"):
        layout().decode_into(KEY, value, memoryview(bytearray(BLOCK)))


def test_value_written_under_another_fingerprint_is_corrupt() -> None:
    value = layout(fingerprint="other-model").encode(KEY, memoryview(payload()))
    with pytest.raises(CorruptBlock, match="fingerprint"):
        layout().decode_into(KEY, value, memoryview(bytearray(BLOCK)))


def test_value_of_another_key_is_corrupt() -> None:
    value = layout().encode(OTHER_KEY, memoryview(payload()))
    with pytest.raises(CorruptBlock, match="another key"):
        layout().decode_into(KEY, value, memoryview(bytearray(BLOCK)))


def test_future_format_version_is_not_served() -> None:
    value = bytearray(layout().encode(KEY, memoryview(payload())))
    struct.pack_into("<B", value, 4, 2)
    with pytest.raises(CorruptBlock, match="version"):
        layout().decode_into(KEY, bytes(value), memoryview(bytearray(BLOCK)))


def test_encode_rejects_a_block_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="bytes"):
        layout().encode(KEY, memoryview(bytes(BLOCK - 1)))


# -- key names ---------------------------------------------------------------------------------


def test_key_names_isolate_namespace_fingerprint_and_block() -> None:
    names = {
        layout().redis_key(KEY),
        layout(namespace="ns2").redis_key(KEY),
        layout(fingerprint="fp2").redis_key(KEY),
        layout().redis_key(OTHER_KEY),
    }
    assert len(names) == 4


def test_hash_tag_covers_exactly_the_block_identity() -> None:
    name = layout(namespace="a.b/c-d_e").redis_key(KEY)
    tag = name[name.index(b"{") + 1 : name.index(b"}")]
    assert tag == KEY.hex().encode()
    assert name.count(b"{") == 1 and name.endswith(b"}")


# -- config ------------------------------------------------------------------------------------


def test_defaults_are_valid() -> None:
    config = RedisTierConfig()
    assert config.url == "redis://127.0.0.1:6379/0"
    assert not config.cluster and not config.uses_tls
    assert config.on_start_unreachable == "fail"


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"url": "http://x:6379"}, "url"),
        ({"url": 6379}, "url"),
        ({"cluster": "false"}, "cluster"),
        ({"cluster": True, "url": "redis://h:7000/3"}, "url"),
        ({"cluster": True, "url": "unix:///tmp/r.sock"}, "url"),
        ({"cluster": True, "ssl_password": "x"}, "ssl_password"),
        ({"namespace": "a{b}"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"namespace": "has space"}, "namespace"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_connections": 2.5}, "max_connections"),
        ({"op_timeout_s": 0}, "op_timeout_s"),
        ({"op_timeout_s": float("inf")}, "op_timeout_s"),
        ({"connect_timeout_s": "1"}, "connect_timeout_s"),
        ({"on_start_unreachable": "ignore"}, "on_start_unreachable"),
        ({"ttl_s": -1}, "ttl_s"),
        ({"ttl_s": 0.0001}, "ttl_s"),
        ({"ssl_cert_reqs": "maybe"}, "ssl_cert_reqs"),
        ({"ssl_min_version": "SSLv3"}, "ssl_min_version"),
        ({"url": "unix:///tmp/r.sock", "ssl": True}, "url"),
        ({"reconnect_interval_s": 5, "max_reconnect_interval_s": 1}, "max_reconnect_interval_s"),
        ({"max_pipeline_bytes": 0}, "max_pipeline_bytes"),
        ({"password": 1234}, "password"),
    ],
)
def test_bad_settings_raise_config_error_naming_the_key(
    settings: dict[str, object], names: str
) -> None:
    with pytest.raises(ConfigError, match=names):
        RedisTier(**settings)


def test_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match="'hostname'"):
        RedisTier(hostname="x")


def test_tls_settings_pass_through() -> None:
    config = RedisTierConfig(
        ssl_ca_certs="/ca.pem",
        ssl_certfile="/c.pem",
        ssl_keyfile="/k.pem",
        ssl_cert_reqs="optional",
        ssl_min_version="TLSv1_3",
    )
    assert config.uses_tls
    kwargs = config.tls_kwargs()
    assert kwargs["ssl_ca_certs"] == "/ca.pem"
    assert kwargs["ssl_certfile"] == "/c.pem" and kwargs["ssl_keyfile"] == "/k.pem"
    assert kwargs["ssl_cert_reqs"] == "optional"
    assert kwargs["ssl_min_version"].name == "TLSv1_3"
    assert RedisTierConfig(url="rediss://h:6380/0").uses_tls
    assert RedisTierConfig().tls_kwargs() == {}


def test_safe_url_masks_the_password() -> None:
    config = RedisTierConfig(url="redis://user:s3cret@h:6379/0")
    assert "s3cret" not in config.safe_url() and "***" in config.safe_url()


def test_ttl_in_milliseconds() -> None:
    assert RedisTierConfig(ttl_s=1.5).ttl_ms == 1500
    assert RedisTierConfig().ttl_ms is None


# -- reconnect gate ----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gate_fails_fast_then_probes_with_backoff() -> None:
    clock = FakeClock()
    gate = ReconnectGate(1.0, 4.0, clock)
    assert gate.admit() and not gate.is_down
    assert gate.record_unreachable() is True
    assert not gate.admit(), "refused at once while down"
    assert gate.seconds_until_probe() == pytest.approx(1.0)
    clock.now += 1.0
    assert gate.admit(), "a probe is let through when due"
    assert not gate.admit(), "only one round of probes per interval"
    assert gate.record_unreachable() is False
    assert gate.seconds_until_probe() == pytest.approx(2.0), "a failed probe doubles the wait"
    clock.now += 2.0
    assert gate.admit()
    gate.record_unreachable()
    clock.now += 4.0
    assert gate.admit()
    gate.record_unreachable()
    assert gate.seconds_until_probe() == pytest.approx(4.0), "capped at max_delay_s"
    clock.now += 4.0
    assert gate.admit()
    assert gate.record_success() is True
    assert not gate.is_down and gate.admit()
    gate.record_unreachable()
    assert gate.seconds_until_probe() == pytest.approx(1.0), "success resets the backoff"


def test_failures_of_operations_already_in_flight_do_not_compound_the_wait() -> None:
    clock = FakeClock()
    gate = ReconnectGate(1.0, 8.0, clock)
    for _ in range(5):
        gate.record_unreachable()
    assert gate.seconds_until_probe() == pytest.approx(1.0)


@given(events=st.lists(st.sampled_from(["admit", "fail", "ok", "tick"]), min_size=1, max_size=60))
def test_gate_invariants(events: list[str]) -> None:
    clock = FakeClock()
    gate = ReconnectGate(0.5, 4.0, clock)
    for event in events:
        if event == "admit":
            admitted = gate.admit()
            assert admitted or gate.is_down, "an up gate admits everything"
        elif event == "fail":
            gate.record_unreachable()
            assert gate.is_down
        elif event == "ok":
            gate.record_success()
            assert not gate.is_down and gate.admit()
        else:
            clock.now += 1.0
        assert 0.0 <= gate.seconds_until_probe() <= 4.0


def test_encode_into_a_reused_buffer_matches_encode() -> None:
    value = bytearray(b"\xff" * (HEADER_LEN + BLOCK))
    view = layout().encode_into(KEY, memoryview(payload(3)), value)
    assert bytes(view) == layout().encode(KEY, memoryview(payload(3)))
    with pytest.raises(ValueError, match="value buffer"):
        layout().encode_into(KEY, memoryview(payload()), bytearray(BLOCK))


def test_value_buffers_are_reused_up_to_a_bound() -> None:
    pool = ValueBuffers(size=64, max_retained=2)
    taken = [pool.take() for _ in range(3)]
    assert all(len(b) == 64 for b in taken)
    pool.give_back(taken)
    assert pool.retained == 2
    reused = pool.take()
    assert any(reused is b for b in taken[:2]), "a retained buffer is handed out again"


def test_a_reply_parsed_after_its_load_ended_writes_nothing() -> None:
    from tiers.redis.loads import LOADED, Load

    tier = RedisTier(url="redis://127.0.0.1:1/0")
    tier._layout = layout()
    value = layout().encode(KEY, memoryview(payload()))
    into = bytearray(BLOCK)
    ended = Load(KEY, memoryview(into), [False])
    answer = tier._load_reply(b"anything", kvt_load=ended)
    assert isinstance(answer, RuntimeError) and "has ended" in str(answer)
    assert into == bytearray(BLOCK)
    live = Load(KEY, memoryview(into), [True])  # while the call is live, it is copied in
    assert tier._load_reply(value, kvt_load=live) is LOADED and bytes(into) == payload()


# -- authenticated values (format 2) -----------------------------------------------------------

AUTH = BlockAuthenticator(b"format-test-key-" * 2, "test")


def auth_layout(fingerprint: str = "fp", authenticator: BlockAuthenticator = AUTH) -> BlockLayout:
    return BlockLayout("ns", fingerprint, BLOCK, authenticator)


def test_authenticated_round_trip() -> None:
    value = auth_layout().encode(KEY, memoryview(payload()))
    assert len(value) == AUTH_HEADER_LEN + BLOCK and value[AUTH_HEADER_LEN:] == payload()
    into = bytearray(BLOCK)
    auth_layout().decode_into(KEY, value, memoryview(into))
    assert into == payload()


@given(position=st.integers(0, AUTH_HEADER_LEN + BLOCK - 1), flip=st.integers(1, 255))
def test_any_single_byte_change_of_an_authenticated_value_is_rejected(
    position: int, flip: int
) -> None:
    value = bytearray(auth_layout().encode(KEY, memoryview(payload())))
    value[position] ^= flip
    into = bytearray(b"\xee" * BLOCK)
    with pytest.raises(RejectedValue):
        auth_layout().decode_into(KEY, bytes(value), memoryview(into))
    assert into == b"\xee" * BLOCK


@given(data=st.binary(min_size=BLOCK, max_size=BLOCK), seed=st.integers(0, 250))
def test_a_forger_without_the_key_cannot_make_a_value_we_accept(data: bytes, seed: int) -> None:
    forger = auth_layout(authenticator=BlockAuthenticator(bytes([seed]) * 32, "forger"))
    with pytest.raises(RejectedValue) as caught:
        auth_layout().decode_into(
            KEY, forger.encode(KEY, memoryview(data)), memoryview(bytearray(BLOCK))
        )
    assert caught.value.kind == "unauthenticated"


def test_tags_bind_the_key_and_the_layout() -> None:
    value = auth_layout().encode(KEY, memoryview(payload()))
    # Re-labelled for another key (key hash patched): the tag no longer matches.
    relabelled = value[:16] + struct.pack("<Q", xxhash.xxh3_64_intdigest(OTHER_KEY)) + value[24:]
    with pytest.raises(RejectedValue, match="authentication tag"):
        auth_layout().decode_into(OTHER_KEY, relabelled, memoryview(bytearray(BLOCK)))
    # Replayed into another layout (fingerprint patched): likewise.
    other = auth_layout(fingerprint="other")
    moved = value[:8] + struct.pack("<Q", other.fingerprint) + value[16:]
    with pytest.raises(RejectedValue, match="authentication tag"):
        other.decode_into(KEY, moved, memoryview(bytearray(BLOCK)))


def test_keyed_and_plain_layouts_read_only_their_own_format() -> None:
    plain_value = layout().encode(KEY, memoryview(payload()))
    keyed_value = auth_layout().encode(KEY, memoryview(payload()))
    with pytest.raises(RejectedValue, match="format version 1"):
        auth_layout().decode_into(KEY, plain_value, memoryview(bytearray(BLOCK)))
    with pytest.raises(RejectedValue, match="format version 4"):
        layout().decode_into(KEY, keyed_value, memoryview(bytearray(BLOCK)))
    hmac_layout = auth_layout(authenticator=BlockAuthenticator(b"s" * 32, "hmac", "hmac-sha256"))
    with pytest.raises(RejectedValue, match="format version 4"):  # and the other way round
        hmac_layout.decode_into(KEY, keyed_value, memoryview(bytearray(BLOCK)))
    blake3_layout = auth_layout(authenticator=BlockAuthenticator(b"s" * 32, "b3", "blake3"))
    with pytest.raises(RejectedValue, match="format version 4"):
        blake3_layout.decode_into(KEY, keyed_value, memoryview(bytearray(BLOCK)))
    blake3_value = blake3_layout.encode(KEY, memoryview(payload()))
    with pytest.raises(RejectedValue, match="format version 3"):
        auth_layout().decode_into(KEY, blake3_value, memoryview(bytearray(BLOCK)))
    other_key = auth_layout(authenticator=BlockAuthenticator(b"k" * 32, "other"))
    names = {
        layout().redis_key(KEY),
        auth_layout().redis_key(KEY),
        other_key.redis_key(KEY),
        hmac_layout.redis_key(KEY),
    }
    assert len(names) == 4, "plain, keyed, other-key and other-MAC blocks live apart"


def test_auth_settings_are_checked_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVT_FORMAT_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match="redis tier: auth_key_env names 'KVT_FORMAT_TEST_KEY'"):
        RedisTierConfig(auth_key_env="KVT_FORMAT_TEST_KEY")
    monkeypatch.setenv("KVT_FORMAT_TEST_KEY", "a-long-enough-secret-key")
    config = RedisTierConfig(auth_key_env="KVT_FORMAT_TEST_KEY")
    assert config.authenticator() is not None
    assert "a-long-enough-secret-key" not in repr(config) + str(dataclasses.asdict(config))
    assert RedisTier(auth_key_env="KVT_FORMAT_TEST_KEY").verifies_reads
    assert not RedisTier().verifies_reads


@pytest.mark.parametrize("nbytes", [1000, 1 << 20])
def test_a_copy_between_buffers_of_two_sizes_is_refused_untouched(nbytes: int) -> None:
    dest = bytearray(b"\xee" * (nbytes + 1))
    with pytest.raises(ValueError, match=f"copying {nbytes} bytes into a buffer of {nbytes + 1}"):
        layout_module.copy_bytes(memoryview(dest), memoryview(bytes(nbytes)))
    assert dest == b"\xee" * (nbytes + 1)


@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["bulk-copies", "memoryview-copies"])
@pytest.mark.parametrize("authenticated", [False, True], ids=["plain", "auth"])
def test_both_copy_paths_round_trip_and_reject(
    monkeypatch: pytest.MonkeyPatch, threshold: int, authenticated: bool
) -> None:
    monkeypatch.setattr(layout_module, "GIL_FREE_COPY_BYTES", threshold)
    big = 512 << 10
    chosen = BlockLayout("ns", "fp", big, AUTH if authenticated else None)
    data = bytes(range(256)) * (big // 256)
    value = bytearray(chosen.value_len)
    view = chosen.encode_into(KEY, memoryview(data).cast("I"), value)
    view.release()
    assert bytes(value[chosen.header_len :]) == data
    into = bytearray(big)
    chosen.decode_into(KEY, bytes(value), memoryview(into).cast("Q"))
    assert into == data
    value[-1] ^= 1
    untouched = bytearray(b"\xee" * big)
    with pytest.raises(RejectedValue):
        chosen.decode_into(KEY, bytes(value), memoryview(untouched))
    assert untouched == b"\xee" * big
