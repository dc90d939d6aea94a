"""Attention blocks of different sizes on P and D with prefix caching on both, on real vLLM CPU
servers, both directions, at TP 1/1 (the float32 token-for-token cells across TP sizes:
test_block_sizes.py).

The tiny Qwen3-Next (GDN, bf16: the only hybrid whose CPU kernels run prefix caching,
docs/testing.md) gets 640-token attention blocks (its Mamba page needs them) and 1280 with
``--block-size 1280`` on the other instance (rig/block_size_pairs.py). Per direction
and prompt length: P's offset is N - 1 or P's prompt checkpoint (docs/architecture.md, "The
replay offset"), D's ``vllm:prompt_tokens_by_source`` shows R tokens from P and N - R computed, the output matches D's aggregated serving (the bf16 rule,
``spec_matrix.check_bf16``, in its own ``cache_salt`` namespace), and a second turn served by D
hits its prefix cache at least as far as an aggregated conversation on D does (not vacuous: at
N = B_D + 1 that conversation hits B_D, and at 2*640 + 20 a checkpoint below R that P hands
over). Negative control: D resuming one token early (rig/fault_connector.py) fails the output check.
"""

from __future__ import annotations

import time

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from rig.cpu_matrix import random_prompt
from rig.oracle import complete
from rig.spec_matrix import caught_desyncs
from rig.spec_matrix import check_bf16 as check
from rig.tiny_models import build_model
from rig.block_size_pairs import DIRECTIONS, block_size_pair, counted_handoff, p_and_d

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
SMALL, LARGE = 640, 1280


@pytest.fixture(scope="module")
def pair(models_root, artifacts):
    model = str(build_model("qwen3_next_mtp", models_root))
    flags = ("--enable-prefix-caching",)
    with block_size_pair(model, artifacts / "block-sizes-cached", "bfloat16", flags, (SMALL, LARGE), 2048) as instances:
        for inst in instances:
            assert inst.server.cache_config().get("mamba_cache_mode") == "align"
        yield instances


def _hit_delta(inst, send) -> float:
    before = inst.server.metric("vllm:prefix_cache_hits_total") or 0.0
    send()
    time.sleep(1.0)  # prefix-cache counters arrive with the step's stats
    return (inst.server.metric("vllm:prefix_cache_hits_total") or 0.0) - before


def _salted(inst, prompt, salt, max_tokens=MAX_TOKENS):
    """Aggregated serving on ``inst`` in its own prefix-cache namespace (vLLM's cache_salt)."""
    return complete(inst.server.base_url, inst.served_model_name, prompt, max_tokens, extra={"cache_salt": salt})


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_handoff_across_block_sizes_matches_aggregated_and_turn_two_hits_what_it_hits(pair, direction):
    p, d = p_and_d(pair, direction)
    block_d = LARGE if d is pair[1] else SMALL
    rows = []
    for i, n in enumerate((300, block_d + 1, 2 * SMALL + 20)):
        prompt = random_prompt(n, seed=500 + i + 10 * DIRECTIONS.index(direction))
        params, out, loaded, computed = counted_handoff(p, d, prompt, MAX_TOKENS)
        salt = f"{direction}-{n}"
        same = check(_salted(d, prompt, salt), out).ok
        turn2 = prompt + out.token_ids + random_prompt(16, seed=600 + i)
        hit_aggregated = _hit_delta(d, lambda: _salted(d, turn2, salt, 1))
        hit_d = _hit_delta(d, lambda: d.reference(turn2, 1))
        rows.append(dict(n=n, offset=params.get("replay_offset"), loaded=loaded, computed=computed, same=same,
                         hit_aggregated=hit_aggregated, hit_d=hit_d))  # fmt: skip
    print(direction, rows)
    # R: N - 1, or P's prompt checkpoint where P keeps it (the whole-prompt replay plan).
    block_p = SMALL if block_d == LARGE else LARGE
    bad = [r for r in rows if r["offset"] not in (r["n"] - 1, get_mamba_prefill_checkpoint_position(r["n"], block_p, False))
           or (r["loaded"], r["computed"]) != (r["offset"], r["n"] - r["offset"])
           or not r["same"] or r["hit_d"] < r["hit_aggregated"]]  # fmt: skip
    assert not bad, f"{direction}: {bad} (all: {rows})"
    assert any(row["hit_aggregated"] > 0 for row in rows), rows


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_handoff_one_token_off_across_block_sizes_is_caught(pair, direction):
    p, d = p_and_d(pair, direction)
    prompts = [random_prompt(n, seed=700 + n) for n in (200, 700, 1000)]
    caught = caught_desyncs(p, d, prompts, MAX_TOKENS, lambda prompt: _salted(d, prompt, f"desync-{direction}"))
    assert sum(caught) >= 2, f"{direction}: only {sum(caught)} of 3 desynced handoffs were caught"
