"""Pure tests of pd_connector.core.handoff: P's choice of the replay offset and D's validation.

No vLLM, NIXL, torch or sockets. vLLM 0.32's implicit backoff rule and its Mamba checkpoint
positions, which these tests compare against: docs/architecture.md, "vLLM 0.32 behaviour the core mirrors".
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pd_connector.core.handoff import (
    Accepted,
    HandoffPlan,
    RecomputeProfile,
    Refused,
    checkpoint_to_keep,
    plan_handoff,
    decide_on_decode,
    mamba_checkpoint_position,
    min_recompute_tokens,
    pinned_boundary,
    plan_handoff,
)
from pd_connector.core.params import (
    encode_handoff_params,
    KEY_MIN_RECOMPUTE,
    KEY_REPLAY_OFFSET,
    KEY_VERSION,
    MAX_BLOCK_ID,
    HandoffParams,
)
from pd_connector.core.protocol import PROTOCOL_VERSION

# Per-example cost of hypothesis is ~1 ms here; small domains are also enumerated exhaustively
# (plain loops, far cheaper) so the suite stays fast while covering >100k configurations.
FAST = settings(max_examples=150, deadline=None)
MANY = settings(max_examples=200, deadline=None)

# --- strategies -------------------------------------------------------------------------------

profiles = st.builds(
    RecomputeProfile,
    has_recurrent_state=st.booleans(),
    prefill_lookahead=st.integers(0, 6),
    bounded_replay=st.booleans(),
    replay_grid=st.one_of(st.just(0), st.integers(1, 64), st.sampled_from([8, 16, 32, 64, 128])),
    eagle_drop=st.booleans(),
)
# The skew scenario of the brief: EAGLE-family lookahead 0..4, recurrent or not, no grid.
skew_profiles = st.builds(
    RecomputeProfile,
    has_recurrent_state=st.booleans(),
    prefill_lookahead=st.integers(0, 4),
)
prompt_lengths = st.integers(1, 5000)


def expected_offset(n: int, profile: RecomputeProfile, requested: int = 0, max_extra: int = 0) -> int:
    """The rule restated: N minus the recompute tail, or vLLM's prompt checkpoint when it is no
    more than ``max_extra`` tokens below that (align mode, ``max_checkpoint_recompute``)."""
    offset = max(0, n - max(min_recompute_tokens(profile), requested))
    u = profile.replay_grid
    if u > 0:
        checkpoint = vllm_mamba_checkpoint(n, u, profile.eagle_drop)
        if 0 < checkpoint <= offset and offset - checkpoint <= max_extra:
            return checkpoint
    return offset


def vllm_backoff(profile: RecomputeProfile) -> int:
    """vLLM 0.32 ``_prefill_backoff`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
    base_scheduler.py): 1 for Mamba or bounded replay, else the MTP lookahead less one."""
    return max(1 if profile.has_recurrent_state or profile.bounded_replay else 0, profile.prefill_lookahead - 1)


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


# --- min_recompute_tokens ---------------------------------------------------------------------


@FAST
@given(profiles)
def test_min_recompute_is_at_least_one_and_covers_every_term(profile):
    need = min_recompute_tokens(profile)
    assert need >= 1
    assert need >= profile.prefill_lookahead - 1
    assert need >= vllm_backoff(profile)


@pytest.mark.parametrize(
    "recurrent, lookahead, expected",
    [
        # vLLM's backoff b per model and drafting, with pd_connector's explicit floor of 1.
        (False, 0, 1),  # pure attention, no spec decode: vLLM b = 0 (full-hit rule rewinds 1)
        (False, 1, 1),  # pure attention, EAGLE / single-module MTP
        (False, 3, 2),  # pure attention, multi-module MTP K=3 -> K-1
        (True, 0, 1),  # hybrid, no spec decode
        (True, 1, 1),  # hybrid, EAGLE
        (True, 2, 1),  # hybrid, MTP K=2 -> max(1, 1)
        (True, 4, 3),  # hybrid, MTP K=4 -> max(1, 3)
    ],
)
def test_min_recompute_matches_vllm_backoff_table(recurrent, lookahead, expected):
    profile = RecomputeProfile(has_recurrent_state=recurrent, prefill_lookahead=lookahead)
    assert min_recompute_tokens(profile) == expected


# --- plan_handoff / plan_handoff --------------------------------------------------------


@MANY
@given(prompt_lengths, profiles, st.integers(-10, 6000))
def test_choose_offset_bounds(n, profile, requested):
    offset = plan_handoff(n, profile, requested).offset
    assert isinstance(offset, int) and not isinstance(offset, bool)
    assert 0 <= offset < n
    if offset > 0:
        assert offset <= n - min_recompute_tokens(profile)
        assert offset <= n - requested
        assert n - offset >= max(min_recompute_tokens(profile), requested)


@MANY
@given(prompt_lengths, profiles, st.integers(0, 6000))
def test_d_recomputes_only_its_minimum_in_every_cache_mode(n, profile, requested):
    """By default the offset is N minus D's tail whatever the prefix-caching grid or the EAGLE
    drop: D never recomputes more than it must (the grid used to move up to a unit of prefill
    work onto D)."""
    tail = max(min_recompute_tokens(profile), requested)
    assert plan_handoff(n, profile, requested).offset == max(0, n - tail)


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 300))
def test_checkpoint_trade_lands_on_vllm_checkpoint_within_its_budget(n, profile, requested, max_extra):
    """With ``max_checkpoint_recompute``, the offset is vLLM's prompt checkpoint exactly when it
    costs D at most that many extra tokens; otherwise N minus the tail. Never below the
    checkpoint, never more extra work than allowed."""
    plan = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra)
    tail = max(min_recompute_tokens(profile), requested)
    assert plan.offset == expected_offset(n, profile, requested, max_extra)
    assert 0 <= max(0, n - tail) - plan.offset <= max_extra
    if profile.replay_grid > 0:
        assert plan.checkpoint == vllm_mamba_checkpoint(n, profile.replay_grid, profile.eagle_drop)
    else:
        assert plan.checkpoint == 0


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 200), st.integers(0, 300))
def test_configured_floor_and_checkpoint_trade_combine(n, profile, requested, configured, max_extra):
    """P's ``min_recompute_tokens`` setting is one more floor on the tail before the trade: the
    plan is the plan for the larger of the request's hint and the setting."""
    got = plan_handoff(n, profile, requested, configured, max_extra)
    assert got == plan_handoff(n, profile, max(requested, configured), 0, max_extra)
    assert n - got.offset >= max(min_recompute_tokens(profile), requested, configured) or got.offset == 0


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 300))
def test_p_keeps_the_whole_prompts_checkpoint_when_its_truncation_would_lose_it(n, profile, requested, max_extra):
    """P asks vLLM to keep the whole prompt's checkpoint exactly when it computed what a hit there
    needs (with the EAGLE drop, the block above too) and vLLM's own checkpoint of the truncated
    prompt (what retention interval 0 keeps) is another. With the drop it never asks: the two
    differ only when a grid point lies in (R, N], and then the block above C ends past R."""
    plan = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra)
    keep = checkpoint_to_keep(plan, profile)
    unit = profile.replay_grid
    truncated = vllm_mamba_checkpoint(plan.offset, unit, profile.eagle_drop) if unit else 0
    needed = plan.checkpoint + (unit if profile.eagle_drop else 0)
    if unit and plan.checkpoint > 0 and needed <= plan.offset and plan.checkpoint != truncated:
        assert keep == plan.checkpoint == plan.offset  # the end of P's prefill: no extra chunk
        assert not profile.eagle_drop
    else:
        assert keep == 0


def test_p_keeps_k_blocks_at_n_equal_k_blocks_plus_one():
    """The e2e failure it pins: N = kB + 1, P computes kB, vLLM keeps (k-1)B; P must keep kB."""
    profile = RecomputeProfile(has_recurrent_state=True, replay_grid=384)
    for k in (1, 2, 3):
        assert checkpoint_to_keep(plan_handoff(k * 384 + 1, profile), profile) == k * 384
        assert checkpoint_to_keep(plan_handoff(k * 384 + 2, profile), profile) == 0  # vLLM keeps it


def test_p_pins_its_checkpoint_only_where_vllm_set_no_junction_of_its_own():
    """vLLM's own junction (a system prompt shared with other cached requests), below or above
    P's checkpoint, stays: it serves every sibling, P's pin only this conversation."""
    assert pinned_boundary(0, 768) == 768
    assert pinned_boundary(768, 768) == 768
    assert pinned_boundary(384, 768) is None
    assert pinned_boundary(1152, 768) is None


@pytest.mark.parametrize("n", [0, -1, -100])
def test_choose_offset_for_empty_prompt_is_zero(n):
    assert plan_handoff(n, RecomputeProfile(has_recurrent_state=True)).offset == 0
    assert plan_handoff(n, RecomputeProfile(replay_grid=16), max_checkpoint_recompute=10**6) == HandoffPlan(0)


def test_choose_offset_equals_vllm_implicit_rule_exhaustive():
    for recurrent in (False, True):
        for lookahead in range(7):
            profile = RecomputeProfile(has_recurrent_state=recurrent, prefill_lookahead=lookahead)
            b = vllm_backoff(profile)
            for requested in range(b + 1):
                for n in range(1, 300):
                    expected = (n - b if n > b else 0) if b >= 1 else n - 1
                    assert plan_handoff(n, profile, requested).offset == expected, (n, profile)


@FAST
@given(
    st.integers(1, 10**9),
    st.booleans(),
    st.integers(0, 6),
    st.data(),
)
def test_choose_offset_equals_vllm_implicit_rule(n, recurrent, lookahead, data):
    """vLLM 0.32: P prefills N - b with b = max(1 if recurrent else 0, lookahead - 1), when
    b >= 1 and N > b. Without a grid, bounded replay or a larger request, we agree exactly."""
    profile = RecomputeProfile(has_recurrent_state=recurrent, prefill_lookahead=lookahead)
    b = vllm_backoff(profile)
    requested = data.draw(st.integers(0, b), label="requested")
    offset = plan_handoff(n, profile, requested).offset
    if b >= 1:
        # vLLM truncates only when N > b; otherwise D recomputes the whole prompt (offset 0).
        assert offset == (n - b if n > b else 0)
    else:
        # b == 0: vLLM hands over all N and rewinds one on D (full-hit rule); we hand over N-1.
        assert offset == n - 1


@pytest.mark.parametrize(
    "n, profile, requested, max_extra, expected",
    [
        (40, RecomputeProfile(has_recurrent_state=True), 0, 0, 39),  # vLLM's P computes 39 of 40
        (40, RecomputeProfile(), 0, 0, 39),
        (40, RecomputeProfile(has_recurrent_state=True, prefill_lookahead=3), 0, 0, 38),
        (40, RecomputeProfile(has_recurrent_state=True), 2, 0, 38),  # D runs MTP K=3
        # The measured case of the brief: 640-token grid, N=805 and 1153 no longer floored.
        (805, RecomputeProfile(has_recurrent_state=True, replay_grid=640), 0, 0, 804),
        (1153, RecomputeProfile(has_recurrent_state=True, replay_grid=640), 0, 0, 1152),
        (805, RecomputeProfile(has_recurrent_state=True, replay_grid=640), 0, 640, 640),
        (805, RecomputeProfile(has_recurrent_state=True, replay_grid=640), 0, 163, 804),
        (805, RecomputeProfile(has_recurrent_state=True, replay_grid=640), 0, 164, 640),
        (128, RecomputeProfile(has_recurrent_state=True, replay_grid=32), 0, 10**6, 96),
        (129, RecomputeProfile(has_recurrent_state=True, replay_grid=32), 0, 0, 128),
        (31, RecomputeProfile(has_recurrent_state=True, replay_grid=32), 0, 10**6, 30),
        (1, RecomputeProfile(), 0, 0, 0),
        (2, RecomputeProfile(), 0, 0, 1),
        (5, RecomputeProfile(), 10, 0, 0),
        (10, RecomputeProfile(bounded_replay=True), 0, 0, 9),
    ],
)
def test_choose_offset_examples(n, profile, requested, max_extra, expected):
    assert plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra).offset == expected


@FAST
@given(st.integers(2, 10**6), st.integers(0, 6))
def test_bounded_replay_backs_off_one_token_like_vllm_not_its_window(n, lookahead):
    """A sliding window under bounded replay (DeepSeek-V4.1) is restored by the load, so vLLM
    backs off one token for it; recomputing the whole window (prefix_replay_tokens) threw
    away up to a window of P's work on every handoff."""
    profile = RecomputeProfile(bounded_replay=True, prefill_lookahead=lookahead)
    assert min_recompute_tokens(profile) == vllm_backoff(profile) == max(1, lookahead - 1)
    assert plan_handoff(n, profile).offset == max(0, n - vllm_backoff(profile))


ALL_PROFILES = [
    RecomputeProfile(rec, la, bounded, grid, eagle)
    for rec in (False, True)
    for la in range(7)
    for bounded in (False, True)
    for grid in (0, 1, 3, 8, 16)
    for eagle in ((False, True) if grid else (False,))
]


def test_choose_offset_exhaustive_small_prompts():
    """Every prompt length 1..96 x 378 profiles x requested tails x budgets: bounds and the
    rule (plain loops)."""
    for profile in ALL_PROFILES:
        need = min_recompute_tokens(profile)
        for requested in (-3, 0, 1, 2, 3, 5, 40, 500):
            tail = max(need, requested)
            for max_extra in (0, 10**6):
                for n in range(1, 97):
                    offset = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra).offset
                    ctx = (n, profile, requested, max_extra, offset)
                    assert 0 <= offset < n, ctx
                    assert offset == 0 or n - offset >= tail, ctx
                    assert offset == expected_offset(n, profile, requested, max_extra), ctx


def vllm_mamba_checkpoint(n: int, unit: int, eagle: bool) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` (vllm/v1/kv_cache_interface.py;
    tests/vllm compare the core's restatement with vLLM's own function)."""
    return max(0, (n // unit) * unit - unit if eagle else ((n - 1) // unit) * unit)


def test_checkpoint_position_examples():
    assert vllm_mamba_checkpoint(80, 8, False) == 72
    assert vllm_mamba_checkpoint(15, 2, True) == 12
    assert vllm_mamba_checkpoint(128, 32, True) == 96
    for unit in (1, 2, 8, 16, 32, 64, 640):
        for eagle in (False, True):
            for n in range(0, 3 * unit + 3):
                assert mamba_checkpoint_position(n, unit, eagle) == vllm_mamba_checkpoint(n, unit, eagle), (n, unit)


def test_unbounded_trade_is_vllm_checkpoint_with_and_without_eagle():
    """With an unbounded budget the offset is vLLM's prefill checkpoint wherever one exists, so
    D registers the received state where its cache manager looks (vllm#51295, #53945)."""
    for unit in (1, 2, 8, 16, 32, 64):
        for eagle in (False, True):
            profile = RecomputeProfile(
                has_recurrent_state=True, prefill_lookahead=int(eagle), replay_grid=unit, eagle_drop=eagle
            )
            for n in range(1, 400):
                checkpoint = vllm_mamba_checkpoint(n, unit, eagle)
                expected = checkpoint if checkpoint > 0 else n - 1
                assert plan_handoff(n, profile, max_checkpoint_recompute=10**9).offset == expected, (n, unit, eagle)


@FAST
@given(prompt_lengths, profiles, st.integers(0, 100), st.integers(0, 100))
def test_choose_offset_monotone_in_requested(n, profile, r1, r2):
    lo, hi = sorted((r1, r2))
    assert plan_handoff(n, profile, hi).offset <= plan_handoff(n, profile, lo).offset


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
    assert 0 <= decision.offset < n
    assert decision.offset == 0 or n - decision.offset >= min_recompute_tokens(profile)
    assert decision.params.replay_offset == decision.offset
    assert decision.params.remote_num_tokens in (None, decision.offset)


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
    assert isinstance(d, Accepted) and d.offset == 10 and d.params.remote_num_tokens is None


def test_offset_zero_is_accepted_as_empty_handoff():
    d = decide_on_decode(returned_params(0, []), 100, RecomputeProfile(prefill_lookahead=5))
    assert isinstance(d, Accepted) and d.offset == 0


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
    offset = plan_handoff(n, p_profile, requested).offset
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
    assert d.offset == offset
    assert d.params.remote_block_ids == source
    assert d.params.remote_num_tokens == offset
    assert d.params.do_remote_prefill == (offset > 0)


# --- the skew property ------------------------------------------------------------------------


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles)
def test_skew_d_accepts_when_p_is_told_d_requirement(n, p_profile, d_profile):
    offset = plan_handoff(n, p_profile, min_recompute_tokens(d_profile)).offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    assert isinstance(d, Accepted), (p_profile, d_profile, d)
    assert d.offset == offset
    assert offset == 0 or n - offset >= min_recompute_tokens(d_profile)


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles)
@example(40, RecomputeProfile(True, 1), RecomputeProfile(True, 3))  # b_P=1, b_D=2: phantom
@example(40, RecomputeProfile(True, 3), RecomputeProfile(True, 1))  # b_P=2, b_D=1: skipped
def test_skew_d_never_accepts_too_short_a_tail_when_p_is_not_told(n, p_profile, d_profile):
    offset = plan_handoff(n, p_profile).offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    if isinstance(d, Accepted):
        assert d.offset == offset
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
                told = plan_handoff(n, p_profile, need).offset
                d = decide_on_decode(returned_params(told, [[7]] if told else []), n, d_profile)
                assert isinstance(d, Accepted) and d.offset == told, (n, p_profile, d_profile, d)
                untold = plan_handoff(n, p_profile).offset
                d = decide_on_decode(returned_params(untold, [[7]] if untold else []), n, d_profile)
                ok = untold == 0 or n - untold >= need
                if ok:
                    assert isinstance(d, Accepted) and d.offset == untold
                else:
                    assert isinstance(d, Refused) and d.kind == "offset_above_requirement"


