"""``pd-connector proxy`` driven by the official OpenAI Python client, as applications call vLLM:
completions and chat, streamed and not, n > 1 and logprobs, each answer the aggregated
baseline's for the same request through the same client; and the errors the client raises:
vLLM's 404 and 400 relayed (``openai.NotFoundError``, ``openai.BadRequestError``, vLLM's own
message) and a dead D as an OpenAI-shaped 5xx (or, once P's first token is streamed, an error
event the client raises as ``openai.APIError``), never a hang or a connection error.

Client behaviour does not depend on the model: only the session's llama stack (conftest.py), no
server of its own but a second proxy in front of P and a dead D. Prompts use seeds no other
module draws; ``ignore_eos`` so every answer runs to ``max_tokens``. The same checks through
vllm-router live in test_vllm_router.py (its module fixture adds a P and a D).
"""

from __future__ import annotations


import openai
import pytest

from rig.cpu_matrix import random_prompt
from rig.oracle import compare, parse_completion
from rig.ports import free_port
from rig.proxy_process import ProxyProcess
from rig.kv_cache import kv_cache_empty_within
from rig.openai_client import (
    chat_choices,
    chat_mismatch,
    completion_choices,
    openai_client,
    streamed_chat_choices,
    streamed_completion_choices,
)

pytestmark = [
    pytest.mark.e2e,
    # Model-independent: checked once, on the llama stack (no other kind's servers started).
    pytest.mark.parametrize("stack", ["llama"], indirect=True),
]

MAX_TOKENS = 12
# vLLM refuses n > 1 under greedy sampling; seeded sampling is reproducible (child i draws with
# seed + i), so choice i through the proxy must be the baseline's choice i (test_lifecycle.py).
SAMPLED = {"n": 2, "temperature": 1.0, "seed": 1234}
GREEDY = {"temperature": 0.0}
# Full-length answers, token ids to compare, logprob keys as token ids (the oracle's form).
COMPLETION_EXTRA = {"ignore_eos": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
# Chat: no return_tokens_as_token_ids (with logprobs it sends the proxy's chat to the standard
# flow; zero replay is the path to drive).
CHAT_EXTRA = {"ignore_eos": True, "return_token_ids": True}
CHAT_MESSAGES = [{"role": "user", "content": "a stitch in time saves nine, or so they say " * 5}]


def check(ref: dict, got: dict):
    """The margin-aware oracle over one /v1/completions choice (a near-tie may flip a token)."""
    return compare(parse_completion({"choices": [ref]}), parse_completion({"choices": [got]}),
                   tie_margin=1e-5, logprob_tol=1e-4)


@pytest.fixture(scope="module")
def clients(stack):
    pd, agg = openai_client(stack.proxy_url), openai_client(stack.baseline.base_url)
    yield pd, agg, stack.config.served_model_name
    pd.close()
    agg.close()


def assert_full_length(choices: dict[int, dict], n: int) -> None:
    assert sorted(choices) == list(range(n)), choices
    for i, c in choices.items():
        assert c["finish_reason"] == "length" and len(c["token_ids"]) == MAX_TOKENS, (i, c)


# ---- answers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("sampling", ["greedy", "n2"])
def test_completions_match_aggregated(clients, stream, sampling):
    """Token-id prompts on both sides of a block boundary, top-5 logprobs; greedy (zero replay)
    and n = 2 seeded samples (the standard flow, one prefill read by both children)."""
    pd, agg, model = clients
    n, params = (1, GREEDY) if sampling == "greedy" else (2, SAMPLED)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    failures = []
    for length in (33, 97):
        prompt = random_prompt(length, seed=46)
        answers = []
        for c in (agg, pd):
            answer = c.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          logprobs=5, stream=stream, extra_body=COMPLETION_EXTRA,
                                          **params, **extra)
            answers.append(streamed_completion_choices(answer) if stream
                           else (completion_choices(answer), answer.usage.model_dump()))
        (ref, ref_usage), (got, usage) = answers
        assert_full_length(ref, n)
        assert_full_length(got, n)
        assert usage == ref_usage, f"length {length}: usage {usage} != {ref_usage}"
        for i in range(n):
            verdict = check(ref[i], got[i])
            if not verdict.ok:
                failures.append(f"length {length} choice {i}: {verdict.describe()}")
            elif verdict.identical and got[i]["text"] != ref[i]["text"]:
                failures.append(f"length {length} choice {i}: text {got[i]['text']!r} != {ref[i]['text']!r}")
        if n > 1:
            assert ref[0]["token_ids"] != ref[1]["token_ids"], "the two samples should differ (seed + i)"
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("sampling", ["greedy", "n2"])
def test_chat_matches_aggregated(clients, stream, sampling):
    """Chat with logprobs (top 2): same tokens, text, finish reason and logprobs as the baseline."""
    pd, agg, model = clients
    n, params = (1, GREEDY) if sampling == "greedy" else (2, SAMPLED)
    extra = {"stream_options": {"include_usage": True}} if stream else {}
    answers = []
    for c in (agg, pd):
        answer = c.chat.completions.create(model=model, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS,
                                           logprobs=True, top_logprobs=2, stream=stream,
                                           extra_body=CHAT_EXTRA, **params, **extra)
        answers.append(streamed_chat_choices(answer) if stream
                       else (chat_choices(answer), answer.usage.model_dump()))
    (ref, ref_usage), (got, usage) = answers
    assert_full_length(ref, n)
    assert_full_length(got, n)
    assert usage == ref_usage, f"usage {usage} != {ref_usage}"
    bad = {i: why for i in range(n) if (why := chat_mismatch(ref[i], got[i]))}
    assert not bad, bad
    if n > 1:
        assert ref[0]["token_ids"] != ref[1]["token_ids"], "the two samples should differ (seed + i)"


