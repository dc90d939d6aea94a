"""``pd-connector check``: does this P/D pair hand a prompt over correctly?

Talks to the two vLLM servers directly (not through a proxy), with the standard library only
(``client``):

1. both answer ``/health`` and ``/v1/models`` and serve the same model;
2. one prefill on P with ``do_remote_decode`` and a token-id prompt of N tokens; P must return
   ``kv_transfer_params`` with ``replay_offset`` and ``pd_protocol_version`` (pd_connector's);
3. a greedy decode on D with those params, and the same decode on D without them (D computes the
   prompt itself); each request carries a fresh ``cache_salt`` so neither hits D's prefix cache;
4. with more than one data-parallel engine behind P's API server (vLLM's ``--data-parallel-size``),
   one more handoff from each P engine, steered with vLLM's ``X-data-parallel-rank`` header, to
   the D engines in turn, each compared with D computing the prompt itself;
5. report the replay offset, the tokens D recomputes, the blocks per KV-cache group, P's latency,
   D's latency with and without the handoff, what D's ``vllm:pd_events_total`` counters say about
   the handoff (when D exports them), and whether the first tokens match.

Every problem found becomes one line saying what to do; the exit code is 0 only when there is
none.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from pd_connector.check.client import (
    DEFAULT_TIMEOUT_S,
    Generation,
    http_request,
    parse_generation,
    read_events,
)
from pd_connector.check.engines import check_dp_engines
from pd_connector.core.params import KEY_REPLAY_OFFSET, KEY_VERSION, PREFILL_REQUEST_PARAMS
from pd_connector.core.protocol import PROTOCOL_VERSION
from pd_connector.urls import normalize_url

logger = logging.getLogger("pd_connector.check.run")

DEFAULT_PROMPT_TOKENS = 64
MAX_TOKENS = 8
# A differing greedy token is put down to numerical noise when D's own top-2 logprobs at that
# position (computing the prompt itself) are closer than this (bf16 noise is ~4e-3).
TIE_MARGIN = 0.02
# How long to wait for D's Prometheus counters to show the handoff (vLLM updates them per step).
METRICS_WAIT_S = 3.0

PREFILL_KV_PARAMS = PREFILL_REQUEST_PARAMS
_PRODUCER_CONFIG = ('--kv-transfer-config \'{"kv_connector":"PDConnector",'
                    '"kv_connector_module_path":"pd_connector.connector","kv_role":"kv_producer",'
                    '...}\'')
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def make_prompt(n: int) -> list[int]:
    """A deterministic token-id prompt of ``n`` ids in [4, 999] (clear of special tokens)."""
    return [4 + (i * 389 + 17) % 996 for i in range(n)]


@dataclass
class CheckReport:
    prefill_url: str
    decode_url: str
    prompt_tokens: int
    model: str | None = None
    p_ms: float | None = None
    kv_params: dict | None = None
    replay_offset: int | None = None
    recompute_tokens: int | None = None
    blocks_per_group: list[int] | None = None
    d_ms_handoff: float | None = None
    d_ms_plain: float | None = None
    tokens_handoff: list[int] | None = None
    tokens_plain: list[int] | None = None
    tokens_match: bool | None = None
    d_events: dict[str, float] | None = None  # vllm:pd_events_total deltas on D
    info: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        lines = [f"pd-connector check: P {self.prefill_url}  D {self.decode_url}"]
        lines += [f"  {line}" for line in self.info]
        lines += [f"  note: {line}" for line in self.notes]
        lines += [f"PROBLEM: {line}" for line in self.problems]
        lines.append("OK: P hands the prompt over to D and D's output matches"
                     if self.ok else f"FAILED: {len(self.problems)} problem(s)")
        return "\n".join(lines)



def _host(url: str) -> str:
    return (urllib.parse.urlsplit(url).hostname or "").lower()


def run_check(
    prefill_url: str,
    decode_url: str,
    *,
    model: str | None = None,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    timeout: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[str], None] | None = None,
) -> CheckReport:
    """Run every check against one P and one D; never raises for what the servers do."""
    p_url, d_url = normalize_url(prefill_url), normalize_url(decode_url)
    rep = CheckReport(p_url, d_url, prompt_tokens)
    say = progress or logger.info

    rep.model = model = _servers_and_model(rep, p_url, d_url, model, timeout, say)
    if model is None:
        return rep
    rep.info.append(f"model {model!r} served by P and D")
    prompt = make_prompt(prompt_tokens)
    salt = uuid.uuid4().hex  # fresh prefix-cache namespaces: nothing is served from cache
    base = {"model": model, "prompt": prompt, "temperature": 0.0, "stream": False}
    params = _prefill_on_p(rep, p_url, d_url, base, salt, prompt_tokens, timeout, say)
    gen_body = {**base, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
    handoff, plain = _decode_on_d(rep, d_url, gen_body, params, salt, timeout, say)
    if rep.d_ms_handoff is not None:
        rep.info.append(
            f"D: {MAX_TOKENS} tokens in {_fmt_ms(rep.d_ms_handoff)} with the handoff, "
            f"{_fmt_ms(rep.d_ms_plain)} computing the prompt itself (a P's first handoff "
            "includes the side-channel handshake: run check again for a warm number)")
    elif rep.d_ms_plain is not None:
        rep.info.append(f"D: {MAX_TOKENS} tokens in {_fmt_ms(rep.d_ms_plain)} computing the "
                        "prompt itself (no handoff to compare)")
    if handoff is not None and plain is not None:
        _compare(rep, handoff, plain)
    if params is not None and KEY_REPLAY_OFFSET in params and plain is not None:
        check_dp_engines(rep, p_url, d_url, base, gen_body, salt, plain, timeout, say)
    return rep


def _servers_and_model(rep: CheckReport, p_url: str, d_url: str, model: str | None, timeout: float, say) -> str | None:
    """Step 1: both servers reachable, healthy and serving one model (returned; None with the
    problems in ``rep``)."""
    served: dict[str, list[str]] = {}
    for role, url in (("P", p_url), ("D", d_url)):
        say(f"{role}: GET {url}/health")
        health = http_request(url + "/health", timeout=min(timeout, 10.0))
        if health.status is None:
            rep.problems.append(
                f"{role} at {url} is not reachable ({health.error}): check that its vLLM server "
                "is running and the URL (host and --port) is right")
            continue
        if isinstance(health.data, dict) and {"prefill", "decode"} <= health.data.keys():
            rep.problems.append(
                f"{role} URL {url} is a pd-connector proxy, not a vLLM server: pass the P and D "
                "servers' own URLs to check")
            continue
        if health.status != 200:
            rep.problems.append(
                f"{role} at {url} answered /health with HTTP {health.status}: its engine is not "
                "ready or has died; see that server's log")
        models = http_request(url + "/v1/models", timeout=min(timeout, 10.0))
        ids = [m.get("id") for m in (models.data or {}).get("data", []) if isinstance(m, dict)] \
            if isinstance(models.data, dict) else []
        if models.status != 200 or not ids:
            rep.problems.append(
                f"{role} at {url} did not list its models on /v1/models ({models.message()}): "
                "is this a vLLM OpenAI-compatible server?")
            continue
        served[role] = [str(i) for i in ids]
    if len(served) < 2:
        return None
    if model is not None:
        for role in ("P", "D"):
            if model not in served[role]:
                rep.problems.append(
                    f"{role} does not serve model {model!r} (it serves {', '.join(served[role])}): "
                    f"pass --model with the --served-model-name both servers use")
        if rep.problems:
            return None
    else:
        common = [m for m in served["P"] if m in served["D"]]
        if not common:
            rep.problems.append(
                f"P serves {', '.join(served['P'])} but D serves {', '.join(served['D'])}: start "
                "both with the same model and --served-model-name (a handoff needs the same model "
                "on both sides)")
            return None
        model = common[0]
    return model


def _prefill_on_p(rep: CheckReport, p_url: str, d_url: str, base: dict, salt: str, prompt_tokens: int,
                  timeout: float, say) -> dict | None:
    """Step 2: a prefill on P; the kv_transfer_params it returned, checked (None if unusable)."""
    say(f"P: prefill of {prompt_tokens} tokens")
    p_ans = http_request(p_url + "/v1/completions", {
        **base, "max_tokens": 1, "kv_transfer_params": dict(PREFILL_KV_PARAMS),
        "cache_salt": f"pdcheck-{salt}-handoff"}, timeout)
    params: dict | None = None
    if p_ans.status != 200:
        rep.problems.append(f"P failed the prefill request ({p_ans.message()})")
    else:
        rep.p_ms = p_ans.elapsed_s * 1e3
        rep.info.append(f"P: prefill of {prompt_tokens} tokens in {_fmt_ms(rep.p_ms)}")
        raw = p_ans.data.get("kv_transfer_params") if isinstance(p_ans.data, dict) else None
        params = raw if isinstance(raw, dict) and raw else None
        rep.kv_params = params
        _check_params(rep, params, p_url, d_url, prompt_tokens)
    return params


def _decode_on_d(rep: CheckReport, d_url: str, gen_body: dict, params: dict | None, salt: str, timeout: float,
                 say) -> "tuple[Generation | None, Generation | None]":
    """Step 3: the same decode on D with P's handoff and without it."""
    handoff: Generation | None = None
    if params is not None:
        before = read_events(d_url, timeout)
        say("D: decode with P's kv_transfer_params")
        ans = http_request(d_url + "/v1/completions", {
            **gen_body, "kv_transfer_params": params, "cache_salt": f"pdcheck-{salt}-handoff"},
            timeout)
        if ans.status != 200:
            rep.problems.append(
                f"D failed the decode with P's kv_transfer_params ({ans.message()}): see D's log "
                "(a load failure with load_failure_policy 'fail' ends this way)")
        else:
            rep.d_ms_handoff = ans.elapsed_s * 1e3
            handoff = parse_generation(ans.data)
            if handoff is None:
                rep.problems.append(f"D's answer is not a completion: {ans.text[:200]}")
            if KEY_REPLAY_OFFSET in params:  # else the problem is already named, once
                _check_events(rep, d_url, before, timeout)
    say("D: the same decode without kv_transfer_params")
    ans = http_request(d_url + "/v1/completions", {**gen_body, "cache_salt": f"pdcheck-{salt}-plain"},
                timeout)
    plain: Generation | None = None
    if ans.status != 200:
        rep.problems.append(f"D failed a plain decode request ({ans.message()}): D cannot serve "
                            "this model or prompt on its own; see D's log")
    else:
        rep.d_ms_plain = ans.elapsed_s * 1e3
        plain = parse_generation(ans.data)
        if plain is None:
            rep.problems.append(f"D's answer is not a completion: {ans.text[:200]}")
    return handoff, plain


