"""ngram speculation across the handoff: D accepts as many draft tokens after a handoff as
aggregated serving does on the same repetitive prompts (within 5%), and the output is identical.

What "acceptance" means here: accepted draft tokens, i.e. the decode steps speculation saves.
The per-draft-token *rate* is printed but not asserted: D proposes exactly one more draft round
per request than aggregated serving (its first step is the one-token recompute, and vLLM drafts
after it). vLLM's own NixlConnector shows the same extra round (on these
prompts with NixlConnector: 5/15/7/16/3 draft rounds under P/D vs 4/14/6/15/2 aggregated,
accepted tokens equal), so the difference belongs to vLLM's scheduling of D, not the handoff.

Two kv_both instances running ngram (P and D), on the plain-attention tiny Llama in float32.
Not on a hybrid: on vLLM CPU 0.32.0, ngram on both tiny hybrids (Nemotron-H
and Qwen3-Next, with or without a KV connector loaded) is not deterministic in aggregated
serving (two identical greedy requests differ from the second or third token on), so no
reference exists there; on Llama it is deterministic. P and D are separate instances because a
self-handoff would count P's one-token request's drafts (proposed, never verified) in D's
counters.
"""

from __future__ import annotations

import time

import pytest

from rig.cpu_matrix import CPU_MODELS, random_prompt
from rig.oracle import compare
from rig.spec_matrix import SPEC_EXTRA_CONFIG, InstanceSpec, handoff, make_instances, running
from rig.tiny_models import build_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 48
# float32: P/D vs aggregated logprobs differ at ulp level (docs/testing.md).
TIE_MARGIN = 1e-5
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def ngram_pair(models_root, artifacts):
    spec = InstanceSpec(
        model=str(build_model("llama", models_root)),
        log_dir=artifacts / "ngram",
        dtype="float32",
        server_args=CPU_MODELS["llama"],
        extra_config=SPEC_EXTRA_CONFIG,
    )
    insts = make_instances(spec, ["ngram_b", "ngram"])
    with running(insts):
        yield insts["ngram_b"], insts["ngram"]


def _repetitive_prompt(n: int, period: int, seed: int) -> list[int]:
    unit = random_prompt(period, seed)
    return (unit * (n // period + 1))[:n]


PROMPTS = [_repetitive_prompt(n, period, seed) for n, period, seed in ((96, 4, 1), (130, 3, 2), (200, 6, 3), (64, 2, 4), (33, 5, 5))]


def _counters(inst) -> tuple[float, float]:
    s = inst.server
    return (
        s.metric("vllm:spec_decode_num_accepted_tokens_total") or 0.0,
        s.metric("vllm:spec_decode_num_draft_tokens_total") or 0.0,
    )


def _measure(d, run):
    """(acceptance rate, accepted tokens, outputs) on D's counters over PROMPTS."""
    accepted0, drafted0 = _counters(d)
    outs = [run(prompt) for prompt in PROMPTS]
    # The counters arrive with the steps' stats, sometimes a logging interval later: wait until
    # they stop moving.
    last, deadline = None, time.monotonic() + 15
    while time.monotonic() < deadline:
        now = _counters(d)
        if now == last and now[1] > drafted0:
            break
        last = now
        time.sleep(1.0)
    accepted1, drafted1 = _counters(d)
    return (accepted1 - accepted0) / max(drafted1 - drafted0, 1), accepted1 - accepted0, outs


def test_ngram_acceptance_under_pd_matches_aggregated(ngram_pair):
    p, d = ngram_pair
    agg_rate, agg_accepted, agg_outs = _measure(d, lambda prompt: d.reference(prompt, MAX_TOKENS))
    pd_rate, pd_accepted, pd_outs = _measure(d, lambda prompt: handoff(p, d, prompt, MAX_TOKENS)[1])
    print(
        f"\nngram on D: aggregated accepted {agg_accepted:.0f} tokens (rate {agg_rate:.3f}), "
        f"P/D accepted {pd_accepted:.0f} (rate {pd_rate:.3f})"
    )
    assert agg_accepted > 0, "the prompts must make ngram drafts acceptable, or the comparison means nothing"
    bad = [v.describe() for r, o in zip(agg_outs, pd_outs) if not (v := compare(r, o, tie_margin=TIE_MARGIN, logprob_tol=LOGPROB_TOL)).ok]
    assert not bad, bad
    assert abs(pd_accepted - agg_accepted) <= 0.05 * agg_accepted
