"""One client request through the proxy: prefill on a P (retried on another P after a
connection error, timeout or 5xx), then decode on a D with P's ``kv_transfer_params`` (sent once
to another D, without them, when the first fails before answering). Independently of both, a
request that hits a pooled keep-alive connection the upstream has just closed is sent once more to
the same upstream on a new connection (``relay.UpstreamClient``).

Standard flow per request (the same steps as vLLM's toy proxy, which works with the NIXL
connector on 0.32.0):

1. POST a copy of the client's body to a P instance with ``max_tokens=1``, no streaming and the
   ``do_remote_decode`` ``kv_transfer_params``. P prefills, samples one token (discarded) and
   keeps its blocks for D to pull.
2. Take the ``kv_transfer_params`` P returns (top level of its JSON).
3. POST the client's original body plus those params to a D instance and relay D's answer,
   streamed or not, as the client asked.

Zero replay (``--resume first-token``, the default, for requests ``first_token.replay_reason``
allows): P is also asked for its first token (``pd_resume``); when it returns one, the client
gets that token at once and D, asked on ``/v1/completions`` with P's prompt ids plus the token,
continues from the second (``first_token.py`` builds every body and answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from aiohttp import web

from pd_connector.core.params import KEY_REPLAY_OFFSET
from pd_connector.proxy import first_token
from pd_connector.proxy.bodies import build_prefill_body
from pd_connector.proxy.first_token import CHAT, MODE_REPLAY, Plan, Replay, StreamAssembler
from pd_connector.proxy.relay import (
    UpstreamClient,
    UpstreamError,
    UpstreamRejected,
    describe_body,
    error_response,
    prefill_once,
    relay_stream,
    request_id_of,
    upstream_headers,
)
from pd_connector.proxy.routing import Pool, ProxyMetrics, Upstream

logger = logging.getLogger("pd_connector.proxy.server")


@dataclass
class ProxyState:
    """Everything a request needs besides the HTTP session; one per proxy app."""

    prefill: Pool
    decode: Pool
    metrics: ProxyMetrics
    decode_min_recompute: int | None
    timeout: float
    health_timeout: float
    health_interval: float
    prefill_retries: int
    resume: str = first_token.DEFAULT_RESUME
    # D's max_model_len per D URL, with when it was read (first_token: caps for chat without one).
    model_lens: dict[str, tuple[int | None, float]] = field(default_factory=dict)
    # Set once a P's chat answer showed a reasoning or tool parser at work: from then on chat
    # requests take the standard flow without asking P for its first token.
    chat_parser_seen: bool = False


# How long D's max_model_len is trusted once read, and retried after a failed read.
MODEL_LEN_TTL_S = 300.0
MODEL_LEN_RETRY_S = 5.0


def _resume_before_prefill(st: ProxyState, path: str, body: dict) -> Replay | None:
    """Why the request takes the standard flow, known before P is asked (None: zero replay)."""
    if st.resume != first_token.RESUME_FIRST_TOKEN:
        return Replay("disabled", "--resume replay")
    if path == CHAT and st.chat_parser_seen:
        return Replay("parser_output", "P's server parses chat output (seen before)")
    return first_token.replay_reason(path, body)


async def _max_model_len(
    st: ProxyState, client: UpstreamClient, up: Upstream, headers: dict, model: Any,
) -> int | None:
    """D's max_model_len from its /v1/models (cached per D), or None when it cannot be read."""
    cached = st.model_lens.get(up.url)
    now = time.monotonic()
    if cached is not None and now - cached[1] < (MODEL_LEN_TTL_S if cached[0] else MODEL_LEN_RETRY_S):
        return cached[0]
    try:
        async with client.pooled.get(up.url + "/v1/models", headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=st.health_timeout)) as r:
            models = await r.json(content_type=None) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        logger.info("decode instance %s: /v1/models unreadable (%s: %s)", up.url, type(e).__name__, e)
        models = None
    value = first_token.max_model_len_of(models, model)
    st.model_lens[up.url] = (value, now)
    return value


def _stale_retry_hook(up: Upstream, request_id: str) -> Callable[[BaseException], None]:
    """What ``UpstreamClient.post`` calls before it resends a request on a fresh connection."""
    def on_stale(e: BaseException) -> None:
        up.stale_connection_retries += 1
        up.requests += 1  # the retry is another attempt on the same upstream
        # INFO, not WARNING: an idle keep-alive connection closed by the upstream is routine.
        logger.info("request %s: %s instance %s closed a kept-alive connection before answering "
                    "(%s: %s); retrying once on a new connection",
                    request_id, up.role, up.url, type(e).__name__, e)
    return on_stale


