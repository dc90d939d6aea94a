"""Pure tests of pd_connector.core.checkpoints: which prompt checkpoints an aggregated server
keeps, which of them P hands over below the offset, which D registers, and their wire form.

The closed form in core/checkpoints.py is compared with a step-by-step restatement of vLLM's
chunking and caching (``_vllm_kept`` below, written after ``Scheduler._mamba_block_aligned_split``,
``_reserve_prefill_lookahead``, ``MambaManager.cache_blocks`` / ``_cache_partial_tail_block`` and
``KVCacheCoordinator.get_num_cacheable_tokens`` of vLLM 0.32 and 0.33) over every setting the rule
depends on: prefix caching of recurrent state or not (``mamba_cache_mode`` align / none; neither
version has ``all``), the unit against the block (fine-grained hits or not), backends that export
checkpoints, the EAGLE drop, and the prefill lookahead (none, EAGLE / single-module MTP, multi-
module MTP with K tokens). tests/vllm/test_checkpoint_handover.py compares it with vLLM itself.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.checkpoints import (
    CheckpointRule,
    checkpoint_pairs,
    checkpoint_slot,
    checkpoint_to_keep,
    checkpoint_to_pin,
    checkpoints_not_computed,
    checkpoints_to_hand_over,
    junction_to_pin,
    kept_checkpoints,
    place_checkpoints,
    state_blocks,
)
from pd_connector.core.handoff import plan_handoff
from pd_connector.core.leases import GRANTED, MISMATCH, LeaseTable
from pd_connector.core.pairing import ATTENTION, MAMBA, GroupLayout
from pd_connector.core.params import (
    CHECKPOINTS_VERSION,
    KEY_CHECKPOINTS,
    decode_checkpoints,
    decode_handoff_params,
    encode_handoff_params,
)
from pd_connector.core.protocol import CheckpointBlocks, Claim, ProtocolError, decode_message, encode_message
from pd_connector.core.recompute_profile import RecomputeProfile, mamba_checkpoint_position

FAST = settings(max_examples=300, deadline=None)

# Every setting the rule reads: block B, unit u (0: mode none), drop, exports, lookahead, and
# the scheduler's split granularity S (vLLM CPU's API server: S = 128 under B = 640).
def rule_of(block_size: int, unit: int, eagle_drop: bool = False, exports: bool = False,
            prefill_lookahead: int = 0, split_block: int = 0) -> CheckpointRule:
    """A hybrid engine's rule: its facts (unit, drop, lookahead) in its ``RecomputeProfile``."""
    profile = RecomputeProfile(True, prefill_lookahead, checkpoint_unit=unit, eagle_drop=eagle_drop)
    return CheckpointRule(block_size, profile, exports, split_block)


rules = st.builds(
    rule_of,
    block_size=st.sampled_from([16, 32, 64, 80]),
    unit=st.sampled_from([0, 8, 16, 32, 64, 80]),
    eagle_drop=st.booleans(),
    exports=st.booleans(),
    prefill_lookahead=st.integers(0, 4),
    split_block=st.sampled_from([0, 8, 16, 32]),
).filter(lambda r: r.unit <= r.block_size and r.block_size % max(r.unit, 1) == 0 and r.block_size % max(r.split_block, 1) == 0)
prompts = st.integers(1, 400)


