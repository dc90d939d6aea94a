"""The official OpenAI Python client (``openai``, a vLLM dependency) pointed at an OpenAI-compatible
server (``pd-connector proxy``, vllm-router, an aggregated vLLM), and its answers as plain dicts
per choice index, streamed ones joined back into the non-streamed form, for the end-to-end tests
that compare P/D serving with aggregated serving through the library applications use."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import openai

TIMEOUT_S = 300.0  # a loaded 2-core CI box; a hang shows up as openai.APITimeoutError


def openai_client(base_url: str, timeout: float = TIMEOUT_S) -> openai.OpenAI:
    """No retries (a retry would hide a failed request and send a second handoff), every request
    bounded, and no HTTP proxy from the environment (loopback servers, as ``pd_connector.urls``)."""
    return openai.OpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key="EMPTY", max_retries=0, timeout=timeout,
        http_client=openai.DefaultHttpxClient(trust_env=False),
    )


def completion_choices(answer: Any) -> dict[int, dict]:
    """A non-streamed /v1/completions answer's choices by index, vLLM's extra fields
    (``token_ids``, ``prompt_token_ids``) included."""
    return {c["index"]: c for c in answer.model_dump()["choices"]}


def streamed_completion_choices(chunks: Iterable[Any]) -> tuple[dict[int, dict], dict | None]:
    """Streamed /v1/completions chunks joined per choice index into the non-streamed form (text,
    token_ids, logprobs lists, finish_reason), and the usage of the last chunk that had one."""
    out: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        data = chunk.model_dump()
        usage = data.get("usage") or usage
        for c in data["choices"]:
            acc = out.setdefault(c["index"], {"index": c["index"], "text": "", "token_ids": [],
                                              "logprobs": None, "finish_reason": None})
            acc["text"] += c.get("text") or ""
            acc["token_ids"] += c.get("token_ids") or []
            if lp := c.get("logprobs"):
                joined = acc["logprobs"] = acc["logprobs"] or {
                    "tokens": [], "token_logprobs": [], "top_logprobs": []}
                for key, values in joined.items():
                    values += lp.get(key) or []
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    return out, usage


def chat_choices(answer: Any) -> dict[int, dict]:
    """A non-streamed chat answer's choices by index: content, token_ids, logprobs (the
    ``content`` list: token, logprob, top_logprobs), finish_reason."""
    out = {}
    for c in answer.model_dump()["choices"]:
        out[c["index"]] = {"content": c["message"]["content"], "token_ids": c.get("token_ids"),
                           "logprobs": (c.get("logprobs") or {}).get("content"),
                           "finish_reason": c["finish_reason"]}
    return out


def streamed_chat_choices(chunks: Iterable[Any]) -> tuple[dict[int, dict], dict | None]:
    """Streamed chat chunks joined per choice index into ``chat_choices``' form, and the usage."""
    out: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        data = chunk.model_dump()
        usage = data.get("usage") or usage
        for c in data["choices"]:
            acc = out.setdefault(c["index"], {"content": "", "token_ids": [], "logprobs": None,
                                              "finish_reason": None})
            acc["content"] += (c.get("delta") or {}).get("content") or ""
            acc["token_ids"] += c.get("token_ids") or []
            if lp := (c.get("logprobs") or {}).get("content"):
                acc["logprobs"] = (acc["logprobs"] or []) + lp
            acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
    return out, usage


def chat_mismatch(ref: dict, got: dict, logprob_tol: float = 1e-4) -> str | None:
    """Why a chat choice differs from the reference's (None: the same tokens, text and finish
    reason, each token's logprob within ``logprob_tol``)."""
    for key in ("token_ids", "content", "finish_reason"):
        if got[key] != ref[key]:
            return f"{key}: {got[key]!r} != {ref[key]!r}"
    if (ref["logprobs"] is None) != (got["logprobs"] is None):
        return f"logprobs present in one answer only: {got['logprobs']!r} vs {ref['logprobs']!r}"
    if ref["logprobs"] is not None:
        tokens = [e["token"] for e in got["logprobs"]], [e["token"] for e in ref["logprobs"]]
        if tokens[0] != tokens[1]:
            return f"logprob tokens {tokens[0]} != {tokens[1]}"
        diff = max((abs(a["logprob"] - b["logprob"]) for a, b in zip(got["logprobs"], ref["logprobs"])),
                   default=0.0)
        if not diff <= logprob_tol or any(math.isnan(e["logprob"]) for e in got["logprobs"]):
            return f"logprob diff {diff:.2e} > {logprob_tol:.0e}"
    return None
