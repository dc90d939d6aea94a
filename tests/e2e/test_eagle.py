"""EAGLE and ngram across the handoff: a float32 Nemotron-H hybrid (Mamba2 + attention) with a tiny
EAGLE-1 drafter, and with ngram, P/D against aggregated serving with the same speculative config.

On vLLM CPU, EAGLE on Mamba2 hybrids already changes greedy output compared with no speculation
(cpu-recipes 10.1: the CPU multi-token verification path), so the reference is always an instance
running the same speculative config; the test first checks that this reference repeats itself.
Four kv_both instances: EAGLE with 1 and 2 speculative tokens, and two with ngram; cells include
self-handoffs.
"""

from __future__ import annotations

import time

import pytest

from pd_connector.testing.cpu_matrix import CPU_MODELS, boundary_lengths, random_prompt
from pd_connector.testing.oracle import compare
from pd_connector.testing.spec_matrix import (
    HONOURED,
    SPEC_EXTRA_CONFIG,
    InstanceSpec,
    SpecSetup,
    expected_outcome,
    handoff,
    make_instances,
    running,
)
from pd_connector.testing.tiny_models import build_model

# Measured (2026-11-29, vLLM CPU 0.32.0, this model in float32): with EAGLE or ngram on a Mamba2
# hybrid, *aggregated* serving is not deterministic: two identical greedy requests to the same
# instance agree on token 0 and differ from token 1 on (65 and 129-token prompts, EAGLE 2 and
# ngram alike), i.e. vLLM CPU's multi-token verification path for Mamba2 (cpu-recipes 10.1, "not
# verified" there) has no stable reference to compare P/D against. P/D also gave a different
# token 0 than aggregated serving on both prompts (a self-handoff, same instance), which the
# non-speculative Mamba2 tests and MTP on GDN (test_speculative.py) do not show; whether that is
# the same CPU path (D's one-token recompute is scheduled like a decode step) or the state slot
# D resumes from under speculative decoding on Mamba2 could not be separated here. Kept as
# non-strict expected failures so the cells run and report, until a GPU run (integration.py
# --device cuda) or a fixed CPU path gives a stable reference.
MAMBA2_SPEC_REFERENCE = pytest.mark.xfail(
    strict=False,
    reason="vLLM CPU: speculative decoding on Mamba2 hybrids is not deterministic run to run",
)
pytestmark = [pytest.mark.e2e, MAMBA2_SPEC_REFERENCE]

MAX_TOKENS = 12
# float32: P/D vs aggregated logprobs differ at ulp level (cpu-recipes 10.5).
TIE_MARGIN = 1e-5
LOGPROB_TOL = 1e-4


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=TIE_MARGIN, logprob_tol=LOGPROB_TOL)


@pytest.fixture(scope="module")
def eagle(models_root, artifacts):
    draft = str(build_model("eagle_llama", models_root))
    setups = [
        SpecSetup(f"eagle{k}", {"method": "eagle", "model": draft, "num_speculative_tokens": k}, 1, "eagle:eagle_llama")
        for k in (1, 2)
    ]
    spec = InstanceSpec(
        model=str(build_model("nemotron_h", models_root)),
        log_dir=artifacts / "eagle",
        dtype="float32",
        server_args=CPU_MODELS["nemotron_h"],
        extra_config=SPEC_EXTRA_CONFIG,
    )
    insts = make_instances(spec, [*setups, "ngram", "ngram_b"])
    with running(insts):
        yield insts


def test_speculative_reference_is_deterministic(eagle):
    for inst in eagle.values():
        prompt = random_prompt(65, seed=50)
        first, second = inst.reference(prompt, MAX_TOKENS), inst.reference(prompt, MAX_TOKENS)
        assert first.token_ids == second.token_ids, inst.setup.name


@pytest.mark.parametrize(("p_name", "d_name"), [("eagle2", "eagle1"), ("eagle1", "eagle2")])
def test_eagle_pd_matches_aggregated_at_block_boundaries(eagle, p_name, d_name):
    p, d = eagle[p_name], eagle[d_name]
    failures = []
    for n in boundary_lengths(32):
        prompt = random_prompt(n, seed=51)
        outcome, offset = expected_outcome(p.setup, d.setup, n)
        params, got = handoff(p, d, prompt, MAX_TOKENS)
        assert outcome == HONOURED and params.get("replay_offset", 0) == offset, (n, params)
        verdict = check(d.reference(prompt, MAX_TOKENS), got)
        if not verdict.ok:
            failures.append(f"n={n} R={offset}: {verdict.describe()}")
    assert not failures, "\n".join(failures)


def _repetitive_prompt(n: int, period: int, seed: int) -> list[int]:
    unit = random_prompt(period, seed)
    return (unit * (n // period + 1))[:n]


def _acceptance(inst) -> tuple[float, float]:
    s = inst.server
    return (
        s.metric("vllm:spec_decode_num_accepted_tokens_total") or 0.0,
        s.metric("vllm:spec_decode_num_draft_tokens_total") or 0.0,
    )


def test_ngram_acceptance_under_pd_matches_aggregated(eagle):
    """ngram on D after a handoff from another ngram instance: the acceptance rate (accepted /
    drafted tokens, D's vllm:spec_decode_* counters) is within 5% of aggregated serving's on the
    same repetitive prompts, and the output is identical."""
    p, d = eagle["ngram_b"], eagle["ngram"]
    prompts = [_repetitive_prompt(n, period, seed) for n, period, seed in ((96, 4, 1), (130, 3, 2), (200, 6, 3), (64, 2, 4))]
    max_tokens = 48

    def measure(run):
        a0, d0 = _acceptance(d)
        outs = [run(prompt) for prompt in prompts]
        deadline = time.monotonic() + 10  # the counters arrive with the last steps' stats
        while True:
            a1, d1 = _acceptance(d)
            if time.monotonic() > deadline or (outs and d1 > d0):
                time.sleep(1.0)
                a1, d1 = _acceptance(d)
                break
            time.sleep(0.2)
        return (a1 - a0) / max(d1 - d0, 1), a1 - a0, outs

    agg_rate, agg_accepted, agg_outs = measure(lambda prompt: d.reference(prompt, max_tokens))
    pd_rate, pd_accepted, pd_outs = measure(lambda prompt: handoff(p, d, prompt, max_tokens)[1])
    print(f"\nngram acceptance: aggregated {agg_rate:.3f} ({agg_accepted:.0f} tokens), P/D {pd_rate:.3f} ({pd_accepted:.0f})")
    assert agg_accepted > 0, "the prompts must make ngram drafts acceptable, or the comparison means nothing"
    bad = [v.describe() for r, o in zip(agg_outs, pd_outs) if not (v := check(r, o)).ok]
    assert not bad, bad
    assert abs(pd_rate - agg_rate) <= 0.05 * agg_rate