def _check_params(rep: CheckReport, params: dict | None, p_url: str, d_url: str, n: int) -> None:
    if params is None:
        rep.problems.append(
            "P is not configured with a kv_producer connector: its answer carries no "
            f"kv_transfer_params; start P with {_PRODUCER_CONFIG}")
        return
    if KEY_REPLAY_OFFSET not in params:
        rep.problems.append(
            "P runs vLLM's NixlConnector or another connector, not pd_connector: its "
            "kv_transfer_params have no replay_offset; set \"kv_connector\":\"PDConnector\" and "
            "\"kv_connector_module_path\":\"pd_connector.connector\" in P's --kv-transfer-config")
        return
    version = params.get(KEY_VERSION)
    if version != PROTOCOL_VERSION:
        rep.problems.append(
            f"P speaks pd_connector protocol version {version!r}, this pd-connector speaks "
            f"{PROTOCOL_VERSION}: install the same pd_connector version on P and D")
    offset = params.get(KEY_REPLAY_OFFSET)
    if not isinstance(offset, int) or isinstance(offset, bool):
        rep.problems.append(f"P returned a malformed replay_offset {offset!r}: P's pd_connector is "
                            "broken or the params were altered; see P's log")
        return
    rep.replay_offset, rep.recompute_tokens = offset, n - offset
    blocks = params.get("remote_block_ids")
    if isinstance(blocks, list) and all(isinstance(g, list) for g in blocks):
        rep.blocks_per_group = [len(g) for g in blocks]
    rep.info.append(
        f"P: replay_offset {offset}, D recomputes {n - offset} token(s); blocks per KV-cache "
        f"group {rep.blocks_per_group}; protocol version {version}")
    if offset <= 0:
        rep.problems.append(
            f"P handed nothing over (replay_offset {offset}): the {n}-token prompt is shorter than "
            "P's minimum recompute, or P computed a different number of tokens than it promised; "
            "retry with a larger --prompt-tokens and see P's log (pd_connector lines)")
    side_host = str(params.get("remote_host") or "")
    if (side_host.lower() in _LOOPBACK and _host(d_url) not in _LOOPBACK
            and _host(p_url) not in _LOOPBACK and _host(p_url) != _host(d_url)):
        rep.problems.append(
            f"P advertises its side channel at {side_host}:{params.get('remote_port')}, which D "
            f"on another host cannot reach: set side_channel_host in P's "
            "kv_connector_extra_config to an address D can reach")


