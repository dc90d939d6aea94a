"""Zero replay (the first-token resume): which requests use it, what D is sent, and how P's first
token and D's continuation become the client's answer. Pure: dicts in, dicts and bytes out.

The contract with the connector:

- router -> P: ``kv_transfer_params.pd_resume = "first_token"`` (absent or ``"replay"``: the
  standard flow, where D recomputes the last prompt token(s) and samples the first token itself);
- P -> router, when P honours it: P computed the whole prompt (N tokens), sampled the first token
  t0 with the client's sampling parameters and returns ``replay_offset = N`` and
  ``pd_first_token = t0``. When P decides otherwise (a decode configuration that must recompute
  several tokens, nothing to hand over), ``pd_first_token`` is absent and the standard flow runs;
- router -> D: ``POST /v1/completions`` with ``prompt = prompt_token_ids + [t0]`` (token ids),
  ``max_tokens`` = the client's limit - 1, the client's sampling parameters, its ``stream`` and
  P's ``kv_transfer_params`` unchanged. D loads N tokens and computes one position (t0), which
  yields the second token.

The client then gets t0 (from P's answer) followed by D's tokens, with the ids, logprobs, usage
and finish reason an aggregated vLLM 0.32 server reports for the same request; streamed, t0's
chunk leaves as soon as P answers, before D is even asked.

vLLM 0.32's answer shapes this relies on (vllm/entrypoints/openai/completion/ and
chat_completion/, protocol.py and serving.py), with ``return_token_ids``:

- completions: ``choices[0].prompt_token_ids`` and ``choices[0].token_ids`` (per choice); streamed,
  ``prompt_token_ids`` in the choice of the first chunk only, ``token_ids`` per chunk (the delta);
  logprobs ``{text_offset, token_logprobs, tokens, top_logprobs: [{token: logprob}]}``;
- chat: top-level ``prompt_token_ids`` (first chunk only when streamed), ``choices[0].token_ids``;
  logprobs ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pd_connector.core.params import KEY_FIRST_TOKEN, KEY_REPLAY_OFFSET, KEY_RESUME
from pd_connector.core.params import RESUME_FIRST_TOKEN as RESUME_FIRST_TOKEN_PARAM
from pd_connector.proxy.bodies import ROUTES, build_decode_body, build_prefill_body

# kv_transfer_params fields of the resume contract (router -> P: KEY_RESUME; P -> D through the
# router: KEY_FIRST_TOKEN with replay_offset = N) are the connector's (core/params.py).
RESUME_FIRST_TOKEN_WIRE = RESUME_FIRST_TOKEN_PARAM

# The proxy's --resume choices: zero replay where the request allows it, or always the standard
# flow (today's behaviour, for P/D pairs whose connector predates the contract or for A/B runs).
RESUME_FIRST_TOKEN = "first-token"
RESUME_REPLAY = "replay"
RESUME_MODES = (RESUME_FIRST_TOKEN, RESUME_REPLAY)
DEFAULT_RESUME = RESUME_FIRST_TOKEN

COMPLETIONS, CHAT = ROUTES
DECODE_PATH = COMPLETIONS  # D always gets a token-id prompt, which only /v1/completions takes
# vLLM's completions default for a missing or null max_tokens (CompletionRequest.max_tokens and
# its normalize_null_max_tokens validator).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Request fields that zero replay reproduces exactly: copied to D as they are (token-level
# sampling controls, which act on each position alone, and transport/identity fields). A field
# outside the sets below sends the request through the standard flow: a vLLM feature the proxy
# does not know could depend on the generated text or tokens, which D would not see whole.
_PASS_TO_D = frozenset({
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "logit_bias", "allowed_token_ids", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "length_penalty", "bad_words", "stream",
    "stream_options", "stream_interval", "priority", "cache_salt", "user", "request_id",
    "session_id", "return_tokens_as_token_ids", "return_token_ids", "logprob_token_ids",
})
# Fields P alone acts on (they shape the prompt, which D receives as P's token ids) or that are
# translated for D below; never copied as they are.
_COMMON_HANDLED = frozenset({
    "kv_transfer_params", "n", "best_of", "use_beam_search", "min_tokens", "echo",
    "prompt_logprobs", "response_format", "structured_outputs", "watermarking", "vllm_xargs",
    "thinking_token_budget", "repetition_detection", "truncate_prompt_tokens",
    "truncation_side", "add_special_tokens",
})
_COMPLETIONS_HANDLED = frozenset({"prompt", "max_tokens", "logprobs", "suffix", "prompt_embeds"})
_CHAT_HANDLED = frozenset({
    "messages", "max_tokens", "max_completion_tokens", "min_completion_tokens", "logprobs",
    "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "include_reasoning", "chat_template", "chat_template_kwargs", "documents",
    "add_generation_prompt", "continue_final_message", "return_prompt_text",
    "mm_processor_kwargs", "media_io_kwargs",
})
_KNOWN = {
    COMPLETIONS: _PASS_TO_D | _COMMON_HANDLED | _COMPLETIONS_HANDLED,
    CHAT: _PASS_TO_D | _COMMON_HANDLED | _CHAT_HANDLED,
}


@dataclass(frozen=True)
class Replay:
    """Why a request takes the standard flow: ``reason`` is a metric label from a fixed
    vocabulary, ``detail`` the sentence for the log."""

    reason: str
    detail: str


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _stops(body: dict) -> list[str] | None:
    """The client's stop strings as a list (None: a value vLLM would reject anyway)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    return None


