"""Pure tests of pd_connector.core.protocol: side-channel framing, versioning and compat diffs.

No vLLM, NIXL, torch or sockets.
"""

from __future__ import annotations

import re
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.params import MAX_BLOCK_ID
from pd_connector.core.compat import compat_differences
from pd_connector.core.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Claim,
    EngineCompat,
    Envelope,
    Extend,
    Extended,
    Granted,
    GroupDesc,
    Hello,
    Message,
    LayerRegion,
    Pending,
    ProtocolError,
    Reject,
    Release,
    Welcome,
    decode_message,
    encode_message,
)

SETTINGS = settings(max_examples=100, deadline=None)

# --- strategies -------------------------------------------------------------------------------

names = st.text(max_size=12)
i64 = st.integers(-(2**63), 2**63 - 1)
u64ish = st.integers(0, 2**63 - 1)

group_descs = st.builds(
    GroupDesc,
    kind=st.sampled_from(["attention", "sliding_window", "mamba"]),
    block_size=st.integers(1, 4096),
    page_bytes=u64ish,
    layer_names=st.lists(names, max_size=4),
)
compats = st.builds(
    EngineCompat,
    model=names,
    dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
    kv_cache_dtype=st.sampled_from(["auto", "fp8", "fp8_e5m2"]),
    groups=st.lists(group_descs, max_size=3),
    conv_state_layout=st.sampled_from(["DS", "SD"]),
    tensor_parallel_size=st.integers(1, 8),
    device=st.sampled_from(["cpu", "cuda", "xpu"]),
    speculative=st.sampled_from(["none", "eagle3:draft-a", "eagle3:draft-b", "mtp"]),
)
regions = st.builds(
    LayerRegion,
    name=names,
    group=st.integers(0, 8),
    addr=u64ish,
    block_stride=u64ish,
    page_bytes=u64ish,
    num_blocks=st.integers(0, 2**31),
)
messages = st.one_of(
    st.builds(Hello, engine_id=names, compat=compats),
    st.builds(
        Welcome,
        engine_id=names,
        agent_name=names,
        agent_metadata=st.binary(max_size=64),
        regions=st.lists(regions, max_size=4),
        compat=compats,
    ),
    st.builds(Release, request_ids=st.lists(names, max_size=5)),
    st.builds(
        Claim,
        engine_id=names,
        request_id=names,
        replay_offset=st.integers(0, 2**40),
        block_ids=st.lists(st.lists(st.integers(1, MAX_BLOCK_ID), max_size=4), max_size=3),
    ),
    st.builds(Extend, request_ids=st.lists(names, max_size=5)),
    st.builds(Extended, held=st.dictionaries(names, st.floats(allow_nan=False), max_size=5)),
    st.builds(
        Granted,
        lease_seconds=st.floats(allow_nan=False),
        state_digest=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    ),
    st.builds(Pending, reason=st.text(max_size=40)),
    st.just(Ack()),
    st.builds(Reject, reason=st.text(max_size=40)),
)


secrets = st.binary(min_size=1, max_size=48)


COVERED_MESSAGES = {Hello, Welcome, Release, Claim, Extend, Extended, Granted, Pending, Ack, Reject}


def test_strategies_cover_every_message_type():
    """A new side-channel message must be added to ``messages`` above (and to this set)."""
    assert set(typing.get_args(Message)) == COVERED_MESSAGES


def frame(version: int, body: bytes, mac: bytes = b"") -> bytes:
    return msgspec.msgpack.encode(Envelope(version, body, mac))


def expect_protocol_error(data: bytes, kind: str | None = None, secret: bytes = b"") -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode_message(data, secret)
    if kind is not None:
        assert info.value.kind == kind, info.value
    return info.value


# --- round trip -------------------------------------------------------------------------------


@SETTINGS
@given(messages, secrets)
def test_every_message_round_trips(message, secret):
    data = encode_message(message)
    assert isinstance(data, bytes)
    decoded = decode_message(data)
    assert type(decoded) is type(message)
    assert decoded == message
    signed = encode_message(message, secret)
    assert decode_message(signed, secret) == message
    # A receiver without a secret does not check MACs (authentication is opt-in per side).
    assert decode_message(signed) == message


@pytest.mark.parametrize(
    "message",
    [
        Ack(),
        Reject(reason=""),
        Release(request_ids=[]),
        Release(request_ids=["a", "b"]),
        Claim(engine_id="e", request_id="r", replay_offset=0, block_ids=[]),
        Granted(lease_seconds=120.0),
        Extend(request_ids=[]),
        Pending(reason=""),
        Hello(engine_id="", compat=EngineCompat("m", "bf16", "auto", [], "DS", 1, "cpu")),
    ],
)
def test_edge_messages_round_trip(message):
    assert decode_message(encode_message(message)) == message