async def _prefill_with_retries(
    st: ProxyState, client: UpstreamClient, path: str, body: dict, headers: dict, log: dict,
) -> dict:
    """Prefill on one P; after a connection error, timeout or 5xx, again on another P (up to
    ``prefill_retries`` more times, a different instance each time while one is left; after that
    the same ones again, except after a timeout)."""
    tried: list[str] = []
    for attempt in range(st.prefill_retries + 1):
        up = st.prefill.select(exclude=tried)
        tried.append(up.url)
        log["P"] = up.url
        try:
            with st.prefill.track(up):
                data = await prefill_once(client, up.url, path, body, headers, st.timeout,
                                          _stale_retry_hook(up, log["req"]))
        except UpstreamRejected:
            st.prefill.mark_healthy(up)  # it answered: reachable
            raise
        except UpstreamError as e:
            if e.unreachable:
                st.prefill.mark_unhealthy(up, e.reason)
            if not e.retryable or attempt == st.prefill_retries:
                raise
            if e.timed_out and len(set(tried)) >= len(st.prefill):
                raise  # a timeout is retried only on a P not tried yet: never wait twice as long

            st.metrics.prefill_retries += 1
            log["p_retries"] = attempt + 1
            logger.warning("request %s: prefill on %s failed (%s); retrying",
                           log["req"], up.url, e.reason)
            continue
        st.prefill.mark_healthy(up)
        return data
    raise AssertionError("unreachable")



class _DecodeNotStarted(Exception):
    """D failed before answering anything; the request may go to another D."""

    def __init__(self, err: UpstreamError):
        super().__init__(str(err))
        self.err = err


# Long: one request's story, read top to bottom: parse, pick P, prefill with retries, pick D, decode.
async def generate(
    request: web.Request, st: ProxyState, client: UpstreamClient
) -> tuple[web.StreamResponse, str]:
    """Prefill then decode; returns the response and its outcome label for the metrics."""
    request_id = request_id_of(request)
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        return error_response(400, f"request body is not valid JSON: {e}",
                              "invalid_request_error"), "invalid_request"
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object",
                              "invalid_request_error"), "invalid_request"

    headers = upstream_headers(request, request_id)
    path = request.path
    log: dict[str, Any] = {"req": request_id, "path": path}
    before = _resume_before_prefill(st, path, body)
    # One token asked: P's answer is the whole answer, so P is asked without a handoff.
    standalone = before is None and first_token.answered_by_prefill(path, body)
    p_body = (first_token.prefill_body(body, st.decode_min_recompute, standalone=standalone)
              if before is None else build_prefill_body(body, st.decode_min_recompute))
    t0 = time.monotonic()
    try:
        p_data = await _prefill_with_retries(st, client, path, p_body, headers, log)
    except UpstreamRejected as e:
        log.update(p_status=e.status, p_ms=_ms(t0), D="skipped")
        _log_request(log, logging.WARNING)
        return e.response(request_id), "prefill_rejected"
    except UpstreamError as e:
        log.update(p_status=e.status, p_ms=_ms(t0), p_error=e.reason, D="skipped")
        _log_request(log, logging.WARNING)
        return e.response(request_id), "prefill_failed"
    except asyncio.CancelledError:
        log.update(p_ms=_ms(t0), p_error="client disconnected, P aborted", D="skipped")
        _log_request(log, logging.WARNING)
        raise
    kv_params = p_data.get("kv_transfer_params")
    if not isinstance(kv_params, dict):
        kv_params = None
    if not kv_params and not standalone:
        st.metrics.prefill_without_params += 1
    log.update(p_status=200, p_ms=_ms(t0), params=bool(kv_params))
    if kv_params and KEY_REPLAY_OFFSET in kv_params:
        log["replay_offset"] = kv_params[KEY_REPLAY_OFFSET]

    d_up = st.decode.select()
    plan = first_token.plan_decode(
        path, body, p_data, kv_params, before=before, standalone=standalone,
        max_model_len=(await _max_model_len(st, client, d_up, headers, body.get("model"))
                       if before is None and first_token.offered(kv_params) else None))
    _note_plan(st, plan, log)
    stream = bool(body.get("stream", False))
    if plan.first is not None and plan.d_body is None:  # P's token ended the request
        return await _answer_from_prefill(request, plan, path, body, stream, request_id, log)
    started: _Started | None = None
    shape: Callable[[Any], dict] | None = None
    if plan.first is not None and stream:
        # Time to first token is P's: t0 leaves now, before D is even asked.
        started = _Started(_stream_response(request_id), StreamAssembler(path, body, plan.first))
        if not await _send(request, started.out, started.assembler.head(None), end=False):
            log.update(D="skipped", d_error="client disconnected before D")
            _log_request(log, logging.WARNING)
            return started.out, "client_disconnected"
    elif plan.first is not None:
        shape = functools.partial(first_token.merge_response, path, body, plan.first)
    # Fallback rule: D is re-sent to another D only when the first one failed before answering
    # anything (connection refused/reset before response headers, or an HTTP 5xx), and only when
    # another D exists, once. Never after D's response started (the client may have seen tokens)
    # and never after a timeout (a non-streamed D sends nothing until it has generated, so a
    # timed-out D may be generating). The retry goes *without* kv_transfer_params: the first D
    # may already have claimed P's blocks (claims are one-shot; P frees the blocks when D's READ
    # completes, else at lease expiry), so the lease's state is unknown. The second D computes
    # the prompt itself, which is always correct, only slower. (The stale keep-alive retry inside
    # _decode is different: it keeps the params, because that request never reached D's
    # application, so nothing can have been claimed.)
    # With zero replay the second D gets D's body without the params: P's prompt ids plus t0,
    # all computed there, so the t0 the client may already have continues correctly.
    can_fall_back = len(st.decode) > 1
    assert plan.d_body is not None and plan.fallback_body is not None
    try:
        return await _decode(request, st, client, d_up, plan.d_path, plan.d_body,
                             headers, stream=stream, request_id=request_id, log=log,
                             can_fall_back=can_fall_back, started=started, shape=shape)
    except _DecodeNotStarted as e:
        st.metrics.decode_fallbacks += 1
        fallback = st.decode.select(exclude=[d_up.url])
        logger.warning("request %s: decode on %s failed before answering (%s); computing the "
                       "prompt on %s instead", request_id, d_up.url, e.err.reason, fallback.url)
        log.update(d_error=e.err.reason, d_fallback=True)
        return await _decode(request, st, client, fallback, plan.d_path, plan.fallback_body,
                             headers, stream=stream, request_id=request_id, log=log,
                             can_fall_back=False, started=started, shape=shape)