def client_limit(path: str, body: dict) -> int | None:
    """The client's cap on generated tokens (None: chat without one, i.e. up to the context)."""
    if path == COMPLETIONS:
        value = body.get("max_tokens")
        return COMPLETIONS_DEFAULT_MAX_TOKENS if value is None else value
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


def _has_media(messages: Any) -> bool:
    """True when a chat message carries a non-text part (image, audio, video, embeddings...)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return True
    return False


def _thinking_kwargs(kwargs: Any) -> bool:
    return isinstance(kwargs, dict) and any(
        "think" in str(k).lower() or "reason" in str(k).lower() for k in kwargs)


# Long: one flat list of rules, each with its reason, read top to bottom.
def replay_reason(path: str, body: dict) -> Replay | None:  # noqa: C901
    """Why this request must take the standard flow (None: zero replay applies), decided from
    the request alone, before P is asked (P must know whether to sample t0 for D)."""
    if path not in _KNOWN:
        return Replay("route", f"{path} is not a generate route")
    unknown = sorted(k for k in body if k not in _KNOWN[path])
    if unknown:
        # A field the proxy does not know might depend on the generated text; D would miss t0.
        return Replay("unknown_field", f"request field(s) {', '.join(unknown)} not known to the proxy")
    n, best_of = body.get("n"), body.get("best_of")
    if n not in (None, 1) or best_of not in (None, 1):
        # P returns one child's params for all n children and each sample has its own t0.
        return Replay("n", "n > 1 (each sample has its own first token)")
    if body.get("use_beam_search"):
        return Replay("beam_search", "beam search keeps several first tokens")
    limit = client_limit(path, body)
    if limit is not None and (not _is_int(limit) or limit < 1):
        return Replay("max_tokens", "max_tokens < 1 or not an integer (left to vLLM's checks)")
    if body.get("echo"):
        return Replay("echo", "echo returns the prompt, which D would see with t0 appended")
    if body.get("prompt_logprobs") is not None:
        return Replay("prompt_logprobs", "prompt logprobs come from one engine's prefill")
    if (body.get("response_format") not in (None, {"type": "text"})
            or body.get("structured_outputs") is not None):
        # The grammar's state after t0 would be lost: D's grammar would start at the 2nd token.
        return Replay("structured_output", "structured output (a grammar must see every token)")
    if body.get("presence_penalty") or body.get("frequency_penalty") or body.get("bad_words"):
        # These act on the generated tokens only; t0 is in D's prompt, so D would not count it.
        return Replay("output_penalty", "presence/frequency penalty or bad_words (need t0 as output)")
    if body.get("seed") is not None and body.get("temperature") != 0:
        # A seeded sampler draws t1 from the generator state after t0; D's would start afresh,
        # so the output would differ from an aggregated server's for the same seed.
        return Replay("seeded_sampling", "seeded random sampling (the generator state after t0)")
    if (body.get("watermarking") or body.get("repetition_detection") is not None
            or body.get("vllm_xargs") is not None):
        return Replay("output_state", "watermarking, repetition_detection or vllm_xargs "
                      "(per-request state over the output)")
    if body.get("thinking_token_budget") is not None:
        return Replay("reasoning", "thinking_token_budget (counts reasoning tokens from the first)")
    if _stops(body) is None:
        return Replay("stop_form", "stop is neither a string nor a list of strings")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and not _is_int(min_tokens):
        return Replay("min_tokens", "min_tokens is not an integer")
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and not (prompt and all(_is_int(t) for t in prompt)):
            return Replay("batched_prompt", "a list of prompts (one answer per prompt)")
        if not (isinstance(prompt, str) and prompt) and not isinstance(prompt, list):
            return Replay("prompt_form", "prompt is not text or token ids (e.g. prompt_embeds)")
        if body.get("suffix") is not None or body.get("prompt_embeds") is not None:
            return Replay("prompt_form", "suffix or prompt_embeds")
        if body.get("logprobs") is not None and not _is_int(body.get("logprobs")):
            return Replay("logprobs_form", "logprobs is not an integer")
        return None
    # Chat: vLLM runs tool and reasoning parsers over the generated text; the proxy cannot.
    if body.get("tools") or body.get("tool_choice") is not None:
        return Replay("tools", "tools/tool_choice (vLLM's tool parser reads the whole output)")
    if (body.get("reasoning_effort") is not None or "include_reasoning" in body
            or _thinking_kwargs(body.get("chat_template_kwargs"))):
        return Replay("reasoning", "reasoning requested (vLLM's reasoning parser reads the whole output)")
    if _has_media(body.get("messages")) or body.get("mm_processor_kwargs") or body.get("media_io_kwargs"):
        # D would get the placeholder token ids without the media (positions, e.g. M-RoPE, differ).
        return Replay("multimodal", "non-text message parts")
    if body.get("logprobs") and body.get("return_tokens_as_token_ids"):
        # Chat logprobs carry bytes of the decoded token, which D's completion form does not.
        return Replay("logprobs_form", "chat logprobs with return_tokens_as_token_ids")
    top = body.get("top_logprobs")
    if body.get("logprobs") and top is not None and not _is_int(top):
        return Replay("logprobs_form", "top_logprobs is not an integer")
    return None


def answered_by_prefill(path: str, body: dict) -> bool:
    """True when the client asks for one token: P's answer is the whole answer (ask it with
    ``prefill_body(..., standalone=True)``)."""
    return client_limit(path, body) == 1


def prefill_body(body: dict, decode_min_recompute: int | None = None, *,
                 standalone: bool = False) -> dict:
    """P's body for zero replay: the standard one-token prefill plus ``pd_resume``; P must also
    return the prompt's token ids and sample t0 as an aggregated server samples the first token.

    ``standalone``: the client wants that one token only; P gets no kv_transfer_params and
    answers as an aggregated server (no handoff: nothing held on P for a D that never comes).
    """
    p = build_prefill_body(body, decode_min_recompute)
    if standalone:
        del p["kv_transfer_params"]
    else:
        p["kv_transfer_params"][KEY_RESUME] = RESUME_FIRST_TOKEN_WIRE
    p["return_token_ids"] = True
    min_tokens = body.get("min_tokens")
    if _is_int(min_tokens) and min_tokens > 0:
        # min_tokens >= 1 keeps EOS and stop tokens/strings off the first position (the
        # standard prefill drops min_tokens: its token is thrown away).
        p["min_tokens"] = 1
    return p


@dataclass(frozen=True)
class FirstToken:
    """P's first token and everything about it the client's answer needs."""

    token: int
    prompt_ids: list[int]
    text: str
    logprobs: dict | None  # P's choice logprobs, in the route's form
    finish_reason: str | None
    stop_reason: Any
    answer: dict  # P's whole JSON (id, created, model, usage, system_fingerprint, ...)
    choice: dict

    @property
    def prompt_tokens(self) -> int:
        usage = self.answer.get("usage")
        value = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return value if _is_int(value) else len(self.prompt_ids)


def offered(kv_params: dict | None) -> bool:
    """True when P sampled t0 for D (``pd_first_token`` set)."""
    return isinstance(kv_params, dict) and kv_params.get(KEY_FIRST_TOKEN) is not None


# Long: every check of P's answer, each with its reason, in one place.
def parse_prefill(  # noqa: C901
    path: str, p_data: dict, kv_params: dict | None, *, standalone: bool = False,
) -> FirstToken | Replay:
    """P's answer as a ``FirstToken``, or why zero replay cannot use it. ``standalone``: P was
    asked without a handoff (``prefill_body``): the token is the one its answer reports."""
    choices = p_data.get("choices")
    if standalone:
        ids = choices[0].get("token_ids") if isinstance(choices, list) and choices \
            and isinstance(choices[0], dict) else None
        t0 = ids[0] if isinstance(ids, list) and len(ids) == 1 else None
    elif not offered(kv_params):
        return Replay("prefill_declined", "P returned no pd_first_token (it chose the standard flow)")
    else:
        assert kv_params is not None
        t0 = kv_params[KEY_FIRST_TOKEN]
    if not _is_int(t0) or t0 < 0 or not isinstance(choices, list) or len(choices) != 1 \
            or not isinstance(choices[0], dict):
        return Replay("prefill_answer", "P's answer has no usable first token or choice")
    choice = choices[0]
    if path == COMPLETIONS:
        prompt_ids = choice.get("prompt_token_ids", p_data.get("prompt_token_ids"))
        text = choice.get("text")
    else:
        prompt_ids = p_data.get("prompt_token_ids")
        message = choice.get("message")
        if not isinstance(message, dict):
            return Replay("prefill_answer", "P's chat answer has no message")
        usage = p_data.get("usage")
        if (message.get("reasoning") is not None or message.get("reasoning_content") is not None
                or message.get("tool_calls") or message.get("function_call") is not None
                or (isinstance(usage, dict) and usage.get("completion_tokens_details") is not None)):
            # P's server runs a reasoning or tool parser (completion_tokens_details is set only
            # with --reasoning-parser): the text must be parsed whole, by vLLM.
            return Replay("parser_output", "P's server parses chat output (reasoning/tool parser)")
        text = message.get("content")
    if not isinstance(text, str):
        return Replay("prefill_answer", "P's answer has no text for its token")
    if not standalone and choice.get("finish_reason") in (None, "length") and (not text or "\ufffd" in text):
        # t0 is part of a character (P's text for it is "" or U+FFFD). vLLM 0.32's
        # FastIncrementalDetokenizer on D primes its DecodeStream with a prompt ending
        # mid-character and returns the whole prompt's text ahead of the output
        # (vllm/v1/engine/detokenizer.py; vllm#48853): D computes it all instead.
        return Replay("partial_character", "P's first token is part of a character (its text is empty or U+FFFD)")
    if not isinstance(prompt_ids, list) or not prompt_ids or not all(_is_int(t) for t in prompt_ids):
        return Replay("prefill_answer", "P's answer has no prompt_token_ids")
    token_ids = choice.get("token_ids")
    if token_ids is not None and token_ids != [t0]:
        return Replay("prefill_answer", f"P's token_ids {token_ids!r} disagree with pd_first_token {t0}")
    offset = len(prompt_ids) if standalone else (kv_params or {}).get(KEY_REPLAY_OFFSET)
    if offset != len(prompt_ids):
        # D accepts P's first token only on top of exactly the R = N tokens P handed over.
        return Replay("prefill_answer",
                      f"replay_offset={offset!r} is not P's {len(prompt_ids)} prompt tokens")
    logprobs = choice.get("logprobs")
    return FirstToken(
        token=t0, prompt_ids=list(prompt_ids), text=text,
        logprobs=logprobs if isinstance(logprobs, dict) else None,
        finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
        answer=p_data, choice=choice,
    )


def finished_by_prefill(path: str, body: dict, first: FirstToken, max_model_len: int | None) -> str | None:
    """The finish reason when t0 ends the request (D is then never asked), else None."""
    if first.finish_reason not in (None, "length"):
        return first.finish_reason  # "stop": EOS, a stop token or a stop string at t0
    limit = client_limit(path, body)
    if limit is not None and limit <= 1:
        return "length"
    if max_model_len is not None and len(first.prompt_ids) + 1 >= max_model_len:
        # The context is full after t0: an aggregated server stops there (and D would refuse a
        # zero-token request).
        return "length"
    return None


def straddling_stop(body: dict, text: str) -> str | None:
    """A stop string that could begin inside t0's text and end in D's (None: none can).

    D checks stop strings against its own output only, so such a match would be missed. It is
    possible exactly when a proper prefix of a stop string is a suffix of t0's text (a stop
    string wholly inside t0's text was P's to find, or is out of vLLM's search window too).
    """
    for stop in _stops(body) or []:
        for k in range(1, min(len(stop) - 1, len(text)) + 1):
            if text.endswith(stop[:k]):
                return stop
    return None


def decode_body(
    path: str, body: dict, first: FirstToken, kv_params: dict | None, max_model_len: int | None,
) -> dict | Replay:
    """D's /v1/completions body: P's prompt ids + [t0], the client's limit - 1 and sampling."""
    d = {k: v for k, v in body.items() if k in _PASS_TO_D}
    d["prompt"] = first.prompt_ids + [first.token]
    limit = client_limit(path, body)
    if limit is None:
        if max_model_len is None:
            return Replay("max_model_len_unknown", "chat without max_tokens and D's max_model_len unknown")
        # vLLM caps the answer at max_model_len - prompt (get_max_tokens); D's prompt is one
        # token longer, so this cap is the aggregated one less t0.
        limit = max_model_len
    elif max_model_len is not None and limit > max_model_len:
        # vLLM refuses it (400); through the standard flow that answer reaches the client as
        # is, rather than after a t0 already streamed.
        return Replay("max_tokens", f"max_tokens={limit} above D's max_model_len={max_model_len}")
    d["max_tokens"] = limit - 1
    min_tokens = body.get("min_tokens")
    if _is_int(min_tokens) and min_tokens > 1:
        d["min_tokens"] = min_tokens - 1  # t0 counts towards the client's minimum
    if path == CHAT:
        if body.get("logprobs"):
            top = body.get("top_logprobs")
            d["logprobs"] = top if _is_int(top) else 0
    elif body.get("logprobs") is not None:
        d["logprobs"] = body["logprobs"]
    if kv_params:
        d["kv_transfer_params"] = kv_params
    return d


