"""P/D through PDConnector against aggregated serving on real vLLM CPU servers (float32).

The oracle is a separate aggregated server with the same model and flags. Every handoff
comparison has a negative control showing the oracle would notice a one-token desync.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pd_connector.core.fingerprint import fingerprint
from pd_connector.core.protocol import PROTOCOL_VERSION
from rig.cpu_matrix import ATTENTION_BLOCK, E2E_SECRET, HYBRIDS, boundary_lengths, random_prompt
from rig.faults import CORRUPT_STATE, RESUME_SHIFT, SKIP_PROMPT_CHECK
from rig.oracle import compare

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12
# float32 on CPU: P/D vs aggregated logprobs differ by ~5e-7 (docs/testing.md); a desync moves
# them by 1e-2 or more. A differing token is a tie only below this reference margin.
TIE_MARGIN = 1e-5
LOGPROB_TOL = 1e-4


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=TIE_MARGIN, logprob_tol=LOGPROB_TOL)


def recompute_histogram(server) -> tuple[float, float, float]:
    """D's vllm:pd_recompute_tokens histogram: (count, sum, observations <= 1 token)."""
    name = "vllm:pd_recompute_tokens"
    return (
        server.metric(f"{name}_count") or 0.0,
        server.metric(f"{name}_sum") or 0.0,
        server.metric(f"{name}_bucket", {"le": "1.0"}) or 0.0,
    )


def test_pd_matches_aggregated_at_block_boundaries(stack):
    failures = []
    lengths = boundary_lengths(ATTENTION_BLOCK[stack.kind])
    before = recompute_histogram(stack.decode)
    for n in lengths:
        prompt = random_prompt(n, seed=1)
        ref = stack.reference(prompt, MAX_TOKENS)
        params, got = stack.handoff(prompt, MAX_TOKENS)
        r = params["replay_offset"]
        assert r == max(0, n - 1), f"n={n}: P chose {r}"
        assert params["pd_protocol_version"] == PROTOCOL_VERSION and params["remote_num_tokens"] == r
        verdict = check(ref, got)
        if not verdict.ok:
            failures.append(f"n={n} R={r}: {verdict.describe()}")
    assert not failures, "\n".join(failures)
    # D recomputed exactly N - R = 1 token for every handoff (n = 1 hands over nothing): as
    # many observations as handoffs, each in the <= 1 bucket, summing to one per handoff.
    # vLLM publishes scheduler stats with the step's outputs; poll briefly for the last ones.
    handoffs = sum(1 for n in lengths if n > 1)
    expected = (handoffs, handoffs, handoffs)
    deadline = time.monotonic() + 10
    while True:
        after = recompute_histogram(stack.decode)
        delta = tuple(a - b for a, b in zip(after, before))
        if delta == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert delta == expected, f"(count, sum, <=1 bucket) moved by {delta}, expected {expected}"


def test_concurrent_batch_through_proxy_matches_aggregated(stack):
    prompts = [random_prompt(n, seed=2) for n in (3, 31, 32, 33, 64, 97, 150, 250)]
    refs = [stack.reference(p, MAX_TOKENS) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: stack.via_proxy(p, MAX_TOKENS), prompts))
    bad = [f"n={len(p)}: {v.describe()}" for p, r, o in zip(prompts, refs, outs) if not (v := check(r, o)).ok]
    assert not bad, "\n".join(bad)


def test_desynced_offset_is_caught_by_the_oracle(stack):
    """Negative control: D resumes one token early on a state P computed for R (a phantom
    token, what vLLM does when P and D derive different backoffs). Editing the params cannot do
    this any more (P refuses the claim), so D's connector (rig/fault_connector.py) forces it;
    the comparison must fail."""
    if stack.kind not in HYBRIDS:
        pytest.skip("attention-only models recompute a token's KV identically: no desync")
    caught = 0
    lengths = (33, 64, 100, 129, 200)
    for n in lengths:
        prompt = random_prompt(n, seed=3)
        ref = stack.reference(prompt, MAX_TOKENS)
        params = {**stack.prefill_only(prompt), RESUME_SHIFT: -1}
        caught += not check(ref, stack.decode_with(prompt, params, MAX_TOKENS)).ok
    assert caught >= len(lengths) - 1, f"only {caught}/{len(lengths)} desyncs detected"


