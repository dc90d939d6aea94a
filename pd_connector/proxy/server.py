"""HTTP proxy that splits an OpenAI request into a prefill (P) and a decode (D) request: the
aiohttp app, its endpoints and ``run_proxy``.

The modules behind it, one concern each:

- ``bodies``: what P and D are sent in the standard flow (pure);
- ``first_token``: zero replay: which requests use it, what D is sent, and the client's answer
  assembled from P's first token and D's continuation (pure);
- ``relay``: one HTTP exchange with one upstream, and its failures;
- ``flow``: one client request, prefill with retries then decode with fallback;
- ``routing``: upstream pools, selection policy, health state and the proxy's own metrics.

Besides the OpenAI routes (``bodies.ROUTES``) the app serves ``/health`` (each upstream's
state; 503 when a whole pool is down), ``/v1/models`` (a decode instance's list) and
``/metrics`` (Prometheus text, ``pd_proxy_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Iterable, Sequence

import aiohttp
from aiohttp import web

from pd_connector.proxy.bodies import (
    PREFILL_KV_PARAMS,
    ROUTES,
    build_decode_body,
    build_prefill_body,
)
from pd_connector.proxy.first_token import DEFAULT_RESUME, RESUME_MODES
from pd_connector.proxy.flow import ProxyState, generate
from pd_connector.proxy.relay import (
    STREAM_DONE,
    UpstreamClient,
    UpstreamError,
    request_id_of,
    upstream_headers,
)
from pd_connector.urls import normalize_url
from pd_connector.proxy.routing import DEFAULT_POLICY, Pool, ProxyMetrics, health_loop, probe_all

__all__ = [
    "PREFILL_KV_PARAMS", "ROUTES", "STATE", "build_app", "build_decode_body", "build_prefill_body",
    "normalize_url", "run_proxy",
]

logger = logging.getLogger("pd_connector.proxy.server")

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_HEALTH_INTERVAL_S = 5.0
DEFAULT_PREFILL_RETRIES = 2
# With health polling off, an upstream marked unhealthy by a request error is tried again after
# this many seconds.
PASSIVE_RECOVERY_S = 5.0
# Pooled connections to P and D idle longer than this are closed by the proxy rather than
# reused. vLLM's API server (uvicorn) closes idle keep-alive connections after
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE = 5 s (vllm/envs.py; launchers/api_server/entry.py passes it to
# uvicorn); with aiohttp's default of 15 s the proxy would reuse connections uvicorn is closing
# at that very moment, and the request would fail before reaching vLLM. Staying below 5 s makes
# that race rare; UpstreamClient's retry on a new connection makes it harmless (including for
# servers run with a shorter keep-alive).
UPSTREAM_KEEPALIVE_S = 4.0

_CLIENT = web.AppKey("pd_client", UpstreamClient)
STATE = web.AppKey("pd_state", ProxyState)


async def _handle_generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    outcome = "proxy_error"
    try:
        response, outcome = await generate(request, st, request.app[_CLIENT])
        return response
    except asyncio.CancelledError:
        outcome = "ok" if request.get(STREAM_DONE) else "client_disconnected"
        raise
    finally:
        st.metrics.count_request(request.path, outcome)


async def _handle_health(request: web.Request) -> web.Response:
    """Probe every upstream now (this also updates what selection uses) and report each one.

    200 while both pools have a healthy instance; 503 when a whole pool is down.
    """
    st = request.app[STATE]
    await probe_all(request.app[_CLIENT].pooled, [st.prefill, st.decode], st.health_timeout)
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
    request_id = request_id_of(request)
    err: UpstreamError | None = None
    for up in sorted(st.decode.upstreams, key=lambda u: not u.healthy):
        try:
            async with request.app[_CLIENT].pooled.get(
                up.url + "/v1/models", headers=upstream_headers(request, request_id),
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


# Long: the app's wiring: every setting and route declared once, in order.
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
    resume: str = DEFAULT_RESUME,
) -> web.Application:
    """The proxy as an aiohttp app (run it with ``run_proxy`` or any aiohttp runner).

    ``timeout`` bounds P's whole request, D's whole non-streamed request and the gap between D's
    streamed chunks, in seconds. ``policy`` picks P and D instances (``least-loaded`` or
    ``round-robin``, each pool separately). ``health_interval``: seconds between background
    ``/health`` polls of every upstream (0: no polling; an instance marked unhealthy by a request
    error is then tried again after ``PASSIVE_RECOVERY_S``). ``prefill_retries``: extra prefill
    attempts after a P connection error, timeout or 5xx. ``resume``: ``first-token`` (zero
    replay where the request allows it: ``first_token.py``) or ``replay`` (always the standard
    flow, where D recomputes the last prompt token(s)).
    """
    prefill_urls = [normalize_url(u) for u in prefill_urls]
    decode_urls = [normalize_url(u) for u in decode_urls]
    if not prefill_urls or not decode_urls:
        raise ValueError("need at least one prefill URL and one decode URL")
    if decode_min_recompute is not None and int(decode_min_recompute) < 0:
        raise ValueError("decode_min_recompute must be >= 0")
    if health_interval < 0 or prefill_retries < 0:
        raise ValueError("health_interval and prefill_retries must be >= 0")
    if resume not in RESUME_MODES:
        raise ValueError(f"unknown resume mode {resume!r}; choose one of {', '.join(RESUME_MODES)}")
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
        resume=resume,
    )
    app = web.Application()
    app[STATE] = st

    async def session_ctx(app: web.Application):
        # limit=0: every in-flight stream holds a connection; aiohttp's default cap of 100 would
        # queue requests behind long generations. GETs (health, models) need no retry of ours:
        # aiohttp retries idempotent requests on a stale connection itself.
        pooled = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        fresh = aiohttp.TCPConnector(limit=0, force_close=True)  # a new connection every time
        async with aiohttp.ClientSession(connector=pooled) as pooled_session, \
                aiohttp.ClientSession(connector=fresh) as fresh_session:
            app[_CLIENT] = UpstreamClient(pooled_session, fresh_session)
            yield

    async def health_ctx(app: web.Application):
        task = None
        if st.health_interval > 0:
            task = asyncio.create_task(health_loop(app[_CLIENT].pooled, [st.prefill, st.decode],
                                                   st.health_interval, st.health_timeout))
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
    resume: str = DEFAULT_RESUME,
) -> None:
    """Serve the proxy until interrupted."""
    app = build_app(
        list(prefill_urls), list(decode_urls),
        decode_min_recompute=decode_min_recompute, timeout=timeout, policy=policy,
        health_interval=health_interval, health_timeout=health_timeout,
        prefill_retries=prefill_retries, resume=resume,
    )
    st = app[STATE]
    logger.info(
        "pd proxy on http://%s:%d prefill=%s decode=%s policy=%s health_interval=%gs "
        "prefill_retries=%d decode_min_recompute=%s resume=%s",
        host, port, st.prefill.urls, st.decode.urls, policy, health_interval, prefill_retries,
        decode_min_recompute, resume,
    )
    # handler_cancellation: a client disconnect cancels the handler at once, which closes D's
    # connection and so aborts the request on D (the poll in _relay_stream is the fallback).
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None,
                print=None)
