"""Prefix caching across the handoff, in vLLM's real Scheduler in Mamba ``align`` mode.

Each case is one conversation: turn 1 (N prompt tokens, a few decoded), then a turn 2 that
extends it. Served three ways: by one aggregated instance; by P then D (P/D); and turn 2 again
through P. Expected positions come from vLLM's own ``get_mamba_prefill_checkpoint_position``.

What is checked (docs/architecture.md, "Prefix caching across the handoff"), without speculation,
with EAGLE and with MTP K = 2 (MTP with a prefix match unit below the block is left out: this
harness samples no drafts, and its aggregated request never finishes there):
- D recomputes only its minimum tail in every cache mode.
- With ``max_checkpoint_recompute`` 0 (a bound: past it P truncates its prefill; the default,
  unbounded, is tests/vllm/test_replay_turns.py), P keeps the whole prompt's checkpoint for its
  own next turn, though its prompt was truncated
  (vLLM's default retention interval 0 derives kept states from the truncated prompt, so P pins
  the whole prompt's as the request's shared-prefix boundary, checkpoints.checkpoint_to_keep): P's
  turn-2 hit is at least the aggregated instance's prompt-only hit, except where that hit needs
  KV or state past the tokens P computed (N - tail; the state after the whole prompt, or, with
  the EAGLE drop, the attention block above the checkpoint, plus multi-module MTP's
  re-prefillable tail, which vLLM never caches), and except a checkpoint that is
  P's own tip inside a Mamba block (a prefix match unit below the block): vLLM registers P's
  sub-block state only at the truncated prompt's checkpoint, one unit lower.
- D keeps the prompt checkpoint only when the handoff lands on it: by default when
  N - tail is the checkpoint; with ``max_checkpoint_recompute`` covering the distance, always,
  at the cost of that many recomputed tokens (vLLM's MambaManager gives a handoff a state block
  at its tip and null blocks below, so no other checkpoint can be written on D).
"""

from __future__ import annotations

import pytest
from rig.scheduler_harness import make_request, make_scheduler, run_step
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.core.recompute_profile import min_recompute_tokens
from rig.cpu_matrix import random_prompt
from rig.tiny_models import build_model

B = 64
HYBRID = ("attention", "mamba")
OUTPUT = 4
LENGTHS = [B - 1, B, B + 1, 2 * B - 1, 2 * B, 2 * B + 1, 3 * B + 1, 81, 100]
# name: (speculative config, prefix match unit, retention interval)
CONFIGS = {
    "plain": (None, None, 0),
    "pmu16": (None, 16, 0),
    "pmu16-dense": (None, 16, None),
    "eagle-pmu16": ("eagle", 16, 0),
    "mtp2": ("mtp2", None, 0),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pc-models")
    return {kind: str(build_model(kind, root)) for kind in ("llama", "eagle_llama", "qwen3_next_mtp")}


def _speculative(models, name):
    if name is None:
        return models["llama"], None
    if name == "eagle":
        return models["llama"], {"method": "eagle", "model": models["eagle_llama"], "num_speculative_tokens": 2}
    return models["qwen3_next_mtp"], {"method": "mtp", "num_speculative_tokens": int(name[3:])}


def _scheduler(models, config, role, max_checkpoint_recompute=0):
    spec, unit, retention = CONFIGS[config]
    model, speculative = _speculative(models, spec)
    return make_scheduler(
        model,
        role,
        groups=HYBRID,
        prefix_caching=True,
        mamba_mode="align",
        block_size=B,
        prefix_match_unit=unit,
        retention_interval=retention,
        speculative=speculative,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        num_blocks=3000,
        extra_config={"max_checkpoint_recompute": max_checkpoint_recompute},
    )


def _outputs(eo, request_id):
    tokens, done, params = [], False, None
    for e in eo.values():
        for o in e.outputs:
            if o.request_id == request_id:
                tokens += o.new_token_ids
                done, params = o.finish_reason is not None, o.kv_transfer_params
    return tokens, done, params


def _serve(s, prompt, params=None, max_tokens=OUTPUT):
    """Run one request to completion: (tokens, returned kv_transfer_params, prefix hit)."""
    req = make_request(prompt, params, max_tokens=max_tokens, block_size=s.hash_block_size)
    s.add_request(req)
    out, eo = run_step(s)
    hit = req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0)
    tokens, returned = _run_to_end(s, req.request_id, *_outputs(eo, req.request_id))
    return tokens, returned, hit


def _run_to_end(s, request_id, tokens, done, returned=None):
    """Step ``s`` until the request finishes (at most 100 steps): (all its tokens, its params)."""
    for _ in range(100):
        if done:
            break
        _, eo = run_step(s)
        more, done, returned = _outputs(eo, request_id)
        tokens = tokens + more
    return tokens, returned