def test_corrupted_recurrent_state_is_detected_by_the_digest(stack):
    """With verify_state_digest on, a state page corrupted after the READ (the rig's fault
    connector on D) fails the digest check and D recomputes: aggregated output, counted."""
    if "verify_state_digest" not in stack.config.extra_config:
        pytest.skip("the digest runs on the hybrid stack configured with it")
    prompt = random_prompt(90, seed=10)
    ref = stack.reference(prompt, MAX_TOKENS)
    before = stack.decode.log_text().count("differs from P's digest")
    params = {**stack.prefill_only(prompt), CORRUPT_STATE: True}
    assert check(ref, stack.decode_with(prompt, params, MAX_TOKENS)).ok
    assert stack.decode.log_text().count("differs from P's digest") == before + 1


def test_params_of_another_prompt_are_caught_by_the_oracle(stack):
    """Negative control for every model: D loads KV/state of a different prompt of the same
    length (D's prompt fingerprint check skipped by the rig's fault connector, as before the
    check existed)."""
    caught = 0
    lengths = (33, 64, 100, 129, 200)
    for n in lengths:
        a, b = random_prompt(n, seed=4), random_prompt(n, seed=5)
        ref = stack.reference(a, MAX_TOKENS)
        params = {**stack.prefill_only(b), SKIP_PROMPT_CHECK: True}
        caught += not check(ref, stack.decode_with(a, params, MAX_TOKENS)).ok
    assert caught >= len(lengths) - 1, f"only {caught}/{len(lengths)} swaps detected"


def test_params_of_another_prompt_are_refused_as_prompt_mismatch(stack):
    """Swaps like the negative control's, without the switch: D's fingerprint of its own prompt
    differs from P's, the handoff is refused and recomputed: aggregated output every time, each
    refusal counted and logged with both lengths. Other prompts than the negative control's: the
    state it loaded for those sits in the llama D's prefix cache under their tokens."""
    lengths = (33, 64, 100, 129, 200)
    before = stack.decode.metric("vllm:pd_events_total", {"event": "refused:prompt_mismatch"}) or 0
    for n in lengths:
        a, b = random_prompt(n, seed=14), random_prompt(n, seed=15)
        got = stack.decode_with(a, stack.prefill_only(b), MAX_TOKENS)
        assert check(stack.reference(a, MAX_TOKENS), got).ok, f"n={n}"
    log = stack.decode.log_text()
    assert f"the first {lengths[-1] - 1} tokens of this {lengths[-1]}-token prompt" in log
    deadline = time.monotonic() + 10
    while (stack.decode.metric("vllm:pd_events_total", {"event": "refused:prompt_mismatch"}) or 0) < before + len(lengths):
        assert time.monotonic() < deadline, "refusals not counted"
        time.sleep(0.2)


def _dead_port():
    from rig.ports import free_port

    return free_port()


# (edit of P's params, the line D logs when it refuses or fails the handoff)
TAMPERED = {
    "offset_at_prompt_length": (lambda p, n: {**p, "replay_offset": n, "remote_num_tokens": n}, "refusing the handoff (offset_out_of_range)"),
    "offset_edited_alone": (lambda p, n: {**p, "replay_offset": p["replay_offset"] - 1}, "refusing the handoff (inconsistent_params)"),
    # The fingerprint covers the offset: D's own check sees the shorter prefix.
    "offset_edited_consistently": (
        lambda p, n: {**p, "replay_offset": p["replay_offset"] - 1, "remote_num_tokens": p["replay_offset"] - 1},
        "refusing the handoff (prompt_mismatch)",
    ),
    # ... and with the fingerprint recomputed for it too, P's claim check (offset and
    # fingerprint against the lease).
    "offset_and_fingerprint_edited_consistently": (
        lambda p, n: {
            **p,
            "replay_offset": p["replay_offset"] - 1,
            "remote_num_tokens": p["replay_offset"] - 1,
            "pd_prompt_fingerprint": fingerprint(random_prompt(n, seed=6), p["replay_offset"] - 1),
        },
        "P refused the claim",
    ),
    "block_ids_swapped": (
        lambda p, n: {**p, "remote_block_ids": [ids[::-1] for ids in p["remote_block_ids"]]},
        "P refused the claim",
    ),
    "unknown_request_id": (lambda p, n: {**p, "remote_request_id": "not-a-request"}, "P refused the claim"),
    "unknown_engine_id": (lambda p, n: {**p, "remote_engine_id": "not-an-engine"}, "handshake failed"),
    "prompt_fingerprint_edited": (lambda p, n: {**p, "pd_prompt_fingerprint": "2:" + "0" * 32}, "refusing the handoff (prompt_mismatch)"),
    # Connected already (earlier requests), so the claim is what times out. Counted on the
    # failed-load line alone: a lease extension to the dead port logs "no answer" too.
    "unreachable_side_channel": (lambda p, n: {**p, "remote_port": _dead_port()}, "failed (no answer from 127.0.0.1"),
    "other_protocol_version": (lambda p, n: {**p, "pd_protocol_version": 99}, "refusing the handoff (version_mismatch)"),
    "nixl_style_no_offset": (lambda p, n: {k: v for k, v in p.items() if k != "replay_offset"}, "refusing the handoff (missing_offset)"),
    "string_offset": (lambda p, n: {**p, "replay_offset": "7"}, "refusing the handoff (malformed)"),
}


