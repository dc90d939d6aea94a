"""HTTP proxy that splits an OpenAI request into a prefill (P) and a decode (D) request.

Flow per request (the same three steps as vLLM's toy proxy, which is known to work with the NIXL
connector on 0.32.0):

1. POST a copy of the client's body to a P instance with ``max_tokens=1``, no streaming and the
   ``do_remote_decode`` ``kv_transfer_params``. P prefills, samples one token (discarded) and keeps
   its blocks for D to pull.
2. Take the ``kv_transfer_params`` P returns (top level of its JSON).
3. POST the client's original body plus those params to a D instance and relay D's answer,
   streamed or not, as the client asked.

The proxy owns the ``kv_transfer_params`` field: anything the client put there is replaced on P and
dropped on D, so the client cannot make D pull blocks that P never produced for this request.

Operations (upstream selection and health state live in ``routing.py``): P and D instances are
picked per pool by policy (least-loaded by default), upstreams failing their ``/health`` poll or a
request are skipped until they answer again, a failed prefill (connection error, timeout, 5xx) is
retried on another P, a decode that fails before D answered may go once to another D (see
``_generate``), and ``GET /metrics`` exposes the proxy's own counters in Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import aiohttp
from aiohttp import web

from pd_connector.routing import (
    DEFAULT_POLICY,
    Pool,
    ProxyMetrics,
    Upstream,
    health_loop,
    probe_all,
)

from pd_connector.protocol import PREFILL_REQUEST_PARAMS

logger = logging.getLogger("pd_connector.proxy")

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_HEALTH_INTERVAL_S = 5.0
DEFAULT_PREFILL_RETRIES = 2
# With health polling off, an upstream marked unhealthy by a request error is tried again after
# this many seconds.
PASSIVE_RECOVERY_S = 5.0
# How often a streaming relay checks whether the client went away while D is silent (queued, or
# pulling KV). Needed because aiohttp only cancels handlers on disconnect when the server runs with
# handler_cancellation=True, which build_app cannot enforce for whoever hosts the app.
DISCONNECT_POLL_S = 0.25

PREFILL_KV_PARAMS = PREFILL_REQUEST_PARAMS
# Fields that would make P generate more than one token or hold the response open.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
ROUTES = ("/v1/completions", "/v1/chat/completions")

@dataclass
class ProxyState:
    prefill: Pool
    decode: Pool
    metrics: ProxyMetrics
    decode_min_recompute: int | None
    timeout: float
    health_timeout: float
    health_interval: float
    prefill_retries: int


_SESSION = web.AppKey("pd_session", aiohttp.ClientSession)
STATE = web.AppKey("pd_state", ProxyState)


def normalize_url(url: str) -> str:
    """Accept ``host:port`` as well as ``http://host:port/``; return without trailing slash."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def build_prefill_body(body: dict, decode_min_recompute: int | None = None) -> dict:
    """P's body: the client's request cut down to a one-token, non-streamed prefill."""
    p = copy.deepcopy(body)
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    for key in _PREFILL_DROP:
        p.pop(key, None)
    params = dict(PREFILL_KV_PARAMS)
    if decode_min_recompute is not None:
        # D's floor on recomputed prompt tokens; P picks a replay offset both sides accept.
        params["pd_min_recompute_tokens"] = int(decode_min_recompute)
    p["kv_transfer_params"] = params
    return p


def build_decode_body(body: dict, kv_params: dict | None) -> dict:
    """D's body: the client's original body plus P's params (if any; else D computes locally)."""
    d = dict(body)  # shallow: nothing below the top level is modified
    d.pop("kv_transfer_params", None)
    if kv_params:
        d["kv_transfer_params"] = kv_params
    return d


class UpstreamError(Exception):
    """An upstream (P or D) did not answer usefully; carries what the client should see.

    ``unreachable``: a request error (connection refused/reset, timeout) that marks the upstream
    unhealthy. ``retryable``: worth another prefill attempt (request errors and 5xx).
    """

    def __init__(self, role: str, url: str, status: int, reason: str, *,
                 retryable: bool = False, unreachable: bool = False, timed_out: bool = False):
        super().__init__(f"{role} instance {url} failed: {reason}")
        self.role, self.url, self.status, self.reason = role, url, status, reason
        self.unreachable = unreachable or timed_out
        self.retryable, self.timed_out = retryable or self.unreachable, timed_out

    def response(self, request_id: str) -> web.Response:
        return _error_response(
            self.status,
            str(self),
            f"{self.role}_error",
            upstream=self.url,
            request_id=request_id,
        )