def test_mtp_skew_p1_d3_is_refused_not_silent():
    """P with num_speculative_tokens=1 and D with 3 (multi-module MTP, hybrid).
    vLLM desyncs silently; here D refuses unless routed with its requirement."""
    p_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=1)
    d_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=4)
    n = 40
    untold = plan_handoff(n, p_profile).offset
    refused(returned_params(untold, [[7]]), n=n, profile=d_profile, kind="offset_above_requirement")
    told = plan_handoff(n, p_profile, min_recompute_tokens(d_profile)).offset
    assert isinstance(decide_on_decode(returned_params(told, [[7]]), n, d_profile), Accepted)
    assert told == n - 3


# A little arithmetic sanity of the property above, independent of the module.
def test_vllm_backoff_helper_matches_vllm_backoff_table():
    assert vllm_backoff(RecomputeProfile()) == 0
    assert vllm_backoff(RecomputeProfile(prefill_lookahead=4)) == 3
    assert vllm_backoff(RecomputeProfile(has_recurrent_state=True)) == 1
    assert vllm_backoff(RecomputeProfile(has_recurrent_state=True, prefill_lookahead=2)) == 1


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


# --- P's configured floor (min_recompute_tokens setting): routers that send no hint -------------


@MANY
@given(prompt_lengths, profiles, st.integers(-10, 6000), st.integers(0, 6000))
def test_configured_floor_is_one_more_floor_on_the_tail(n, profile, requested, configured):
    """R = N - max(P's own minimum, the router's request, P's setting), then the grid: the
    setting acts exactly as a request of the same size would, whichever of the two is larger."""
    got = plan_handoff(n, profile, requested, configured).offset
    assert got == plan_handoff(n, profile, max(requested, configured)).offset
    assert got == plan_handoff(n, profile, configured, requested).offset
    if got > 0:
        assert n - got >= max(min_recompute_tokens(profile), requested, configured)