# Edits refused before the seal is checked: the params do not decode as a handoff at all.
UNSEALABLE = ("other_protocol_version", "nixl_style_no_offset", "string_offset")


def sealed(stack) -> bool:
    return stack.kind in E2E_SECRET


@pytest.mark.parametrize("tamper", sorted(TAMPERED))
def test_tampered_params_are_refused_and_output_still_matches(stack, tamper):
    """Each edit is refused (by D's validation, P's claim check or the handshake) and the
    request is recomputed locally: aggregated output, never an error, never wrong text."""
    edit, logged = TAMPERED[tamper]
    if sealed(stack) and tamper not in UNSEALABLE:
        # P seals its handoffs (a shared secret): D refuses any edited field by the seal, before
        # contacting P (docs/security.md); the checks above remain the defence without a secret.
        logged = "refusing the handoff (unauthenticated)"
    n = 70
    prompt = random_prompt(n, seed=6)
    ref = stack.reference(prompt, MAX_TOKENS)
    before = stack.decode.log_text().count(logged)
    got = stack.decode_with(prompt, edit(stack.prefill_only(prompt), n), MAX_TOKENS)
    assert check(ref, got).ok, "a refused handoff must still give aggregated output"
    assert stack.decode.log_text().count(logged) == before + 1

def _post(url, body, stream=False):
    import json
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    if not stream:
        return json.loads(raw)
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-500:]
    return [json.loads(e) for e in events[:-1]]


def test_chat_and_streaming_through_the_proxy_match_aggregated(stack):
    if stack.kind != "llama":
        pytest.skip("the proxy's routes are model-independent: checked once")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 6}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = _post(stack.baseline.base_url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    got = _post(stack.proxy_url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert got == ref
    chunks = _post(stack.proxy_url + "/v1/chat/completions", {**body, "stream": True}, stream=True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ref
    prompt = random_prompt(90, seed=7)
    completion = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    ref_text = _post(stack.baseline.base_url + "/v1/completions", completion)["choices"][0]["text"]
    chunks = _post(stack.proxy_url + "/v1/completions", {**completion, "stream": True}, stream=True)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref_text


def test_metrics_are_exported_next_to_vllms(stack):
    """Runs after the handoffs above: the vllm:pd_* series on both servers' /metrics moved."""
    n = 50
    prompt = random_prompt(n, seed=8)
    stack.handoff(prompt, 2)
    d, p = stack.decode, stack.prefill
    assert d.metric("vllm:pd_transfer_seconds_count") >= 1
    assert d.metric("vllm:pd_claim_seconds_count") >= 1 and d.metric("vllm:pd_read_seconds_count") >= 1
    assert d.metric("vllm:pd_transfer_bytes_sum") > 0
    assert d.metric("vllm:pd_descriptors_count") >= 1
    assert d.metric("vllm:pd_recompute_tokens_count") >= 1
    assert d.metric("vllm:pd_handshake_seconds_count") >= 1
    assert d.metric("vllm:pd_events_total", {"event": "handoff_accepted"}) >= 1
    assert d.metric("vllm:pd_events_total", {"event": "refused:missing_offset"}) >= 1
    assert p.metric("vllm:pd_events_total", {"event": "handoff_offered"}) >= 1
    if sealed(stack):  # edited params never reached P: the seal refused them on D
        assert d.metric("vllm:pd_events_total", {"event": "refused:unauthenticated"}) >= 1
    else:
        assert d.metric("vllm:pd_events_total", {"event": "load_failed:claim"}) >= 1
        assert p.metric("vllm:pd_events_total", {"event": "claim_refused:mismatch"}) >= 1


def test_no_blocks_leak_after_handoffs(stack):
    """Runs after the tests above for each model: every lease was ended by D's notification or
    release (refusals included), so both instances are back to an empty KV cache."""
    import time

    deadline = time.monotonic() + 60
    usage = {}
    while time.monotonic() < deadline:
        usage = {s: s.metric("vllm:kv_cache_usage_perc") for s in (stack.prefill, stack.decode)}
        if all(v == 0 for v in usage.values()):
            return
        time.sleep(1)
    raise AssertionError(f"KV cache not released: {usage}")