# ---- errors -------------------------------------------------------------------------------------

def _raised(call, expected: type[openai.APIStatusError]) -> openai.APIStatusError:
    with pytest.raises(expected) as info:
        call()
    return info.value


def _request(c: openai.OpenAI, route: str, model: str, stream: bool, **kw):
    prompt = {"prompt": random_prompt(40, seed=47)} if route == "completions" else {"messages": CHAT_MESSAGES}
    create = c.completions.create if route == "completions" else c.chat.completions.create
    return lambda: create(model=model, stream=stream, extra_body={"ignore_eos": True},
                          **{"max_tokens": MAX_TOKENS, "temperature": 0.0, **prompt, **kw})


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_unknown_model_is_not_found(clients, route, stream):
    """P's 404 reaches the client as vLLM wrote it: ``openai.NotFoundError``, vLLM's message."""
    pd, agg, _ = clients
    ref = _raised(_request(agg, route, "no-such-model", stream), openai.NotFoundError)
    err = _raised(_request(pd, route, "no-such-model", stream), openai.NotFoundError)
    assert err.status_code == ref.status_code == 404
    assert err.body == ref.body and "no-such-model" in err.body["message"], (err.body, ref.body)


@pytest.mark.parametrize(("route", "stream", "bad"), [
    pytest.param("completions", False, {"max_tokens": -1}, id="completions-max_tokens-plain"),
    pytest.param("completions", True, {"max_tokens": -1}, id="completions-max_tokens-streamed"),
    pytest.param("completions", False, {"temperature": -5.0}, id="completions-temperature-plain"),
    pytest.param("chat", False, {"max_tokens": -1}, id="chat-max_tokens-plain"),
    pytest.param("chat", True, {"temperature": -5.0}, id="chat-temperature-streamed"),
])
def test_bad_parameters_are_bad_requests(clients, stack, route, stream, bad):
    """vLLM's 400 reaches the client as vLLM wrote it: ``openai.BadRequestError``. A negative
    temperature is P's refusal; max_tokens = -1 is D's (P is asked for one token), after P
    prefilled for it: the handoff D never claims is freed at P's claim deadline."""
    pd, agg, model = clients
    ref = _raised(_request(agg, route, model, stream, **bad), openai.BadRequestError)
    err = _raised(_request(pd, route, model, stream, **bad), openai.BadRequestError)
    assert err.status_code == ref.status_code == 400
    assert err.body["message"] == ref.body["message"] and err.body["type"] == ref.body["type"], (err.body, ref.body)
    assert not kv_cache_empty_within([stack.prefill, stack.decode], 30.0), "a refused request left KV blocks held"


@pytest.fixture(scope="module")
def dead_decode_proxy(stack, artifacts):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    log_dir = artifacts / "openai_client"
    log_dir.mkdir(parents=True, exist_ok=True)
    proxy = ProxyProcess(stack.prefill.base_url, dead, log_dir / "proxy-dead-decode.log",
                         {"PYTHONPATH": stack.prefill.env.get("PYTHONPATH", "")}, unhealthy_ok=True)
    # A short client timeout: a proxy that hangs on a dead D fails here as APITimeoutError.
    client = openai_client(proxy.url, timeout=120.0)
    try:
        yield client, dead
    finally:
        client.close()
        proxy.stop()


def _error_shape(error: dict, dead: str) -> None:
    """vLLM's ErrorInfo fields (message, type, param, code), the message naming the dead D."""
    assert {"message", "type", "param", "code"} <= set(error), error
    assert error["type"] == "decode_error" and dead in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_dead_decode_is_an_openai_error(dead_decode_proxy, stack, route, stream):
    """D refuses connections: non-streamed, ``openai.InternalServerError`` (502) whose body is
    ``{"error": {...}}``; streamed, P's first token may already be out (zero replay), and the
    failure then comes as vLLM's error event, which the client raises as ``openai.APIError``.
    Neither a hang nor a connection error; P's blocks are freed at its claim deadline."""
    client, dead = dead_decode_proxy
    call = _request(client, route, stack.config.served_model_name, stream)
    chunks = []
    try:
        answer = call()
        if stream:
            for chunk in answer:
                chunks.append(chunk)
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        pytest.fail(f"connection error or hang instead of an HTTP error: {e!r}")
    except openai.APIStatusError as e:
        assert e.status_code == 502, e
        whole = e.response.json()
        assert set(whole) == {"error"}, whole
        _error_shape(whole["error"], dead)
        assert e.body == whole["error"] and e.body["code"] == 502
        assert not chunks
    except openai.APIError as e:
        assert stream and chunks, f"an in-stream error without a stream: {e!r}"
        _error_shape(e.body, dead)
    else:
        pytest.fail(f"no error through a dead D: {answer!r} {chunks!r}")
    assert not kv_cache_empty_within([stack.prefill], 30.0), "P still holds the blocks of a handoff nobody claimed"