@FAST
@given(prompt_lengths, profiles, st.integers(0, 6000))
def test_configured_floor_zero_changes_nothing(n, profile, requested):
    assert plan_handoff(n, profile, requested, 0).offset == plan_handoff(n, profile, requested).offset


@FAST
@given(prompt_lengths, profiles, st.integers(0, 100), st.integers(0, 100))
def test_choose_offset_monotone_in_configured_floor(n, profile, c1, c2):
    lo, hi = sorted((c1, c2))
    assert plan_handoff(n, profile, 0, hi).offset <= plan_handoff(n, profile, 0, lo).offset


@MANY
@given(prompt_lengths, skew_profiles, skew_profiles, st.integers(0, 4))
def test_skew_d_accepts_when_p_is_configured_with_d_requirement_and_no_hint(n, p_profile, d_profile, extra):
    """A router that sends no pd_min_recompute_tokens (vllm-router): P's setting at D's
    requirement (or above) makes every handoff one D honours."""
    offset = plan_handoff(n, p_profile, 0, min_recompute_tokens(d_profile) + extra).offset
    d = decide_on_decode(returned_params(offset, [[7]] if offset else []), n, d_profile)
    assert isinstance(d, Accepted), (p_profile, d_profile, d)
    assert d.offset == offset


def test_skew_mtp_mismatch_is_honoured_with_the_configured_floor():
    """P MTP 1 token, D MTP 3 (needs 2): without the setting every handoff is refused, with
    ``min_recompute_tokens: 2`` on P each one is honoured at N - 2."""
    p_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=1)
    d_profile = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=3)
    for n in (33, 64, 129):
        refused(returned_params(plan_handoff(n, p_profile).offset, [[7]]), n=n, profile=d_profile,
                kind="offset_above_requirement")
        floored = plan_handoff(n, p_profile, 0, 2).offset
        assert floored == n - 2
        assert isinstance(decide_on_decode(returned_params(floored, [[7]]), n, d_profile), Accepted)
