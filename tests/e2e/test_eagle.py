"""EAGLE across the handoff: the tiny Qwen3-Next hybrid (GDN + attention) as target with a tiny
EAGLE-1 drafter, P/D against aggregated serving with D's speculative config.

Two kv_both instances (EAGLE with 1 and 2 speculative tokens); cells are handoffs between them
in both directions, so P and D differ in ``num_speculative_tokens`` while sharing the drafter
(same KV layout). GDN runs only in bf16 on CPU: the margin-aware oracle of spec_matrix, with its
own negative control here.

Why not a Mamba2 target (vLLM CPU 0.32.0): with EAGLE or ngram on
Nemotron-H, *aggregated* serving itself is not deterministic (two identical greedy requests
differ from the second token on), so there is no reference to compare P/D against; the same
drafter on this GDN target is deterministic run to run. ngram is not deterministic on either
hybrid and is covered on a plain-attention model (test_ngram_acceptance.py).
"""

from __future__ import annotations

import pytest

from rig.cpu_matrix import boundary_lengths, random_prompt
from rig.spec_matrix import (
    HONOURED,
    SPEC_EXTRA_CONFIG,
    InstanceSpec,
    SpecSetup,
    caught_desyncs,
    check_bf16 as check,
    expected_outcome,
    handoff,
    make_instances,
    running,
)
from rig.tiny_models import build_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def eagle(models_root, artifacts):
    draft = str(build_model("eagle_llama", models_root))
    setups = [
        # EAGLE-family lookahead is 1 whatever the token count (VllmConfig.num_prefill_lookahead_tokens).
        SpecSetup(f"eagle{k}", {"method": "eagle", "model": draft, "num_speculative_tokens": k}, 1, "eagle:eagle_llama")
        for k in (1, 2)
    ]
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", models_root)),
        log_dir=artifacts / "eagle",
        extra_config=SPEC_EXTRA_CONFIG,
        faults=True,  # the rig's FaultInjectingConnector: inert unless a request asks
    )
    insts = make_instances(spec, setups)
    with running(insts):
        yield insts


def test_eagle_reference_is_deterministic(eagle):
    """The oracle needs a stable reference (it is not, on Mamba2 targets: see the module doc)."""
    for inst in eagle.values():
        prompt = random_prompt(65, seed=50)
        assert inst.reference(prompt, MAX_TOKENS).token_ids == inst.reference(prompt, MAX_TOKENS).token_ids


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


def test_desynced_eagle_handoff_is_caught(eagle):
    """Negative control: D resumes one token early on the state P computed for R. The oracle above
    must catch it on nearly every prompt, or its passing means nothing."""
    d = eagle["eagle1"]
    lengths = (33, 64, 65, 100, 129, 200)
    prompts = [random_prompt(n, seed=52) for n in lengths]
    caught = caught_desyncs(eagle["eagle2"], d, prompts, MAX_TOKENS, lambda prompt: d.reference(prompt, MAX_TOKENS))
    assert sum(caught) >= len(lengths) - 1, f"only {sum(caught)}/{len(lengths)} desyncs detected: {caught}"
