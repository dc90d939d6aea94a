"""Pure tests of pd_connector.core.handoff, D's side: ``decide_on_decode`` validating P's params
(junk never raises, each refusal by kind, P's own output accepted) and the skew property (P and
D of different speculative configs: D accepts exactly when P was told, or configured with, D's
requirement).

No vLLM, NIXL, torch or sockets. P's choice of the offset: test_handoff_offset.py.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pd_connector.core.handoff import Accepted, Refused, decide_on_decode, plan_handoff
from pd_connector.core.params import (
    encode_handoff_params,
    KEY_MIN_RECOMPUTE,
    KEY_REPLAY_OFFSET,
    KEY_VERSION,
    MAX_BLOCK_ID,
    HandoffParams,
)
from pd_connector.core.recompute_profile import RecomputeProfile, min_recompute_tokens
from pd_connector.core.protocol import PROTOCOL_VERSION
from rig.handoff_strategies import profiles, prompt_lengths, skew_profiles

# Per-example cost of hypothesis is ~1 ms here; small domains are also enumerated exhaustively
# (plain loops, far cheaper) so the suite stays fast while covering >100k configurations.
FAST = settings(max_examples=150, deadline=None)
MANY = settings(max_examples=200, deadline=None)


def returned_params(
    offset: int,
    source: list[list[int]],
    *,
    engine_id: str = "prefill-engine-0",
    request_id: str = "cmpl-abc-0",
    host: str = "127.0.0.1",
    port: int = 5660,
) -> dict:
    """The dict P returns (the scheduler calls the same function)."""
    return encode_handoff_params(offset, source, engine_id=engine_id, request_id=request_id, host=host, port=port)


def valid_params(offset: int = 10, **overrides) -> dict:
    out = returned_params(offset, [[1, 2, 3]] if offset else [])
    out.update(overrides)
    return out


# --- decide_on_decode: arbitrary junk never raises ----------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
junk = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), children, max_size=4),
    ),
    max_leaves=15,
)
known_keys = st.sampled_from(
    list(HandoffParams.__struct_fields__) + ["remote_blocks_expiry_time", "tp_size", KEY_MIN_RECOMPUTE]
)


@st.composite
def tampered_params(draw):
    """Valid P output with some known keys replaced by junk (or deleted)."""
    n = draw(st.integers(2, 500))
    raw = valid_params(draw(st.integers(0, n - 1)))
    for key in draw(st.lists(known_keys, max_size=4)):
        if draw(st.booleans()):
            raw[key] = draw(junk)
        else:
            raw.pop(key, None)
    return raw


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(junk, st.dictionaries(st.text(max_size=20), junk, max_size=6), tampered_params()),
    st.integers(-5, 1000),
    profiles,
)
def test_decide_never_raises_on_junk(raw, n, profile):
    decision = decide_on_decode(raw, n, profile)
    assert isinstance(decision, (Accepted, Refused))
    if isinstance(decision, Refused):
        assert isinstance(decision.kind, str) and decision.kind
        assert isinstance(decision.reason, str) and decision.reason
        return
    # Anything accepted must honour D's own requirement.
    assert 0 <= decision.replay_offset < n
    assert decision.replay_offset == 0 or n - decision.replay_offset >= min_recompute_tokens(profile)
    assert decision.params.replay_offset == decision.replay_offset
    assert decision.params.remote_num_tokens in (None, decision.replay_offset)


def test_decide_never_raises_on_deeply_nested_version():
    """Regression: the bad version was formatted with {version!r}; a deeply nested value (5000
    levels) made repr() raise RecursionError, so decide_on_decode raised instead of refusing
    (needs a Python caller: json.loads cannot build it). Now formatted with reprlib."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    d = decide_on_decode(valid_params(**{KEY_VERSION: deep}), 100, RecomputeProfile())
    assert isinstance(d, Refused) and d.kind == "version_mismatch" and d.params is None
    assert str(PROTOCOL_VERSION) in d.reason and len(d.reason) < 300


@pytest.mark.parametrize(
    "version",
    [list(range(10_000)), "v" * 100_000, {str(i): i for i in range(1000)}, 10**400, b"\xff" * 5000],
)
def test_version_mismatch_reason_is_bounded(version):
    """Whatever P (or a tamperer) puts in the version field, the log line stays short."""
    d = decide_on_decode(valid_params(**{KEY_VERSION: version}), 100, RecomputeProfile())
    assert isinstance(d, Refused) and d.kind == "version_mismatch"
    assert len(d.reason) < 300