MODE_FIRST_TOKEN, MODE_REPLAY = "first_token", "replay"  # metric labels


@dataclass(frozen=True)
class Plan:
    """What happens after P answered: the standard flow (``replay``) or zero replay
    (``first_token``), why (``reason``, a metric label), and what D is sent.

    ``d_body`` None: t0 ended the request (``finish_reason``) and D is not asked.
    ``fallback_body``: for a second D when the first failed before answering, without P's params
    (the first D may have claimed P's blocks): it computes the prompt itself.
    """

    mode: str
    reason: str
    detail: str
    d_path: str
    d_body: dict | None
    fallback_body: dict | None
    first: FirstToken | None = None
    finish_reason: str | None = None


def _replay_plan(path: str, body: dict, kv_params: dict | None, why: Replay) -> Plan:
    # Whatever P did, D gets the client's request and P's params, as in the standard flow. When
    # P had resumed at its first token (pd_first_token set) D refuses those params for this
    # prompt (resume_mismatch), tells P to free its blocks at once, and computes the prompt.
    return Plan(MODE_REPLAY, why.reason, why.detail, path, build_decode_body(body, kv_params),
                build_decode_body(body, None))


def plan_decode(
    path: str, body: dict, p_data: dict, kv_params: dict | None, *,
    before: Replay | None, max_model_len: int | None, standalone: bool = False,
) -> Plan:
    """Decide, once P answered, how D continues the request. ``before``: the reason found
    before P was asked (P was then not asked for its first token). ``standalone``: P was asked
    for the client's one token without a handoff (``answered_by_prefill``)."""
    if before is not None:
        return _replay_plan(path, body, kv_params, before)
    first = parse_prefill(path, p_data, kv_params, standalone=standalone)
    if isinstance(first, Replay):
        return _replay_plan(path, body, kv_params, first)
    finish = finished_by_prefill(path, body, first, max_model_len)
    if finish is not None:
        reason = "prefill_only" if standalone else "prefill_finished"
        return Plan(MODE_FIRST_TOKEN, reason, f"P's token ended the request ({finish})",
                    path, None, None, first, finish)
    stop = straddling_stop(body, first.text)
    if stop is not None:
        return _replay_plan(path, body, kv_params, Replay(
            "stop_string_boundary", f"stop string {stop!r} could start in P's token {first.text!r}"))
    d_body = decode_body(path, body, first, kv_params, max_model_len)
    if isinstance(d_body, Replay):
        return _replay_plan(path, body, kv_params, d_body)
    fallback = {k: v for k, v in d_body.items() if k != "kv_transfer_params"}
    return Plan(MODE_FIRST_TOKEN, "decoded", "D continues after P's token", DECODE_PATH, d_body,
                fallback, first)


