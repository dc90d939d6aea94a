"""Pure tests of pd_connector.core.params: decoding P's ``kv_transfer_params`` (HandoffParams) and
``release_target``, whom D releases when the params are too broken to decode.

No vLLM, NIXL, torch or sockets.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.params import MAX_BLOCK_ID, LeaseRef, decode_handoff_params, release_target
from pd_connector.core.protocol import PROTOCOL_VERSION, ProtocolError

SETTINGS = settings(max_examples=100, deadline=None)


# --- HandoffParams decoding (kv_transfer_params) ----------------------------------------------


def _params(**overrides):
    raw = {
        "pd_protocol_version": PROTOCOL_VERSION,
        "replay_offset": 8,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 5660,
        "remote_block_ids": [[1, 2]],
    }
    raw.update(overrides)
    return raw


def test_decode_handoff_params_ignores_unknown_keys_and_defaults():
    p = decode_handoff_params(_params(tp_size=1, whatever={"x": [1]}))
    assert p.do_remote_prefill is True and p.remote_num_tokens is None
    assert p.remote_block_ids == [[1, 2]]


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ({"replay_offset": -1}, "offset_out_of_range"),
        ({"remote_port": 0}, "malformed"),
        ({"remote_port": 70000}, "malformed"),
        ({"remote_host": ""}, "malformed"),
        ({"remote_block_ids": [[0]]}, "malformed"),
        ({"remote_block_ids": [[3], [2, -1]]}, "malformed"),
        ({"remote_block_ids": [[2**31]]}, "malformed"),
        ({"remote_block_ids": [[2**63]]}, "malformed"),
        ({"remote_block_ids": [[2**70]]}, "malformed"),
        ({"pd_protocol_version": 1}, "version_mismatch"),
        ({"pd_protocol_version": True}, "version_mismatch"),
        ({"replay_offset": "8"}, "malformed"),
        ({"do_remote_prefill": 1}, "malformed"),
    ],
)
def test_decode_handoff_params_errors(overrides, kind):
    with pytest.raises(ProtocolError) as info:
        decode_handoff_params(_params(**overrides))
    assert info.value.kind == kind


@pytest.mark.parametrize(
    "key",
    ["remote_block_ids", "remote_host", "remote_port", "replay_offset", "do_remote_prefill", "remote_num_tokens"],
)
def test_decode_handoff_params_deeply_nested_field_is_malformed(key):
    """RecursionError while converting a deeply nested value becomes ProtocolError("malformed")."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ProtocolError) as info:
        decode_handoff_params(_params(**{key: deep}))
    assert info.value.kind == "malformed"


@pytest.mark.parametrize(
    "version",
    [list(range(10_000)), "v" * 100_000, 10**400, 1.0000001, None, "1", [1]],
)
def test_decode_handoff_params_bad_version_message_is_bounded(version):
    """Bad versions are formatted with reprlib: never raises (deep or huge values), stays short."""
    raw = _params(pd_protocol_version=version)
    if version is None:
        del raw["pd_protocol_version"]
    with pytest.raises(ProtocolError) as info:
        decode_handoff_params(raw)
    assert info.value.kind == "version_mismatch"
    assert len(str(info.value)) < 300 and str(PROTOCOL_VERSION) in str(info.value)


def test_decode_handoff_params_deeply_nested_version_is_version_mismatch():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ProtocolError) as info:
        decode_handoff_params(_params(pd_protocol_version=deep))
    assert info.value.kind == "version_mismatch" and len(str(info.value)) < 300


# --- release_target: whom to release from params too broken to decode -------------------------

TARGET = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 5660, "remote_request_id": "r"}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"pd_protocol_version": 99},
        {"pd_protocol_version": True},
        {"replay_offset": -1},
        {"replay_offset": "8"},
        {"remote_block_ids": [[0]]},
        {"remote_block_ids": "junk"},
        {"remote_num_tokens": [1]},
        {"do_remote_prefill": 1},
        {"whatever": {"x": [1]}},
    ],
)
def test_release_target_from_broken_params(overrides):
    raw = _params(**overrides)
    assert release_target(raw) == ref_of(TARGET)