def _check_events(rep: CheckReport, d_url: str, before: dict | None, timeout: float) -> None:
    if before is None:
        rep.notes.append("D's /metrics could not be read: cannot confirm that D used the handoff")
        return
    deadline = time.monotonic() + METRICS_WAIT_S
    delta: dict[str, float] = {}
    while True:
        after = read_events(d_url, timeout) or {}
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
        if delta or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    rep.d_events = delta
    refused = sorted(k.split(":", 1)[1] for k in delta if k.startswith("refused:"))
    failed = sorted(k.split(":", 1)[1] for k in delta if k.startswith("load_failed:"))
    if refused:
        rep.problems.append(
            f"D refused P's handoff ({', '.join(refused)}) and computed the prompt itself: see "
            "D's log for 'refusing the handoff' (docs/failure-modes.md lists each kind)")
    if failed:
        rep.problems.append(
            f"D could not load P's KV ({', '.join(failed)}) and computed the prompt itself: check "
            "that D reaches P's side channel (remote_host/remote_port) and NIXL works between "
            "them; see D's log")
    if delta.get("handoff_accepted"):
        rep.info.append("D accepted the handoff (vllm:pd_events_total{event=\"handoff_accepted\"})")
    elif not refused and not failed:
        rep.notes.append(
            "D's vllm:pd_events_total did not move: D may not run PDConnector as kv_consumer "
            "(then it ignores the params and computes the prompt itself), or its stats are off")


