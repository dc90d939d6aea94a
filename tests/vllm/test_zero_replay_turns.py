"""Zero replay in vLLM's real Scheduler (Mamba ``align`` prefix caching): P computes the whole
prompt as aggregated serving does and samples the first token, which travels with the handoff;
D's prompt is P's N tokens plus that token, D loads N tokens and computes one position (the
first token's), yielding the second token.

Each case is a conversation: turn 1 (N prompt tokens), then a turn 2 extending it, served by an
aggregated instance, by P then D, and turn 2 again on P and on D. At every turn-1 length on,
just below and just above unit and block boundaries, with and without speculation (EAGLE with a
prefix match unit, MTP), and at the seed's geometry scaled down (a prefix match unit below the
Mamba block, retention interval 0):
- P hands over R = N and its first token, and D computes exactly one position;
- P's and D's first tokens plus D's continuation equal aggregated serving's output;
- P's turn-2 hit equals an aggregated instance's that served the same prompt (P prefilled as
  it does), and D's turn-2 hit is at least the aggregated instance's.
Negative control: D given the client's prompt (no first token) refuses, and a first token
changed in transit is refused.
"""

from __future__ import annotations

import pytest
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.core.params import KEY_FIRST_TOKEN, KEY_RESUME, RESUME_FIRST_TOKEN
from rig.cpu_matrix import random_prompt
from rig.scheduler_harness import make_request, run_step
from tests.vllm.test_prefix_cache_turns import B, OUTPUT, _outputs, _run_to_end, _scheduler, _serve, models  # noqa: F401

LENGTHS = [B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1, 16, 17, 47, 48, 49, 81, 100]
CONFIGS = ["plain", "pmu16", "eagle-pmu16", "mtp2"]
FIRST_TOKEN_PARAMS = {"do_remote_decode": True, KEY_RESUME: RESUME_FIRST_TOKEN}


def _decode_from(d, prompt, params):
    """D's side: (tokens, prompt tokens D computed itself, accepted)."""
    req = make_request(prompt, dict(params), max_tokens=OUTPUT - 1, block_size=d.hash_block_size)
    d.add_request(req)
    out, eo = run_step(d)
    accepted = req.request_id in out.kv_connector_metadata.to_recv
    if accepted:
        out, eo = run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    loaded = req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0) if accepted else 0
    tokens, _ = _run_to_end(d, req.request_id, *_outputs(eo, req.request_id))
    return tokens, len(prompt) - loaded, accepted


@pytest.mark.parametrize("config", CONFIGS)
def test_zero_replay_computes_one_position_on_d_and_reuses_what_aggregated_serving_does(models, config):
    aggregated = _scheduler(models, config, "kv_both")
    prompt_only = _scheduler(models, config, "kv_both")
    p = _scheduler(models, config, "kv_producer")
    d = _scheduler(models, config, "kv_consumer")
    for i, n in enumerate(LENGTHS):
        turn1 = random_prompt(n, 3000 + 17 * i)
        out_a, _, _ = _serve(aggregated, turn1)
        _serve(prompt_only, turn1, max_tokens=1)
        first, params, _ = _serve(p, turn1, dict(FIRST_TOKEN_PARAMS))
        ctx = (config, n, params)
        assert params["replay_offset"] == n and params[KEY_FIRST_TOKEN] == first[0] == out_a[0], ctx
        out_d, computed, accepted = _decode_from(d, turn1 + first, params)
        assert accepted and computed == 1, (ctx, computed)
        assert first + out_d == out_a, ctx
        turn2 = turn1 + out_a + random_prompt(2 * B + 5, 3001 + 17 * i)
        hit_aggregated = _serve(aggregated, turn2, max_tokens=1)[2]
        hit_prompt_only = _serve(prompt_only, turn2, max_tokens=1)[2]
        hit_p = _serve(p, turn2, dict(FIRST_TOKEN_PARAMS))[2]
        hit_d = _serve(d, turn2, max_tokens=1)[2]
        hits = dict(aggregated=hit_aggregated, prompt_only=hit_prompt_only, p=hit_p, d=hit_d)
        assert hit_p >= hit_prompt_only, (ctx, hits)
        assert hit_d >= hit_aggregated, (ctx, hits)