def test_release_target_without_version():
    """A pd_connector P always sends both keys; an offset without a version is broken params
    from a pd_connector peer, which can be told to release."""
    raw = _params()
    del raw["pd_protocol_version"]
    assert release_target(raw) == ref_of(TARGET)


def ref_of(fields: dict) -> LeaseRef:
    return LeaseRef(
        fields["remote_engine_id"], fields["remote_host"], fields["remote_port"], fields["remote_request_id"]
    )


def nixl_connector_params() -> dict:
    """What vLLM 0.32's NixlConnector P returns (nixl/pull_scheduler.py request_finished): the
    same four target keys, pointing at *its* NIXL handshake listener, and no replay_offset or
    pd_protocol_version (decide_on_decode refuses it as missing_offset)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3]],
        "remote_engine_id": "nixl-prefill-engine",
        "remote_request_id": "cmpl-abc-0",
        "remote_host": "10.0.0.5",
        "remote_port": 5600,
        "tp_size": 1,
    }


def test_release_target_of_non_pd_connector_params_is_none():
    raw = nixl_connector_params()
    assert release_target(raw) is None


def test_nixl_connector_params_are_refused_as_missing_offset():
    """Such params are the missing_offset case, never decoded."""
    with pytest.raises(ProtocolError) as info:
        decode_handoff_params(nixl_connector_params())
    assert info.value.kind == "missing_offset"


@pytest.mark.parametrize("port", [1, 65535])
def test_release_target_port_bounds_accepted(port):
    assert release_target(_params(remote_port=port)).port == port


@pytest.mark.parametrize(
    "overrides",
    [
        {"remote_port": 0},
        {"remote_port": -1},
        {"remote_port": 65536},
        {"remote_port": True},
        {"remote_port": "5660"},
        {"remote_port": 5660.0},
        {"remote_port": None},
        {"remote_host": ""},
        {"remote_host": 5},
        {"remote_host": None},
        {"remote_engine_id": None},
        {"remote_engine_id": 3},
        {"remote_request_id": None},
        {"remote_request_id": ["r"]},
    ],
)
def test_release_target_unusable_is_none(overrides):
    assert release_target(_params(**overrides)) is None


@pytest.mark.parametrize("key", list(TARGET))
def test_release_target_missing_field_is_none(key):
    raw = _params()
    del raw[key]
    assert release_target(raw) is None


@pytest.mark.parametrize("raw", [None, 0, "x", [], [("remote_host", "h")], b"{}", object()])
def test_release_target_of_non_dict_is_none(raw):
    assert release_target(raw) is None


@pytest.mark.parametrize("key", list(TARGET))
def test_release_target_deeply_nested_field_is_none(key):
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert release_target(_params(**{key: deep})) is None


def expected_release_target(raw: dict) -> LeaseRef | None:
    """Oracle: the four fields present with their exact types, a TCP port and a host."""
    values = {k: raw.get(k) for k in TARGET}
    port = values["remote_port"]
    if not all(type(values[k]) is str for k in TARGET if k != "remote_port"):
        return None
    if type(port) is not int or not 0 < port < 65536 or not values["remote_host"]:
        return None
    return ref_of(values)


field_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.integers(-2, 65537),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def broken_params(draw):
    """Valid params with some fields (target fields or others) replaced by junk or deleted;
    replay_offset stays present (params without it are not pd_connector's: never released)."""
    raw = _params()
    keys = st.sampled_from(list(TARGET) + ["replay_offset", "pd_protocol_version", "remote_block_ids"])
    for key in draw(st.lists(keys, max_size=3)):
        if key != "replay_offset" and draw(st.booleans()):
            raw.pop(key, None)
        else:
            raw[key] = draw(field_junk)
    return raw


@SETTINGS
@given(broken_params())
def test_release_target_matches_oracle_and_decoded_params(raw):
    """Never raises; a target exactly when the four fields are usable; and whenever the params
    decode as a whole, the same P and request as the decoded params."""
    target = release_target(raw)
    assert target == expected_release_target(raw)
    try:
        params = decode_handoff_params(raw)
    except ProtocolError:
        return
    assert target == params.lease


def test_decode_handoff_params_block_id_bounds():
    assert decode_handoff_params(_params(remote_block_ids=[[1, MAX_BLOCK_ID - 1]])).remote_block_ids == [
        [1, MAX_BLOCK_ID - 1]
    ]