class _BadRepr:
    def __repr__(self):
        raise RuntimeError("repr exploded")


def test_version_whose_repr_raises_is_still_refused():
    d = decide_on_decode(valid_params(**{KEY_VERSION: _BadRepr()}), 100, RecomputeProfile())
    assert isinstance(d, Refused) and d.kind == "version_mismatch"


def test_decide_refuses_deeply_nested_fields():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for key in ("remote_block_ids", "remote_host", "remote_num_tokens", KEY_REPLAY_OFFSET):
        d = decide_on_decode(valid_params(**{key: deep}), 100, RecomputeProfile())
        assert isinstance(d, Refused) and d.kind == "malformed", key


@pytest.mark.parametrize(
    "raw", [None, 0, "replay_offset", [("replay_offset", 3)], b"{}", 3.5, object()]
)
def test_decide_refuses_non_dict_as_malformed(raw):
    d = decide_on_decode(raw, 100, RecomputeProfile())
    assert isinstance(d, Refused) and d.kind == "malformed" and d.params is None


# --- decide_on_decode: specific refusals ------------------------------------------------------


def refused(raw, n=100, profile=RecomputeProfile(), kind=None) -> Refused:
    d = decide_on_decode(raw, n, profile)
    assert isinstance(d, Refused), d
    if kind is not None:
        assert d.kind == kind, d
    return d


def test_missing_offset_is_refused_as_missing_offset():
    # What vLLM's NixlConnector sends: no replay_offset, no protocol version.
    nixl_params = valid_params()
    del nixl_params[KEY_REPLAY_OFFSET]
    del nixl_params[KEY_VERSION]
    d = refused(nixl_params, kind="missing_offset")
    assert d.params is None


@pytest.mark.parametrize("version", [None, 0, 1, -1, PROTOCOL_VERSION + 1, "2", True, False, 1.5])
def test_version_mismatch_is_refused(version):
    raw = valid_params()
    if version is None:
        del raw[KEY_VERSION]
    else:
        raw[KEY_VERSION] = version
    d = refused(raw, kind="version_mismatch")
    assert repr(version) in d.reason
    assert str(PROTOCOL_VERSION) in d.reason


def test_bool_version_true_is_a_mismatch_not_version_one():
    # True == 1 in Python: a bool must never pass as an integer version (protocol 1's trap).
    refused(valid_params(**{KEY_VERSION: True}), kind="version_mismatch")


@pytest.mark.parametrize("offset", [True, False])
def test_bool_offset_is_refused(offset):
    refused(valid_params(replay_offset=offset, remote_num_tokens=None), kind="malformed")


@pytest.mark.parametrize("offset", [-1, -100, -(2**63)])
def test_negative_offset_is_refused(offset):
    refused(valid_params(replay_offset=offset, remote_num_tokens=None), kind="offset_out_of_range")


@pytest.mark.parametrize("offset", ["10", 10.0, None, [10], {"v": 10}])
def test_non_int_offset_is_refused(offset):
    refused(valid_params(replay_offset=offset, remote_num_tokens=None), kind="malformed")


@FAST
@given(st.integers(1, 2000), st.data())
def test_offset_at_or_beyond_prompt_is_refused(n, data):
    offset = data.draw(st.one_of(st.just(n), st.integers(n, 2**64)), label="offset")
    d = refused(
        valid_params(offset, remote_num_tokens=offset), n=n, kind="offset_out_of_range"
    )
    assert d.params is not None and d.params.replay_offset == offset  # P can still be released


@FAST
@given(st.integers(2, 2000), profiles.filter(lambda p: min_recompute_tokens(p) > 1), st.data())
def test_offset_leaving_too_few_tokens_is_refused(n, profile, data):
    need = min_recompute_tokens(profile)
    if n <= need:
        return
    offset = data.draw(st.integers(n - need + 1, n - 1), label="offset")
    d = refused(valid_params(offset), n=n, profile=profile, kind="offset_above_requirement")
    assert str(need) in d.reason and d.params is not None


def test_offset_above_requirement_example():
    # D runs MTP K=4 (needs 3 tokens), P backed off 1 only (plain hybrid).
    d_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=4)
    d = refused(valid_params(39), n=40, profile=d_profile, kind="offset_above_requirement")
    assert KEY_MIN_RECOMPUTE in d.reason
    assert isinstance(decide_on_decode(valid_params(37), 40, d_profile), Accepted)