def test_frame_carries_protocol_version_first():
    envelope = msgspec.msgpack.decode(encode_message(Ack()), type=Envelope)
    assert envelope.protocol_version == PROTOCOL_VERSION


# --- authentication ---------------------------------------------------------------------------


@SETTINGS
@given(messages, secrets, secrets)
def test_wrong_or_missing_secret_is_unauthenticated(message, mine, theirs):
    # HMAC pads a key shorter than its block with zero bytes (RFC 2104), so secrets that differ
    # only in trailing NULs are the same key (hypothesis found b"\0" and b"\0\0").
    if mine.rstrip(b"\0") != theirs.rstrip(b"\0"):
        expect_protocol_error(encode_message(message, theirs), "unauthenticated", secret=mine)
    expect_protocol_error(encode_message(message), "unauthenticated", secret=mine)


@SETTINGS
@given(messages, secrets, st.data())
def test_tampered_body_or_mac_is_unauthenticated(message, secret, data):
    envelope = msgspec.msgpack.decode(encode_message(message, secret), type=Envelope)
    body, mac = bytearray(envelope.body), bytearray(envelope.mac)
    target = data.draw(st.sampled_from(["body", "mac"]), label="target")
    buf = body if target == "body" else mac
    i = data.draw(st.integers(0, len(buf) - 1), label="at")
    buf[i] ^= data.draw(st.integers(1, 255), label="xor")
    tampered = frame(PROTOCOL_VERSION, bytes(body), bytes(mac))
    expect_protocol_error(tampered, "unauthenticated", secret=secret)


def test_unauthenticated_frame_body_is_never_decoded():
    """With a secret, an unsigned frame whose body is garbage is refused for the MAC, before
    the body decoder sees it."""
    expect_protocol_error(frame(PROTOCOL_VERSION, b"\xc1garbage"), "unauthenticated", secret=b"k")


# --- version mismatch -------------------------------------------------------------------------


@SETTINGS
@given(st.integers(-(2**63), 2**64 - 1).filter(lambda v: v != PROTOCOL_VERSION), messages)
def test_wrong_version_is_version_mismatch_naming_both(version, message):
    body = msgspec.msgpack.encode(message)
    err = expect_protocol_error(frame(version, body), "version_mismatch")
    numbers = re.findall(r"-?\d+", str(err))
    assert str(version) in numbers
    assert str(PROTOCOL_VERSION) in numbers


def test_wrong_version_is_reported_even_when_body_is_unreadable():
    """The envelope is checked before the body: a peer with another schema gets a version
    error, not a decode error."""
    err = expect_protocol_error(frame(PROTOCOL_VERSION + 1, b"\xc1 not msgpack"), "version_mismatch")
    assert str(PROTOCOL_VERSION + 1) in str(err) and str(PROTOCOL_VERSION) in str(err)


def test_bool_version_in_envelope_is_rejected():
    data = msgspec.msgpack.encode([True, msgspec.msgpack.encode(Ack())])
    assert isinstance(expect_protocol_error(data), ProtocolError)


# --- malformed input never escapes as another exception ----------------------------------------


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_bytes_give_protocol_error_or_a_message(data):
    try:
        decode_message(data)
    except ProtocolError as exc:
        assert exc.kind in {"malformed", "version_mismatch", "oversized"}
    try:
        decode_message(data, b"k")
    except ProtocolError as exc:
        assert exc.kind in {"malformed", "version_mismatch", "oversized", "unauthenticated"}


msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    ),
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)
    ),
    max_leaves=20,
)


@SETTINGS
@given(msgpack_values)
def test_arbitrary_msgpack_frames_give_protocol_error(value):
    """Well-formed msgpack of the wrong shape, as the frame or as the body of a v1 frame."""
    for data in (msgspec.msgpack.encode(value), frame(PROTOCOL_VERSION, msgspec.msgpack.encode(value))):
        for secret in (b"", b"k"):
            try:
                decode_message(data, secret)
            except ProtocolError:
                pass


