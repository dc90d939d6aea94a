"""P dies between its prefill and D's read. Collected after the other e2e modules, so it is the
last test on its stack (the stack's P stays down afterwards)."""

import pytest

from pd_connector.dev.testing.cpu_matrix import random_prompt
from pd_connector.dev.testing.oracle import compare

pytestmark = pytest.mark.e2e


def test_prefill_killed_before_decode_reads_recomputes_locally(stack):
    if stack.kind != "nemotron_h":
        pytest.skip("one hybrid carries the destructive test")
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
