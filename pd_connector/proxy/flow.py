"""One client request through the proxy: prefill on a P (retried on another P after a
connection error, timeout or 5xx), then decode on a D with P's ``kv_transfer_params`` (sent once
to another D, without them, when the first fails before answering). Independently of both, a
request that hits a pooled keep-alive connection the upstream has just closed is sent once more to
the same upstream on a new connection (``relay.UpstreamClient``).

Flow per request (the same steps as vLLM's toy proxy, which works with the NIXL connector on
0.32.0):

1. POST a copy of the client's body to a P instance with ``max_tokens=1``, no streaming and the
   ``do_remote_decode`` ``kv_transfer_params``. P prefills, samples one token (discarded) and
   keeps its blocks for D to pull.
2. Take the ``kv_transfer_params`` P returns (top level of its JSON).
3. POST the client's original body plus those params to a D instance and relay D's answer,
   streamed or not, as the client asked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web

from pd_connector.core.params import KEY_REPLAY_OFFSET
from pd_connector.proxy.bodies import build_decode_body, build_prefill_body
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
    t0 = time.monotonic()
    try:
        p_data = await _prefill_with_retries(
            st, client, path, build_prefill_body(body, st.decode_min_recompute), headers, log)
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
    if not kv_params:
        st.metrics.prefill_without_params += 1
    log.update(p_status=200, p_ms=_ms(t0), params=bool(kv_params))
    if kv_params and KEY_REPLAY_OFFSET in kv_params:
        log["replay_offset"] = kv_params[KEY_REPLAY_OFFSET]

    d_up = st.decode.select()
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
    can_fall_back = len(st.decode) > 1
    try:
        return await _decode(request, st, client, d_up, path, build_decode_body(body, kv_params),
                             headers, stream=bool(body.get("stream", False)),
                             request_id=request_id, log=log, can_fall_back=can_fall_back)
    except _DecodeNotStarted as e:
        st.metrics.decode_fallbacks += 1
        fallback = st.decode.select(exclude=[d_up.url])
        logger.warning("request %s: decode on %s failed before answering (%s); computing the "
                       "prompt on %s instead", request_id, d_up.url, e.err.reason, fallback.url)
        log.update(d_error=e.err.reason, d_fallback=True)
        return await _decode(request, st, client, fallback, path, build_decode_body(body, None),
                             headers, stream=bool(body.get("stream", False)),
                             request_id=request_id, log=log, can_fall_back=False)


# Long: the decode exchange and each way it can end (stream or not, D down, client gone), in one place.
async def _decode(
    request: web.Request, st: ProxyState, client: UpstreamClient, up: Upstream,
    path: str, d_body: dict, headers: dict, *, stream: bool, request_id: str, log: dict,
    can_fall_back: bool,
) -> tuple[web.StreamResponse, str]:
    log["D"] = up.url
    timeout = st.timeout
    # Streams may run long with no bound on total time; bound only the gap between chunks.
    d_timeout = (
        aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        if stream
        else aiohttp.ClientTimeout(total=timeout)
    )
    t1 = time.monotonic()

    def failed(err: UpstreamError) -> tuple[web.StreamResponse, str]:
        st.decode.mark_unhealthy(up, err.reason)
        log.update(d_status=err.status, d_ms=_ms(t1), d_error=err.reason)
        _log_request(log, logging.WARNING)
        return err.response(request_id), "decode_failed"

    with st.decode.track(up):
        try:
            d_resp = await client.post(up.url + path, json=d_body, headers=headers,
                                       timeout=d_timeout,
                                       on_stale=_stale_retry_hook(up, request_id))
        except asyncio.TimeoutError:
            return failed(UpstreamError("decode", up.url, 504, f"timed out after {timeout:g} s"))
        except aiohttp.ClientError as e:
            err = UpstreamError("decode", up.url, 502, f"{type(e).__name__}: {e}")
            if can_fall_back:
                st.decode.mark_unhealthy(up, err.reason)
                raise _DecodeNotStarted(err) from e
            return failed(err)
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
                if stream:
                    out, stopped = await relay_stream(request, d_resp, request_id)
                    if stopped:
                        broke = not stopped.startswith("client")
                        if broke:
                            st.decode.mark_unhealthy(up, stopped)
                        log.update(d_ms=_ms(t1), d_error=stopped)
                        _log_request(log, logging.WARNING)
                        return out, "decode_failed" if broke else "client_disconnected"
                else:
                    raw = await d_resp.read()
                    out = web.Response(body=raw, status=d_resp.status, headers={
                        "Content-Type": d_resp.headers.get("Content-Type", "application/json"),
                        "X-Request-Id": request_id,
                    })
        except asyncio.CancelledError:
            log.update(d_ms=_ms(t1), d_error="client disconnected, D aborted")
            _log_request(log, logging.WARNING)
            raise
        except asyncio.TimeoutError:
            return failed(UpstreamError("decode", up.url, 504, f"timed out after {timeout:g} s"))
        except aiohttp.ClientError as e:
            # Only reached before anything was sent to the client (the relay handles later errors).
            return failed(UpstreamError("decode", up.url, 502, f"{type(e).__name__}: {e}"))
    log["d_ms"] = _ms(t1)
    _log_request(log, logging.INFO if outcome == "ok" else logging.WARNING)
    return out, outcome



def _ms(start: float) -> str:
    return f"{(time.monotonic() - start) * 1e3:.1f}ms"


def _log_request(fields: dict, level: int) -> None:
    logger.log(level, " ".join(f"{k}={v}" for k, v in fields.items()))