@FAST
@given(st.integers(2, 2000), st.data())
def test_remote_num_tokens_disagreeing_with_offset_is_refused(n, data):
    offset = data.draw(st.integers(0, n - 1), label="offset")
    other = data.draw(st.integers(0, 2**63).filter(lambda x: x != offset), label="remote_num_tokens")
    d = refused(valid_params(offset, remote_num_tokens=other), n=n, kind="inconsistent_params")
    assert d.params is not None


def test_remote_num_tokens_absent_is_accepted():
    raw = valid_params(10)
    del raw["remote_num_tokens"]
    d = decide_on_decode(raw, 100, RecomputeProfile())
    assert isinstance(d, Accepted) and d.replay_offset == 10 and d.params.remote_num_tokens is None


def test_offset_zero_is_accepted_as_empty_handoff():
    d = decide_on_decode(returned_params(0, []), 100, RecomputeProfile(prefill_lookahead=5))
    assert isinstance(d, Accepted) and d.replay_offset == 0


@pytest.mark.parametrize(
    "override",
    [
        {"remote_port": 0},
        {"remote_port": 65536},
        {"remote_port": True},
        {"remote_host": ""},
        {"remote_engine_id": ""},
        {"remote_request_id": ""},
        {"remote_block_ids": [[1, 0, 2]]},
        {"remote_block_ids": [[1], [-3]]},
        {"remote_block_ids": [[True]]},
        {"remote_block_ids": [[MAX_BLOCK_ID + 1]]},
        {"remote_block_ids": [[2**64]]},
        {"remote_block_ids": [1, 2]},
        {"remote_block_ids": None},
    ],
)
def test_malformed_fields_are_refused(override):
    refused(valid_params(**override), kind="malformed")


@pytest.mark.parametrize("key", ["remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"])
def test_missing_required_field_is_refused(key):
    raw = valid_params()
    del raw[key]
    refused(raw, kind="malformed")


# --- round trip: P's own output is accepted ---------------------------------------------------


@st.composite
def p_source(draw, offset):
    if offset == 0:
        return []
    n_groups = draw(st.integers(1, 4))
    # Real block ids: non-null and below params.MAX_BLOCK_ID (NIXL indices are int32).
    ids = st.integers(1, MAX_BLOCK_ID - 1)
    return [draw(st.lists(ids, min_size=1, max_size=8)) for _ in range(n_groups)]


@FAST
@given(prompt_lengths, profiles, profiles, st.integers(0, 16), st.data())
def test_p_output_round_trips_through_d(n, p_profile, d_profile, extra, data):
    """P chooses R with D's requirement (or more) and returns params the way the scheduler
    does: D accepts exactly R."""
    requested = min_recompute_tokens(d_profile) + extra
    offset = plan_handoff(n, p_profile, requested).replay_offset
    source = data.draw(p_source(offset), label="source")
    raw = returned_params(
        offset,
        source,
        engine_id=data.draw(st.text(min_size=1, max_size=10), label="engine"),
        request_id=data.draw(st.text(min_size=1, max_size=10), label="rid"),
        port=data.draw(st.integers(1, 65535), label="port"),
    )
    d = decide_on_decode(raw, n, d_profile)
    assert isinstance(d, Accepted), d
    assert d.replay_offset == offset
    assert d.params.remote_block_ids == source
    assert d.params.remote_num_tokens == offset
    assert d.params.do_remote_prefill == (offset > 0)


# --- the skew property ------------------------------------------------------------------------


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles)
def test_skew_d_accepts_when_p_is_told_d_requirement(n, p_profile, d_profile):
    offset = plan_handoff(n, p_profile, min_recompute_tokens(d_profile)).replay_offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    assert isinstance(d, Accepted), (p_profile, d_profile, d)
    assert d.replay_offset == offset
    assert offset == 0 or n - offset >= min_recompute_tokens(d_profile)


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles)
@example(40, RecomputeProfile(True, 1), RecomputeProfile(True, 3))  # b_P=1, b_D=2: phantom
@example(40, RecomputeProfile(True, 3), RecomputeProfile(True, 1))  # b_P=2, b_D=1: skipped
def test_skew_d_never_accepts_too_short_a_tail_when_p_is_not_told(n, p_profile, d_profile):
    offset = plan_handoff(n, p_profile).replay_offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    if isinstance(d, Accepted):
        assert d.replay_offset == offset
        assert offset == 0 or n - offset >= min_recompute_tokens(d_profile)
    else:
        assert d.kind == "offset_above_requirement"
        assert 0 < offset and n - offset < min_recompute_tokens(d_profile)