def _note_plan(st: ProxyState, plan: Plan, log: dict) -> None:
    """Count the plan, log it, and remember a chat parser seen at P."""
    st.metrics.count_resume(plan.mode, plan.reason)
    log["resume"] = plan.mode if plan.mode != MODE_REPLAY else f"replay({plan.reason})"
    if plan.reason == "parser_output" and not st.chat_parser_seen:
        st.chat_parser_seen = True
        logger.warning("a prefill instance parses chat output (reasoning or tool parser): chat "
                       "requests take the standard flow from now on (%s); run the proxy with "
                       "--resume replay to skip the first-token request", plan.detail)
    elif plan.reason in ("prefill_answer", "max_model_len_unknown", "stop_string_boundary"):
        logger.info("request %s: standard flow after P's first token: %s", log["req"], plan.detail)


@dataclass
class _Started:
    """A streamed answer already under way (t0 sent) when D is asked: D's chunks are rewritten
    into it, and D's failures become an error event in it (the status line has gone)."""

    out: web.StreamResponse
    assembler: StreamAssembler

    async def fail(self, status: int, message: str, raw: bytes | None = None) -> None:
        with contextlib.suppress(ConnectionResetError):
            await self.out.write(self.assembler.error_event(message, status, raw))
            await self.out.write_eof()


def _stream_response(request_id: str) -> web.StreamResponse:
    out = web.StreamResponse(status=200)
    out.content_type = "text/event-stream"
    out.headers["X-Request-Id"] = request_id
    out.headers["Cache-Control"] = "no-cache"
    return out


async def _send(request: web.Request, out: web.StreamResponse, data: bytes, *, end: bool) -> bool:
    """Open the client's stream and write ``data`` (and its end); False when the client is gone."""
    try:
        await out.prepare(request)
        await out.write(data)
        if end:
            await out.write_eof()
    except ConnectionResetError:
        return False
    return True


async def _answer_from_prefill(
    request: web.Request, plan: Plan, path: str, body: dict, stream: bool, request_id: str,
    log: dict,
) -> tuple[web.StreamResponse, str]:
    """The client's whole answer from P's token. A P asked with a handoff (its token ended the
    request: EOS or a stop) keeps the blocks until its claim deadline: the proxy has no way to
    release them (that is D's side channel). A one-token request held none (``standalone``)."""
    assert plan.first is not None and plan.finish_reason is not None
    log.update(D="skipped", finish=plan.finish_reason)
    _log_request(log, logging.INFO)
    if not stream:
        answer = first_token.prefill_only_response(path, body, plan.first, plan.finish_reason)
        return web.json_response(answer, headers={"X-Request-Id": request_id}), "ok"
    out = _stream_response(request_id)
    head = StreamAssembler(path, body, plan.first).head(plan.finish_reason)
    return out, "ok" if await _send(request, out, head, end=True) else "client_disconnected"