# ---- answers ------------------------------------------------------------------------------------

def _asked_ids(body: dict) -> bool:
    return bool(body.get("return_token_ids"))


def _usage(first: FirstToken, d_completion: int, *, drop_none: bool = False) -> dict:
    """Usage as the aggregated server counts it: P's prompt, t0 plus D's tokens. P's details
    (cached prompt tokens) are the prompt's; D's would count the tokens loaded from P.
    ``drop_none``: as vLLM writes a stream's usage chunk (exclude_none)."""
    usage = dict(first.answer.get("usage") or {})
    prompt = first.prompt_tokens
    usage.update(prompt_tokens=prompt, completion_tokens=1 + d_completion,
                 total_tokens=prompt + 1 + d_completion)
    return {k: v for k, v in usage.items() if v is not None} if drop_none else usage


def _d_completion_tokens(usage: Any) -> int:
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not _is_int(value):
        raise ValueError("D's answer carries no usage.completion_tokens")
    return value


def _text_offset_base(logprobs: dict | None) -> int:
    """Where D's completions text_offset starts: after P's token, as vLLM counts it (the
    previous offset plus the previous token string's length)."""
    tokens, offsets = (logprobs or {}).get("tokens"), (logprobs or {}).get("text_offset")
    if not tokens or not offsets:
        return 0
    return offsets[-1] + len(tokens[-1])


