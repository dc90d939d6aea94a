"""P restarted or killed between handoffs. Run last on its stack (conftest.py,
DESTRUCTIVE_MODULES): the restart test leaves P running, the kill test is the last test on its
stack (the stack's P stays down afterwards)."""

import time

import pytest

from rig.cpu_matrix import random_prompt
from rig.oracle import compare

pytestmark = pytest.mark.e2e

EXTERNAL = ("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"})


def loaded_tokens(stack) -> float:
    return stack.decode.metric(*EXTERNAL) or 0.0


def test_prefill_restarted_under_its_engine_id_serves_the_next_handoffs(stack):
    """P comes back under the same engine id (pinned in kv_transfer_config) with a new NIXL
    agent: D's cached connection is stale. None of the handoffs after it returns wrong text; the
    first reconnects (D sees P's new agent) and may be recomputed, as a new P's first handoff
    may be (PDStack.warm_up: it has taken 3-8 s on a loaded CI box, past the claim's timeout);
    the next ones are all loaded from P."""
    if stack.kind != "nemotron_h":
        pytest.skip("one hybrid carries the destructive tests")
    warm = random_prompt(100, seed=50)
    assert compare(stack.reference(warm, 8), stack.handoff(warm, 8)[1], tie_margin=1e-5, logprob_tol=1e-4).ok
    stack.prefill.restart()
    first = random_prompt(90, seed=52)
    assert compare(stack.reference(first, 8), stack.handoff(first, 8)[1], tie_margin=1e-5, logprob_tol=1e-4).ok
    prompts = [random_prompt(n, seed=51) for n in (64, 129, 200)]
    before = loaded_tokens(stack)
    offsets = []
    for prompt in prompts:
        params, got = stack.handoff(prompt, 8)
        offsets.append(params["replay_offset"])
        assert params["remote_engine_id"] == stack.config.prefill_engine_id
        assert compare(stack.reference(prompt, 8), got, tie_margin=1e-5, logprob_tol=1e-4).ok, len(prompt)
    deadline = time.monotonic() + 10
    while loaded_tokens(stack) - before < sum(offsets) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert loaded_tokens(stack) - before == sum(offsets), "handoffs after the restart were not loaded"
    assert "restarted; connecting again" in stack.decode.log_text()


def test_prefill_killed_before_decode_reads_recomputes_locally(stack):
    if stack.kind != "nemotron_h":
        pytest.skip("one hybrid carries the destructive tests")
    prompt = random_prompt(150, seed=11)
    ref = stack.reference(prompt, 8)
    params = stack.prefill_only(prompt)
    assert params["replay_offset"] == 149
    stack.prefill.stop()
    got = stack.decode_with(prompt, params, 8)
    assert compare(ref, got, tie_margin=1e-5, logprob_tol=1e-4).ok
    log = stack.decode.log_text()
    assert f"no answer from {params['remote_host']}:{params['remote_port']}" in log
    # D keeps serving after losing its prefill peer.
    assert compare(stack.reference(prompt[:40], 8), stack.decode_with(prompt[:40], None, 8), tie_margin=1e-5).ok
