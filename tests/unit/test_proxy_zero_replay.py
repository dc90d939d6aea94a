"""Zero replay in the proxy (``--resume first-token``): the pure rules and answer assembly of
``pd_connector/proxy/first_token.py``, and the flow against in-process fake P and D servers.

The fake answers below have vLLM 0.32.0's shapes (``model_dump()`` of CompletionResponse /
ChatCompletionResponse, and the stream chunks' ``model_dump_json(exclude_unset=True)``); each
test's "aggregated" answer is what one vLLM server returns for the same request, built by hand
from vllm/entrypoints/openai/{completion,chat_completion}/serving.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import types

import aiohttp
import pytest
from aiohttp import web

from pd_connector import cli
from pd_connector.proxy import first_token as ft
from pd_connector.proxy import server as proxy_mod
from pd_connector.proxy.server import PREFILL_KV_PARAMS, build_app
from rig.fake_upstreams import FakeUpstream, async_test, serve

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT_IDS = [5, 6, 7, 8]
T0 = 42
# What a pd_connector P returns when it resumed at its first token (R = N = 4).
P_PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
    "remote_engine_id": "engine-p0", "remote_request_id": "req-1", "remote_host": "127.0.0.1",
    "remote_port": 5601, "tp_size": 1, "remote_num_tokens": 4, "replay_offset": 4,
    "pd_protocol_version": 1, "pd_first_token": T0,
}
P_PARAMS_REPLAY = {k: v for k, v in P_PARAMS.items() if k != "pd_first_token"} | {
    "replay_offset": 3, "remote_num_tokens": 3}

# ---- vLLM-shaped answers --------------------------------------------------------------------------

P_CMPL_LOGPROBS = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": [" Paris"],
                   "top_logprobs": [{" Paris": -0.5, " Lyon": -1.5}]}
D_CMPL_LOGPROBS = {"text_offset": [0, 1], "token_logprobs": [-0.1, -0.2], "tokens": [",", " the"],
                   "top_logprobs": [{",": -0.1, ".": -2.5}, {" the": -0.2, " a": -1.9}]}


def p_completion(*, text=" Paris", finish="length", stop_reason=None, logprobs=None,
                 params=P_PARAMS, usage_details=None) -> dict:
    """P's answer to the zero-replay prefill (max_tokens=1, return_token_ids=true)."""
    return {
        "id": "cmpl-req-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason, "token_ids": [T0], "prompt_logprobs": None,
                     "prompt_token_ids": PROMPT_IDS, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1,
                  "prompt_tokens_details": usage_details, "completion_tokens_details": None},
        "kv_transfer_params": params, "ec_transfer_params": None, "metrics": None,
    }


def d_completion(*, text=", the", token_ids=(7, 9), finish="length", logprobs=None,
                 return_ids=False) -> dict:
    """D's answer to the zero-replay decode (prompt = PROMPT_IDS + [T0])."""
    return {
        "id": "cmpl-req-1", "object": "text_completion", "created": 1700000005, "model": "tiny",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": None,
                     "token_ids": list(token_ids) if return_ids else None,
                     "prompt_logprobs": None,
                     "prompt_token_ids": PROMPT_IDS + [T0] if return_ids else None,
                     "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 5, "total_tokens": 5 + len(token_ids),
                  "completion_tokens": len(token_ids), "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


P_CHAT_LOGPROBS = {"content": [{"token": " Paris", "logprob": -0.5, "bytes": list(b" Paris"),
                                "top_logprobs": [{"token": " Paris", "logprob": -0.5,
                                                  "bytes": list(b" Paris")}]}]}


def p_chat(*, text=" Paris", finish="length", logprobs=None, message_extra=None,
           completion_details=None) -> dict:
    return {
        "id": "chatcmpl-req-1", "object": "chat.completion", "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None, **(message_extra or {})},
                     "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
                     "token_ids": [T0], "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1,
                  "prompt_tokens_details": None, "completion_tokens_details": completion_details},
        "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS, "prompt_text": None,
        "kv_transfer_params": P_PARAMS, "ec_transfer_params": None, "metrics": None,
    }


def first_of(path, p_data) -> ft.FirstToken:
    got = ft.parse_prefill(path, p_data, p_data["kv_transfer_params"])
    assert isinstance(got, ft.FirstToken), got
    return got


def events(raw: bytes) -> list:
    """The data payloads of a server-sent event stream (JSON decoded, [DONE] as is)."""
    out = []
    for event in raw.split(b"\n\n"):
        if event:
            assert event.startswith(b"data: "), event
            payload = event[6:]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def sse_bytes(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


CMPL_BODY = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 3,
             "temperature": 0}
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Capital of France?"}],
             "max_completion_tokens": 3, "temperature": 0}


# ---- which requests replay ----------------------------------------------------------------------

def test_plain_requests_use_zero_replay():
    assert ft.replay_reason(COMPLETIONS, CMPL_BODY) is None
    assert ft.replay_reason(COMPLETIONS, {**CMPL_BODY, "prompt": [1, 2, 3], "stream": True,
                                          "stream_options": {"include_usage": True},
                                          "logprobs": 2, "stop": ["\n"], "min_tokens": 2,
                                          "seed": 7, "return_token_ids": True}) is None
    assert ft.replay_reason(CHAT, CHAT_BODY) is None
    assert ft.replay_reason(CHAT, {**CHAT_BODY, "logprobs": True, "top_logprobs": 3,
                                   "messages": [{"role": "user", "content": [
                                       {"type": "text", "text": "hi"}]}],
                                   "chat_template_kwargs": {"custom": 1}}) is None


