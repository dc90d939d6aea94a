"""Replay (no first token carried: vllm-router) in vLLM's real Scheduler, Mamba ``align`` prefix
caching, default settings: P prefills the whole prompt as aggregated serving does and the
handoff resumes at vLLM's prompt checkpoint C, from the state P keeps there.

Each case is a conversation (turn 1 of N prompt tokens, then a turn 2 extending it) served by
an aggregated instance, by P then D, and turn 2 again on P and on D. At turn-1 lengths on, just
below and just above unit and block boundaries, without speculation, with EAGLE (with and
without a prefix match unit) and MTP, and at the seed's geometry:
- P hands over the offset the core plans (C wherever P keeps it, else N - tail), and D computes
  exactly N - R prompt tokens; its output is aggregated serving's;
- the state handed over is P's checkpoint at R, the block its prefix cache keys the state at R
  under, not the request's tip (which holds the state after all N tokens);
- P's turn-2 hit equals the prompt-only aggregated instance's and D's is at least the
  aggregated instance's (the losses of a truncated P, tests/vllm/test_prefix_cache_turns.py, are
  gone).
Negative control: a P that hands over its tip as the state at C is caught by the block check.
"""

from __future__ import annotations

import pytest
from vllm.v1.core.kv_cache_utils import resolve_block_hashes

from pd_connector.core import checkpoints
from pd_connector.core.handoff import plan_handoff
from pd_connector.core.recompute_profile import min_recompute_tokens
from rig.cpu_matrix import random_prompt
from rig.scheduler_harness import make_request
from tests.vllm.test_prefix_cache_turns import B, _decode, _scheduler, _serve, models  # noqa: F401
from tests.vllm.test_zero_replay_turns import SEED_LENGTHS, SEED_TURN2, _seed_scheduler

LENGTHS = [B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1, 16, 17, 47, 48, 49, 81, 100]
CONFIGS = ["plain", "pmu16", "eagle-pmu16", "mtp2"]
P_PARAMS = {"do_remote_decode": True}
UNBOUNDED = None  # max_checkpoint_recompute's default


