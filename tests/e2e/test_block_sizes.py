"""Attention blocks of different sizes on P and D at different TP sizes, on real vLLM CPU
servers, float32, both directions: P's blocks smaller than D's and larger (equal TP with prefix
caching: test_block_sizes_prefix_cache.py).

The tiny Nemotron-H (Mamba2 + attention) at TP 1 with ``--block-size 32`` and at TP 2 with
``--block-size 64`` (rig/block_size_pairs.py), so the cells are P1 (32) -> D2 (64) and
P2 (64) -> D1 (32), each D rank reading its heads and channels from the P rank(s) holding them,
sub-block by sub-block. Per direction and prompt
length (on, around and across both block sizes): P's offset is N - 1, D's own
``vllm:prompt_tokens_by_source`` shows R tokens from P and N - R computed, and D's output equals
its own aggregated serving token for token. Negative control: D resuming one token early on P's
state (rig/fault_connector.py) must fail that comparison on most prompts.
"""

from __future__ import annotations

import pytest

from rig.cpu_matrix import CPU_MODELS, random_prompt
from rig.spec_matrix import caught_desyncs
from rig.tiny_models import build_model
from rig.block_size_pairs import DIRECTIONS, block_size_pair, counted_handoff, p_and_d

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
BLOCKS = (32, 64)
LENGTHS = [5, 31, 33, 63, 65, 97, 130, 257]


@pytest.fixture(scope="module")
def pair(models_root, artifacts):
    model = str(build_model("nemotron_h", models_root))
    flags = [f for f in CPU_MODELS["nemotron_h"] if f not in ("--block-size", "32")]
    with block_size_pair(model, artifacts / "block-sizes", "float32", flags, BLOCKS, 1024, tp=(1, 2)) as instances:
        yield instances


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pd_across_block_sizes_matches_aggregated_token_for_token(pair, direction):
    p, d = p_and_d(pair, direction)
    failures = []
    for n in LENGTHS:
        prompt = random_prompt(n, seed=11)
        params, out, loaded, computed = counted_handoff(p, d, prompt, MAX_TOKENS)
        r = params.get("replay_offset")
        want = d.reference(prompt, MAX_TOKENS).token_ids
        if r != n - 1 or (loaded, computed) != (r, n - r) or out.token_ids != want:
            failures.append(f"n={n}: R={r}, loaded {loaded}, computed {computed}, {out.token_ids} vs aggregated {want}")
    assert not failures, f"{direction}:\n" + "\n".join(failures)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_handoff_one_token_off_across_block_sizes_is_caught(pair, direction):
    p, d = p_and_d(pair, direction)
    prompts = [random_prompt(n, seed=13) for n in (40, 70, 130, 200)]
    exact = lambda reference, got: reference.token_ids == got.token_ids  # noqa: E731
    caught = caught_desyncs(p, d, prompts, MAX_TOKENS, lambda prompt: d.reference(prompt, MAX_TOKENS), same=exact)
    assert sum(caught) >= 3, f"{direction}: only {sum(caught)} of 4 desynced handoffs were caught"
