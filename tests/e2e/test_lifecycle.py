"""Lifecycle of P's blocks on real vLLM CPU servers: every handoff D refuses frees P's cache
within seconds (P runs with lease_seconds 600 and an 8 s claim deadline, cpu_matrix.E2E_EXTRA_
CONFIG), a fingerprint rewritten for another prompt is refused by P's claim check, and n > 1
requests through the proxy read one handoff per request, match aggregated serving, and leak
nothing. It does not depend on which module ran before it on the shared stack."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pd_connector.core.fingerprint import fingerprint
from rig.cpu_matrix import E2E_SECRET, random_prompt
from rig.oracle import compare, parse_completion
from rig.ports import free_port
from rig.kv_cache import kv_cache_empty_within

pytestmark = pytest.mark.e2e

MAX_TOKENS = 8
TIE_MARGIN, LOGPROB_TOL = 1e-5, 1e-4
EXTERNAL = ("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"})


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=TIE_MARGIN, logprob_tol=LOGPROB_TOL)


def metric(server, name, labels=None) -> float:
    return server.metric(name, labels) or 0.0


def event(server, name: str) -> float:
    return metric(server, "vllm:pd_events_total", {"event": name})


def cache_empty_within(stack, seconds: float, servers=None) -> dict:
    """``kv_cache_empty_within`` on ``servers`` (P by default)."""
    return kv_cache_empty_within(servers or (stack.prefill,), seconds)


def sealed(stack) -> bool:
    """P seals its handoffs (a shared secret): D refuses edited params before contacting P."""
    return stack.kind in E2E_SECRET


def test_a_fingerprint_rewritten_for_another_prompt_is_refused_by_p(stack):
    """D gets prompt A with P's params for prompt B, the fingerprint rewritten to A's: D's own
    check passes; P compares the claimed fingerprint with the one it computed and refuses.
    With a shared secret D already refuses the edit (the seal), and never claims."""
    n = 80
    a, b = random_prompt(n, seed=21), random_prompt(n, seed=22)
    params = stack.prefill_only(b)
    params["pd_prompt_fingerprint"] = fingerprint(a, params["replay_offset"])
    counter = (stack.decode, "refused:unauthenticated") if sealed(stack) else (stack.prefill, "claim_refused:prompt_mismatch")
    refused = event(*counter)
    got = stack.decode_with(a, params, MAX_TOKENS)
    assert check(stack.reference(a, MAX_TOKENS), got).ok
    if not sealed(stack):
        assert "is not the one of the 79 tokens this instance computed" in stack.prefill.log_text()
    deadline = time.monotonic() + 10
    while event(*counter) < refused + 1:
        assert time.monotonic() < deadline, f"{counter[1]} not counted"
        time.sleep(0.2)


def _changed(prompt: list[int], at: int) -> list[int]:
    out = list(prompt)
    out[at] = out[at] + 1 if out[at] < 999 else 4  # still a token of random_prompt's range
    return out


# D's prompt from P's (prompt, R) -> (D's prompt, the refusal it must draw, or None: honoured)
PROMPT_EDITS = {
    "one_token_at_r_minus_1": lambda prompt, r: (_changed(prompt, r - 1), "prompt_mismatch"),
    "one_token_at_0": lambda prompt, r: (_changed(prompt, 0), "prompt_mismatch"),
    # The first R tokens are P's: the state P computed at R is D's too.
    "p_prompt_plus_a_suffix": lambda prompt, r: (prompt + random_prompt(9, seed=41), None),
    # R = N - 1 leaves this prompt nothing to recompute (a P with a longer tail would not).
    "p_prompt_minus_its_last_token": lambda prompt, r: (
        prompt[:-1],
        "offset_out_of_range" if r >= len(prompt) - 1 else None,
    ),
}


@pytest.mark.parametrize("case", PROMPT_EDITS)
def test_d_prompt_that_differs_from_p_is_answered_as_aggregated_serving_answers_it(stack, case):
    """The router sends D another prompt than P's: one token changed at R - 1 or at 0, P's
    prompt with a suffix, P's prompt minus its last token. Every answer equals aggregated
    serving's for D's prompt; a mismatch is refused and counted; the suffix is honoured (the
    tokens before R are P's), shown by D's own count of transferred tokens."""
    prompt = random_prompt(120, seed=50 + list(PROMPT_EDITS).index(case))
    params = stack.prefill_only(prompt)
    r = params["replay_offset"]
    assert 0 < r < len(prompt)
    d_prompt, refusal = PROMPT_EDITS[case](prompt, r)
    refused_before = event(stack.decode, f"refused:{refusal}") if refusal else 0
    loaded_before = metric(stack.decode, *EXTERNAL)
    got = stack.decode_with(d_prompt, params, MAX_TOKENS)
    assert check(stack.reference(d_prompt, MAX_TOKENS), got).ok
    deadline = time.monotonic() + 10
    if refusal:
        while event(stack.decode, f"refused:{refusal}") < refused_before + 1:
            assert time.monotonic() < deadline, f"refused:{refusal} not counted"
            time.sleep(0.2)
        assert metric(stack.decode, *EXTERNAL) == loaded_before
    else:
        while metric(stack.decode, *EXTERNAL) < loaded_before + r:
            assert time.monotonic() < deadline, "D did not load P's R tokens"
            time.sleep(0.2)


# (edit of P's params for D's prompt, what P's log says about the lease afterwards)
REFUSED = {
    "block_ids_tampered": (
        lambda p, prompt: (prompt, {**p, "remote_block_ids": [ids[::-1] for ids in p["remote_block_ids"]]}),
        "decode load failed: P refused the claim",
    ),
    "wrong_engine_id": (
        lambda p, prompt: (prompt, {**p, "remote_engine_id": "not-an-engine"}),
        "decode load failed: handshake failed",
    ),
    "prompt_mismatch": (
        lambda p, prompt: (random_prompt(len(prompt), seed=99), p),
        "refused (prompt_mismatch)",
    ),
    # D cannot tell a P it cannot reach: P's claim deadline frees the blocks.
    "unreachable_p_address": (
        lambda p, prompt: (prompt, {**p, "remote_port": free_port()}),
        "expired without the decode instance finishing its read",
    ),
}
EXPIRED = REFUSED["unreachable_p_address"][1]
PARAMS_EDITED = ("block_ids_tampered", "wrong_engine_id", "unreachable_p_address")


def test_every_refused_handoff_frees_p_within_seconds_not_at_the_lease_end(stack):
    """With lease_seconds 600 on P: tampered block ids, a wrong engine id and a prompt mismatch
    are released by D with the reason (P logs it), and an unreachable P address is freed at P's
    claim deadline; P's KV cache is empty again within 10 s of the last request."""
    assert stack.config.extra_config["lease_seconds"] == 600
    for case, (edit, _) in REFUSED.items():
        prompt = random_prompt(120, seed=30)
        d_prompt, params = edit(stack.prefill_only(prompt), prompt)
        got = stack.decode_with(d_prompt, params, MAX_TOKENS)
        assert check(stack.reference(d_prompt, MAX_TOKENS), got).ok, case
    left = cache_empty_within(stack, 10)
    assert not left, f"P's KV cache still in use 10 s after the refusals: {left}"
    log = stack.prefill.log_text()
    # Sealed: D refuses edited params without contacting P, whose claim deadline frees them.
    expected = {
        case: EXPIRED if sealed(stack) and case in PARAMS_EDITED else line for case, (_, line) in REFUSED.items()
    }
    missing = [case for case, line in expected.items() if line not in log]
    assert not missing, f"P's log does not say why for {missing}"


def choices(completion) -> list:
    """One Completion per choice of an n > 1 response, in index order."""
    raw = completion.raw
    ordered = sorted(raw["choices"], key=lambda c: c["index"])
    return [parse_completion({**raw, "choices": [c]}, completion.prompt_ids) for c in ordered]


def loaded_and_claims(stack) -> tuple[float, float, float, float]:
    """D's prompt tokens not computed (loaded from P, or a local prefix-cache hit of a sibling's
    loaded blocks on a model with prefix caching), its granted claims, those granted within
    1 s, and its claims refused or run out."""
    d = stack.decode
    return (
        metric(d, *EXTERNAL) + metric(d, "vllm:prompt_tokens_by_source", {"source": "local_cache_hit"}),
        metric(d, "vllm:pd_claim_seconds_count"),
        metric(d, "vllm:pd_claim_seconds_bucket", {"le": "1.0"}),
        event(d, "load_failed:claim"),
    )


def sampled(n: int) -> dict:
    """vLLM refuses n > 1 under greedy sampling; seeded sampling is reproducible (child i draws
    with seed + i, vllm/v1/engine/parallel_sampling.py), so choice i of P/D must be choice i of
    aggregated serving."""
    return {"n": n, "temperature": 1.0, "seed": 1234}


def test_n_samples_through_the_proxy_read_one_handoff_each_and_match_aggregated(stack):
    """n = 2: the proxy prefills once and tells P two decode requests will read it; both of D's
    children load it (no claim refused or waited on for more than 1 s), both choices are
    aggregated serving's, and P's cache is empty promptly."""
    prompt = random_prompt(150, seed=40)
    ref = choices(stack.reference(prompt, MAX_TOKENS, extra=sampled(2)))
    offered = event(stack.prefill, "handoff_offered")
    before = loaded_and_claims(stack)
    got = choices(stack.via_proxy(prompt, MAX_TOKENS, extra=sampled(2)))
    bad = [i for i, (r, c) in enumerate(zip(ref, got)) if not check(r, c).ok]
    assert len(got) == 2 and not bad, f"choices {bad} differ from aggregated"
    assert ref[0].token_ids != ref[1].token_ids, "the two samples should differ (seed + i)"
    assert not cache_empty_within(stack, 10, (stack.prefill, stack.decode))
    deadline = time.monotonic() + 10
    while True:
        after = loaded_and_claims(stack)
        delta = [a - b for a, b in zip(after, before)]
        if delta[0] >= 2 * 149 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta[0] == 2 * 149, f"D computed {2 * 150 - delta[0]} of both children's 300 prompt tokens, expected 2"
    assert delta[1] == delta[2] >= 1, f"claims {delta[1]}, of which within 1 s {delta[2]}"
    assert delta[3] == 0, "a child's claim was refused"
    assert event(stack.prefill, "handoff_offered") == offered + 1, "P prefilled once"


def test_concurrent_n3_batch_leaks_nothing(stack):
    prompts = [random_prompt(n, seed=41) for n in (40, 97, 160, 230)]
    refs = [choices(stack.reference(p, MAX_TOKENS, extra=sampled(3))) for p in prompts]
    expired = event(stack.prefill, "lease_expired")
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: choices(stack.via_proxy(p, MAX_TOKENS, extra=sampled(3))), prompts))
    bad = [
        f"n={len(p)} choice {i}: {v.describe()}"
        for p, ref, out in zip(prompts, refs, outs)
        for i, (r, c) in enumerate(zip(ref, out))
        if not (v := check(r, c)).ok
    ]
    assert not bad and all(len(o) == 3 for o in outs), "\n".join(bad)
    left = cache_empty_within(stack, 10, (stack.prefill, stack.decode))
    assert not left, f"KV cache still in use: {left}"
    assert event(stack.prefill, "lease_expired") == expired, "a lease waited for its deadline"