@SETTINGS
@given(
    msgpack_values,
    st.sampled_from(
        ["hello", "welcome", "release", "claim", "extend", "granted", "pending", "ack", "reject", "nope"]
    ),
)
def test_tagged_bodies_with_junk_fields_give_protocol_error(fields, tag):
    body = {"type": tag}
    if isinstance(fields, dict):
        body.update(fields)
        body["type"] = tag
    try:
        decode_message(frame(PROTOCOL_VERSION, msgspec.msgpack.encode(body)))
    except ProtocolError as exc:
        assert exc.kind == "malformed"


@SETTINGS
@given(messages, st.data())
def test_truncated_frames_give_protocol_error(message, data):
    full = encode_message(message)
    cut = data.draw(st.integers(0, len(full) - 1), label="cut")
    expect_protocol_error(full[:cut], "malformed")


def test_every_truncation_of_a_welcome_gives_protocol_error():
    compat = EngineCompat("m", "bf16", "auto", [GroupDesc("mamba", 16, 4096, ["l0"])], "DS", 1, "cpu")
    full = encode_message(
        Welcome("e", "agent", b"\x01" * 40, [LayerRegion("l0", 0, 2**40, 4096, 4096, 100)], compat)
    )
    for cut in range(len(full)):
        expect_protocol_error(full[:cut], "malformed")


@SETTINGS
@given(messages, st.data())
def test_corrupted_frames_give_protocol_error_or_a_message(message, data):
    buf = bytearray(encode_message(message))
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        i = data.draw(st.integers(0, len(buf) - 1), label="at")
        buf[i] = data.draw(st.integers(0, 255), label="byte")
    try:
        decode_message(bytes(buf))
    except ProtocolError:
        pass


def test_trailing_bytes_after_frame_give_protocol_error():
    expect_protocol_error(encode_message(Ack()) + b"\x00", "malformed")


def test_oversized_frame_is_refused_before_decoding():
    err = expect_protocol_error(b"\x00" * (MAX_MESSAGE_BYTES + 1), "oversized")
    assert str(MAX_MESSAGE_BYTES) in str(err)
    # A *valid* frame just over the limit is refused too: the size check comes first.
    big = encode_message(Reject(reason="x" * MAX_MESSAGE_BYTES))
    assert len(big) > MAX_MESSAGE_BYTES
    expect_protocol_error(big, "oversized")


def test_frame_at_exactly_the_limit_is_decoded():
    # msgpack headers are constant-size above 64 KiB, so the overhead measured there holds.
    overhead = len(encode_message(Reject(reason="y" * 2**16))) - 2**16
    reason = "y" * (MAX_MESSAGE_BYTES - overhead)
    data = encode_message(Reject(reason=reason))
    assert len(data) == MAX_MESSAGE_BYTES
    assert decode_message(data) == Reject(reason=reason)


def test_huge_length_prefix_is_truncation_not_allocation():
    # Array / bin headers claiming 4 GiB on a few bytes of input.
    expect_protocol_error(b"\xdd\xff\xff\xff\xff", "malformed")
    expect_protocol_error(b"\x92\x01\xc6\xff\xff\xff\xf0", "malformed")


@pytest.mark.parametrize(
    "where, secret",
    [
        ("unknown_body_field", b""),
        ("known_body_field", b""),
        ("extra_envelope_element", b""),
        ("extra_envelope_element", b"k"),
        ("envelope_body_field", b""),
    ],
)
def test_decode_message_deeply_nested_frame_raises_protocol_error(where, secret):
    """Regression: msgspec raises RecursionError (not DecodeError) while decoding or skipping a
    deeply nested value (~1000 levels, 2 KB); it escaped as RecursionError instead of
    ProtocolError. The envelope case is reached before the MAC check, so even with a shared
    secret an unauthenticated peer triggered it."""
    nested = b"\x91" * 2000 + b"\xc0"  # [[[...[nil]...]]], 2 KB
    if where == "unknown_body_field":
        data = frame(PROTOCOL_VERSION, b"\x82\xa4type\xa3ack\xa1x" + nested)
    elif where == "known_body_field":
        data = frame(PROTOCOL_VERSION, b"\x82\xa4type\xa6reject\xa6reason" + nested)
    elif where == "extra_envelope_element":
        data = b"\x94\x01\xc4\x00\xc4\x00" + nested  # [1, b"", b"", <nested>]
    else:
        data = b"\x93\x01" + nested + b"\xc4\x00"  # [1, <nested>, b""]
    err = expect_protocol_error(data, "malformed", secret=secret)
    assert len(str(err)) < 500


def test_version_check_happens_before_body_decode():
    """A body written by a newer schema (unknown tag) under our version is malformed; under
    another version it is a version mismatch."""
    body = msgspec.msgpack.encode({"type": "hello2", "x": 1})
    expect_protocol_error(frame(PROTOCOL_VERSION, body), "malformed")
    expect_protocol_error(frame(PROTOCOL_VERSION + 1, body), "version_mismatch")


