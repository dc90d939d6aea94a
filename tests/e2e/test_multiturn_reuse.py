"""D-side multi-turn reuse after a handoff, with prefix caching on (Mamba ``align`` mode).

The scenario of vllm#51295, scaled down: turn 1 has ``k*B + 1`` prompt tokens (the length that made
upstream fall to a full miss on D), turn 2 extends the conversation. P hands over at the replay
grid (R = k*B), so D receives the recurrent state exactly where its own cache manager checkpoints
it, and D's turn 2 must hit its local prefix cache for the first k*B tokens.

Qwen3-Next (GDN) is the only hybrid whose CPU kernels run prefix caching (the Mamba2 hybrids crash
in align mode, docs/testing.md); bf16, so outputs use the margin-aware oracle of
spec_matrix.check_bf16. Two kv_both instances: A is P and the aggregated reference, B is D (kept
free of reference traffic so its cache hits come only from the handoff).
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pd_connector.dev.testing.cpu_matrix import random_prompt
from pd_connector.dev.testing.spec_matrix import SPEC_EXTRA_CONFIG, InstanceSpec, handoff, make_instances, running
from pd_connector.dev.testing.spec_matrix import check_bf16 as check
from pd_connector.dev.testing.tiny_models import build_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def pair(models_root, artifacts):
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", models_root)),
        log_dir=artifacts / "multiturn",
        max_model_len=2048,
        server_args=("--enable-prefix-caching",),
        extra_config=SPEC_EXTRA_CONFIG,
    )
    a = make_instances(spec, ["off"])
    # B on the other core: two instances pinned to one core starve each other (cpu_binds).
    b = make_instances(dataclasses.replace(spec, log_dir=artifacts / "multiturn-d"), ["off"], first_core=1)
    with running(a, b):
        yield a["off"], b["off"]


def _hits(inst) -> tuple[float, float]:
    s = inst.server
    return (s.metric("vllm:prefix_cache_hits_total") or 0.0, s.metric("vllm:prefix_cache_queries_total") or 0.0)


@pytest.mark.parametrize("k", [1, 2])
def test_turn_two_hits_the_decode_prefix_cache_after_a_handoff(pair, k):
    a, b = pair
    cache = b.server.cache_config()
    assert cache.get("mamba_cache_mode") == "align", cache
    block = int(cache["block_size"])
    turn1 = random_prompt(k * block + 1, seed=30 + k)
    params, out1 = handoff(a, b, turn1, MAX_TOKENS)
    assert params["replay_offset"] == k * block, params  # on the replay grid, not N - 1
    assert check(a.reference(turn1, MAX_TOKENS), out1).ok

    turn2 = turn1 + out1.token_ids + random_prompt(block // 2 + 7, seed=40 + k)
    before = _hits(b)
    params2, out2 = handoff(a, b, turn2, MAX_TOKENS)
    time.sleep(1.0)  # prefix-cache counters arrive with the step's stats
    after = _hits(b)
    hits = after[0] - before[0]
    assert hits >= k * block, f"turn 2 hit {hits} tokens on D, expected >= {k * block} (queries {after[1] - before[1]})"
    assert check(a.reference(turn2, MAX_TOKENS), out2).ok
