"""Prompt checkpoints below the offset across the handoff, in vLLM's real Scheduler (align mode).

Each case is one conversation (turn 1 of N prompt tokens and a few decoded, then a turn 2 that
extends it), served by one aggregated instance and by P then D (docs/architecture.md, "Prefix
caching across the handoff"). Checked per speculative setting, unit and backend the rule reads:
- core/checkpoints.kept_checkpoints is what vLLM keeps: the Mamba states an aggregated
  instance holds in its prefix cache after the prompt, probed in its block pool;
- P hands over exactly ``checkpoints_to_hand_over(N, R)`` (vLLM offered P every one of them);
- D computes only its minimum tail, registers every state it receives where its own vLLM
  keeps it, and its turn-2 hit is at least the aggregated instance's, except where that hit is
  a checkpoint P's truncated prefill never computes (``checkpoints_not_computed``: the EAGLE
  drop on a block-aligned prompt, multi-module MTP's re-prefillable tail), the documented
  fallback;
- negative control: with the states withheld (rig/fault_connector.py on D) the hit drops where it
  rested on them;
- prefix caching on one side only: D without it refuses the states alone and loads the rest;
- the blocks: P's pin lives until its lease ends (or the request is aborted), D's checkpoint
  block is keyed only when its load succeeded.
"""

from __future__ import annotations

import pytest
from rig.scheduler_harness import make_request, make_scheduler, run_step
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.core import checkpoints
from pd_connector.core.handoff import plan_handoff
from pd_connector.core.recompute_profile import min_recompute_tokens
from pd_connector.core.params import KEY_CHECKPOINTS
from rig.cpu_matrix import random_prompt
from rig.tiny_models import build_model
from rig.faults import WITHHOLD_CHECKPOINTS