def test_negative_controls_client_prompt_and_altered_first_token_are_refused(models):
    p = _scheduler(models, "plain", "kv_producer")
    d = _scheduler(models, "plain", "kv_consumer")
    turn1 = random_prompt(2 * B + 1, 77)
    first, params, _ = _serve(p, turn1, dict(FIRST_TOKEN_PARAMS))
    _, computed, accepted = _decode_from(d, turn1, params)  # the client's prompt, no first token
    assert not accepted and computed == len(turn1)
    first, params, _ = _serve(p, turn1, dict(FIRST_TOKEN_PARAMS))
    other = (first[0] + 1) % 100
    # The router's prompt carries another token than P sampled (params intact; an edit of both
    # is the seal's to catch: tests/unit/test_trust.py).
    _, computed, accepted = _decode_from(d, turn1 + [other], params)
    assert not accepted and computed == len(turn1) + 1
    stats = d.connector._scheduler.stats
    assert stats["refused:resume_mismatch"] == 1 and stats["refused:first_token_mismatch"] == 1, stats


# The seed's geometry (vllm#51295): Mamba block 1536, prefix match unit 128, retention interval 0,
# a turn 1 of 24576 tokens (and lengths on, just below and above its unit and block boundaries),
# a turn 2 of 50000. Replay lost a unit on P and a block on D here.
SEED_BLOCK, SEED_UNIT, SEED_TURN2 = 1536, 128, 50000
SEED_LENGTHS = [24576, 24575, 24577, 24576 - 128, 24576 - 127, 23040, 23041, 24576 + 127]


def _seed_scheduler(models, spec, role):
    from tests.vllm.test_prefix_cache_turns import _speculative

    from rig.scheduler_harness import make_scheduler

    model, speculative = _speculative(models, spec)
    return make_scheduler(
        model, role, groups=("attention", "mamba"), prefix_caching=True, mamba_mode="align",
        block_size=SEED_BLOCK, prefix_match_unit=SEED_UNIT, retention_interval=0, speculative=speculative,
        max_model_len=SEED_TURN2 + 64, max_num_batched_tokens=8192, num_blocks=400,
    )


# MTP with a prefix match unit below the block is left out as in test_prefix_cache_turns.py: this
# harness samples no drafts, and such a request never finishes in it (MTP runs in CONFIGS above).
@pytest.mark.parametrize("spec", [None, "eagle"], ids=["plain", "eagle"])
def test_the_seeds_geometry_reuses_what_aggregated_serving_does(models, spec, monkeypatch):
    # The tiny models declare 2048 positions; this Scheduler runs no forward pass.
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    aggregated, p, d = (_seed_scheduler(models, spec, role) for role in ("kv_both", "kv_producer", "kv_consumer"))
    for i, n in enumerate(SEED_LENGTHS):
        turn1 = random_prompt(n, 5000 + i)
        out_a, _, _ = _serve(aggregated, turn1, max_tokens=1)
        first, params, _ = _serve(p, turn1, dict(FIRST_TOKEN_PARAMS))
        assert params["replay_offset"] == n and first == out_a, (spec, n)
        _, computed, accepted = _decode_from(d, turn1 + first, params)
        assert accepted and computed == 1, (spec, n, computed)
        turn2 = turn1 + out_a + random_prompt(SEED_TURN2 - n - 1, 5001 + i)
        hits = {
            "aggregated": _serve(aggregated, turn2, max_tokens=1)[2],
            "p": _serve(p, turn2, dict(FIRST_TOKEN_PARAMS))[2],
            "d": _serve(d, turn2, max_tokens=1)[2],
        }
        assert hits["p"] >= hits["aggregated"] and hits["d"] >= hits["aggregated"], (spec, n, hits)
