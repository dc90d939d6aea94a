"""vllm-router (PyPI, ``--vllm-pd-disaggregation``), the production router, in front of two P and
two D PDConnector instances: completions and chat, streamed and not, equal to aggregated serving,
and every P and every D took part in real handoffs (D's ``external_kv_transfer`` prompt tokens);
the same through the official OpenAI Python client, as applications call it.

vllm-router knows nothing of pd_connector: it sends P NixlConnector's prefill request and
forwards the ``kv_transfer_params`` P returns to D untouched. Installed in its own venv by
``scripts/setup_router_venv.sh`` (``make venv`` / ``scripts/setup_venv.sh`` run it).

The baseline, P1 and D1 are the session's llama stack, so its earlier tests' prompts may sit in
their prefix caches: the prompts here are drawn with seeds no other test uses (a D whose own
prefix cache holds a prompt's first R tokens loads nothing from P: scheduler.py,
get_num_new_matched_tokens). The chat prompt is test_pd_vs_aggregated's: D1 meets it cached as
it did before on the chat test's second round.
"""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

import pytest

from rig.cpu_matrix import CPU_MODELS, E2E_EXTRA_CONFIG, random_prompt
from rig.oracle import compare, complete, parse_completion
from rig.placement import cpu_binds
from rig.ports import free_port
from rig.servers import VllmServer, source_checkout_env, start_many
from rig.stack import kv_transfer_config
from rig.tiny_models import build_model
from rig.openai_client import (
    chat_choices,
    completion_choices,
    openai_client,
    streamed_chat_choices,
    streamed_completion_choices,
)
from rig.router import VllmRouter, router_binary

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed: run scripts/setup_router_venv.sh"),
    pytest.mark.parametrize("stack", ["llama"], indirect=True),
]

MAX_TOKENS = 12


def check(reference, candidate):
    return compare(reference, candidate, tie_margin=1e-5, logprob_tol=1e-4)


@pytest.fixture(scope="module")
def pools(stack, models_root, artifacts):
    """The session's llama stack (conftest.py: its aggregated baseline, P1 and D1, the same
    configuration this module needs) plus P2 and D2 started here, and vllm-router over the P and
    D pools, round robin."""
    model = build_model("llama", models_root)
    log_dir = artifacts / "vllm_router"
    # Next to the stack's three: the bindings a group of all five would give the last two.
    binds = iter(cpu_binds(5)[len(stack.servers):])
    settings = E2E_EXTRA_CONFIG["llama"]

    def server(name: str, role: str) -> VllmServer:
        bind, bind_env = next(binds)
        kv = ["--kv-transfer-config", kv_transfer_config(role, free_port(), "cpu", **settings)]
        return VllmServer(model, extra_args=[*CPU_MODELS["llama"], *kv], env={**source_checkout_env(), **bind_env},
                          omp_threads_bind=bind, log_path=log_dir / f"{name}.log")

    started = [server("prefill2", "kv_producer"), server("decode2", "kv_consumer")]
    start_many(started, timeout=900)
    prefills, decodes = [stack.prefill, started[0]], [stack.decode, started[1]]
    try:
        with VllmRouter([p.base_url for p in prefills], [d.base_url for d in decodes],
                        log_path=log_dir / "vllm-router.log") as router:
            yield SimpleNamespace(baseline=stack.baseline, prefills=prefills, decodes=decodes, router=router)
    finally:
        for s in started:
            s.stop()


def event(server, name: str) -> float:
    return server.metric("vllm:pd_events_total", {"event": name}) or 0.0


def external_tokens(server) -> float:
    return server.metric("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"}) or 0.0


def counters(pools) -> dict:
    return {
        "offered": [event(p, "handoff_offered") for p in pools.prefills],
        "accepted": [event(d, "handoff_accepted") for d in pools.decodes],
        "external": [external_tokens(d) for d in pools.decodes],
    }


def wait_for_handoffs(pools, before: dict, per_instance: int, timeout: float = 15.0) -> dict:
    """Every P offered and every D accepted at least ``per_instance`` more handoffs, and every D
    counted prompt tokens from P (vLLM publishes a step's stats a little later: poll)."""
    deadline = time.monotonic() + timeout
    while True:
        now = counters(pools)
        moved = {k: [a - b for a, b in zip(now[k], before[k])] for k in now}
        done = (min(moved["offered"]) >= per_instance and min(moved["accepted"]) >= per_instance
                and min(moved["external"]) > 0)
        if done or time.monotonic() > deadline:
            return moved
        time.sleep(0.3)


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        raw = resp.read().decode()
    if not stream:
        return json.loads(raw)
    events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-500:]
    return [json.loads(e) for e in events[:-1]]