def _compare(rep: CheckReport, handoff: Generation, plain: Generation) -> None:
    a, b = handoff.token_ids, plain.token_ids
    rep.tokens_handoff, rep.tokens_plain = a, b
    if not a and not b:  # server did not return token ids: compare the text
        rep.tokens_match = handoff.text == plain.text
    else:
        rep.tokens_match = a == b
    if rep.tokens_match:
        rep.info.append(f"first {MAX_TOKENS} tokens match with and without the handoff: {a}")
        return
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    margin = math.inf
    if pos < len(plain.top) and len(plain.top[pos]) >= 2:
        top = sorted(plain.top[pos].values(), reverse=True)
        margin = top[0] - top[1]
    if margin < TIE_MARGIN:
        rep.notes.append(
            f"outputs differ from token {pos} on, where D's own top two choices are {margin:.1e} "
            f"apart (a near-tie: numerical noise, not counted): {a} vs {b}")
        return
    rep.problems.append(
        f"D's output with the handoff differs from D computing the prompt itself at token {pos} "
        f"({a} vs {b}): the KV D loaded does not match the prompt; check that P and D run the "
        "same model, dtype and kv-cache dtype, and see D's log")


def _fmt_ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.1f} ms"


def main(args: Any) -> int:
    """Entry point for ``pd-connector check`` (``args`` from the CLI parser)."""
    rep = run_check(args.prefill, args.decode, model=args.model,
                    prompt_tokens=args.prompt_tokens, timeout=args.timeout)
    print(rep.format())
    return 0 if rep.ok else 1

