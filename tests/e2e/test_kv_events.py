"""KV events across the handoff for an attention-only model (the tiny llama, prefix caching on by
vLLM's default), end to end: what a cache-aware router indexes (docs/operations.md, "KV events
for cache-aware routers").

After the aggregated baseline serves a prompt and P hands it over to D, D's ``BlockStored``
events include every (group, block hash) the baseline announced for it: in the replay flow (D
loads P's KV of [0, R) and computes the rest) and under zero replay (P's first token appended,
D loads all N tokens and computes one position). The hybrid with prefix caching is pinned in
tests/e2e/test_multiturn_reuse.py (checkpoints below R included), MTP in process in
tests/vllm/test_kv_events_mtp.py.

No server of its own: the session's llama ``stack`` (conftest.py ``start_stack``) publishes the
KV events of its baseline, P and D (``rig.kv_events.publish_from_stack``, ``PYTHONHASHSEED=0``
on each so their hashes agree).

Negative control: the handoff of the prompt with one token altered in its last full block
(P prefills and D decodes that prompt). D must announce exactly the baseline's blocks before the
altered one and miss every block from it on (hashes chain on tokens). Why not "D does not
register the blocks it loaded": on an attention-only model vLLM caches every full block of a
request up to its computed tokens at the request's next allocation (``KVCacheManager.
allocate_slots`` -> ``cache_blocks``), which D reaches for the one token it computes, so a
loaded block D failed to register at load (``Scheduler._update_waiting_for_remote_kv``) would
still be announced; what can go wrong across a handoff is the hash of what D's request holds
(its tokens, zero replay's prompt + t0, the hashing settings), which this control moves by one
block. A checkpoint D does not register is pinned on the hybrid (the withheld-checkpoint
controls of test_multiturn_reuse.py and tests/vllm/test_kv_events_mtp.py).
"""

from __future__ import annotations

import time

import pytest

from pd_connector.core.params import KEY_FIRST_TOKEN, KEY_RESUME, RESUME_FIRST_TOKEN
from rig.cpu_matrix import ATTENTION_BLOCK, random_prompt
from rig.kv_events import KvEvents, by_group

pytestmark = [pytest.mark.e2e, pytest.mark.parametrize("stack", ["llama"], indirect=True)]

MAX_TOKENS = 12
MODES = ["replay", "zero_replay", "negative_control_altered_block"]
# Seeds no other test of the llama stack uses: a prompt already in D's prefix cache is a local
# hit there, announced by nothing.
SEED = 38_000


def _geometry(stack) -> tuple[int, int]:
    """(prompt length, full blocks the baseline caches): 6 full prompt blocks and a 7th that
    the first generated tokens complete, so a block holding prompt and output is compared too."""
    block = ATTENTION_BLOCK[stack.kind]
    n = 6 * block + 24
    return n, (n + MAX_TOKENS - 1) // block


@pytest.mark.parametrize("mode", MODES)
def test_d_announces_every_block_aggregated_serving_announces(stack, mode):
    ports = stack.kv_events_ports
    assert set(ports) >= {"baseline", "decode"}, "the llama stack publishes no KV events (conftest.start_stack)"
    block = ATTENTION_BLOCK[stack.kind]
    n, full_blocks = _geometry(stack)
    prompt = random_prompt(n, seed=SEED + MODES.index(mode))
    with KvEvents(ports["baseline"]) as on_baseline, KvEvents(ports["decode"]) as on_d:
        time.sleep(1.0)  # ZMQ's slow joiner, and whatever the publishers queued meanwhile
        mark = on_baseline.mark()
        reference = stack.reference(prompt, MAX_TOKENS)
        aggregated = on_baseline.stored(mark)
        mark = on_d.mark()
        if mode == "zero_replay":
            params = stack.prefill_only(prompt, **{KEY_RESUME: RESUME_FIRST_TOKEN})
            assert params.get("replay_offset") == n and isinstance(params.get(KEY_FIRST_TOKEN), int), params
            first = params[KEY_FIRST_TOKEN]
            tokens = [first] + stack.decode_with(prompt + [first], params, MAX_TOKENS - 1).token_ids
        else:
            sent = list(prompt)
            altered = None
            if mode == "negative_control_altered_block":
                altered = (full_blocks - 2) * block + 3  # in the last full prompt block
                assert altered < n
                sent[altered] = 4 + (sent[altered] - 4 + 1) % 996
            params, out = stack.handoff(sent, MAX_TOKENS)
            assert 0 < params.get("replay_offset", 0) < n, params  # D loads P's KV, then computes
            tokens = out.token_ids
        announced = on_d.stored(mark)
    missing = aggregated - announced
    row = dict(mode=mode, n=n, offset=params.get("replay_offset"), aggregated=by_group(aggregated),
               d=by_group(announced), missing=by_group(missing), same_tokens=tokens == reference.token_ids)
    print(row)
    assert len(aggregated) == full_blocks, row  # the baseline announced the prompt's and output's full blocks
    if mode == "negative_control_altered_block":
        # Exactly the blocks before the altered one match: the check sees a single block's hash.
        assert len(aggregated & announced) == altered // block and len(missing) == full_blocks - altered // block, row
    else:
        assert not missing, row
        assert row["same_tokens"], row  # float32: token-identical (the stack's oracle tests)