@pytest.mark.parametrize("path, extra, reason", [
    (COMPLETIONS, {"n": 2}, "n"),
    (CHAT, {"n": 3}, "n"),
    (COMPLETIONS, {"best_of": 2}, "n"),
    (COMPLETIONS, {"use_beam_search": True}, "beam_search"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (CHAT, {"echo": True}, "echo"),
    (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (COMPLETIONS, {"suffix": "x"}, "prompt_form"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "batched_prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "batched_prompt"),
    (COMPLETIONS, {"prompt_embeds": "AAAA"}, "prompt_form"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "structured_output"),
    (CHAT, {"structured_outputs": {"regex": "a+"}}, "structured_output"),
    (COMPLETIONS, {"presence_penalty": 0.5}, "output_penalty"),
    (CHAT, {"frequency_penalty": 0.2}, "output_penalty"),
    (COMPLETIONS, {"bad_words": ["x"]}, "output_penalty"),
    (COMPLETIONS, {"seed": 1, "temperature": 0.7}, "seeded_sampling"),
    (CHAT, {"seed": 1, "temperature": None}, "seeded_sampling"),
    (COMPLETIONS, {"vllm_xargs": {"a": 1}}, "output_state"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "none"}, "tools"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning"),
    (CHAT, {"include_reasoning": False}, "reasoning"),
    (CHAT, {"chat_template_kwargs": {"enable_thinking": True}}, "reasoning"),
    (CHAT, {"thinking_token_budget": 10}, "reasoning"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "multimodal"),
    (CHAT, {"logprobs": True, "return_tokens_as_token_ids": True}, "logprobs_form"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"some_new_vllm_field": 1}, "unknown_field"),
    (CHAT, {"suffix": "x"}, "unknown_field"),
])
def test_excluded_features_take_the_standard_flow(path, extra, reason):
    body = {**(CMPL_BODY if path == COMPLETIONS else CHAT_BODY), **extra}
    got = ft.replay_reason(path, body)
    assert got is not None and got.reason == reason, got


def test_zero_temperature_seed_and_zero_penalties_stay_zero_replay():
    assert ft.replay_reason(COMPLETIONS, {**CMPL_BODY, "seed": 3, "temperature": 0.0}) is None
    assert ft.replay_reason(CHAT, {**CHAT_BODY, "presence_penalty": 0, "bad_words": []}) is None


def test_prefill_body_asks_p_for_its_first_token():
    body = {**CMPL_BODY, "min_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    pb = ft.prefill_body(body, 1)
    assert pb["kv_transfer_params"] == {**PREFILL_KV_PARAMS, "pd_min_recompute_tokens": 1,
                                        "pd_resume": "first_token"}
    assert pb["return_token_ids"] is True and pb["min_tokens"] == 1
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "stream_options" not in pb
    assert "min_tokens" not in ft.prefill_body(CMPL_BODY)
    alone = ft.prefill_body({**CMPL_BODY, "max_tokens": 1}, 1, standalone=True)
    assert "kv_transfer_params" not in alone and alone["return_token_ids"] is True
    assert ft.answered_by_prefill(COMPLETIONS, {**CMPL_BODY, "max_tokens": 1})
    assert ft.answered_by_prefill(CHAT, {**CHAT_BODY, "max_completion_tokens": 1})
    assert not ft.answered_by_prefill(COMPLETIONS, {"prompt": "x"})  # vLLM's default is 16
    assert body["min_tokens"] == 4 and "return_token_ids" not in body  # not mutated


# ---- P's answer ----------------------------------------------------------------------------------

def test_parse_completion_and_chat_answers():
    got = first_of(COMPLETIONS, p_completion(logprobs=P_CMPL_LOGPROBS))
    assert (got.token, got.prompt_ids, got.text, got.finish_reason) == (T0, PROMPT_IDS, " Paris", "length")
    assert got.logprobs == P_CMPL_LOGPROBS and got.prompt_tokens == 4
    chat = first_of(CHAT, p_chat())
    assert (chat.token, chat.prompt_ids, chat.text) == (T0, PROMPT_IDS, " Paris")


def test_parse_rejects_what_d_could_not_continue():
    def reason(path, data):
        got = ft.parse_prefill(path, data, data.get("kv_transfer_params"))
        assert isinstance(got, ft.Replay)
        return got.reason

    assert reason(COMPLETIONS, p_completion(params=P_PARAMS_REPLAY)) == "prefill_declined"
    assert reason(COMPLETIONS, p_completion(params={**P_PARAMS, "replay_offset": 3})) == "prefill_answer"
    bad_ids = p_completion()
    bad_ids["choices"][0]["token_ids"] = [T0 + 1]
    assert reason(COMPLETIONS, bad_ids) == "prefill_answer"
    no_prompt = p_completion()
    no_prompt["choices"][0]["prompt_token_ids"] = None
    assert reason(COMPLETIONS, no_prompt) == "prefill_answer"
    # A chat server with a reasoning or tool parser: the proxy cannot parse the text itself.
    assert reason(CHAT, p_chat(message_extra={"reasoning": ""})) == "parser_output"
    assert reason(CHAT, p_chat(completion_details={"reasoning_tokens": 0})) == "parser_output"
    assert reason(CHAT, p_chat(text=None)) == "prefill_answer"


def test_a_first_token_that_is_part_of_a_character_takes_the_standard_flow():
    """Regression: zero replay's text began with the whole prompt's when P's first token was an
    incomplete UTF-8 byte (4 of 32 prompts in bench e2e; the ids were right): vLLM's detokenizer
    on D, primed with a prompt that ends mid-character, emits the prompt's text first."""
    got = ft.parse_prefill(COMPLETIONS, p_completion(text="\ufffd"), P_PARAMS)
    assert isinstance(got, ft.Replay) and got.reason == "partial_character"
    chat = ft.parse_prefill(CHAT, p_chat(text="x\ufffd"), P_PARAMS)
    assert isinstance(chat, ft.Replay) and chat.reason == "partial_character"
    empty = ft.parse_prefill(COMPLETIONS, p_completion(text=""), P_PARAMS)  # how vLLM holds it back
    assert isinstance(empty, ft.Replay) and empty.reason == "partial_character"
    # Negative control: a whole character stays zero replay, and an empty text that ended the
    # request (EOS) is answered from P.
    assert isinstance(ft.parse_prefill(COMPLETIONS, p_completion(text="", finish="stop"), P_PARAMS), ft.FirstToken)
    assert isinstance(ft.parse_prefill(COMPLETIONS, p_completion(text=" \u00e9"), P_PARAMS), ft.FirstToken)


def test_finished_by_prefill():
    stop = first_of(COMPLETIONS, p_completion(finish="stop", text=""))
    assert ft.finished_by_prefill(COMPLETIONS, CMPL_BODY, stop, None) == "stop"
    one = first_of(COMPLETIONS, p_completion())
    assert ft.finished_by_prefill(COMPLETIONS, {**CMPL_BODY, "max_tokens": 1}, one, None) == "length"
    assert ft.finished_by_prefill(COMPLETIONS, CMPL_BODY, one, None) is None
    assert ft.finished_by_prefill(COMPLETIONS, {**CMPL_BODY, "max_tokens": None}, one, None) is None
    assert ft.finished_by_prefill(COMPLETIONS, CMPL_BODY, one, 5) == "length"  # 4 + t0 fill 5
    assert ft.finished_by_prefill(CHAT, CHAT_BODY | {"max_completion_tokens": None}, first_of(CHAT, p_chat()), 6) is None


@pytest.mark.parametrize("stop, text, hit", [
    (["\n\n"], "\n", "\n\n"),        # t0 ends with the stop string's first character
    (["END"], " EN", "END"),
    ("END", " E", "END"),
    (["END"], "END", None),          # wholly inside t0: P's to find
    (["xyz", "\n\n"], " Paris", None),
    (["ab"], "", None),
    (None, "\n", None),
])
def test_straddling_stop(stop, text, hit):
    assert ft.straddling_stop({"stop": stop}, text) == hit


# ---- D's body -------------------------------------------------------------------------------------

def test_completion_decode_body():
    body = {**CMPL_BODY, "logprobs": 2, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
            "min_tokens": 3, "seed": 5, "top_p": 0.9, "stream": True,
            "stream_options": {"include_usage": True}, "truncate_prompt_tokens": 100,
            "add_special_tokens": True, "kv_transfer_params": {"client": "junk"}}
    d = ft.decode_body(COMPLETIONS, body, first_of(COMPLETIONS, p_completion()), P_PARAMS, None)
    assert d == {
        "model": "tiny", "prompt": PROMPT_IDS + [T0], "max_tokens": 2, "temperature": 0,
        "logprobs": 2, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
        "min_tokens": 2, "seed": 5, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True}, "kv_transfer_params": P_PARAMS,
    }
    # No client max_tokens: vLLM's completions default (16) less t0.
    d = ft.decode_body(COMPLETIONS, {"prompt": "x"}, first_of(COMPLETIONS, p_completion()), P_PARAMS, None)
    assert d["max_tokens"] == 15


def test_chat_decode_body():
    body = {**CHAT_BODY, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "add_generation_prompt": True, "stop": "x"}
    d = ft.decode_body(CHAT, body, first_of(CHAT, p_chat()), P_PARAMS, None)
    assert d == {"model": "tiny", "prompt": PROMPT_IDS + [T0], "max_tokens": 2, "temperature": 0,
                 "logprobs": 2, "return_token_ids": True, "stop": "x",
                 "kv_transfer_params": P_PARAMS}
    assert ft.decode_body(CHAT, {**CHAT_BODY, "logprobs": True}, first_of(CHAT, p_chat()), None, None)["logprobs"] == 0
    # Chat without a limit: the context is; D's prompt is one token longer, vLLM clamps.
    open_ended = {k: v for k, v in CHAT_BODY.items() if k != "max_completion_tokens"}
    assert ft.decode_body(CHAT, open_ended, first_of(CHAT, p_chat()), P_PARAMS, 4096)["max_tokens"] == 4095
    unknown = ft.decode_body(CHAT, open_ended, first_of(CHAT, p_chat()), P_PARAMS, None)
    assert isinstance(unknown, ft.Replay) and unknown.reason == "max_model_len_unknown"
    too_many = ft.decode_body(CHAT, {**CHAT_BODY, "max_completion_tokens": 9000}, first_of(CHAT, p_chat()), P_PARAMS, 4096)
    assert isinstance(too_many, ft.Replay) and too_many.reason == "max_tokens"


def test_plan_decode():
    p = p_completion()
    plan = ft.plan_decode(COMPLETIONS, CMPL_BODY, p, P_PARAMS, before=None, max_model_len=None)
    assert (plan.mode, plan.reason, plan.d_path) == ("first_token", "decoded", COMPLETIONS)
    assert plan.d_body["prompt"] == PROMPT_IDS + [T0] and plan.d_body["kv_transfer_params"] == P_PARAMS
    assert "kv_transfer_params" not in plan.fallback_body
    assert plan.fallback_body["prompt"] == PROMPT_IDS + [T0]
    # Chat: D is asked on /v1/completions.
    chat = ft.plan_decode(CHAT, CHAT_BODY, p_chat(), P_PARAMS, before=None, max_model_len=None)
    assert chat.d_path == COMPLETIONS and "messages" not in chat.d_body
    # t0 ended the request: no D.
    done = ft.plan_decode(COMPLETIONS, CMPL_BODY, p_completion(finish="stop"), P_PARAMS,
                          before=None, max_model_len=None)
    assert done.d_body is None and done.finish_reason == "stop" and done.reason == "prefill_finished"
    # A stop string that could straddle t0 and D's text: the standard flow, P's params included
    # (D refuses them for the client's prompt and releases P at once).
    straddle = ft.plan_decode(COMPLETIONS, {**CMPL_BODY, "stop": [" Paris!"]}, p, P_PARAMS,
                              before=None, max_model_len=None)
    assert (straddle.mode, straddle.reason) == ("replay", "stop_string_boundary")
    assert straddle.d_body == {**CMPL_BODY, "stop": [" Paris!"], "kv_transfer_params": P_PARAMS}
    assert straddle.d_path == COMPLETIONS
    before = ft.plan_decode(CHAT, {**CHAT_BODY, "n": 2}, p_chat(), P_PARAMS_REPLAY,
                            before=ft.Replay("n", "n"), max_model_len=None)
    assert before.d_body == {**CHAT_BODY, "n": 2, "kv_transfer_params": P_PARAMS_REPLAY}
    assert before.d_path == CHAT


# ---- non-streamed answers -------------------------------------------------------------------------

def test_merge_completion_matches_aggregated():
    body = {**CMPL_BODY, "logprobs": 1, "return_token_ids": True}
    first = first_of(COMPLETIONS, p_completion(logprobs=P_CMPL_LOGPROBS))
    merged = ft.merge_response(COMPLETIONS, body, first,
                               d_completion(logprobs=D_CMPL_LOGPROBS, return_ids=True))
    aggregated = {
        "id": "cmpl-req-1", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 0, "text": " Paris, the",
                     "logprobs": {"text_offset": [0, 6, 7],
                                  "token_logprobs": [-0.5, -0.1, -0.2],
                                  "tokens": [" Paris", ",", " the"],
                                  "top_logprobs": P_CMPL_LOGPROBS["top_logprobs"]
                                  + D_CMPL_LOGPROBS["top_logprobs"]},
                     "finish_reason": "length", "stop_reason": None, "token_ids": [T0, 7, 9],
                     "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS,
                     "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }
    assert merged == aggregated


def test_merge_completion_without_ids_or_logprobs():
    first = first_of(COMPLETIONS, p_completion())
    merged = ft.merge_response(COMPLETIONS, CMPL_BODY, first,
                               d_completion(finish="stop", token_ids=(7,), text=","))
    choice = merged["choices"][0]
    assert choice["text"] == " Paris," and choice["finish_reason"] == "stop"
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["logprobs"] is None and merged["kv_transfer_params"] is None
    assert merged["usage"]["completion_tokens"] == 2 and merged["usage"]["total_tokens"] == 6
    with pytest.raises(ValueError):
        ft.merge_response(COMPLETIONS, CMPL_BODY, first, {"choices": []})
    with pytest.raises(ValueError):
        ft.merge_response(COMPLETIONS, CMPL_BODY, first, {"choices": [{"text": "x"}]})  # no usage


def test_merge_chat_matches_aggregated():
    body = {**CHAT_BODY, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    first = first_of(CHAT, p_chat(logprobs=P_CHAT_LOGPROBS))
    merged = ft.merge_response(CHAT, body, first, d_completion(
        logprobs=D_CMPL_LOGPROBS, return_ids=True, finish="stop"))
    aggregated = {
        "id": "chatcmpl-req-1", "object": "chat.completion", "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": " Paris, the", "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "reasoning": None},
                     "logprobs": {"content": P_CHAT_LOGPROBS["content"] + [
                         {"token": ",", "logprob": -0.1, "bytes": list(b","),
                          "top_logprobs": [{"token": ",", "logprob": -0.1, "bytes": list(b",")}]},
                         {"token": " the", "logprob": -0.2, "bytes": list(b" the"),
                          "top_logprobs": [{"token": " the", "logprob": -0.2,
                                            "bytes": list(b" the")}]}]},
                     "finish_reason": "stop", "stop_reason": None, "token_ids": [T0, 7, 9],
                     "routed_experts": None}],
        "service_tier": None, "system_fingerprint": None,
        "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
        "prompt_logprobs": None, "prompt_token_ids": PROMPT_IDS, "prompt_text": None,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }
    assert merged == aggregated
    plain = ft.merge_response(CHAT, CHAT_BODY, first, d_completion())
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    assert plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_from_completion_keeps_chat_counts():
    lp = {"text_offset": [0, 1], "token_logprobs": [-0.1, None], "tokens": [",", "x"],
          "top_logprobs": [{",": -0.1, ".": -2.5, ";": -3.0}, None]}
    two = ft.chat_logprobs_from_completion(lp, {"top_logprobs": 2})["content"]
    assert [t["token"] for t in two[0]["top_logprobs"]] == [",", "."]
    assert two[1] == {"token": "x", "logprob": -9999.0, "bytes": [120], "top_logprobs": []}
    assert ft.chat_logprobs_from_completion(lp, {"top_logprobs": 0})["content"][0]["top_logprobs"] == []
    assert len(ft.chat_logprobs_from_completion(lp, {"top_logprobs": -1})["content"][0]["top_logprobs"]) == 3
    assert ft.chat_logprobs_from_completion(None, {}) is None
    assert ft.chat_logprobs_from_completion({"tokens": ["é"], "token_logprobs": [-1.0],
                                             "top_logprobs": [{"é": -1.0}]},
                                            {"top_logprobs": 1})["content"][0]["bytes"] == [195, 169]


def test_prefill_only_response():
    first = first_of(COMPLETIONS, p_completion(finish="stop", text="", logprobs=None))
    answer = ft.prefill_only_response(COMPLETIONS, CMPL_BODY, first, "stop")
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["token_ids"] is None and answer["choices"][0]["prompt_token_ids"] is None
    assert answer["kv_transfer_params"] is None and answer["usage"]["completion_tokens"] == 1
    asked = ft.prefill_only_response(COMPLETIONS, {**CMPL_BODY, "return_token_ids": True}, first, "stop")
    assert asked["choices"][0]["token_ids"] == [T0] and asked["choices"][0]["prompt_token_ids"] == PROMPT_IDS


# ---- streamed answers -----------------------------------------------------------------------------

def d_stream_completion(logprobs=False, ids=False, usage=False, continuous=False) -> list[dict]:
    """D's streamed chunks for ', the' (two tokens), as vLLM 0.32 writes them."""
    def chunk(text, tok, lp, finish, first=False):
        c = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
             "stop_reason": None, "prompt_token_ids": PROMPT_IDS + [T0] if ids and first else None,
             "token_ids": [tok] if ids else None}
        return {"id": "cmpl-req-1", "object": "text_completion", "created": 1700000005,
                "model": "tiny", "choices": [c]}
    lp1 = {"text_offset": [0], "token_logprobs": [-0.1], "tokens": [","],
           "top_logprobs": [{",": -0.1, ".": -2.5}]} if logprobs else None
    lp2 = {"text_offset": [1], "token_logprobs": [-0.2], "tokens": [" the"],
           "top_logprobs": [{" the": -0.2, " a": -1.9}]} if logprobs else None
    chunks = [chunk(",", 7, lp1, None, first=True), chunk(" the", 9, lp2, "length")]
    if continuous:
        for i, c in enumerate(chunks, 1):
            c["usage"] = {"prompt_tokens": 5, "completion_tokens": i, "total_tokens": 5 + i}
    if usage:
        chunks.append({"id": "cmpl-req-1", "object": "text_completion", "created": 1700000005,
                       "model": "tiny", "choices": [],
                       "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}})
    return chunks


def test_completion_stream_matches_aggregated():
    body = {**CMPL_BODY, "stream": True, "logprobs": 1, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    asm = ft.StreamAssembler(COMPLETIONS, body, first_of(COMPLETIONS, p_completion(logprobs=P_CMPL_LOGPROBS)))
    raw = sse_bytes(*d_stream_completion(logprobs=True, ids=True, usage=True))
    # D's bytes arrive cut anywhere: events are rewritten whole.
    out = asm.head(None) + b"".join(asm.feed(raw[i:i + 7]) for i in range(0, len(raw), 7)) + asm.flush()
    top = {"id": "cmpl-req-1", "object": "text_completion", "created": 1700000000, "model": "tiny"}
    assert events(out) == [
        {**top, "choices": [{"index": 0, "text": " Paris", "logprobs": P_CMPL_LOGPROBS,
                             "finish_reason": None, "stop_reason": None,
                             "prompt_token_ids": PROMPT_IDS, "token_ids": [T0]}]},
        {**top, "choices": [{"index": 0, "text": ",", "logprobs": {
            "text_offset": [6], "token_logprobs": [-0.1], "tokens": [","],
            "top_logprobs": [{",": -0.1, ".": -2.5}]}, "finish_reason": None, "stop_reason": None,
            "prompt_token_ids": None, "token_ids": [7]}]},
        {**top, "choices": [{"index": 0, "text": " the", "logprobs": {
            "text_offset": [7], "token_logprobs": [-0.2], "tokens": [" the"],
            "top_logprobs": [{" the": -0.2, " a": -1.9}]}, "finish_reason": "length",
            "stop_reason": None, "prompt_token_ids": None, "token_ids": [9]}]},
        {**top, "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
        "[DONE]",
    ]


def test_completion_stream_continuous_usage_and_hidden_ids():
    body = {**CMPL_BODY, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    asm = ft.StreamAssembler(COMPLETIONS, body, first_of(COMPLETIONS, p_completion()))
    out = events(asm.head(None) + asm.feed(sse_bytes(*d_stream_completion(ids=True, usage=True, continuous=True))))
    assert [e["usage"]["completion_tokens"] for e in out[:4]] == [1, 2, 3, 3]
    assert all(e["usage"]["prompt_tokens"] == 4 for e in out[:4])
    assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None
               for e in out[:3] for c in e["choices"])


def test_chat_stream_matches_aggregated():
    body = {**CHAT_BODY, "stream": True, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}
    asm = ft.StreamAssembler(CHAT, body, first_of(CHAT, p_chat(logprobs=P_CHAT_LOGPROBS)))
    out = asm.head(None) + asm.feed(sse_bytes(*d_stream_completion(logprobs=True, usage=True)))
    top = {"id": "chatcmpl-req-1", "object": "chat.completion.chunk", "created": 1700000000,
           "model": "tiny"}
    assert events(out) == [
        {**top, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}],
         "prompt_token_ids": None, "prompt_text": None},
        {**top, "choices": [{"index": 0, "delta": {"content": " Paris"},
                             "logprobs": P_CHAT_LOGPROBS, "finish_reason": None,
                             "token_ids": None}]},
        {**top, "choices": [{"index": 0, "delta": {"content": ","}, "logprobs": {"content": [
            {"token": ",", "logprob": -0.1, "bytes": [44],
             "top_logprobs": [{"token": ",", "logprob": -0.1, "bytes": [44]}]}]},
            "finish_reason": None, "token_ids": None}]},
        {**top, "choices": [{"index": 0, "delta": {"content": " the"}, "logprobs": {"content": [
            {"token": " the", "logprob": -0.2, "bytes": list(b" the"),
             "top_logprobs": [{"token": " the", "logprob": -0.2, "bytes": list(b" the")}]}]},
            "finish_reason": "length", "stop_reason": None, "token_ids": None}]},
        {**top, "choices": [], "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}},
        "[DONE]",
    ]


def test_stream_head_when_p_finished():
    body = {**CHAT_BODY, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    asm = ft.StreamAssembler(CHAT, body, first_of(CHAT, p_chat(finish="stop", text="")))
    out = events(asm.head("stop"))
    assert out[0]["prompt_token_ids"] == PROMPT_IDS
    assert out[1]["choices"] == [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                  "finish_reason": "stop", "stop_reason": None, "token_ids": [T0]}]
    assert out[2]["usage"] == {"prompt_tokens": 4, "total_tokens": 5, "completion_tokens": 1}
    assert out[3] == "[DONE]"


def test_stream_passes_errors_keepalives_and_odd_events():
    asm = ft.StreamAssembler(COMPLETIONS, CMPL_BODY, first_of(COMPLETIONS, p_completion()))
    raw = b': keep-alive\n\ndata: {"error": {"message": "boom", "code": 500}}\n\ndata: nope\n\n'
    assert asm.feed(raw) == raw
    assert asm.feed(b"data: [DO") == b"" and asm.flush() == b"data: [DO"
    err = events(asm.error_event("D failed", 502))
    assert err == [{"error": {"message": "D failed", "type": "decode_error", "param": None,
                              "code": 502}}, "[DONE]"]
    vllm_err = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}).encode()
    assert events(asm.error_event("x", 400, vllm_err))[0] == json.loads(vllm_err)


def test_max_model_len_of():
    models = {"object": "list", "data": [{"id": "a", "max_model_len": 100}, {"id": "b", "max_model_len": 200}]}
    assert ft.max_model_len_of(models, "b") == 200
    assert ft.max_model_len_of(models, "zzz") == 100
    assert ft.max_model_len_of({"data": [{"id": "a"}]}, "a") is None
    assert ft.max_model_len_of(None, "a") is None


# ---- through the proxy ----------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def stack(p_answer, d_kwargs=None, n_d=1, proxy_kwargs=None):
    p = FakeUpstream("p0", answer=p_answer)
    ds = [FakeUpstream(f"d{i}", **(d_kwargs or {})) for i in range(n_d)]
    async with contextlib.AsyncExitStack() as es:
        p_url = await es.enter_async_context(serve(p.app))
        d_urls = [await es.enter_async_context(serve(d.app)) for d in ds]
        app = build_app([p_url], d_urls, health_interval=0, **(proxy_kwargs or {}))
        url = await es.enter_async_context(serve(app))
        session = await es.enter_async_context(aiohttp.ClientSession())
        yield types.SimpleNamespace(url=url, p=p, ds=ds, d=ds[0], session=session)


async def resume_metrics(s) -> dict:
    async with s.session.get(s.url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("pd_proxy_resume_total{"):
            labels, value = line.split("} ")
            out[labels.split("{")[1]] = int(value)
    return out


@async_test
async def test_completion_through_proxy():
    body = {**CMPL_BODY, "logprobs": 1, "return_token_ids": True}
    d_answer = d_completion(logprobs=D_CMPL_LOGPROBS, return_ids=True)
    async with stack(p_completion(logprobs=P_CMPL_LOGPROBS), {"answer": d_answer}) as s:
        async with s.session.post(s.url + COMPLETIONS, json=body) as r:
            assert r.status == 200
            got = await r.json()
        pb = s.p.received[0]["body"]
        assert pb["kv_transfer_params"]["pd_resume"] == "first_token" and pb["return_token_ids"] is True
        (d,) = s.d.received
        assert d["path"] == COMPLETIONS
        assert d["body"] == {"model": "tiny", "prompt": PROMPT_IDS + [T0], "max_tokens": 2,
                             "temperature": 0, "logprobs": 1, "return_token_ids": True,
                             "kv_transfer_params": P_PARAMS}
        assert got["choices"][0]["text"] == " Paris, the"
        assert got["choices"][0]["token_ids"] == [T0, 7, 9]
        assert got["choices"][0]["logprobs"]["text_offset"] == [0, 6, 7]
        assert got["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3,
                                "prompt_tokens_details": None, "completion_tokens_details": None}
        assert got["id"] == "cmpl-req-1" and got["kv_transfer_params"] is None
        assert await resume_metrics(s) == {'mode="first_token",reason="decoded"': 1}


@async_test
async def test_chat_through_proxy():
    async with stack(p_chat(), {"answer": d_completion(finish="stop")}) as s:
        async with s.session.post(s.url + CHAT, json=CHAT_BODY) as r:
            assert r.status == 200
            got = await r.json()
        assert s.p.received[0]["path"] == CHAT
        (d,) = s.d.received
        assert d["path"] == COMPLETIONS
        assert d["body"] == {"model": "tiny", "prompt": PROMPT_IDS + [T0], "max_tokens": 2,
                             "temperature": 0, "kv_transfer_params": P_PARAMS}
        assert got["object"] == "chat.completion" and got["id"] == "chatcmpl-req-1"
        assert got["choices"][0]["message"]["content"] == " Paris, the"
        assert got["choices"][0]["finish_reason"] == "stop"
        assert got["usage"]["completion_tokens"] == 3 and got["prompt_token_ids"] is None


@async_test
async def test_streamed_first_token_leaves_before_d_is_asked():
    """The point of zero replay: the client has t0 while D has not even been asked (D is held
    here until the client read it)."""
    body = {**CMPL_BODY, "stream": True}
    chunks = [sse_bytes(*d_stream_completion())]
    async with stack(p_completion(), {"stream_chunks": chunks}) as s:
        s.d.gate = asyncio.Event()
        async with s.session.post(s.url + COMPLETIONS, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            first = await r.content.readuntil(b"\n\n")
            assert events(first)[0]["choices"][0]["text"] == " Paris"
            s.d.gate.set()
            rest = await r.content.read()
        assert [e if isinstance(e, str) else e["choices"][0]["text"] for e in events(rest)] == [
            ",", " the", "[DONE]"]
        (d,) = s.d.received
        assert d["body"]["stream"] is True and d["body"]["prompt"] == PROMPT_IDS + [T0]


@async_test
async def test_chat_stream_through_proxy():
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with stack(p_chat(), {"stream_chunks": [sse_bytes(*d_stream_completion(usage=True))]}) as s:
        async with s.session.post(s.url + CHAT, json=body) as r:
            got = events(await r.read())
        assert [e["object"] for e in got[:-1]] == ["chat.completion.chunk"] * 5
        assert "".join(c["delta"].get("content", "") for e in got[:-1] for c in e["choices"]) == " Paris, the"
        assert got[-2]["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
        assert s.d.received[0]["body"]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_p_finished_answers_without_d(stream):
    async with stack(p_completion(finish="stop", text="", stop_reason=None)) as s:
        async with s.session.post(s.url + COMPLETIONS, json={**CMPL_BODY, "stream": stream}) as r:
            assert r.status == 200
            raw = await r.read()
        if stream:
            got = events(raw)
            assert got[0]["choices"][0]["finish_reason"] == "stop" and got[-1] == "[DONE]"
        else:
            got = json.loads(raw)
            assert got["choices"][0]["finish_reason"] == "stop" and got["usage"]["completion_tokens"] == 1
        assert s.d.received == []
        assert await resume_metrics(s) == {'mode="first_token",reason="prefill_finished"': 1}


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_one_token_requests_go_to_p_alone_without_a_handoff(stream):
    """max_tokens=1: P's token is the answer; P is asked as an aggregated server (no
    kv_transfer_params), so it holds no blocks for a D that would never come."""
    p_answer = p_completion(params=None)
    async with stack(p_answer) as s:
        async with s.session.post(s.url + COMPLETIONS,
                                  json={**CMPL_BODY, "max_tokens": 1, "stream": stream}) as r:
            raw = await r.read()
        choice = events(raw)[0]["choices"][0] if stream else json.loads(raw)["choices"][0]
        assert choice["text"] == " Paris" and choice["finish_reason"] == "length"
        pb = s.p.received[0]["body"]
        assert "kv_transfer_params" not in pb and pb["return_token_ids"] is True
        assert s.d.received == []
        assert await resume_metrics(s) == {'mode="first_token",reason="prefill_only"': 1}
    # A P answer without its token falls back to D, which computes the prompt itself.
    no_ids = p_completion(params=None)
    no_ids["choices"][0]["token_ids"] = None
    async with stack(no_ids) as s:
        async with s.session.post(s.url + COMPLETIONS, json={**CMPL_BODY, "max_tokens": 1}) as r:
            assert r.status == 200
        assert s.d.received[0]["body"] == {**CMPL_BODY, "max_tokens": 1}


@async_test
async def test_p_without_first_token_gets_the_standard_flow():
    async with stack(p_completion(params=P_PARAMS_REPLAY)) as s:
        async with s.session.post(s.url + COMPLETIONS, json=CMPL_BODY) as r:
            assert r.status == 200
            assert await r.json() == {"id": "cmpl-d0", "choices": [{"text": "from d0"}]}
        assert s.d.received[0]["body"] == {**CMPL_BODY, "kv_transfer_params": P_PARAMS_REPLAY}
        assert await resume_metrics(s) == {'mode="replay",reason="prefill_declined"': 1}


@async_test
async def test_n_samples_take_the_standard_flow():
    body = {**CMPL_BODY, "n": 2}
    async with stack(p_completion(params=P_PARAMS_REPLAY)) as s:
        async with s.session.post(s.url + COMPLETIONS, json=body) as r:
            assert r.status == 200
        pb = s.p.received[0]["body"]
        assert "pd_resume" not in pb["kv_transfer_params"] and "return_token_ids" not in pb
        assert pb["kv_transfer_params"]["pd_decode_requests"] == 2
        assert s.d.received[0]["body"] == {**body, "kv_transfer_params": P_PARAMS_REPLAY}
        assert await resume_metrics(s) == {'mode="replay",reason="n"': 1}


@async_test
async def test_straddling_stop_string_sends_d_the_client_request():
    body = {**CMPL_BODY, "stop": ["is\n"]}
    async with stack(p_completion(text=" Paris")) as s:  # " Paris" ends with "is"
        async with s.session.post(s.url + COMPLETIONS, json=body) as r:
            assert r.status == 200
        assert s.d.received[0]["body"] == {**body, "kv_transfer_params": P_PARAMS}
        assert await resume_metrics(s) == {'mode="replay",reason="stop_string_boundary"': 1}


@async_test
async def test_chat_parser_seen_once_turns_chat_to_the_standard_flow():
    async with stack(p_chat(completion_details={"reasoning_tokens": 1})) as s:
        for _ in range(2):
            async with s.session.post(s.url + CHAT, json=CHAT_BODY) as r:
                assert r.status == 200
        first, second = (x["body"] for x in s.p.received)
        assert first["kv_transfer_params"].get("pd_resume") == "first_token"
        assert "pd_resume" not in second["kv_transfer_params"]
        assert all(x["path"] == CHAT and x["body"]["messages"] == CHAT_BODY["messages"]
                   for x in s.d.received)
        assert await resume_metrics(s) == {'mode="replay",reason="parser_output"': 2}


@async_test
async def test_open_ended_chat_reads_d_max_model_len():
    body = {k: v for k, v in CHAT_BODY.items() if k != "max_completion_tokens"}
    async with stack(p_chat(), {"answer": d_completion(), "max_model_len": 64}) as s:
        for _ in range(2):
            async with s.session.post(s.url + CHAT, json=body) as r:
                assert r.status == 200
        assert [x["body"]["max_tokens"] for x in s.d.received] == [63, 63]
        assert s.d.models_requests == 1  # read once, then cached
    async with stack(p_chat(), {"answer": d_completion()}) as s:  # D does not say
        async with s.session.post(s.url + CHAT, json=body) as r:
            assert r.status == 200
        assert s.d.received[0]["path"] == CHAT
        assert await resume_metrics(s) == {'mode="replay",reason="max_model_len_unknown"': 1}


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_decode_fallback_continues_after_t0_without_params(stream):
    chunks = [sse_bytes(*d_stream_completion())]
    async with stack(p_completion(), {"stream_chunks": chunks, "answer": d_completion()},
                     n_d=2) as s:
        s.ds[0].status = 503
        async with s.session.post(s.url + COMPLETIONS, json={**CMPL_BODY, "stream": stream}) as r:
            assert r.status == 200
            raw = await r.read()
        bad, good = (s.ds if s.ds[0].received else s.ds[::-1])
        assert bad.received[0]["body"]["kv_transfer_params"] == P_PARAMS
        assert "kv_transfer_params" not in good.received[0]["body"]
        assert good.received[0]["body"]["prompt"] == PROMPT_IDS + [T0]
        text = ("".join(e["choices"][0]["text"] for e in events(raw)[:-1]) if stream
                else json.loads(raw)["choices"][0]["text"])
        assert text == " Paris, the"


@async_test
async def test_decode_error_after_t0_is_an_event_in_the_stream():
    async with stack(p_completion(), {"status": 400}) as s:
        async with s.session.post(s.url + COMPLETIONS, json={**CMPL_BODY, "stream": True}) as r:
            assert r.status == 200
            got = events(await r.read())
        assert got[0]["choices"][0]["text"] == " Paris"
        assert got[1] == {"error": {"message": "d0 says 400", "code": 400}} and got[2] == "[DONE]"


@async_test
async def test_decode_error_without_stream_is_passed_through():
    async with stack(p_completion(), {"status": 400}) as s:
        async with s.session.post(s.url + COMPLETIONS, json=CMPL_BODY) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "d0 says 400"


@async_test
async def test_unusable_decode_answer_is_502():
    async with stack(p_completion()) as s:  # the default fake D answer has no usage
        async with s.session.post(s.url + COMPLETIONS, json=CMPL_BODY) as r:
            assert r.status == 502
            assert "answer not usable" in (await r.json())["error"]["message"]


def test_client_body_is_not_mutated():
    body = copy.deepcopy({**CHAT_BODY, "min_tokens": 3, "logprobs": True})
    before = copy.deepcopy(body)
    ft.prefill_body(body)
    ft.plan_decode(CHAT, body, p_chat(), P_PARAMS, before=None, max_model_len=None)
    assert body == before


def test_cli_resume_flag(monkeypatch):
    calls = []
    monkeypatch.setattr(proxy_mod, "run_proxy", lambda *a, **kw: calls.append(kw))
    assert cli.main(["proxy", "--prefill", "a", "--decode", "b", "--port", "1"]) == 0
    assert cli.main(["proxy", "--prefill", "a", "--decode", "b", "--port", "1",
                     "--resume", "replay"]) == 0
    assert [kw["resume"] for kw in calls] == ["first-token", "replay"]
    assert cli.RESUME_MODES == ft.RESUME_MODES
    with pytest.raises(SystemExit):
        cli.main(["proxy", "--prefill", "a", "--decode", "b", "--port", "1", "--resume", "x"])
    with pytest.raises(ValueError):
        build_app(["http://a"], ["http://b"], resume="x")


@pytest.mark.parametrize("proxy_cancellation", [True, False])
@async_test
async def test_client_leaving_after_t0_aborts_decode(proxy_cancellation):
    """The client has P's token and leaves while D streams: D's connection is closed (vLLM then
    aborts the request), whether or not the hosting server cancels handlers on disconnect."""
    aborted = asyncio.Event()

    async def d_handler(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(400):  # ~20 s if never aborted
                chunk = {"id": "x", "object": "text_completion", "created": 1, "model": "tiny",
                         "choices": [{"index": 0, "text": "a", "logprobs": None,
                                      "finish_reason": None, "stop_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.05)
        except (ConnectionResetError, asyncio.CancelledError):
            aborted.set()
            raise
        return resp

    d_app = web.Application()
    d_app.router.add_post(COMPLETIONS, d_handler)
    p = FakeUpstream("p0", answer=p_completion())
    async with serve(p.app) as p_url, serve(d_app) as d_url:
        app = build_app([p_url], [d_url], health_interval=0)
        async with serve(app, handler_cancellation=proxy_cancellation) as url:
            async with aiohttp.ClientSession() as session:
                r = await session.post(url + COMPLETIONS, json={**CMPL_BODY, "max_tokens": 900,
                                                                "stream": True})
                first = await r.content.readuntil(b"\n\n")
                assert events(first)[0]["choices"][0]["text"] == " Paris"  # P's token
                assert events(await r.content.readuntil(b"\n\n"))[0]["choices"][0]["text"] == "a"
                r.close()
            await asyncio.wait_for(aborted.wait(), timeout=3)
