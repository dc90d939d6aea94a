"""Pure tests of pd_connector.core.handoff, P's side: the replay offset P chooses
(``plan_handoff``, on core/recompute_profile.py's ``min_recompute_tokens`` and checkpoint
position; core/checkpoints.py's ``checkpoint_to_keep`` on the plans it makes),
what it offers at finish time (``offered_offset``) and the router's requirement field.

No vLLM, NIXL, torch or sockets. vLLM 0.32's implicit backoff rule and its Mamba checkpoint
positions, which these tests compare against: docs/architecture.md, "vLLM 0.32 behaviour the core mirrors".
D's side (``decide_on_decode``): test_handoff_decide.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.checkpoints import checkpoint_to_keep, pinned_boundary
from pd_connector.core.handoff import HandoffPlan, offered_offset, plan_handoff, requested_min_recompute
from pd_connector.core.recompute_profile import RecomputeProfile, mamba_checkpoint_position, min_recompute_tokens
from rig.handoff_strategies import profiles, prompt_lengths

# Per-example cost of hypothesis is ~1 ms here; small domains are also enumerated exhaustively
# (plain loops, far cheaper) so the suite stays fast while covering >100k configurations.
FAST = settings(max_examples=150, deadline=None)
MANY = settings(max_examples=200, deadline=None)


def expected_offset(n: int, profile: RecomputeProfile, requested: int = 0, max_extra: int = 0) -> int:
    """The rule restated: N minus the recompute tail, or vLLM's prompt checkpoint when it is no
    more than ``max_extra`` tokens below that (align mode, ``max_checkpoint_recompute``)."""
    offset = max(0, n - max(min_recompute_tokens(profile), requested))
    u = profile.checkpoint_unit
    if u > 0:
        checkpoint = vllm_mamba_checkpoint(n, u, profile.eagle_drop)
        if 0 < checkpoint <= offset and offset - checkpoint <= max_extra:
            return checkpoint
    return offset


def vllm_backoff(profile: RecomputeProfile) -> int:
    """vLLM 0.32 ``_prefill_backoff`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
    base_scheduler.py): 1 for Mamba or bounded replay, else the MTP lookahead less one."""
    return max(1 if profile.has_recurrent_state or profile.bounded_replay else 0, profile.prefill_lookahead - 1)


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


# --- plan_handoff --------------------------------------------------------


@MANY
@given(prompt_lengths, profiles, st.integers(-10, 6000))
def test_choose_offset_bounds(n, profile, requested):
    offset = plan_handoff(n, profile, requested).replay_offset
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
    assert plan_handoff(n, profile, requested).replay_offset == max(0, n - tail)


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 300))
def test_checkpoint_trade_lands_on_vllm_checkpoint_within_its_budget(n, profile, requested, max_extra):
    """With ``max_checkpoint_recompute``, the offset is vLLM's prompt checkpoint exactly when it
    costs D at most that many extra tokens; otherwise N minus the tail. Never below the
    checkpoint, never more extra work than allowed."""
    plan = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra)
    tail = max(min_recompute_tokens(profile), requested)
    assert plan.replay_offset == expected_offset(n, profile, requested, max_extra)
    assert 0 <= max(0, n - tail) - plan.replay_offset <= max_extra
    if profile.checkpoint_unit > 0:
        assert plan.checkpoint == vllm_mamba_checkpoint(n, profile.checkpoint_unit, profile.eagle_drop)
    else:
        assert plan.checkpoint == 0


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 200), st.integers(0, 300))
def test_configured_floor_and_checkpoint_trade_combine(n, profile, requested, configured, max_extra):
    """P's ``min_recompute_tokens`` setting is one more floor on the tail before the trade: the
    plan is the plan for the larger of the request's hint and the setting."""
    got = plan_handoff(n, profile, requested, configured, max_extra)
    assert got == plan_handoff(n, profile, max(requested, configured), 0, max_extra)
    assert n - got.replay_offset >= max(min_recompute_tokens(profile), requested, configured) or got.replay_offset == 0


@MANY
@given(prompt_lengths, profiles, st.integers(0, 200), st.integers(0, 300))
def test_p_keeps_the_whole_prompts_checkpoint_when_its_truncation_would_lose_it(n, profile, requested, max_extra):
    """P asks vLLM to keep the whole prompt's checkpoint exactly when it computed what a hit there
    needs (with the EAGLE drop, the block above too) and vLLM's own checkpoint of the truncated
    prompt (what retention interval 0 keeps) is another. With the drop it never asks: the two
    differ only when a grid point lies in (R, N], and then the block above C ends past R."""
    plan = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra)
    keep = checkpoint_to_keep(plan, profile)
    unit = profile.checkpoint_unit
    truncated = vllm_mamba_checkpoint(plan.replay_offset, unit, profile.eagle_drop) if unit else 0
    needed = plan.checkpoint + (unit if profile.eagle_drop else 0)
    if unit and plan.checkpoint > 0 and needed <= plan.replay_offset and plan.checkpoint != truncated:
        assert keep == plan.checkpoint == plan.replay_offset  # the end of P's prefill: no extra chunk
        assert not profile.eagle_drop
    else:
        assert keep == 0


def test_p_keeps_k_blocks_at_n_equal_k_blocks_plus_one():
    """The e2e failure it pins: N = kB + 1, P computes kB, vLLM keeps (k-1)B; P must keep kB."""
    profile = RecomputeProfile(has_recurrent_state=True, checkpoint_unit=384)
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
    assert plan_handoff(n, RecomputeProfile(has_recurrent_state=True)).replay_offset == 0
    assert plan_handoff(n, RecomputeProfile(checkpoint_unit=16), max_checkpoint_recompute=10**6) == HandoffPlan(0)


def test_choose_offset_equals_vllm_implicit_rule_exhaustive():
    for recurrent in (False, True):
        for lookahead in range(7):
            profile = RecomputeProfile(has_recurrent_state=recurrent, prefill_lookahead=lookahead)
            b = vllm_backoff(profile)
            for requested in range(b + 1):
                for n in range(1, 300):
                    expected = (n - b if n > b else 0) if b >= 1 else n - 1
                    assert plan_handoff(n, profile, requested).replay_offset == expected, (n, profile)


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
    offset = plan_handoff(n, profile, requested).replay_offset
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
        (805, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=640), 0, 0, 804),
        (1153, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=640), 0, 0, 1152),
        (805, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=640), 0, 640, 640),
        (805, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=640), 0, 163, 804),
        (805, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=640), 0, 164, 640),
        (128, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=32), 0, 10**6, 96),
        (129, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=32), 0, 0, 128),
        (31, RecomputeProfile(has_recurrent_state=True, checkpoint_unit=32), 0, 10**6, 30),
        (1, RecomputeProfile(), 0, 0, 0),
        (2, RecomputeProfile(), 0, 0, 1),
        (5, RecomputeProfile(), 10, 0, 0),
        (10, RecomputeProfile(bounded_replay=True), 0, 0, 9),
    ],
)
def test_choose_offset_examples(n, profile, requested, max_extra, expected):
    assert plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra).replay_offset == expected


@FAST
@given(st.integers(2, 10**6), st.integers(0, 6))
def test_bounded_replay_backs_off_one_token_like_vllm_not_its_window(n, lookahead):
    """A sliding window under bounded replay (DeepSeek-V4.1) is restored by the load, so vLLM
    backs off one token for it; recomputing the whole window (prefix_replay_tokens) threw
    away up to a window of P's work on every handoff."""
    profile = RecomputeProfile(bounded_replay=True, prefill_lookahead=lookahead)
    assert min_recompute_tokens(profile) == vllm_backoff(profile) == max(1, lookahead - 1)
    assert plan_handoff(n, profile).replay_offset == max(0, n - vllm_backoff(profile))


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
                    offset = plan_handoff(n, profile, requested, max_checkpoint_recompute=max_extra).replay_offset
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
                has_recurrent_state=True, prefill_lookahead=int(eagle), checkpoint_unit=unit, eagle_drop=eagle
            )
            for n in range(1, 400):
                checkpoint = vllm_mamba_checkpoint(n, unit, eagle)
                expected = checkpoint if checkpoint > 0 else n - 1
                assert plan_handoff(n, profile, max_checkpoint_recompute=10**9).replay_offset == expected, (n, unit, eagle)


@FAST
@given(prompt_lengths, profiles, st.integers(0, 100), st.integers(0, 100))
def test_choose_offset_monotone_in_requested(n, profile, r1, r2):
    lo, hi = sorted((r1, r2))
    assert plan_handoff(n, profile, hi).replay_offset <= plan_handoff(n, profile, lo).replay_offset


# A little arithmetic sanity of vllm_backoff above, independent of the module.
def test_vllm_backoff_helper_matches_vllm_backoff_table():
    assert vllm_backoff(RecomputeProfile()) == 0
    assert vllm_backoff(RecomputeProfile(prefill_lookahead=4)) == 3
    assert vllm_backoff(RecomputeProfile(has_recurrent_state=True)) == 1
    assert vllm_backoff(RecomputeProfile(has_recurrent_state=True, prefill_lookahead=2)) == 1


# --- P's configured floor (min_recompute_tokens setting): routers that send no hint -------------


@MANY
@given(prompt_lengths, profiles, st.integers(-10, 6000), st.integers(0, 6000))
def test_configured_floor_is_one_more_floor_on_the_tail(n, profile, requested, configured):
    """R = N - max(P's own minimum, the router's request, P's setting), then the grid: the
    setting acts exactly as a request of the same size would, whichever of the two is larger."""
    got = plan_handoff(n, profile, requested, configured).replay_offset
    assert got == plan_handoff(n, profile, max(requested, configured)).replay_offset
    assert got == plan_handoff(n, profile, configured, requested).replay_offset
    if got > 0:
        assert n - got >= max(min_recompute_tokens(profile), requested, configured)


@FAST
@given(prompt_lengths, profiles, st.integers(0, 6000))
def test_configured_floor_zero_changes_nothing(n, profile, requested):
    assert plan_handoff(n, profile, requested, 0).replay_offset == plan_handoff(n, profile, requested).replay_offset


@FAST
@given(prompt_lengths, profiles, st.integers(0, 100), st.integers(0, 100))
def test_choose_offset_monotone_in_configured_floor(n, profile, c1, c2):
    lo, hi = sorted((c1, c2))
    assert plan_handoff(n, profile, 0, hi).replay_offset <= plan_handoff(n, profile, 0, lo).replay_offset


# --- offered_offset / requested_min_recompute: P's finish-time rule, the router's field ----------


@given(st.integers(0, 10_000), st.integers(0, 10_000))
def test_p_hands_over_only_the_state_it_computed(chosen, computed):
    got = offered_offset(chosen, computed)
    assert got == (chosen if chosen > 0 and computed == chosen else 0)


def test_p_offset_not_computed_hands_over_nothing():
    # e.g. preempted and recomputed differently: the Mamba slot is not the state at R
    assert offered_offset(39, 40) == 0
    assert offered_offset(39, 38) == 0
    assert offered_offset(39, 39) == 39


@pytest.mark.parametrize("raw, expected", [(None, 0), (0, 0), (3, 3), (-1, None), (True, None), ("3", None), (2.0, None), ([3], None)])
def test_requested_min_recompute(raw, expected):
    assert requested_min_recompute(raw) == expected


# --- the whole-prompt replay plan ---------------------------------------------------------------


@MANY
# A grid of recurrent-state checkpoints implies recurrent state (profile_from_vllm).
@given(prompt_lengths, profiles.filter(lambda p: p.has_recurrent_state or not p.checkpoint_unit), st.integers(0, 40),
       st.one_of(st.none(), st.integers(0, 300)), st.data())
def test_whole_prompt_plan_resumes_only_where_p_keeps_the_state(n, profile, requested, bound, data):
    """Given the states P keeps prefilling the whole prompt: a hybrid's whole-prompt plan
    resumes at vLLM's prompt checkpoint, which P keeps, within the bound on D's extra tokens; an
    attention-only plan hands over N - tail of the whole prompt; otherwise P truncates (the plan
    without states). D always recomputes at least its tail."""
    checkpoint = mamba_checkpoint_position(n, profile.checkpoint_unit, profile.eagle_drop) if profile.checkpoint_unit else 0
    states = data.draw(st.sets(st.sampled_from([checkpoint, 1, n // 2, n - 1]) if n > 1 else st.just(0)).map(
        lambda s: tuple(sorted(p for p in s if 0 < p < n))))
    plan = plan_handoff(n, profile, requested, max_checkpoint_recompute=bound, whole_prompt_states=states)
    tail = max(min_recompute_tokens(profile), requested)
    truncated = plan_handoff(n, profile, requested, max_checkpoint_recompute=bound)
    assert not truncated.whole_prompt
    assert plan.replay_offset == 0 or n - plan.replay_offset >= tail
    if bound is not None:
        assert max(0, n - tail) - plan.replay_offset <= bound
    if not plan.whole_prompt:
        assert plan == truncated
    elif profile.has_recurrent_state:
        assert plan.replay_offset == checkpoint == plan.checkpoint and checkpoint in states
    else:
        assert plan.replay_offset == n - tail > 0
    reachable = profile.checkpoint_unit and 0 < checkpoint <= n - tail and checkpoint in states
    if profile.has_recurrent_state and bound is None and reachable:
        assert plan.whole_prompt and plan.replay_offset == checkpoint


def test_whole_prompt_plan_examples():
    hybrid = RecomputeProfile(has_recurrent_state=True, checkpoint_unit=64)
    eagle = RecomputeProfile(has_recurrent_state=True, prefill_lookahead=1, checkpoint_unit=16, eagle_drop=True)
    # N = 2B + 5: resume on the checkpoint 2B, D recomputes 5 tokens.
    assert plan_handoff(133, hybrid, max_checkpoint_recompute=None, whole_prompt_states=(128,)) == HandoffPlan(
        128, 128, whole_prompt=True)
    # A bound of 3 cannot cover the 4 extra tokens: P truncates to N - 1.
    assert plan_handoff(133, hybrid, max_checkpoint_recompute=3, whole_prompt_states=(128,)) == HandoffPlan(132, 128)
    # P does not keep the checkpoint (e.g. multi-module MTP's re-prefillable tail): truncate.
    assert plan_handoff(133, hybrid, max_checkpoint_recompute=None, whole_prompt_states=()) == HandoffPlan(132, 128)
    # The EAGLE drop on a prompt of whole units: C = N - u, D recomputes a unit.
    assert plan_handoff(64, eagle, max_checkpoint_recompute=None, whole_prompt_states=(48,)).replay_offset == 48
    # Attention only: the whole prompt, R = N - 1; not under a sliding window (no states given).
    assert plan_handoff(40, RecomputeProfile(), whole_prompt_states=()) == HandoffPlan(39, whole_prompt=True)
    assert plan_handoff(40, RecomputeProfile()) == HandoffPlan(39)