class UpstreamRejected(Exception):
    """P answered 4xx: the client's request is at fault; relayed as is, never retried."""

    def __init__(self, url: str, status: int, raw: bytes, content_type: str | None):
        super().__init__(f"prefill instance {url} answered HTTP {status}")
        self.url, self.status, self.raw, self.content_type = url, status, raw, content_type

    def response(self, request_id: str) -> web.Response:
        return web.Response(body=self.raw, status=self.status, headers={
            "Content-Type": self.content_type or "application/json", "X-Request-Id": request_id})


def _error_response(status: int, message: str, etype: str, **extra: Any) -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, **extra}}, status=status)


def _describe_body(raw: bytes, limit: int = 500) -> str:
    """Short text of an upstream error body: vLLM's own error message when it sent one."""
    try:
        parsed = json.loads(raw)
        err = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:limit]
        if isinstance(parsed, dict) and parsed.get("message"):  # vLLM's older error shape
            return str(parsed["message"])[:limit]
    except (ValueError, UnicodeDecodeError):
        pass
    return raw[:limit].decode("utf-8", "replace")


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    # Servers started with --api-key need the client's credentials on both hops.
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return headers


async def _prefill(
    session: aiohttp.ClientSession, url: str, path: str, body: dict, headers: dict, timeout: float
) -> dict:
    """One prefill attempt: P's JSON answer, or UpstreamError / UpstreamRejected."""
    try:
        async with session.post(
            url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            raw = await resp.read()
            if 400 <= resp.status < 500:
                raise UpstreamRejected(url, resp.status, raw, resp.headers.get("Content-Type"))
            if not 200 <= resp.status < 300:
                raise UpstreamError(
                    "prefill", url, resp.status if resp.status >= 500 else 502,
                    f"HTTP {resp.status}: {_describe_body(raw)}", retryable=True,
                )
            try:
                data = json.loads(raw)
            except ValueError as e:
                raise UpstreamError(
                    "prefill", url, 502, f"response is not JSON ({e})", retryable=True) from e
            if not isinstance(data, dict):
                raise UpstreamError(
                    "prefill", url, 502, "response is not a JSON object", retryable=True)
            return data
    except asyncio.TimeoutError as e:
        raise UpstreamError(
            "prefill", url, 504, f"timed out after {timeout:g} s", timed_out=True) from e
    except aiohttp.ClientError as e:
        raise UpstreamError(
            "prefill", url, 502, f"{type(e).__name__}: {e}", unreachable=True) from e


async def _prefill_with_retries(
    st: ProxyState, session: aiohttp.ClientSession, path: str, body: dict, headers: dict,
    log: dict,
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
                data = await _prefill(session, up.url, path, body, headers, st.timeout)
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


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _relay_stream(
    request: web.Request, d_resp: aiohttp.ClientResponse, request_id: str
) -> tuple[web.StreamResponse, str | None]:
    """Copy D's body to the client chunk by chunk.

    Returns the response and why the relay stopped early (None when D's body ended). Once the
    client is gone, D's connection is closed rather than read to the end: closing (not releasing)
    it is what aborts the request on D and frees its KV blocks.
    """
    out = web.StreamResponse(status=d_resp.status)
    out.content_type = d_resp.content_type
    if d_resp.charset:
        out.charset = d_resp.charset
    out.headers["X-Request-Id"] = request_id
    out.headers["Cache-Control"] = "no-cache"
    read: asyncio.Task | None = None
    try:
        try:
            await out.prepare(request)
        except ConnectionResetError:
            d_resp.close()
            return out, "client disconnected, D aborted"
        while True:
            if read is None:
                read = asyncio.ensure_future(d_resp.content.readany())
            # Wait for D's next chunk, but wake up periodically to notice a vanished client while
            # D produces nothing (the read task survives the timeout, so no data is lost).
            done, _ = await asyncio.wait({read}, timeout=DISCONNECT_POLL_S)
            if not done:
                if _client_gone(request):
                    d_resp.close()
                    return out, "client disconnected, D aborted"
                continue
            task, read = read, None
            try:
                chunk = task.result()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                # Headers are already sent, so the client can only see a cut stream.
                d_resp.close()
                return out, f"decode stream broke: {type(e).__name__}: {e}"
            if not chunk:
                break
            try:
                await out.write(chunk)
            except ConnectionResetError:
                d_resp.close()
                return out, "client disconnected, D aborted"
        try:
            await out.write_eof()
        except ConnectionResetError:
            return out, "client disconnected at end of stream"
    except asyncio.CancelledError:
        # The server cancelled the handler (client gone, handler_cancellation=True).
        d_resp.close()
        raise
    finally:
        if read is not None and not read.done():
            read.cancel()
    return out, None


class _DecodeNotStarted(Exception):
    """D failed before answering anything; the request may go to another D."""

    def __init__(self, err: UpstreamError):
        super().__init__(str(err))
        self.err = err


async def _handle_generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    outcome = "proxy_error"
    try:
        response, outcome = await _generate(request, st)
        return response
    except asyncio.CancelledError:
        outcome = "client_disconnected"
        raise
    finally:
        st.metrics.count_request(request.path, outcome)


async def _generate(request: web.Request, st: ProxyState) -> tuple[web.StreamResponse, str]:
    """Prefill then decode; returns the response and its outcome label for the metrics."""
    session = request.app[_SESSION]
    request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        return _error_response(400, f"request body is not valid JSON: {e}",
                               "invalid_request_error"), "invalid_request"
    if not isinstance(body, dict):
        return _error_response(400, "request body must be a JSON object",
                               "invalid_request_error"), "invalid_request"

    headers = _upstream_headers(request, request_id)
    path = request.path
    log: dict[str, Any] = {"req": request_id, "path": path}
    t0 = time.monotonic()
    try:
        p_data = await _prefill_with_retries(
            st, session, path, build_prefill_body(body, st.decode_min_recompute), headers, log)
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
    if kv_params and "replay_offset" in kv_params:
        log["replay_offset"] = kv_params["replay_offset"]

    d_up = st.decode.select()
    # Fallback rule: D is re-sent to another D only when the first one failed before answering
    # anything (connection refused/reset before response headers, or an HTTP 5xx), and only when
    # another D exists, once. Never after D's response started (the client may have seen tokens)
    # and never after a timeout (a non-streamed D sends nothing until it has generated, so a
    # timed-out D may be generating). The retry goes *without* kv_transfer_params: the first D
    # may already have claimed P's blocks (claims are one-shot; P frees the blocks when D's READ
    # completes, else at lease expiry), so the lease's state is unknown. The second D computes
    # the prompt itself, which is always correct, only slower.
    can_fall_back = len(st.decode) > 1
    try:
        return await _decode(request, st, session, d_up, path, build_decode_body(body, kv_params),
                             headers, stream=bool(body.get("stream", False)),
                             request_id=request_id, log=log, can_fall_back=can_fall_back)
    except _DecodeNotStarted as e:
        st.metrics.decode_fallbacks += 1
        fallback = st.decode.select(exclude=[d_up.url])
        logger.warning("request %s: decode on %s failed before answering (%s); computing the "
                       "prompt on %s instead", request_id, d_up.url, e.err.reason, fallback.url)
        log.update(d_error=e.err.reason, d_fallback=True)
        return await _decode(request, st, session, fallback, path, build_decode_body(body, None),
                             headers, stream=bool(body.get("stream", False)),
                             request_id=request_id, log=log, can_fall_back=False)


async def _decode(
    request: web.Request, st: ProxyState, session: aiohttp.ClientSession, up: Upstream,
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
            d_resp = await session.post(up.url + path, json=d_body, headers=headers,
                                        timeout=d_timeout)
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
                        f"HTTP {d_resp.status}: {_describe_body(await d_resp.read())}"))
                if d_resp.status < 500:
                    st.decode.mark_healthy(up)
                outcome = ("ok" if d_resp.status < 400 else
                           "decode_rejected" if d_resp.status < 500 else "decode_failed")
                if stream:
                    out, stopped = await _relay_stream(request, d_resp, request_id)
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


async def _handle_health(request: web.Request) -> web.Response:
    """Probe every upstream now (this also updates what selection uses) and report each one.

    200 while both pools have a healthy instance; 503 when a whole pool is down.
    """
    st = request.app[STATE]
    await probe_all(request.app[_SESSION], [st.prefill, st.decode], st.health_timeout)
    down = [p.role for p in (st.prefill, st.decode) if p.all_down]
    return web.json_response({
        "status": "ok" if not down else f"unavailable: no healthy {' or '.join(down)} instance",
        "policy": st.prefill.policy,
        "prefill": st.prefill.snapshot(),
        "decode": st.decode.snapshot(),
    }, status=503 if down else 200)


async def _handle_models(request: web.Request) -> web.Response:
    # P and D serve the same model, so a D's list is the answer; healthy Ds first.
    st = request.app[STATE]
    request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
    err: UpstreamError | None = None
    for up in sorted(st.decode.upstreams, key=lambda u: not u.healthy):
        try:
            async with request.app[_SESSION].get(
                up.url + "/v1/models", headers=_upstream_headers(request, request_id),
                timeout=aiohttp.ClientTimeout(total=min(st.timeout, 30.0)),
            ) as resp:
                raw = await resp.read()
                return web.Response(body=raw, status=resp.status, headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json")})
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            err = UpstreamError("decode", up.url, 502, f"{type(e).__name__}: {e}")
            st.decode.mark_unhealthy(up, err.reason)
    assert err is not None
    return err.response(request_id)


async def _handle_metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(body=st.metrics.render([st.prefill, st.decode]).encode(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    decode_min_recompute: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    policy: str = DEFAULT_POLICY,
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    prefill_retries: int = DEFAULT_PREFILL_RETRIES,
) -> web.Application:
    """The proxy as an aiohttp app (run it with ``run_proxy`` or any aiohttp runner).

    ``timeout`` bounds P's whole request, D's whole non-streamed request and the gap between D's
    streamed chunks, in seconds. ``policy`` picks P and D instances (``least-loaded`` or
    ``round-robin``, each pool separately). ``health_interval``: seconds between background
    ``/health`` polls of every upstream (0: no polling; an instance marked unhealthy by a request
    error is then tried again after ``PASSIVE_RECOVERY_S``). ``prefill_retries``: extra prefill
    attempts after a P connection error, timeout or 5xx.
    """
    prefill_urls = [normalize_url(u) for u in prefill_urls]
    decode_urls = [normalize_url(u) for u in decode_urls]
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill URL and one decode URL")
    if decode_min_recompute is not None and int(decode_min_recompute) < 0:
        raise ValueError("decode_min_recompute must be >= 0")
    if health_interval < 0 or prefill_retries < 0:
        raise ValueError("health_interval and prefill_retries must be >= 0")
    recover = None if health_interval > 0 else PASSIVE_RECOVERY_S
    st = ProxyState(
        prefill=Pool("prefill", prefill_urls, policy, recover_after_s=recover),
        decode=Pool("decode", decode_urls, policy, recover_after_s=recover),
        metrics=ProxyMetrics(),
        decode_min_recompute=decode_min_recompute,
        timeout=float(timeout),
        health_timeout=float(health_timeout),
        health_interval=float(health_interval),
        prefill_retries=int(prefill_retries),
    )
    app = web.Application()
    app[STATE] = st

    async def session_ctx(app: web.Application):
        # limit=0: every in-flight stream holds a connection; aiohttp's default cap of 100 would
        # queue requests behind long generations.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app[_SESSION] = session
            yield

    async def health_ctx(app: web.Application):
        task = None
        if st.health_interval > 0:
            task = asyncio.create_task(health_loop(
                app[_SESSION], [st.prefill, st.decode], st.health_interval, st.health_timeout))
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(session_ctx)
    app.cleanup_ctx.append(health_ctx)
    for route in ROUTES:
        app.router.add_post(route, _handle_generate)
    app.router.add_get("/health", _handle_health)
    app.router.add_get("/v1/models", _handle_models)
    app.router.add_get("/metrics", _handle_metrics)
    return app


def run_proxy(
    prefill_urls: Iterable[str],
    decode_urls: Iterable[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    decode_min_recompute: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    policy: str = DEFAULT_POLICY,
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    prefill_retries: int = DEFAULT_PREFILL_RETRIES,
) -> None:
    """Serve the proxy until interrupted."""
    app = build_app(
        list(prefill_urls), list(decode_urls),
        decode_min_recompute=decode_min_recompute, timeout=timeout, policy=policy,
        health_interval=health_interval, health_timeout=health_timeout,
        prefill_retries=prefill_retries,
    )
    st = app[STATE]
    logger.info(
        "pd proxy on http://%s:%d prefill=%s decode=%s policy=%s health_interval=%gs "
        "prefill_retries=%d decode_min_recompute=%s",
        host, port, st.prefill.urls, st.decode.urls, policy, health_interval, prefill_retries,
        decode_min_recompute,
    )
    # handler_cancellation: a client disconnect cancels the handler at once, which closes D's
    # connection and so aborts the request on D (the poll in _relay_stream is the fallback).
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                print=None)