def _decode(d, prompt, params):
    """D's side of a handoff: (tokens, prompt tokens D computed itself)."""
    req = make_request(prompt, dict(params), max_tokens=OUTPUT, block_size=d.hash_block_size)
    d.add_request(req)
    out, eo = run_step(d)
    assert req.request_id in out.kv_connector_metadata.to_recv, "the handoff was not admitted"
    run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    loaded = req.num_computed_tokens
    tokens, done = [], False
    for _ in range(100):
        if done:
            break
        out, eo = run_step(d)
        more, done, _ = _outputs(eo, req.request_id)
        tokens += more
    return tokens, len(prompt) - loaded


class Conversation:
    def __init__(self, models, config, max_checkpoint_recompute=0):
        self.aggregated = _scheduler(models, config, "kv_both")
        self.prompt_only = _scheduler(models, config, "kv_both")  # no decode past the prompt
        self.p = _scheduler(models, config, "kv_producer", max_checkpoint_recompute)
        self.d = _scheduler(models, config, "kv_consumer")
        half = self.p.connector._scheduler
        self.profile = half.profile
        self.unit = half.profile.checkpoint_unit
        self.drop = half.profile.eagle_drop

    def run(self, n, seed):
        turn1 = random_prompt(n, seed)
        out_a, _, _ = _serve(self.aggregated, turn1)
        _serve(self.prompt_only, turn1, max_tokens=1)
        _, params, _ = _serve(self.p, turn1, {"do_remote_decode": True})
        out_d, local = _decode(self.d, turn1, params)
        assert out_d == out_a
        turn2 = turn1 + out_a + random_prompt(2 * B + 5, seed + 1)
        return {
            "offset": params["replay_offset"],
            "local": local,
            "hit_aggregated": _serve(self.aggregated, turn2, max_tokens=1)[2],
            "hit_prompt_only": _serve(self.prompt_only, turn2, max_tokens=1)[2],
            "hit_d": _serve(self.d, turn2, max_tokens=1)[2],
            "hit_p": _serve(self.p, turn2, {"do_remote_decode": True})[2],
        }


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_d_recomputes_its_minimum_and_p_keeps_the_checkpoint(models, config):
    conv = Conversation(models, config)
    assert conv.p.cache_config.mamba_cache_mode == "align" and conv.p.need_mamba_block_aligned_split
    # The retention interval the managers act on (the harness once left it dense, hiding P's
    # lost checkpoint at N = kB + 1 that vLLM's default 0 shows end to end).
    assert conv.p.kv_cache_manager.coordinator.retention_interval == CONFIGS[config][2]
    tail = min_recompute_tokens(conv.profile)
    assert conv.unit == (CONFIGS[config][1] or B)
    assert conv.drop == (CONFIGS[config][0] is not None)
    for i, n in enumerate(LENGTHS):
        got = conv.run(n, seed=1000 * i + 7)
        ctx = (config, n, got)
        assert got["offset"] == n - tail and got["local"] == tail, ctx
        checkpoint = get_mamba_prefill_checkpoint_position(n, conv.unit, conv.drop)
        # The tokens an aggregated hit needs computed: with the drop, the block above the
        # checkpoint; with multi-module MTP, vLLM's re-prefillable tail on top (its last
        # num_reprefillable_tokens computed tokens are never cached: get_num_cacheable_tokens).
        reprefillable = conv.p.kv_cache_manager.coordinator.num_reprefillable_tokens
        reach = got["hit_prompt_only"] + (conv.unit if conv.drop else 0) + reprefillable
        if got["hit_prompt_only"] == n - tail and (n - tail) % B:
            # The checkpoint is N - tail, inside a Mamba block: within a bound of 0, P prefills
            # the whole prompt and resumes there (a truncated P would register its sub-block
            # state one unit lower, MambaManager._cache_partial_tail_block).
            assert got["hit_p"] == got["hit_prompt_only"], ctx
        elif reach <= n - tail:
            assert got["hit_p"] >= got["hit_prompt_only"], ctx
        # Never below vLLM's checkpoint of the truncated prompt P computed.
        assert got["hit_p"] >= get_mamba_prefill_checkpoint_position(n - tail, conv.unit, conv.drop) or (
            conv.drop and (n - tail) % conv.unit == 0
        ), ctx
        if checkpoint == n - tail or got["hit_aggregated"] > n:
            assert got["hit_d"] >= got["hit_aggregated"], ctx


@pytest.mark.parametrize("config", ["plain", "pmu16", "eagle-pmu16"])
def test_checkpoint_trade_gives_d_the_aggregated_hit(models, config):
    """With max_checkpoint_recompute covering the distance, the offset is vLLM's checkpoint:
    D recomputes N - checkpoint tokens and its turn-2 hit is the aggregated instance's."""
    conv = Conversation(models, config, max_checkpoint_recompute=10**6)
    tail = min_recompute_tokens(conv.profile)
    for i, n in enumerate(LENGTHS):
        got = conv.run(n, seed=1000 * i + 11)
        ctx = (config, n, got)
        checkpoint = get_mamba_prefill_checkpoint_position(n, conv.unit, conv.drop)
        expected = checkpoint if 0 < checkpoint <= n - tail else n - tail
        assert got["offset"] == expected and got["local"] == n - expected, ctx
        assert got["hit_d"] >= got["hit_aggregated"], ctx