def test_skew_exhaustive_small_prompts():
    """Every P/D pair of (recurrent, lookahead 0..4) profiles, prompts 1..160, told and untold."""
    sk = [RecomputeProfile(rec, la) for rec in (False, True) for la in range(5)]
    for p_profile in sk:
        for d_profile in sk:
            need = min_recompute_tokens(d_profile)
            for n in range(1, 161):
                told = plan_handoff(n, p_profile, need).replay_offset
                d = decide_on_decode(returned_params(told, [[7]] if told else []), n, d_profile)
                assert isinstance(d, Accepted) and d.replay_offset == told, (n, p_profile, d_profile, d)
                untold = plan_handoff(n, p_profile).replay_offset
                d = decide_on_decode(returned_params(untold, [[7]] if untold else []), n, d_profile)
                ok = untold == 0 or n - untold >= need
                if ok:
                    assert isinstance(d, Accepted) and d.replay_offset == untold
                else:
                    assert isinstance(d, Refused) and d.kind == "offset_above_requirement"


def test_mtp_skew_p1_d3_is_refused_not_silent():
    """P with num_speculative_tokens=1 and D with 3 (multi-module MTP, hybrid).
    vLLM desyncs silently; here D refuses unless routed with its requirement."""
    p_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=1)
    d_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=4)
    n = 40
    untold = plan_handoff(n, p_profile).replay_offset
    refused(returned_params(untold, [[7]]), n=n, profile=d_profile, kind="offset_above_requirement")
    told = plan_handoff(n, p_profile, min_recompute_tokens(d_profile)).replay_offset
    assert isinstance(decide_on_decode(returned_params(told, [[7]]), n, d_profile), Accepted)
    assert told == n - 3


def test_group_count_mismatch_is_refused_before_the_offset_requirement():
    """Regression (skew matrix, P without MTP -> D with MTP 3): D refused for the offset (which a
    routing hint would only move) instead of for the different cache layout (which no hint
    fixes), so the operator saw the wrong cause and the matrix counted the wrong event."""
    profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=3)  # needs 2
    params = returned_params(32, [[1], [2], [3], [4]])  # 4 groups, leaves 1 token of 33
    refused = decide_on_decode(params, 33, profile, num_groups=2)
    assert isinstance(refused, Refused) and refused.kind == "group_mismatch", refused
    assert "4 block lists" in refused.reason and "2 KV-cache groups" in refused.reason
    assert refused.params is not None  # so D releases P's lease at once
    assert decide_on_decode(params, 33, profile).kind == "offset_above_requirement"
    assert isinstance(decide_on_decode(returned_params(30, [[1], [2]]), 33, profile, num_groups=2), Accepted)
    # Nothing handed over (offset 0, no block lists) is never a layout mismatch.
    assert isinstance(decide_on_decode(returned_params(0, []), 33, profile, num_groups=2), Accepted)


# --- the skew property with P's configured floor (routers that send no hint) --------------------


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles, st.integers(0, 4))
def test_skew_d_accepts_when_p_is_configured_with_d_requirement_and_no_hint(n, p_profile, d_profile, extra):
    """A router that sends no pd_min_recompute_tokens (vllm-router): P's setting at D's
    requirement (or above) makes every handoff one D honours."""
    offset = plan_handoff(n, p_profile, 0, min_recompute_tokens(d_profile) + extra).replay_offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    assert isinstance(d, Accepted), (p_profile, d_profile, d)
    assert d.replay_offset == offset


def test_skew_mtp_mismatch_is_honoured_with_the_configured_floor():
    """P MTP 1 token, D MTP 3 (needs 2): without the setting every handoff is refused, with
    ``min_recompute_tokens: 2`` on P each one is honoured at N - 2."""
    p_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=1)
    d_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=3)
    for n in (33, 64, 129):
        refused(returned_params(plan_handoff(n, p_profile).replay_offset, [[7]]), n=n, profile=d_profile,
                kind="offset_above_requirement")
        floored = plan_handoff(n, p_profile, 0, 2).replay_offset
        assert floored == n - 2
        assert isinstance(decide_on_decode(returned_params(floored, [[7]]), n, d_profile), Accepted)