def _state_block_at(p, prompt, position) -> list[int]:
    """The blocks P's prefix cache keys the Mamba state at ``position`` of ``prompt`` under,
    one per Mamba group (as ``CheckpointPool`` looks them up)."""
    half = p.connector._scheduler
    pool = p.kv_cache_manager.block_pool
    req = make_request(prompt, None, block_size=p.hash_block_size)
    found = []
    for layout, vllm_group in zip(half.layouts, half.group_ids):
        if layout.kind != "mamba":
            continue
        index, partial = checkpoints.checkpoint_slot(position, layout.block_size)
        if partial:
            key = req.block_hashes[position // pool.hash_block_size - 1]
        else:
            key = resolve_block_hashes(req.block_hashes, pool.hash_block_size, layout.block_size)[index]
        cached = pool.get_cached_block(key, [vllm_group])
        found.append(cached[0].block_id if cached else None)
    return found


def _handed_states(p, params) -> list[int]:
    half = p.connector._scheduler
    return [ids[0] for layout, ids in zip(half.layouts, params["remote_block_ids"]) if layout.kind == "mamba"]


def _expected_plan(p, n):
    half = p.connector._scheduler
    rule = half.checkpoints.rule
    return plan_handoff(n, half.profile, max_checkpoint_recompute=UNBOUNDED,
                        whole_prompt_states=checkpoints.whole_prompt_states(n, rule))


def _check_conversation(aggregated, prompt_only, p, d, turn1, turn2_tail, ctx):
    n = len(turn1)
    out_a, _, _ = _serve(aggregated, turn1)
    _serve(prompt_only, turn1, max_tokens=1)
    _, params, _ = _serve(p, turn1, dict(P_PARAMS), max_tokens=1)
    plan = _expected_plan(p, n)
    r = params["replay_offset"]
    assert r == plan.replay_offset, (ctx, r, plan)
    if plan.whole_prompt and r < n:
        assert r == plan.checkpoint
        # The state at R is P's checkpoint there, not its tip.
        assert _handed_states(p, params) == _state_block_at(p, turn1, r), ctx
    out_d, local = _decode(d, turn1, params)
    assert out_d == out_a and local == n - r, (ctx, local)
    turn2 = turn1 + out_a + turn2_tail
    hits = {
        "aggregated": _serve(aggregated, turn2, max_tokens=1)[2],
        "prompt_only": _serve(prompt_only, turn2, max_tokens=1)[2],
        "p": _serve(p, turn2, dict(P_PARAMS), max_tokens=1)[2],
        "d": _serve(d, turn2, max_tokens=1)[2],
    }
    assert hits["p"] >= hits["prompt_only"] and hits["d"] >= hits["aggregated"], (ctx, r, hits)
    return plan


@pytest.mark.parametrize("config", CONFIGS)
def test_replay_resumes_on_ps_checkpoint_and_reuses_what_aggregated_serving_does(models, config):
    aggregated, prompt_only = (_scheduler(models, config, "kv_both") for _ in range(2))
    p = _scheduler(models, config, "kv_producer", max_checkpoint_recompute=UNBOUNDED)
    d = _scheduler(models, config, "kv_consumer")
    tail = min_recompute_tokens(p.connector._scheduler.profile)
    on_checkpoint = 0
    for i, n in enumerate(LENGTHS):
        plan = _check_conversation(
            aggregated, prompt_only, p, d, random_prompt(n, 4000 + 17 * i), random_prompt(2 * B + 5, 4001 + 17 * i),
            (config, n),
        )
        on_checkpoint += plan.whole_prompt and plan.replay_offset < n - tail
    # The lengths reach the case this plan exists for: a checkpoint below N - tail.
    assert on_checkpoint, config


# MTP with a prefix match unit below the block is left out as in test_zero_replay_turns.py.
@pytest.mark.parametrize("spec", [None, "eagle"], ids=["plain", "eagle"])
def test_the_seeds_geometry_reuses_what_aggregated_serving_does_under_replay(models, spec, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # no forward pass runs here
    aggregated, prompt_only, p, d = (
        _seed_scheduler(models, spec, role) for role in ("kv_both", "kv_both", "kv_producer", "kv_consumer")
    )
    for i, n in enumerate(SEED_LENGTHS):
        turn1 = random_prompt(n, 6000 + i)
        _check_conversation(aggregated, prompt_only, p, d, turn1, random_prompt(SEED_TURN2 - n - 5, 6001 + i), (spec, n))


def test_negative_control_a_tip_handed_over_as_the_checkpoint_is_caught(models, monkeypatch):
    """A P that hands over the request's tip (the state after N) as the state at C: the block
    check above fails. The harness runs no forward pass, so the text cannot catch it here; end
    to end it is wrong text (tests/e2e/test_multiturn_reuse.py)."""
    monkeypatch.setattr(checkpoints, "resume_state", lambda source, states, offset: (source, [s for s in states if s.position < offset]))
    p = _scheduler(models, "plain", "kv_producer", max_checkpoint_recompute=UNBOUNDED)
    turn1 = random_prompt(2 * B + 5, 91)
    _, params, _ = _serve(p, turn1, dict(P_PARAMS), max_tokens=1)
    assert params["replay_offset"] == 2 * B
    assert _handed_states(p, params) != _state_block_at(p, turn1, 2 * B)


@pytest.mark.parametrize("config", ["plain", "eagle-pmu16"])
def test_a_prompt_p_has_cached_resumes_on_the_cached_checkpoint(models, config):
    """The same prompt twice through P: the second prefill hits P's prefix cache up to C, so
    vLLM offers no state at C; P takes it from its prefix cache (by the hash vLLM keys it
    under) and D resumes on it as on the first."""
    aggregated = _scheduler(models, config, "kv_both")
    p = _scheduler(models, config, "kv_producer", max_checkpoint_recompute=UNBOUNDED)
    turn1 = random_prompt(2 * B + 5, 93)
    out_a, _, _ = _serve(aggregated, turn1)
    for attempt in range(2):
        _, params, hit = _serve(p, turn1, dict(P_PARAMS), max_tokens=1)
        r = params["replay_offset"]
        assert r < len(turn1) - 1 and (hit >= r) == bool(attempt), (attempt, r, hit)
        assert _handed_states(p, params) == _state_block_at(p, turn1, r), attempt
        d = _scheduler(models, config, "kv_consumer")  # a D that has not cached the prompt
        out_d, local = _decode(d, turn1, params)
        assert out_d == out_a and local == len(turn1) - r, attempt
    assert not p.connector._scheduler.stats.get("p_resume_state_not_kept")