def _shift_completion_logprobs(lp: dict | None, base: int) -> dict | None:
    if not isinstance(lp, dict):
        return lp
    return {**lp, "text_offset": [o + base for o in lp.get("text_offset") or []]}


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs_from_completion(lp: dict | None, body: dict) -> dict | None:
    """D's completions logprobs in chat form, as vLLM's _create_chat_logprobs builds them.

    Completions keep the first k+1 entries of each position's dict, chat the first k (all for
    -1 or with logprob_token_ids), in the engine's order (the sampled token first).
    """
    if not isinstance(lp, dict):
        return None
    top_k = body.get("top_logprobs")
    top_k = top_k if _is_int(top_k) else 0
    take_all = top_k == -1 or bool(body.get("logprob_token_ids"))
    values, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    content = []
    for i, token in enumerate(lp.get("tokens") or []):
        value = values[i] if i < len(values) else None
        step = tops[i] if i < len(tops) else None
        if value is None or not isinstance(step, dict):
            # vLLM: no logprobs at this position -> the default -9999.0 and no alternatives.
            content.append({"token": token, "logprob": -9999.0, "bytes": _token_bytes(token),
                            "top_logprobs": []})
            continue
        items = list(step.items()) if take_all else list(step.items())[:max(top_k, 0)]
        content.append({
            "token": token, "logprob": value, "bytes": _token_bytes(token),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": _token_bytes(t)} for t, v in items],
        })
    return {"content": content}


