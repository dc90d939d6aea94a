"""P/D through PDConnector against aggregated serving on real vLLM CPU servers (float32).

The oracle is a separate aggregated server with the same model and flags. Every handoff
comparison has a negative control showing the oracle would notice a one-token desync.
"""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from pd_connector.testing.cpu_matrix import ATTENTION_BLOCK, HYBRIDS, boundary_lengths, random_prompt
from pd_connector.testing.oracle import compare

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# float32 on CPU: P/D vs aggregated logprobs differ by ~5e-7 (cpu-recipes 10.5); a desync moves
# them by 1e-2 or more. A differing token is a tie only below this reference margin.
TIE_MARGIN = 1e-5
LOGPROB_TOL = 1e-4


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=TIE_MARGIN, logprob_tol=LOGPROB_TOL)


def test_pd_matches_aggregated_at_block_boundaries(stack):
    failures = []
    lengths = boundary_lengths(ATTENTION_BLOCK[stack.kind])
    for n in lengths:
        prompt = random_prompt(n, seed=1)
        ref = stack.reference(prompt, MAX_TOKENS)
        params, got = stack.handoff(prompt, MAX_TOKENS)
        r = params["replay_offset"]
        assert r == max(0, n - 1), f"n={n}: P chose {r}"
        assert params["pd_protocol_version"] == 1 and params["remote_num_tokens"] == r
        verdict = check(ref, got)
        if not verdict.ok:
            failures.append(f"n={n} R={r}: {verdict.describe()}")
    assert not failures, "\n".join(failures)
    # D recomputed exactly N - R tokens for every handoff (its log line says so).
    log = stack.decode.log_text()
    for n in lengths:
        if n > 1:
            assert re.search(rf"replay_offset={n - 1}, recomputing 1 token\(s\)", log), n


def test_concurrent_batch_through_proxy_matches_aggregated(stack):
    prompts = [random_prompt(n, seed=2) for n in (3, 31, 32, 33, 64, 97, 150, 250)]
    refs = [stack.reference(p, MAX_TOKENS) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: stack.via_proxy(p, MAX_TOKENS), prompts))
    bad = [f"n={len(p)}: {v.describe()}" for p, r, o in zip(prompts, refs, outs) if not (v := check(r, o)).ok]
    assert not bad, "\n".join(bad)


def test_desynced_offset_is_caught_by_the_oracle(stack):
    """Negative control: D resumes one token early on a state P computed for R (a phantom
    token, what vLLM does when P and D derive different backoffs). Params stay self-consistent
    so D accepts them; the comparison must fail."""
    if stack.kind not in HYBRIDS:
        pytest.skip("attention-only models recompute a token's KV identically: no desync")
    caught = 0
    lengths = (33, 64, 100, 129, 200)
    for n in lengths:
        prompt = random_prompt(n, seed=3)
        ref = stack.reference(prompt, MAX_TOKENS)
        params = stack.prefill_only(prompt)
        params["replay_offset"] -= 1
        params["remote_num_tokens"] -= 1
        caught += not check(ref, stack.decode_with(prompt, params, MAX_TOKENS)).ok
    assert caught >= len(lengths) - 1, f"only {caught}/{len(lengths)} desyncs detected"


def test_params_of_another_prompt_are_caught_by_the_oracle(stack):
    """Negative control for every model: D loads KV/state of a different prompt of the same
    length."""
    caught = 0
    lengths = (33, 64, 100, 129, 200)
    for n in lengths:
        a, b = random_prompt(n, seed=4), random_prompt(n, seed=5)
        ref = stack.reference(a, MAX_TOKENS)
        caught += not check(ref, stack.decode_with(a, stack.prefill_only(b), MAX_TOKENS)).ok
    assert caught >= len(lengths) - 1, f"only {caught}/{len(lengths)} swaps detected"


@pytest.mark.parametrize(
    "tamper, kind",
    [
        (lambda p, n: {**p, "replay_offset": n, "remote_num_tokens": n}, "offset_out_of_range"),
        (lambda p, n: {**p, "replay_offset": p["replay_offset"] - 1}, "inconsistent_params"),
        (lambda p, n: {**p, "pd_protocol_version": 99}, "version_mismatch"),
        (lambda p, n: {k: v for k, v in p.items() if k != "replay_offset"}, "missing_offset"),
        (lambda p, n: {**p, "replay_offset": "7"}, "malformed"),
    ],
    ids=["offset_at_n", "offset_edited", "version", "nixl_style_no_offset", "string_offset"],
)
def test_tampered_params_are_refused_and_output_still_matches(stack, tamper, kind):
    n = 70
    prompt = random_prompt(n, seed=6)
    ref = stack.reference(prompt, MAX_TOKENS)
    before = stack.decode.log_text().count(f"refusing the handoff ({kind})")
    got = stack.decode_with(prompt, tamper(stack.prefill_only(prompt), n), MAX_TOKENS)
    assert check(ref, got).ok, "a refused handoff must still give aggregated output"
    assert stack.decode.log_text().count(f"refusing the handoff ({kind})") == before + 1