def test_completions_through_vllm_router_match_aggregated(pools):
    """Token-id prompts on and around block boundaries, non-streamed with logprobs (the
    margin-aware oracle) and streamed (text); round robin sends each pool's instances in turn."""
    before = counters(pools)
    router = pools.router.url
    failures = []
    lengths = (31, 33, 64, 97, 150, 250)
    for n in lengths:
        prompt = random_prompt(n, seed=43)
        ref = complete(pools.baseline.base_url, "tiny", prompt, MAX_TOKENS)
        verdict = check(ref, complete(router, "tiny", prompt, MAX_TOKENS))
        if not verdict.ok:
            failures.append(f"n={n}: {verdict.describe()}")
    for n in (45, 130):
        prompt = random_prompt(n, seed=44)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        ref = post(pools.baseline.base_url + "/v1/completions", body)["choices"][0]["text"]
        chunks = post(router + "/v1/completions", {**body, "stream": True}, stream=True)
        got = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        if got != ref:
            failures.append(f"streamed n={n}: {got!r} != {ref!r}")
    assert not failures, "\n".join(failures)
    moved = wait_for_handoffs(pools, before, per_instance=len(lengths) // 2)
    assert min(moved["offered"]) >= len(lengths) // 2 and min(moved["accepted"]) >= len(lengths) // 2, moved
    assert min(moved["external"]) > 0, f"a decode instance loaded nothing from P: {moved}"


def test_chat_through_vllm_router_matches_aggregated(pools):
    before = counters(pools)
    router = pools.router.url
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 6}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    ref = post(pools.baseline.base_url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    for _ in range(2):  # round robin: both P and both D
        assert post(router + "/v1/chat/completions", body)["choices"][0]["message"]["content"] == ref
        chunks = post(router + "/v1/chat/completions", {**body, "stream": True}, stream=True)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ref
    moved = wait_for_handoffs(pools, before, per_instance=2)
    assert min(moved["accepted"]) >= 2 and min(moved["external"]) > 0, moved


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_openai_client_through_vllm_router_matches_aggregated(pools, stream):
    """The official OpenAI Python client, as applications call vLLM: a completion (token ids,
    top-5 logprobs) and a chat answer through vllm-router, twice each (round robin: both P and
    both D), each the aggregated baseline's through the same client. Prompts of their own per
    case (seeds 48 and 49, chat texts no other test sends), so every D loads them from P."""
    before = counters(pools)
    seed = 49 if stream else 48
    prompt = random_prompt(70, seed=seed)
    messages = [{"role": "user", "content": f"case {seed}: ask the router, then the decoder " * 5}]
    extra = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    router, agg = openai_client(pools.router.url), openai_client(pools.baseline.base_url)
    failures = []
    try:
        def completion(c):
            answer = c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=5, stream=stream, extra_body=extra)
            return (streamed_completion_choices(answer)[0] if stream else completion_choices(answer))[0]

        def chat(c):
            answer = c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=stream, extra_body={"ignore_eos": True})
            return (streamed_chat_choices(answer)[0] if stream else chat_choices(answer))[0]

        ref, ref_chat = completion(agg), chat(agg)
        assert ref["finish_reason"] == ref_chat["finish_reason"] == "length"
        for round_ in range(2):
            got = completion(router)
            verdict = check(parse_completion({"choices": [ref]}), parse_completion({"choices": [got]}))
            if not verdict.ok or (verdict.identical and got["text"] != ref["text"]):
                failures.append(f"completion, round {round_}: {verdict.describe()}: {got['text']!r} vs {ref['text']!r}")
            got_chat = chat(router)
            if (got_chat["content"], got_chat["finish_reason"]) != (ref_chat["content"], "length"):
                failures.append(f"chat, round {round_}: {got_chat!r} != {ref_chat!r}")
    finally:
        router.close()
        agg.close()
    assert not failures, "\n".join(failures)
    moved = wait_for_handoffs(pools, before, per_instance=2)
    assert min(moved["accepted"]) >= 2 and min(moved["external"]) > 0, moved


def test_no_blocks_held_after_the_router_tests(pools):
    """Every lease ended (D's completion notification), so every P and D is back to an empty
    KV cache."""
    deadline = time.monotonic() + 60
    usage = {}
    while time.monotonic() < deadline:
        usage = {s.log_path.stem: s.metric("vllm:kv_cache_usage_perc") for s in (*pools.prefills, *pools.decodes)}
        if all(v == 0 for v in usage.values()):
            return
        time.sleep(1)
    raise AssertionError(f"KV cache not released: {usage}")