def _merge_logprobs(path: str, body: dict, first: FirstToken, d_lp: Any) -> dict | None:
    if path == COMPLETIONS:
        if body.get("logprobs") is None:
            return None
        p_lp = first.logprobs or {}
        d_lp = _shift_completion_logprobs(d_lp, _text_offset_base(first.logprobs)) or {}
        return {k: list(p_lp.get(k) or []) + list(d_lp.get(k) or [])
                for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
    if not body.get("logprobs"):
        return None
    d_chat = chat_logprobs_from_completion(d_lp, body) or {"content": []}
    return {"content": list((first.logprobs or {}).get("content") or []) + d_chat["content"]}


def _strip_for_client(path: str, body: dict, answer: dict, choice: dict) -> None:
    """Drop what the proxy asked P for and the client did not (token ids), and P's params."""
    if "kv_transfer_params" in answer:
        answer["kv_transfer_params"] = None
    if not _asked_ids(body):
        if "token_ids" in choice:
            choice["token_ids"] = None
        if "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = None
        if "prompt_token_ids" in answer:
            answer["prompt_token_ids"] = None


def prefill_only_response(path: str, body: dict, first: FirstToken, finish_reason: str) -> dict:
    """The client's answer when t0 ended the request: P's own answer, cleaned up."""
    answer = dict(first.answer)
    choice = {**first.choice, "finish_reason": finish_reason}
    answer["choices"] = [choice]
    _strip_for_client(path, body, answer, choice)
    return answer


def merge_response(path: str, body: dict, first: FirstToken, d_data: Any) -> dict:
    """The client's non-streamed answer: t0 (P's answer) followed by D's completion; P's id,
    created and model. Raises ValueError when D's answer is not a vLLM completion."""
    if not isinstance(d_data, dict) or not isinstance(d_data.get("choices"), list) \
            or len(d_data["choices"]) != 1 or not isinstance(d_data["choices"][0], dict):
        raise ValueError("D's answer is not a one-choice completion")
    d_choice = d_data["choices"][0]
    d_text = d_choice.get("text")
    if not isinstance(d_text, str):
        raise ValueError("D's answer has no text")
    answer = dict(first.answer)
    choice = dict(first.choice)
    d_ids = d_choice.get("token_ids") or []
    if path == COMPLETIONS:
        choice["text"] = first.text + d_text
        finish = d_choice.get("finish_reason")
    else:
        choice["message"] = {**first.choice["message"], "content": first.text + d_text}
        # vLLM's chat answer reports "stop" for an output without a finish reason.
        finish = d_choice.get("finish_reason") or "stop"
    choice.update(
        finish_reason=finish, stop_reason=d_choice.get("stop_reason"),
        logprobs=_merge_logprobs(path, body, first, d_choice.get("logprobs")),
        token_ids=[first.token] + list(d_ids) if _asked_ids(body) else None,
    )
    answer["choices"] = [choice]
    answer["usage"] = _usage(first, _d_completion_tokens(d_data.get("usage")))
    _strip_for_client(path, body, answer, choice)
    if "metrics" in answer:
        answer["metrics"] = None  # P's timing covers t0 only
    return answer


# ---- streams -------------------------------------------------------------------------------------

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event as vLLM writes it (compact JSON)."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _stream_flags(body: dict) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats), as vLLM's should_include_usage reads them."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict):
        return False, False
    usage = bool(opts.get("include_usage"))
    return usage, usage and bool(opts.get("continuous_usage_stats"))