B = 64
OUTPUT = 4
LENGTHS = [B - 1, B, B + 1, B + 5, 2 * B - 1, 2 * B, 2 * B + 1, 2 * B + 5, 2 * B + 20, 3 * B + 1, 3 * B + 40, 100]
# name: (speculative config, prefix match unit, retention interval, backend exports checkpoints,
# cache_config.block_size where the scheduler splits prefill chunks: vLLM CPU's API server keeps
# 128 under the tiny Qwen3-Next's 640-token blocks, so "split16" is that server scaled down)
CONFIGS = {
    "plain": (None, None, 0, False, None),
    "pmu16": (None, 16, 0, False, None),
    "pmu16-dense": (None, 16, None, False, None),
    "eagle": ("eagle", None, 0, False, None),
    "eagle-pmu16": ("eagle", 16, 0, False, None),
    "mtp2": ("mtp2", None, 0, False, None),
    "exports": (None, None, 0, True, None),
    "exports-pmu16": (None, 16, 0, True, None),
    "split16": (None, None, 0, False, 16),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-models")
    return {kind: str(build_model(kind, root)) for kind in ("llama", "eagle_llama", "qwen3_next_mtp")}


def _scheduler(models, config, role, prefix_caching=True, faults=False):
    spec, unit, retention, exports, split = CONFIGS[config]
    model, speculative = models["llama"], None
    if spec == "eagle":
        speculative = {"method": "eagle", "model": models["eagle_llama"], "num_speculative_tokens": 2}
    elif spec:
        model, speculative = models["qwen3_next_mtp"], {"method": "mtp", "num_speculative_tokens": int(spec[3:])}
    return make_scheduler(
        model,
        role,
        groups=("attention", "mamba"),
        prefix_caching=prefix_caching,
        mamba_mode="align" if prefix_caching else "none",
        block_size=B,
        prefix_match_unit=unit if prefix_caching else None,
        retention_interval=retention,
        speculative=speculative,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        num_blocks=3000,
        mamba_exports_checkpoints=exports,
        cache_block_size=split,
        # A bound of 0: P truncates its prefill unless the offset is its checkpoint, so the
        # states below R travel as checkpoints. The default (whole prompt, R on the
        # checkpoint) is tests/vllm/test_replay_turns.py.
        extra_config={"max_checkpoint_recompute": 0},
        faults=faults,
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
    """One request to completion: (tokens, returned kv_transfer_params, prefix hit)."""
    req = make_request(prompt, params, max_tokens=max_tokens, block_size=s.hash_block_size)
    s.add_request(req)
    out, eo = run_step(s)
    hit = req.num_computed_tokens - out.num_scheduled_tokens.get(req.request_id, 0)
    tokens, done, returned = _outputs(eo, req.request_id)
    for _ in range(100):
        if done:
            break
        out, eo = run_step(s)
        more, done, returned = _outputs(eo, req.request_id)
        tokens += more
    return tokens, returned, hit


def _decode(d, prompt, params):
    """D's side of a handoff: (tokens, prompt tokens D computed itself, claimed checkpoints)."""
    req = make_request(prompt, dict(params), max_tokens=OUTPUT, block_size=d.hash_block_size)
    d.add_request(req)
    out, _ = run_step(d)
    task = out.kv_connector_metadata.to_recv.get(req.request_id)
    assert task is not None, "the handoff was not admitted"
    run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    loaded = req.num_computed_tokens
    tokens, done = [], False
    for _ in range(100):
        if done:
            break
        _, eo = run_step(d)
        more, done, _ = _outputs(eo, req.request_id)
        tokens += more
    return tokens, len(prompt) - loaded, [c.position for c in task.checkpoints]


def cached_states(s, prompt) -> set[int]:
    """Positions below len(prompt) whose Mamba state ``s`` holds in its prefix cache, under the
    block hash (a block state) or the fine-grained hash (a sub-block one) vLLM keys it by."""
    req = make_request(prompt, None, block_size=s.hash_block_size)
    pool = s.kv_cache_manager.block_pool
    h = pool.hash_block_size
    groups = [g for g, group in enumerate(s.kv_cache_config.kv_cache_groups) if isinstance(group.kv_cache_spec, MambaSpec)]
    size = s.kv_cache_config.kv_cache_groups[groups[0]].kv_cache_spec.block_size
    by_block = resolve_block_hashes(req.block_hashes, h, size)
    found = set()
    for p in range(h, len(prompt), h):
        keys = [req.block_hashes[p // h - 1]] + ([by_block[p // size - 1]] if p % size == 0 else [])
        if all(any(pool.get_cached_block(key, [g]) for key in keys) for g in groups):
            found.add(p)
    return found


class Conversation:
    def __init__(self, models, config, d_prefix_caching=True, withhold=False):
        self.aggregated = _scheduler(models, config, "kv_both")
        self.prompt_only = _scheduler(models, config, "kv_both")
        self.p = _scheduler(models, config, "kv_producer")
        self.d = _scheduler(models, config, "kv_consumer", prefix_caching=d_prefix_caching, faults=withhold)
        self.withhold = withhold
        half = self.p.connector._scheduler
        self.profile, self.rule = half.profile, half.checkpoints.rule

    def run(self, n, seed):
        turn1 = random_prompt(n, seed)
        out_a, _, _ = _serve(self.aggregated, turn1)
        _serve(self.prompt_only, turn1, max_tokens=1)
        _, params, _ = _serve(self.p, turn1, {"do_remote_decode": True}, max_tokens=1)
        sent = [s["position"] for s in (params.get(KEY_CHECKPOINTS) or {}).get("states", [])]
        to_d = {**params, WITHHOLD_CHECKPOINTS: True} if self.withhold else params
        out_d, local, claimed = _decode(self.d, turn1, to_d)
        assert out_d == out_a
        turn2 = turn1 + out_a + random_prompt(2 * B + 5, seed + 1)
        return {
            "offset": params["replay_offset"],
            "local": local,
            "sent": sent,
            "claimed": claimed,
            "kept_prompt_only": cached_states(self.prompt_only, turn1),
            "kept_d": cached_states(self.d, turn1) if self.d.cache_config.enable_prefix_caching else set(),
            "hit_aggregated": _serve(self.aggregated, turn2, max_tokens=1)[2],
            "hit_d": _serve(self.d, turn2, max_tokens=1)[2],
        }


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_d_keeps_every_checkpoint_aggregated_serving_keeps(models, config, monkeypatch):
    conv = Conversation(models, config)
    rule, tail = conv.rule, min_recompute_tokens(conv.profile)
    assert rule.keeps_states and rule.exports == CONFIGS[config][3]
    handed_any = False
    for i, n in enumerate(LENGTHS):
        got = conv.run(n, seed=1000 * i + 17)
        ctx = (config, n, got)
        offset = got["offset"]
        assert offset == n - tail and got["local"] == tail, ctx
        # The pure rule is vLLM's: the prompt-only instance keeps exactly these states.
        assert got["kept_prompt_only"] == set(checkpoints.kept_checkpoints(n, rule, computed=n)), ctx
        plan = plan_handoff(n, conv.profile, whole_prompt_states=checkpoints.whole_prompt_states(n, rule))
        junction = checkpoints.junction_to_pin(n, plan, conv.profile, rule)
        computed = n if plan.whole_prompt else offset
        handed = list(checkpoints.checkpoints_to_hand_over(n, offset, rule, junction, computed))
        assert got["sent"] == handed == got["claimed"], ctx
        handed_any |= bool(handed)
        # D holds each state it received (and its own tip's where the offset is a checkpoint).
        assert set(handed) <= got["kept_d"], ctx
        missing = checkpoints.checkpoints_not_computed(n, offset, rule, junction, computed)
        if got["hit_aggregated"] not in missing:
            assert got["hit_d"] >= got["hit_aggregated"], ctx
    assert handed_any, config


@pytest.mark.parametrize("config", ["plain", "pmu16", "eagle"])
def test_negative_control_withheld_checkpoints_drop_the_hit(models, config):
    """The same conversations with D told to place none of P's states: where aggregated
    serving's turn-2 hit is a state P handed over, D's hit falls below it."""
    conv = Conversation(models, config, withhold=True)
    dropped = 0
    for i, n in enumerate(LENGTHS):
        got = conv.run(n, seed=1000 * i + 17)
        assert got["claimed"] == [] and not set(got["sent"]) & got["kept_d"], (config, n, got)
        if got["hit_aggregated"] in got["sent"]:
            assert got["hit_d"] < got["hit_aggregated"], (config, n, got)
            dropped += 1
    assert dropped, config


def test_d_without_prefix_caching_refuses_the_checkpoints_only(models):
    conv = Conversation(models, "plain", d_prefix_caching=False)
    got = conv.run(2 * B + 5, seed=5)
    assert got["sent"] == [2 * B] and got["claimed"] == [] and got["local"] == 1, got
    assert conv.d.connector._scheduler.stats.get("checkpoint_refused:no_prefix_cache") == 1


def test_p_without_prefix_caching_sends_no_checkpoints(models):
    p = _scheduler(models, "plain", "kv_producer", prefix_caching=False)
    d = _scheduler(models, "plain", "kv_consumer")
    turn1 = random_prompt(2 * B + 5, seed=6)
    _, params, _ = _serve(p, turn1, {"do_remote_decode": True}, max_tokens=1)
    assert KEY_CHECKPOINTS not in params
    _, local, claimed = _decode(d, turn1, params)
    assert local == 1 and claimed == []


def _prefill(p, prompt):
    req = make_request(prompt, {"do_remote_decode": True}, max_tokens=1, block_size=p.hash_block_size)
    p.add_request(req)
    params = None
    for _ in range(10):
        _, eo = run_step(p)
        _, done, params = _outputs(eo, req.request_id)
        if done:
            break
    return req, params


def test_p_pins_a_checkpoint_until_its_lease_ends(models):
    """vLLM frees the checkpoint from P's table before request_finished; P's pin keeps the block
    (and its bytes) until every P rank reported the lease ended, then frees it, still cached."""
    p = _scheduler(models, "plain", "kv_producer")
    pool = p.kv_cache_manager.block_pool
    req, params = _prefill(p, random_prompt(2 * B + 5, seed=21))
    block = pool.blocks[params[KEY_CHECKPOINTS]["states"][0]["block_ids"][1][0]]
    assert block.ref_cnt == 1 and block.block_hash is not None
    run_step(p, kv_output=KVConnectorOutput(finished_sending={req.request_id}))
    assert block.ref_cnt == 0 and block.block_hash is not None  # evictable, still in P's cache


def test_an_aborted_prefill_unpins_its_checkpoints(models):
    """Negative of the one above: a P request aborted after vLLM offered its checkpoint hands
    nothing over and frees the pin at once."""
    from vllm.v1.request import RequestStatus

    p = _scheduler(models, "plain", "kv_producer")
    pool = p.kv_cache_manager.block_pool
    req = make_request(random_prompt(2 * B + 5, seed=22), {"do_remote_decode": True}, max_tokens=1,
                       block_size=p.hash_block_size)
    p.add_request(req)
    run_step(p)  # the chunk [0, 2B): vLLM offers the state at 2B, P pins it
    pins = p.connector._scheduler.checkpoints._pins[req.request_id]
    block = pins[2 * B][1]
    assert block.ref_cnt == 2  # the request's and P's pin
    p.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert block.ref_cnt == 0 and req.request_id not in p.connector._scheduler.checkpoints._pins


def test_a_failed_load_registers_no_checkpoint(models):
    """D's checkpoint block is freed unkeyed when the load fails (nothing P did not deliver
    enters D's prefix cache); the same load ending well keys it (the negative control)."""
    p, d = (_scheduler(models, "plain", role) for role in ("kv_producer", "kv_consumer"))
    pool = d.kv_cache_manager.block_pool
    for failed in (True, False):
        turn1 = random_prompt(2 * B + 5, seed=23 + failed)
        _, params = _prefill(p, turn1)
        req = make_request(turn1, dict(params), max_tokens=OUTPUT, block_size=d.hash_block_size)
        d.add_request(req)
        out, _ = run_step(d)
        task = out.kv_connector_metadata.to_recv[req.request_id]
        block = pool.blocks[task.checkpoint_pairs[1][0][1]]
        ended = {req.request_id}
        run_step(d, kv_output=KVConnectorOutput(finished_recving=ended, failed_recving=ended if failed else set()))
        assert block.ref_cnt == 0 and (block.block_hash is None) == failed, failed
        assert (2 * B in cached_states(d, turn1)) != failed
