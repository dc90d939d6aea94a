"""Zero replay with MTP on the Qwen3-Next hybrid (GDN + attention, bf16), through
``pd-connector proxy``, on the session's speculative instances (conftest.py ``spec_instances``;
no server of its own).

P and D with the same MTP configuration: where D's tail is one token (MTP 1 and 2: vLLM's
lookahead leaves ``max(1, K - 1)``), P computes the whole prompt and its first token reaches D,
which loads all N prompt tokens and computes one position, its drafter's prompt KV read with
the rest; the client's answer equals aggregated serving's by the bf16 rule. MTP 3 needs two
tokens recomputed: P answers with a replay offset and no first token, and the proxy sends D the
client's request (the replay flow). Prefix caching with MTP is covered in vLLM's own Scheduler
(tests/vllm/test_zero_replay_turns.py): this hybrid crashes in align mode with speculative
decoding on vLLM CPU (docs/testing.md).
"""

from __future__ import annotations

import time

import pytest

from pd_connector.core.recompute_profile import min_recompute_tokens
from pd_connector.core.params import KEY_FIRST_TOKEN, KEY_RESUME, RESUME_FIRST_TOKEN
from rig.cpu_matrix import random_prompt
from rig.oracle import complete
from rig.proxy_process import ProxyProcess
from rig.spec_matrix import check_bf16 as check

pytestmark = pytest.mark.e2e

MAX_TOKENS = 10
LENGTHS = (17, 96, 161)


def accounting(inst) -> dict[str, float]:
    return inst.server.prompt_tokens_by_source()


def settled_delta(inst, before: dict, external: float, seconds: float = 10.0) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        now = accounting(inst)
        delta = {k: now[k] - before[k] for k in now}
        if delta["external_kv_transfer"] >= external or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.mark.parametrize("setup", ["mtp1", "mtp2", "mtp3"])
def test_mtp_through_the_proxy_resumes_where_d_can(spec_instances, artifacts, setup):
    inst = spec_instances[setup]
    tail = min_recompute_tokens(inst.setup.profile)
    proxy = ProxyProcess(inst.server.base_url, inst.server.base_url, artifacts / f"zero-replay-{setup}-proxy.log")
    try:
        for i, n in enumerate(LENGTHS):
            prompt = random_prompt(n, seed=1200 + i)
            ref = inst.reference(prompt, MAX_TOKENS)
            params = inst.prefill(prompt, **{KEY_RESUME: RESUME_FIRST_TOKEN})
            if tail == 1:
                assert params["replay_offset"] == n and params[KEY_FIRST_TOKEN] == ref.token_ids[0], params
            else:
                assert params["replay_offset"] == n - tail and params.get(KEY_FIRST_TOKEN) is None, params
            before = accounting(inst)
            got = complete(proxy.url, inst.served_model_name, prompt, MAX_TOKENS)
            verdict = check(ref, got)
            assert verdict.ok, (setup, n, verdict.describe())
            # One kv_both instance is P and D here: P computed the prompt (local_compute n, or
            # n - tail under replay), D loaded what P handed over and computed the rest.
            r = n if tail == 1 else n - tail
            delta = settled_delta(inst, before, r)
            assert delta["external_kv_transfer"] == r, (setup, n, delta)
            assert delta["local_compute"] == r + (1 if tail == 1 else tail), (setup, n, delta)
    finally:
        proxy.stop()