@dataclass
class StreamAssembler:
    """The client's streamed answer: t0's chunk(s) at once (``head``), then D's completion
    chunks rewritten to the client's route (``feed``/``flush``, which take D's raw bytes and
    return the client's): one id/created/model (P's), logprob offsets and usage counting t0,
    prompt ids only once (in t0's chunk, as vLLM sends them in the first chunk only)."""

    path: str
    body: dict
    first: FirstToken
    _buf: bytes = b""
    _base: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._base = _text_offset_base(self.first.logprobs)
        self.include_usage, self.continuous = _stream_flags(self.body)

    # -- identity and shared pieces --

    def _top(self) -> dict:
        a = self.first.answer
        obj = "text_completion" if self.path == COMPLETIONS else "chat.completion.chunk"
        return {"id": a.get("id"), "object": obj, "created": a.get("created"), "model": a.get("model")}

    def _running_usage(self, completion: int) -> dict:
        n = self.first.prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": completion, "total_tokens": n + completion}

    def _ids(self, ids: Any) -> Any:
        return ids if _asked_ids(self.body) else None

    def _usage_chunk(self, usage: dict) -> dict:
        chunk = {**self._top(), "choices": [], "usage": usage}
        fingerprint = self.first.answer.get("system_fingerprint")
        if fingerprint is not None:
            chunk["system_fingerprint"] = fingerprint
        return chunk

    # -- what leaves as soon as P answered --

    def head(self, finish_reason: str | None) -> bytes:
        """t0's chunk(s); with ``finish_reason`` (t0 ended the request) the whole stream."""
        first, out = self.first, []
        fin = {} if finish_reason is None else {"stop_reason": first.stop_reason}
        if self.path == COMPLETIONS:
            choice = {"index": 0, "text": first.text,
                      "logprobs": first.logprobs if self.body.get("logprobs") is not None else None,
                      "finish_reason": finish_reason, "stop_reason": fin.get("stop_reason"),
                      "prompt_token_ids": self._ids(first.prompt_ids),
                      "token_ids": self._ids([first.token])}
            chunk = {**self._top(), "choices": [choice]}
            if self.continuous:
                chunk["usage"] = self._running_usage(1)
            out.append(chunk)
        else:
            role = first.choice["message"].get("role") or "assistant"
            opening = {**self._top(), "choices": [{"index": 0, "delta": {"role": role, "content": ""},
                                                   "logprobs": None, "finish_reason": None}],
                       "prompt_token_ids": self._ids(first.prompt_ids),
                       "prompt_text": first.answer.get("prompt_text")}
            if self.continuous:
                opening["usage"] = self._running_usage(0)
            choice = {"index": 0, "delta": {"content": first.text},
                      "logprobs": first.logprobs if self.body.get("logprobs") else None,
                      "finish_reason": finish_reason, **fin,
                      "token_ids": self._ids([first.token])}
            chunk = {**self._top(), "choices": [choice]}
            if self.continuous:
                chunk["usage"] = self._running_usage(1)
            out += [opening, chunk]
        data = b"".join(sse(c) for c in out)
        if finish_reason is not None:
            if self.include_usage:
                data += sse(self._usage_chunk(_usage(first, 0, drop_none=True)))
            data += DONE
        return data

    # -- D's chunks --

    def feed(self, chunk: bytes) -> bytes:
        """D's raw bytes in, the client's bytes out (whole events only; the rest waits)."""
        self._buf += chunk
        out = []
        while b"\n\n" in self._buf:
            event, self._buf = self._buf.split(b"\n\n", 1)
            out.append(self._event(event) + b"\n\n")
        return b"".join(out)

    def flush(self) -> bytes:
        """Whatever D sent after its last complete event (passed on as is)."""
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data:") or b"\n" in event:
            return event  # comments (SSE keep-alives) and anything unusual pass as they are
        payload = event[5:].strip()
        if payload == b"[DONE]":
            return event
        try:
            obj = json.loads(payload)
        except ValueError:
            return event
        if not isinstance(obj, dict) or "choices" not in obj:
            return event  # vLLM's in-stream errors ({"error": ...}) reach the client unchanged
        return sse(self.rewrite(obj))[:-2]

    def rewrite(self, d_chunk: dict) -> dict:
        """One of D's completion chunks as the client's chunk."""
        out = self._top()
        choices = []
        for c in d_chunk.get("choices") or []:
            if not isinstance(c, dict):
                continue
            lp = _shift_completion_logprobs(c.get("logprobs"), self._base)
            if self.path == COMPLETIONS:
                new = {**c, "index": 0, "logprobs": lp if self.body.get("logprobs") is not None else None}
                if "prompt_token_ids" in new:
                    new["prompt_token_ids"] = None  # D's prompt (with t0); the client had its own
                if "token_ids" in new:
                    new["token_ids"] = self._ids(new["token_ids"])
            else:
                chat_lp = chat_logprobs_from_completion(lp, self.body) if self.body.get("logprobs") else None
                new = {"index": 0, "delta": {"content": c.get("text") or ""}, "logprobs": chat_lp,
                       "finish_reason": c.get("finish_reason")}
                if c.get("finish_reason") is not None:
                    new["stop_reason"] = c.get("stop_reason")
                new["token_ids"] = self._ids(c.get("token_ids"))
            choices.append(new)
        out["choices"] = choices
        usage = d_chunk.get("usage")
        if isinstance(usage, dict):
            try:
                d_tokens = _d_completion_tokens(usage)
            except ValueError:
                out["usage"] = usage
            else:
                # A token chunk's running usage has the three counts only (vLLM: exclude_unset);
                # the final usage chunk also P's details (exclude_none).
                out["usage"] = (self._running_usage(1 + d_tokens) if d_chunk.get("choices")
                                else _usage(self.first, d_tokens, drop_none=True))
        for key in ("system_fingerprint",):
            if d_chunk.get(key) is not None:
                out[key] = d_chunk[key]
        return out

    def error_event(self, message: str, status: int, raw: bytes | None = None) -> bytes:
        """D failed after t0 went out: the error as vLLM streams one, then the end."""
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        if not (isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)):
            parsed = {"error": {"message": message, "type": "decode_error", "param": None,
                                "code": status}}
        return sse(parsed) + DONE


def max_model_len_of(models: Any, model: Any) -> int | None:
    """``max_model_len`` from a vLLM ``/v1/models`` answer (the entry named ``model`` if there
    is one, else the first); None when absent."""
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        return None
    entries = [e for e in data if isinstance(e, dict)]
    named = [e for e in entries if e.get("id") == model]
    for entry in named or entries[:1]:
        value = entry.get("max_model_len")
        if _is_int(value) and value > 0:
            return value
    return None