def _vllm_kept(prompt_len: int, rule: CheckpointRule, computed: int | None, junction: int = 0) -> set[int]:
    """vLLM's single-chunk prefill of a prompt, step by step: chunk ends, then what caching keeps.
    ``junction``: the request's shared-prefix boundary (block-floored stop, retained)."""
    if rule.unit <= 0:
        return set()
    B, u, drop, lookahead = rule.block_size, rule.unit, rule.eagle_drop, rule.prefill_lookahead
    S = rule.split_block or B  # cache_config.block_size, what the scheduler splits on
    rp = max(0, lookahead - 1)
    partial = u < B
    start, states, steps = 0, set(), 0
    while start < prompt_len and steps < 8:
        steps += 1
        end = prompt_len
        last_cache = mamba_checkpoint_position(prompt_len, S, drop)
        checkpoint = mamba_checkpoint_position(prompt_len, u, drop)
        internal = (
            rule.exports
            and start % u == 0
            and -(-end // B) - 2 > (start - 1) // B
            and -(-end // S) - 2 > (start - 1) // S
            and start + u <= checkpoint
            and start < checkpoint < end
        )
        if internal:
            last_cache = 0
        stops = [
            (start // S + 1) * S if start % S and not internal else 0,
            last_cache,
            checkpoint if partial and not internal and last_cache < checkpoint < prompt_len else 0,
            start + (junction - start) // S * S if start < junction < end else 0,
        ]
        end = min((s for s in stops if start < s < end), default=end)
        remaining = prompt_len - end
        if 0 < remaining < lookahead:
            end -= lookahead - remaining
        if end <= start:
            break
        if internal and end == prompt_len:  # the manager exports only in the chunk reaching the end
            states.add(("export", checkpoint))
        states.add(("end", end))
        start = end
    cacheable = (computed if computed is not None else 10**9) - rp
    # replay_boundaries(N, B, use_eagle), each aligned down to u, then to its block.
    if drop:
        boundaries = {max((prompt_len - 1) // B * B - B, 0), max(prompt_len // B * B - B, 0)}
    else:
        boundaries = {(prompt_len - 1) // u * u // B * B}
    if junction:
        boundaries.add(junction // u * u // B * B)
    kept = set()
    for kind, p in states:
        if p <= 0 or p >= prompt_len:
            continue
        if kind == "export":
            kept.add(p)  # re-keyed at the prompt checkpoint by every caching step
        elif p % B == 0 and p in boundaries and p <= cacheable:
            kept.add(p)  # a retained block state (reachable_block_mask)
        elif partial and p == checkpoint and not rp:
            kept.add(p)  # the sub-block tail: the caching step of its chunk ends exactly on it
    return kept


@FAST
@given(prompts, rules, st.booleans(), st.integers(0, 400))
def test_kept_checkpoints_restate_vllm(n, rule, stopped, junction):
    computed = n if stopped else None
    got = set(kept_checkpoints(n, rule, computed, junction))
    assert got == _vllm_kept(n, rule, computed, junction), (n, rule, computed, junction)


def test_kept_checkpoints_exhaustive_small():
    """Every combination on a small grid (cheap loops beside hypothesis)."""
    for b in (8, 16):
        for u in (0, 4, 8, 16):
            if u > b or (u and b % u):
                continue
            for drop in (False, True):
                for exports in (False, True):
                    for lookahead in range(4):
                        rule = rule_of(b, u, drop, exports, lookahead)
                        for n in range(1, 5 * b):
                            for computed in (None, n):
                                got = set(kept_checkpoints(n, rule, computed))
                                assert got == _vllm_kept(n, rule, computed), (n, rule, computed)


def test_the_cpu_servers_split_keeps_a_checkpoint_only_on_both_grids():
    """vLLM CPU's API server: chunks end on multiples of cache_config.block_size = 128, Mamba
    blocks are 640 (tiny Qwen3-Next): aggregated serving keeps 1280 at N = 1300 (1280 is on both
    grids) and nothing below N at 805 or 1445 (768 and 1408 are mid-block), so P hands over
    1280 at 1300 only."""
    rule = rule_of(block_size=640, unit=640, split_block=128)
    assert kept_checkpoints(1300, rule) == (1280,) and kept_checkpoints(645, rule) == (640,)
    assert kept_checkpoints(805, rule) == () and kept_checkpoints(1445, rule) == ()
    assert kept_checkpoints(1299, rule, computed=1299) == (1280,)  # P's own replay boundary
    assert checkpoints_to_hand_over(1300, 1299, rule) == (1280,)
    assert checkpoints_to_hand_over(805, 804, rule) == checkpoints_to_hand_over(1445, 1444, rule) == ()


@FAST
@given(prompts, rules)
def test_checkpoints_lie_on_the_grid_and_inside_the_prompt(n, rule):
    kept = kept_checkpoints(n, rule)
    assert list(kept) == sorted(set(kept)) and len(kept) <= 2
    for p in kept:
        assert 0 < p < n and p % rule.unit == 0
    if not rule.fine_grained:
        assert all(p % rule.block_size == 0 for p in kept)


def p_junction(n: int, offset: int, rule: CheckpointRule) -> int:
    """The shared-prefix boundary P pins (engine/prefill/prefill_scheduler.py): its own next turn's
    checkpoint first, else one for D."""
    profile = rule.profile
    plan = plan_handoff(n, profile)
    assert plan.replay_offset == offset
    keep = checkpoint_to_keep(plan, profile) if offset else 0
    assert junction_to_pin(n, plan, profile, rule) == (keep or checkpoint_to_pin(n, offset, rule) if offset else 0)
    return junction_to_pin(n, plan, profile, rule)


def test_mode_none_keeps_nothing_and_hands_over_nothing():
    rule = rule_of(block_size=64, unit=0)
    for n in range(1, 300):
        assert kept_checkpoints(n, rule) == ()
        assert checkpoints_to_hand_over(n, n - 1, rule) == ()


@pytest.mark.parametrize("n, expected", [(133, (128,)), (148, (128,)), (129, ()), (193, ()), (104, (64,)), (64, ())])
def test_the_issue_case_two_units_and_a_few_tokens(n, expected):
    """Unit B, no speculation, R = N - 1: the checkpoint below R aggregated serving keeps (N = 2B
    + 5 keeps 2B = 128, where R = 132) is handed over; none at N = kB + 1, where R is it."""
    rule = rule_of(block_size=64, unit=64)
    assert checkpoints_to_hand_over(n, n - 1, rule) == expected
    assert checkpoints_not_computed(n, n - 1, rule) == ()


@FAST
@given(prompts, rules)
def test_handed_over_checkpoints_are_kept_by_both_and_below_the_offset(n, rule):
    profile = rule.profile
    offset = plan_handoff(n, profile).replay_offset
    junction = p_junction(n, offset, rule)
    handed = checkpoints_to_hand_over(n, offset, rule, junction)
    missing = checkpoints_not_computed(n, offset, rule, junction)
    below = {p for p in kept_checkpoints(n, rule) if p < offset}
    assert set(handed) | set(missing) == below and not set(handed) & set(missing)
    assert set(handed) <= set(kept_checkpoints(offset, rule, computed=offset, junction=junction))


@FAST
@given(prompts, rules.filter(lambda r: not r.eagle_drop and r.prefill_lookahead <= 1))
def test_p_misses_no_checkpoint_without_the_drop_or_multi_module_mtp(n, rule):
    """With R = N - 1 and no EAGLE drop, P's truncated prompt, with its pin, keeps every
    checkpoint below R the whole prompt's does."""
    assert checkpoints_not_computed(n, n - 1, rule, p_junction(n, n - 1, rule)) == ()


@FAST
@given(prompts, rules)
def test_p_keeps_what_it_hands_over_in_vllms_own_prefill(n, rule):
    """Restated on P's side: the truncated prompt's prefill, its pin as the junction, keeps
    every checkpoint handed over; what it does not keep is exactly ``checkpoints_not_computed``."""
    profile = rule.profile
    offset = plan_handoff(n, profile).replay_offset
    pin = p_junction(n, offset, rule)
    on_p = _vllm_kept(offset, rule, computed=offset, junction=pin) if offset else set()
    below = {p for p in _vllm_kept(n, rule, None) if p < offset}
    assert set(checkpoints_to_hand_over(n, offset, rule, pin)) == below & on_p, (n, offset, pin, rule)
    assert set(checkpoints_not_computed(n, offset, rule, pin)) == below - on_p


def test_the_eagle_drop_on_a_block_aligned_prompt_is_pinned_on_p():
    """floor(N/B)*B - B for the whole prompt, floor((N-1)/B)*B - B for P's: at N = kB, P pins
    N - B as its junction, so it computes and hands over the state there too."""
    rule = rule_of(block_size=64, unit=64, eagle_drop=True, prefill_lookahead=1)
    assert checkpoint_to_pin(192, 191, rule) == 128
    assert checkpoints_to_hand_over(192, 191, rule) == () and checkpoints_not_computed(192, 191, rule) == (128,)
    assert checkpoints_to_hand_over(192, 191, rule, 128) == (128,) and checkpoints_not_computed(192, 191, rule, 128) == ()
    assert checkpoint_to_pin(200, 199, rule) == 0 and checkpoints_to_hand_over(200, 199, rule) == (128,)
    fine = rule_of(block_size=64, unit=16, eagle_drop=True, prefill_lookahead=1)
    # The sub-block tail N - u of a prompt of whole units: no junction stops inside a block.
    assert checkpoints_not_computed(160, 159, fine) == (144,) and checkpoints_to_hand_over(160, 159, fine) == (64,)


def test_multi_module_mtp_keeps_nothing_in_its_re_prefillable_tail():
    """K = 3 (lookahead 3): P computes R = N - 2, and caches nothing in its last 2 tokens."""
    rule = rule_of(block_size=64, unit=64, prefill_lookahead=3)
    assert kept_checkpoints(131, rule) == (128,)
    assert kept_checkpoints(129, rule, computed=129) == ()  # 128 is one token below the end
    assert checkpoints_to_hand_over(200, 198, rule) == (192,)
    assert checkpoints_to_hand_over(195, 193, rule) == ()  # R - 2 = 191 < 192: P cached nothing
    assert checkpoints_not_computed(195, 193, rule) == (192,)


LAYOUTS = (GroupLayout(ATTENTION, 64), GroupLayout(MAMBA, 64, mamba_cache_mode="align"))
RULE = rule_of(block_size=64, unit=64)


def test_d_places_what_p_hands_over_with_the_same_rule():
    states = [CheckpointBlocks(128, [[], [7]])]
    placement = place_checkpoints(states, 133, 132, LAYOUTS, RULE)
    assert placement.placed == tuple(states) and placement.refused == ()


@pytest.mark.parametrize(
    "states, rule, kind",
    [
        ([CheckpointBlocks(128, [[], [7]])], rule_of(64, 0), "no_prefix_cache"),
        ([CheckpointBlocks(128, [[3], [7]])], RULE, "groups"),
        ([CheckpointBlocks(128, [[], [7, 8]])], RULE, "groups"),
        ([CheckpointBlocks(128, [[7]])], RULE, "groups"),
        ([CheckpointBlocks(132, [[], [7]])], RULE, "out_of_range"),
        ([CheckpointBlocks(64, [[], [7]])], RULE, "not_kept_here"),
        ([CheckpointBlocks(128, [[], [7]])], rule_of(48, 48), "not_kept_here"),
    ],
)
def test_d_refuses_a_checkpoint_it_cannot_place(states, rule, kind):
    placement = place_checkpoints(states, 133, 132, LAYOUTS, rule)
    assert placement.placed == () and placement.refused == ((states[0].position, kind),)


def test_d_refuses_a_repeated_checkpoint_once_placed():
    states = [CheckpointBlocks(128, [[], [7]]), CheckpointBlocks(128, [[], [9]])]
    placement = place_checkpoints(states, 133, 132, LAYOUTS, RULE)
    assert placement.placed == (states[0],) and placement.refused == ((128, "out_of_range"),)


def test_pairs_go_to_mamba_groups_only():
    layouts = (*LAYOUTS, GroupLayout(MAMBA, 64, mamba_cache_mode="align"))
    states = [CheckpointBlocks(64, [[], [5], [6]]), CheckpointBlocks(128, [[], [7], [8]])]
    assert checkpoint_pairs(layouts, states, [[50, 60], [70, 80]]) == [[], [(5, 50), (7, 70)], [(6, 60), (8, 80)]]
    with pytest.raises(ValueError):
        checkpoint_pairs(layouts, states, [[50, 0], [70, 80]])  # never the null block
    with pytest.raises(ValueError):
        checkpoint_pairs(layouts, states, [[50, 60]])


def test_state_blocks_need_every_mamba_group():
    assert state_blocks(LAYOUTS, 128, {1: 9}) == CheckpointBlocks(128, [[], [9]])
    assert state_blocks(LAYOUTS, 128, {}) is None


@pytest.mark.parametrize("p, slot", [(64, (0, False)), (128, (1, False)), (144, (2, True)), (96, (1, True))])
def test_checkpoint_slot(p, slot):
    assert checkpoint_slot(p, 64) == slot


def _params(**extra):
    params = encode_handoff_params(132, [[1, 2, 3], [4]], engine_id="p", request_id="r", host="h", port=5600)
    params.update(extra)
    return params


def test_params_carry_the_checkpoints_and_round_trip():
    states = [CheckpointBlocks(128, [[], [9]])]
    params = encode_handoff_params(
        132, [[1, 2, 3], [4]], engine_id="p", request_id="r", host="h", port=5600, checkpoints=states
    )
    assert params[KEY_CHECKPOINTS]["version"] == CHECKPOINTS_VERSION
    assert decode_checkpoints(msgspec.json.decode(msgspec.json.encode(params))) == states
    assert KEY_CHECKPOINTS not in _params() and decode_checkpoints(_params()) == []


@pytest.mark.parametrize(
    "field, kind",
    [
        ({"version": CHECKPOINTS_VERSION + 1, "states": []}, "checkpoint_version"),
        ({"states": []}, "checkpoint_version"),
        ({"version": True, "states": []}, "checkpoint_version"),
        ([1, 2], "checkpoint_version"),
        ({"version": CHECKPOINTS_VERSION, "states": [{"position": 0, "block_ids": [[], [9]]}]}, "checkpoint_malformed"),
        ({"version": CHECKPOINTS_VERSION, "states": [{"position": 8, "block_ids": [[], [0]]}]}, "checkpoint_malformed"),
        ({"version": CHECKPOINTS_VERSION, "states": [{"position": 8}]}, "checkpoint_malformed"),
        ({"version": CHECKPOINTS_VERSION, "states": "x"}, "checkpoint_malformed"),
        (
            {"version": CHECKPOINTS_VERSION, "states": [{"position": 8, "block_ids": [[], [1]]}] * 17},
            "checkpoint_malformed",
        ),
    ],
)
def test_bad_checkpoints_refuse_only_themselves(field, kind):
    """A D that cannot read them refuses the checkpoints, never the handoff: the params still
    decode whole."""
    params = _params(**{KEY_CHECKPOINTS: field})
    with pytest.raises(ProtocolError) as exc:
        decode_checkpoints(params)
    assert exc.value.kind == kind
    assert decode_handoff_params(params).replay_offset == 132


def test_a_claim_may_read_leased_checkpoints_only():
    table = LeaseTable()
    leased = [CheckpointBlocks(128, [[], [9]])]
    table.grant("r", 100.0, 132, [[1, 2, 3], [4]], checkpoints=leased)
    assert table.claim("r", 132, [[1, 2, 3], [4]], 1.0, 50.0, reader="a")[0] == GRANTED
    assert table.claim("r", 132, [[1, 2, 3], [4]], 1.0, 50.0, reader="b", checkpoints=leased)[0] == GRANTED
    stray = [CheckpointBlocks(128, [[], [10]])]
    outcome, why = table.claim("r", 132, [[1, 2, 3], [4]], 1.0, 50.0, reader="c", checkpoints=stray)
    assert outcome == MISMATCH and "did not lease" in why
    moved = [CheckpointBlocks(64, [[], [9]])]
    assert table.claim("r", 132, [[1, 2, 3], [4]], 1.0, 50.0, reader="c", checkpoints=moved)[0] == MISMATCH


def test_the_claim_carries_checkpoints_on_the_wire():
    claim = Claim("d", "r", 132, [[1, 2, 3], [4]], checkpoints=[CheckpointBlocks(128, [[], [9]])])
    assert decode_message(encode_message(claim)) == claim
    assert decode_message(encode_message(Claim("d", "r", 132, [[1]]))).checkpoints == []


def test_resume_state_takes_the_mamba_state_from_the_checkpoint_at_the_offset():
    """A whole-prompt replay plan: each Mamba group's block is P's checkpoint at R (not the tip
    ``select_source_blocks`` picked), attention blocks stay, checkpoints below R go along, and
    none kept at R means nothing to hand over."""
    from pd_connector.core.checkpoints import resume_state
    from pd_connector.core.protocol import CheckpointBlocks

    source = [[1, 2, 3], [90], [4, 5, 6], [91]]  # attention, mamba, attention, mamba; 91/90: tips
    states = [CheckpointBlocks(64, [[], [40], [], [41]]), CheckpointBlocks(128, [[], [50], [], [51]])]
    blocks, below = resume_state(source, states, 128)
    assert blocks == [[1, 2, 3], [50], [4, 5, 6], [51]] and below == [states[0]]
    assert resume_state(source, states[:1], 128) is None


def test_p_pins_the_resume_state_only_for_a_hybrid_computing_past_r():
    from pd_connector.core.checkpoints import prefill_checkpoints, whole_prompt_states
    from pd_connector.core.handoff import HandoffPlan
    from pd_connector.core.pairing import GroupLayout

    rule = rule_of(block_size=64, unit=64)
    hybrid, attention_only = rule.profile, msgspec.structs.replace(rule.profile, has_recurrent_state=False)
    whole, truncated = HandoffPlan(128, 128, whole_prompt=True), HandoffPlan(132, 128)
    assert prefill_checkpoints(133, whole, hybrid, rule).computes == 133
    assert prefill_checkpoints(133, truncated, hybrid, rule).computes == 132
    assert 128 in prefill_checkpoints(133, whole, hybrid, rule).wanted
    assert 132 not in prefill_checkpoints(133, truncated, hybrid, rule).wanted  # its tip is the state at R
    assert 128 not in prefill_checkpoints(133, whole, attention_only, rule).wanted  # attention only: no state
    # A sliding-window group: no prefix of the whole prompt stays whole.
    assert whole_prompt_states(133, rule, [GroupLayout("sliding_window", 16, sliding_window=32)]) is None
    assert whole_prompt_states(133, rule, [GroupLayout("attention", 16)]) is not None
