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
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
import uuid
from typing import Any, Iterable, Sequence

import aiohttp
from aiohttp import web

logger = logging.getLogger("pd_connector.proxy")

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
# How often a streaming relay checks whether the client went away while D is silent (queued, or
# pulling KV). Needed because aiohttp only cancels handlers on disconnect when the server runs with
# handler_cancellation=True, which build_app cannot enforce for whoever hosts the app.
DISCONNECT_POLL_S = 0.25

# Sent to P: asks P's connector to keep the prompt's blocks for a remote decode. The remote_* fields
# must be present (as None) because the NIXL connector reads them unconditionally.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields that would make P generate more than one token or hold the response open.
_PREFILL_DROP = ("stream_options", "min_tokens", "min_completion_tokens")
ROUTES = ("/v1/completions", "/v1/chat/completions")

_SESSION = web.AppKey("pd_session", aiohttp.ClientSession)
_STATE = web.AppKey("pd_state", dict)


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
                 retryable: bool = False, unreachable: bool = False):
        super().__init__(f"{role} instance {url} failed: {reason}")
        self.role, self.url, self.status, self.reason = role, url, status, reason
        self.retryable, self.unreachable = retryable or unreachable, unreachable

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
) -> tuple[int, dict]:
    try:
        async with session.post(
            url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            raw = await resp.read()
            if not 200 <= resp.status < 300:
                raise UpstreamError(
                    "prefill", url, resp.status, f"HTTP {resp.status}: {_describe_body(raw)}"
                )
            try:
                data = json.loads(raw)
            except ValueError as e:
                raise UpstreamError("prefill", url, 502, f"response is not JSON ({e})") from e
            if not isinstance(data, dict):
                raise UpstreamError("prefill", url, 502, "response is not a JSON object")
            return resp.status, data
    except asyncio.TimeoutError as e:
        raise UpstreamError("prefill", url, 502, f"timed out after {timeout:g} s") from e
    except aiohttp.ClientError as e:
        raise UpstreamError("prefill", url, 502, f"{type(e).__name__}: {e}") from e


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


async def _handle_generate(request: web.Request) -> web.StreamResponse:
    state = request.app[_STATE]
    session = request.app[_SESSION]
    request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        return _error_response(400, f"request body is not valid JSON: {e}", "invalid_request_error")
    if not isinstance(body, dict):
        return _error_response(400, "request body must be a JSON object", "invalid_request_error")

    headers = _upstream_headers(request, request_id)
    path = request.path
    stream = bool(body.get("stream", False))
    timeout = state["timeout"]
    p_url = next(state["prefill"])
    log = {"req": request_id, "path": path, "P": p_url}

    t0 = time.monotonic()
    try:
        p_status, p_data = await _prefill(
            session, p_url, path,
            build_prefill_body(body, state["decode_min_recompute"]), headers, timeout,
        )
    except UpstreamError as e:
        log.update(p_status=e.status, p_ms=_ms(t0), p_error=e.reason, D="skipped")
        _log_request(log, logging.WARNING)
        return e.response(request_id)
    kv_params = p_data.get("kv_transfer_params")
    if not isinstance(kv_params, dict):
        kv_params = None
    log.update(p_status=p_status, p_ms=_ms(t0), params=bool(kv_params))
    if kv_params and "replay_offset" in kv_params:
        log["replay_offset"] = kv_params["replay_offset"]

    d_url = next(state["decode"])
    log["D"] = d_url
    d_body = build_decode_body(body, kv_params)
    # Streams may run long with no bound on total time; bound only the gap between chunks.
    d_timeout = (
        aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        if stream
        else aiohttp.ClientTimeout(total=timeout)
    )
    t1 = time.monotonic()
    try:
        async with session.post(
            d_url + path, json=d_body, headers=headers, timeout=d_timeout
        ) as d_resp:
            log["d_status"] = d_resp.status
            if stream:
                out, stopped = await _relay_stream(request, d_resp, request_id)
                if stopped:
                    log.update(d_ms=_ms(t1), d_error=stopped)
                    _log_request(log, logging.WARNING)
                    return out
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
        err = UpstreamError("decode", d_url, 502, f"timed out after {timeout:g} s")
        log.update(d_status=err.status, d_ms=_ms(t1), d_error=err.reason)
        _log_request(log, logging.WARNING)
        return err.response(request_id)
    except aiohttp.ClientError as e:
        # Only reached before anything was sent to the client (the relay handles later errors).
        err = UpstreamError("decode", d_url, 502, f"{type(e).__name__}: {e}")
        log.update(d_status=err.status, d_ms=_ms(t1), d_error=err.reason)
        _log_request(log, logging.WARNING)
        return err.response(request_id)
    log["d_ms"] = _ms(t1)
    _log_request(log, logging.INFO)
    return out


def _ms(start: float) -> str:
    return f"{(time.monotonic() - start) * 1e3:.1f}ms"


def _log_request(fields: dict, level: int) -> None:
    logger.log(level, " ".join(f"{k}={v}" for k, v in fields.items()))


async def _probe(session: aiohttp.ClientSession, url: str, timeout: float) -> dict:
    try:
        async with session.get(
            url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            return {"url": url, "healthy": resp.status == 200, "status": resp.status}
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return {"url": url, "healthy": False, "status": None, "error": type(e).__name__}


async def _handle_health(request: web.Request) -> web.Response:
    # Always 200: this reports the proxy's own liveness; upstream state is informational.
    state = request.app[_STATE]
    session = request.app[_SESSION]
    t = state["health_timeout"]
    prefill, decode = await asyncio.gather(
        asyncio.gather(*(_probe(session, u, t) for u in state["prefill_urls"])),
        asyncio.gather(*(_probe(session, u, t) for u in state["decode_urls"])),
    )
    return web.json_response({"status": "ok", "prefill": prefill, "decode": decode})


async def _handle_models(request: web.Request) -> web.Response:
    # P and D serve the same model, so D's list is the answer.
    state = request.app[_STATE]
    url = state["decode_urls"][0]
    request_id = request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"
    try:
        async with request.app[_SESSION].get(
            url + "/v1/models", headers=_upstream_headers(request, request_id),
            timeout=aiohttp.ClientTimeout(total=state["timeout"]),
        ) as resp:
            raw = await resp.read()
            return web.Response(body=raw, status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "application/json")})
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return UpstreamError("decode", url, 502, f"{type(e).__name__}: {e}").response(request_id)


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    decode_min_recompute: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
) -> web.Application:
    """The proxy as an aiohttp app (run it with ``run_proxy`` or any aiohttp runner).

    ``timeout`` bounds P's whole request, D's whole non-streamed request and the gap between D's
    streamed chunks, in seconds.
    """
    prefill_urls = [normalize_url(u) for u in prefill_urls]
    decode_urls = [normalize_url(u) for u in decode_urls]
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill URL and one decode URL")
    if decode_min_recompute is not None and int(decode_min_recompute) < 0:
        raise ValueError("decode_min_recompute must be >= 0")

    app = web.Application()
    app[_STATE] = {
        "prefill_urls": prefill_urls,
        "decode_urls": decode_urls,
        # Per-app cycles: requests are handled on one event loop, so next() needs no lock.
        "prefill": itertools.cycle(prefill_urls),
        "decode": itertools.cycle(decode_urls),
        "decode_min_recompute": decode_min_recompute,
        "timeout": float(timeout),
        "health_timeout": float(health_timeout),
    }

    async def session_ctx(app: web.Application):
        # limit=0: every in-flight stream holds a connection; aiohttp's default cap of 100 would
        # queue requests behind long generations.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            app[_SESSION] = session
            yield

    app.cleanup_ctx.append(session_ctx)
    for route in ROUTES:
        app.router.add_post(route, _handle_generate)
    app.router.add_get("/health", _handle_health)
    app.router.add_get("/v1/models", _handle_models)
    return app


def run_proxy(
    prefill_urls: Iterable[str],
    decode_urls: Iterable[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    decode_min_recompute: int | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Serve the proxy until interrupted."""
    app = build_app(
        list(prefill_urls), list(decode_urls),
        decode_min_recompute=decode_min_recompute, timeout=timeout,
    )
    logger.info(
        "pd proxy on http://%s:%d prefill=%s decode=%s decode_min_recompute=%s",
        host, port, app[_STATE]["prefill_urls"], app[_STATE]["decode_urls"], decode_min_recompute,
    )
    # handler_cancellation: a client disconnect cancels the handler at once, which closes D's
    # connection and so aborts the request on D (the poll in _relay_stream is the fallback).
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                print=None)
