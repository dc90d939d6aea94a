"""KV events across the handoff with MTP *and* prefix caching on a hybrid, in vLLM's real
Scheduler: what a cache-aware router indexes (docs/operations.md, "KV events for cache-aware
routers").

vLLM CPU has no kernel for speculative decoding on a hybrid with prefix caching (Mamba ``align``
mode: the precopy kernel, docs/testing.md), so this cell cannot run end to end here. The events
do not need the model: they come from the scheduler's block pool (``BlockPool.cache_full_blocks``
/ ``cache_partial_block`` queue ``BlockStored``; ``Scheduler.update_from_output`` takes them from
the KV-cache manager and the connector each step and hands them to the publisher), which this
harness runs for real. Each Scheduler is built with ``kv_events_config`` enabled
(``make_scheduler(kv_events=True)``, publisher "null") and its publisher swapped for a
collector, so every event is one the server would publish.

An aggregated Scheduler and a P -> D pair, the tiny Qwen3-Next with MTP
(``num_speculative_tokens`` 2, as tests/vllm/test_replay_turns.py's ``mtp2``), attention + Mamba
groups in align mode, serve the same prompt: D's ``BlockStored`` (group, hash) set includes the
aggregated one's, attention blocks and Mamba state blocks alike, at lengths where a checkpoint
lies below the offset:
- ``replay``: P bounded at ``max_checkpoint_recompute`` 0 truncates its prefill to N - tail and
  hands over the checkpoint below R, which D registers through its checkpoint pool;
- ``replay_whole_prompt``: the default, P prefills the whole prompt and R is its checkpoint;
- ``zero_replay``: P's first token travels, D loads all N tokens.
Negative control: the bounded replay with the checkpoints withheld (the rig's
FaultInjectingConnector on D, ``rig.faults.WITHHOLD_CHECKPOINTS``): D does not register them and
its set misses exactly the aggregated Mamba blocks. The harness samples no drafts (its "model"
returns one token a step), so MTP shows in the scheduler's geometry (lookahead slots, the
re-prefillable tail vLLM never caches, the connector's offsets), not in accepted tokens.
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import BlockStored
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.core.params import KEY_CHECKPOINTS, KEY_RESUME, RESUME_FIRST_TOKEN
from rig import faults
from rig.cpu_matrix import random_prompt
from rig.kv_events import by_group
from rig.scheduler_harness import make_request, make_scheduler, run_step
from tests.vllm.test_prefix_cache_turns import B, OUTPUT, _outputs, _run_to_end, models  # noqa: F401

MTP = {"method": "mtp", "num_speculative_tokens": 2}
LENGTHS = [2 * B + 5, 2 * B + 20, 3 * B + 1]
MODES = ["replay", "replay_whole_prompt", "zero_replay", "negative_control_withheld"]
BOUNDED = {"max_checkpoint_recompute": 0}


class Collector:
    """Stands in for the scheduler's publisher: every ``KVEventBatch`` it would publish."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass

    def stored(self) -> set[tuple[int | None, object]]:
        return {(e.group_idx, h) for e in self.events if isinstance(e, BlockStored) for h in e.block_hashes}


def _scheduler(models, role, extra_config=None, faults_on=False):
    s = make_scheduler(
        models["qwen3_next_mtp"],
        role,
        groups=("attention", "mamba"),
        prefix_caching=True,
        mamba_mode="align",
        block_size=B,
        speculative=MTP,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        num_blocks=3000,
        extra_config=extra_config,
        faults=faults_on,
        kv_events=True,
    )
    assert s.enable_kv_cache_events and s.kv_cache_manager.block_pool.enable_kv_cache_events
    s.kv_event_publisher = Collector()
    return s


def _serve(s, prompt, params=None, max_tokens=OUTPUT):
    req = make_request(prompt, params, max_tokens=max_tokens, block_size=s.hash_block_size)
    s.add_request(req)
    _, eo = run_step(s)
    return _run_to_end(s, req.request_id, *_outputs(eo, req.request_id))


def _decode(d, prompt, params, max_tokens):
    req = make_request(prompt, dict(params), max_tokens=max_tokens, block_size=d.hash_block_size)
    d.add_request(req)
    out, _ = run_step(d)
    assert req.request_id in out.kv_connector_metadata.to_recv, "the handoff was not admitted"
    _, eo = run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    return _run_to_end(d, req.request_id, *_outputs(eo, req.request_id))[0]


def _mamba_groups(s) -> set[int]:
    return {g for g, group in enumerate(s.kv_cache_config.kv_cache_groups) if isinstance(group.kv_cache_spec, MambaSpec)}


@pytest.mark.parametrize("mode", MODES)
def test_d_announces_every_block_aggregated_serving_announces(models, mode):
    withheld = mode == "negative_control_withheld"
    handed_below = 0
    for i, n in enumerate(LENGTHS):
        aggregated = _scheduler(models, "kv_both")
        p = _scheduler(models, "kv_producer", None if mode == "replay_whole_prompt" else BOUNDED)
        d = _scheduler(models, "kv_consumer", faults_on=withheld)
        mamba = _mamba_groups(d)
        prompt = random_prompt(n, 7100 + 13 * i)
        reference, _ = _serve(aggregated, prompt)
        if mode == "zero_replay":
            first, params = _serve(p, prompt, {"do_remote_decode": True, KEY_RESUME: RESUME_FIRST_TOKEN}, max_tokens=1)
            assert params["replay_offset"] == n, params
            tokens = first + _decode(d, prompt + first, params, OUTPUT - 1)
        else:
            _, params = _serve(p, prompt, {"do_remote_decode": True}, max_tokens=1)
            to_d = {**params, faults.WITHHOLD_CHECKPOINTS: True} if withheld else params
            tokens = _decode(d, prompt, to_d, OUTPUT)
        sent = [s["position"] for s in (params.get(KEY_CHECKPOINTS) or {}).get("states", [])]
        handed_below += any(pos < params["replay_offset"] for pos in sent)
        on_aggregated, on_d = aggregated.kv_event_publisher.stored(), d.kv_event_publisher.stored()
        missing = on_aggregated - on_d
        row = dict(mode=mode, n=n, offset=params["replay_offset"], sent=sent, aggregated=by_group(on_aggregated),
                   d=by_group(on_d), missing=by_group(missing))
        print(row)
        assert tokens == reference, row
        # Attention blocks and Mamba state blocks announced: not vacuous.
        assert {g for g, _ in on_aggregated} >= {0} | mamba, row
        if withheld:
            # Exactly the state blocks D was told not to register: the attention blocks load.
            assert sent and missing == {(g, h) for g, h in on_aggregated if g in mamba}, row
        else:
            assert not missing, row
    if mode in ("replay", "zero_replay", "negative_control_withheld"):
        # The lengths reach what registration is about: a checkpoint below the offset.
        assert handed_below == len(LENGTHS), (mode, handed_below)