# Long: the decode exchange and each way it can end (stream or not, D down, client gone), in one place.
async def _decode(
    request: web.Request, st: ProxyState, client: UpstreamClient, up: Upstream,
    path: str, d_body: dict, headers: dict, *, stream: bool, request_id: str, log: dict,
    can_fall_back: bool, started: _Started | None = None,
    shape: Callable[[Any], dict] | None = None,
) -> tuple[web.StreamResponse, str]:
    """Send D its body and relay the answer. ``started``: the client's stream is already open
    (zero replay sent t0): D's chunks are rewritten into it and its failures become an error
    event. ``shape``: zero replay's non-streamed answer, built from D's JSON."""
    log["D"] = up.url
    timeout = st.timeout
    # Streams may run long with no bound on total time; bound only the gap between chunks.
    d_timeout = (
        aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        if stream
        else aiohttp.ClientTimeout(total=timeout)
    )
    t1 = time.monotonic()

    async def failed(err: UpstreamError, *, unhealthy: bool = True) -> tuple[web.StreamResponse, str]:
        if unhealthy:
            st.decode.mark_unhealthy(up, err.reason)
        log.update(d_status=err.status, d_ms=_ms(t1), d_error=err.reason)
        _log_request(log, logging.WARNING)
        if started is not None:
            await started.fail(err.status, str(err))
            return started.out, "decode_failed"
        return err.response(request_id), "decode_failed"

    with st.decode.track(up):
        try:
            d_resp = await client.post(up.url + path, json=d_body, headers=headers,
                                       timeout=d_timeout,
                                       on_stale=_stale_retry_hook(up, request_id))
        except asyncio.TimeoutError:
            return await failed(UpstreamError("decode", up.url, 504, f"timed out after {timeout:g} s"))
        except aiohttp.ClientError as e:
            err = UpstreamError("decode", up.url, 502, f"{type(e).__name__}: {e}")
            if can_fall_back:
                st.decode.mark_unhealthy(up, err.reason)
                raise _DecodeNotStarted(err) from e
            return await failed(err)
        except asyncio.CancelledError:
            log.update(d_ms=_ms(t1), d_error="client disconnected, D aborted")
            _log_request(log, logging.WARNING)
            raise
        try:
            async with d_resp:
                log["d_status"] = d_resp.status
                if d_resp.status >= 500 and can_fall_back:
                    raise _DecodeNotStarted(UpstreamError(
                        "decode", up.url, d_resp.status,
                        f"HTTP {d_resp.status}: {describe_body(await d_resp.read())}"))
                if d_resp.status < 500:
                    st.decode.mark_healthy(up)
                outcome = ("ok" if d_resp.status < 400 else
                           "decode_rejected" if d_resp.status < 500 else "decode_failed")
                if started is not None and d_resp.status >= 400:
                    # The client already has t0 and a 200: D's error goes in the stream.
                    raw = await d_resp.read()
                    await started.fail(d_resp.status, f"decode instance {up.url} answered HTTP "
                                       f"{d_resp.status}: {describe_body(raw)}", raw)
                    out = started.out
                elif stream:
                    out, stopped = await relay_stream(
                        request, d_resp, request_id, out=started.out if started else None,
                        rewrite=started.assembler if started else None)
                    if stopped:
                        broke = not stopped.startswith("client")
                        if broke:
                            st.decode.mark_unhealthy(up, stopped)
                        log.update(d_ms=_ms(t1), d_error=stopped)
                        _log_request(log, logging.WARNING)
                        return out, "decode_failed" if broke else "client_disconnected"
                else:
                    raw = await d_resp.read()
                    if shape is not None and d_resp.status == 200:
                        try:
                            raw = json.dumps(shape(json.loads(raw))).encode()
                        except ValueError as e:  # not JSON, or not a vLLM completion
                            return await failed(UpstreamError(
                                "decode", up.url, 502, f"answer not usable: {e}"), unhealthy=False)
                    out = web.Response(body=raw, status=d_resp.status, headers={
                        "Content-Type": d_resp.headers.get("Content-Type", "application/json"),
                        "X-Request-Id": request_id,
                    })
        except asyncio.CancelledError:
            log.update(d_ms=_ms(t1), d_error="client disconnected, D aborted")
            _log_request(log, logging.WARNING)
            raise
        except asyncio.TimeoutError:
            return await failed(UpstreamError("decode", up.url, 504, f"timed out after {timeout:g} s"))
        except aiohttp.ClientError as e:
            # Only reached before D's answer reached the client (the relay handles later errors).
            return await failed(UpstreamError("decode", up.url, 502, f"{type(e).__name__}: {e}"))
    log["d_ms"] = _ms(t1)
    _log_request(log, logging.INFO if outcome == "ok" else logging.WARNING)
    return out, outcome


def _ms(start: float) -> str:
    return f"{(time.monotonic() - start) * 1e3:.1f}ms"


def _log_request(fields: dict, level: int) -> None:
    logger.log(level, " ".join(f"{k}={v}" for k, v in fields.items()))