# --- compat_differences -----------------------------------------------------------------------


# TP sizes may differ (the shard plan pairs ranks); page sizes then differ with them.
TOP_FIELDS = [f for f in EngineCompat.__struct_fields__ if f not in ("groups", "tensor_parallel_size")]


@SETTINGS
@given(compats)
def test_identical_compat_has_no_differences(compat):
    assert compat_differences(compat, compat) == []
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(compat), type=EngineCompat)
    assert compat_differences(compat, copy) == []


@SETTINGS
@given(compats, compats)
def test_compat_differences_names_each_differing_field(mine, theirs):
    diffs = compat_differences(mine, theirs)
    same_tp = mine.tensor_parallel_size == theirs.tensor_parallel_size
    expected = 0
    for field in TOP_FIELDS:
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            expected += 1
            assert any(d.startswith(f"{field}:") and repr(a) in d and repr(b) in d for d in diffs), (
                field,
                diffs,
            )
    if len(mine.groups) != len(theirs.groups):
        expected += 1
        assert any(
            "groups" in d and str(len(mine.groups)) in d and str(len(theirs.groups)) in d
            for d in diffs
        )
    else:
        for i, (ga, gb) in enumerate(zip(mine.groups, theirs.groups)):
            # Token blocks of one kind, one size a multiple of the other: re-cut, not refused.
            small, large = sorted((ga.block_size, gb.block_size))
            recut = small != large and ga.kind == gb.kind != "mamba" and small > 0 and large % small == 0
            for sub in GroupDesc.__struct_fields__:
                va, vb = getattr(ga, sub), getattr(gb, sub)
                if sub == "block_size" and recut or sub == "page_bytes" and (recut or not same_tp):
                    continue
                if va != vb:
                    expected += 1
                    assert any(
                        d.startswith(f"group {i} {sub}:") and repr(va) in d and repr(vb) in d
                        for d in diffs
                    ), (i, sub, diffs)
    assert len(diffs) == expected


def test_compat_differences_example_local_then_remote():
    a = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 4096, ["l0"])], "DS", 1, "cpu")
    b = EngineCompat("m", "float16", "auto", [GroupDesc("attention", 24, 4096, ["l0"])], "DS", 2, "cpu")
    assert compat_differences(a, b) == [
        "dtype: local 'bfloat16', remote 'float16'",
        "group 0 block_size: local 16, remote 24 (not an integral ratio)",
    ]


@pytest.mark.parametrize("theirs", [32, 64, 8])
def test_attention_block_sizes_of_an_integral_ratio_are_not_a_difference(theirs):
    """P's blocks 2x, 4x or half of D's: re-cut into sub-blocks (core/block_phases.py), and
    the page sizes differ with them, at equal TP too."""
    a = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 4096, ["l0"])], "DS", 1, "cpu")
    b = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", theirs, 256 * theirs, ["l0"])], "DS", 1, "cpu")
    assert compat_differences(a, b) == []


def test_compat_differences_ignore_tp_size_and_per_rank_page_bytes_across_tp():
    """Ranks of P TP 1 and D TP 2 hold pages of different sizes; each unit's size is checked by
    the shard plan instead. At equal TP a page-size difference is still refused by name."""
    a = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 4096, ["l0"])], "DS", 1, "cpu")
    b = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 2048, ["l0"])], "DS", 2, "cpu")
    assert compat_differences(a, b) == []
    c = EngineCompat("m", "bfloat16", "auto", [GroupDesc("attention", 16, 2048, ["l0"])], "DS", 1, "cpu")
    assert compat_differences(a, c) == ["group 0 page_bytes: local 4096, remote 2048"]


def test_protocol_error_is_a_value_error_with_kind():
    err = ProtocolError("malformed", "x")
    assert isinstance(err, ValueError) and err.kind == "malformed" and str(err) == "x"


def test_pd_connector_envelope_is_not_a_nixl_handshake_message():
    """Why a Release must not reach a NixlConnector listener: our frame decodes there as a
    3-element list, (msg, pp_rank, tp_rank) = (1, body bytes, mac bytes)."""
    decoded = msgspec.msgpack.decode(encode_message(Release(request_ids=["cmpl-abc-0"])))
    assert isinstance(decoded, list) and len(decoded) == 3
    assert decoded[0] == PROTOCOL_VERSION and isinstance(decoded[1], bytes)
