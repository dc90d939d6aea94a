"""Load with faults on the hybrid stack: 200 requests at concurrency 16, random prompt lengths,
~10% of clients disconnecting mid-flight, a few tampered handoffs. Every completed answer must
equal aggregated serving, and both instances must return to an empty KV cache (no leaks)."""

import http.client
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest

from rig.cpu_matrix import random_prompt
from rig.oracle import compare

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 200
CONCURRENCY = 16
MAX_TOKENS = 6


def _disconnecting_client(url: str, prompt: list[int], after_s: float) -> None:
    """Send a completion and hang up after ``after_s`` (the proxy must abort P/D's work)."""
    parsed = urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=after_s)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        conn.getresponse().read()
    except (TimeoutError, OSError):
        pass
    finally:
        conn.close()


def _wait_for_empty_kv_cache(servers, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        usage = {s.log_path.stem: s.metric("vllm:kv_cache_usage_perc") for s in servers}
        if all(v == 0 for v in usage.values()) or time.monotonic() > deadline:
            return usage
        time.sleep(1)


def test_load_with_aborts_and_tampering_matches_aggregated_without_leaks(stack):
    if stack.kind != "nemotron_h":
        pytest.skip("one hybrid carries the load test")
    rng = random.Random(42)
    jobs = []
    for i in range(NUM_REQUESTS):
        n = rng.randrange(1, 400)
        roll = rng.random()
        kind = "abort" if roll < 0.10 else "tamper" if roll < 0.13 else "normal"
        jobs.append((i, kind, random_prompt(n, seed=100 + i)))
    refs = {i: stack.reference(p, MAX_TOKENS) for i, kind, p in jobs if kind != "abort"}

    def run(job):
        i, kind, prompt = job
        if kind == "abort":
            _disconnecting_client(stack.proxy_url, prompt, after_s=rng.uniform(0.05, 1.0))
            return i, None
        if kind == "tamper":
            params = stack.prefill_only(prompt)
            if params.get("remote_block_ids"):
                params["remote_block_ids"] = [[b + 1 for b in g] for g in params["remote_block_ids"]]
            return i, stack.decode_with(prompt, params, MAX_TOKENS)
        return i, stack.via_proxy(prompt, MAX_TOKENS)

    t0 = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(run, jobs))
    elapsed = time.monotonic() - t0
    bad = []
    for i, got in results:
        if got is None:
            continue
        verdict = compare(refs[i], got, tie_margin=1e-5, logprob_tol=1e-4)
        if not verdict.ok:
            bad.append(f"request {i} (n={len(got.prompt_ids)}): {verdict.describe()}")
    completed = sum(got is not None for _, got in results)
    print(f"\nload: {completed} answers + {NUM_REQUESTS - completed} aborted in {elapsed:.1f} s")
    assert not bad, "\n".join(bad)
    # Aborted handoffs are freed by D's release, D's READ completion or, at worst, P's 30 s lease.
    usage = _wait_for_empty_kv_cache([stack.prefill, stack.decode], timeout_s=90)
    assert all(v == 0 for v in usage.values()), f"leaked KV blocks: {usage}"
