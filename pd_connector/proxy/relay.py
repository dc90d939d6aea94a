"""The proxy's HTTP exchanges with one upstream (P or D), and what their failures look like.

``UpstreamClient.post`` sends one request (retried once on a fresh connection when a pooled
keep-alive connection turns out to be closed); ``prefill_once`` posts one prefill and returns P's
JSON; ``relay_stream`` copies D's streamed answer to the client. Failures become
``UpstreamError`` (P or D did not answer usefully: the caller may retry elsewhere) or
``UpstreamRejected`` (P answered 4xx: the client's request is at fault and goes back as is).
Which upstream to use, and whether to retry elsewhere, is ``flow``'s business.
"""

from __future__ import annotations

import asyncio
import errno
import json
import uuid
from typing import Any, Callable, Protocol

import aiohttp
from aiohttp import web

# How often a streaming relay checks whether the client went away while D is silent (queued, or
# pulling KV). Needed because aiohttp only cancels handlers on disconnect when the server runs with
# handler_cancellation=True, which build_app cannot enforce for whoever hosts the app.
DISCONNECT_POLL_S = 0.25

# What writing to, or reading from, a connection the peer has already closed raises.
_STALE_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE})


def is_stale_connection(exc: BaseException) -> bool:
    """True for the failure a pooled keep-alive connection gives when the upstream closed it just
    as we sent a request on it (uvicorn closes idle connections after its keep-alive timeout): the
    connection dropped or was reset, before any response byte.

    Connect errors (a new connection refused or reset) and timeouts are not this: a timed-out
    request may have reached the application.
    """
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)):
        return True
    if not isinstance(exc, aiohttp.ClientOSError) or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if exc.errno in _STALE_ERRNOS:
        return True
    # A body write on a connection the upstream is closing comes wrapped: ClientOSError(None,
    # "Can not write request body for ...") caused by "Cannot write to closing transport"
    # (aiohttp 3.x ClientRequest.write_bytes). The server cannot have read the whole body.
    cause = exc.__cause__
    return exc.errno is None and cause is not None and cause is not exc and is_stale_connection(cause)


class UpstreamClient:
    """The proxy's HTTP client for P and D: a session with a keep-alive pool, and one that opens a
    new connection for every request, for the single retry after a stale pooled connection.

    aiohttp retries such failures itself only for idempotent methods (``ClientSession._request``,
    ``IDEMPOTENT_METHODS``), never for POST, so a generate request on a connection the upstream
    had just closed would fail. The request cannot have reached the application then (the server
    closed the connection before reading it), so sending it again to the same upstream is safe
    and is what proxies do (nginx ``proxy_next_upstream``, envoy's reset-before-request retry).
    """

    def __init__(self, pooled: aiohttp.ClientSession, fresh: aiohttp.ClientSession):
        self.pooled, self.fresh = pooled, fresh

    async def post(
        self, url: str, *, json: dict, headers: dict, timeout: aiohttp.ClientTimeout,
        on_stale: Callable[[BaseException], None],
    ) -> aiohttp.ClientResponse:
        """POST and return once the status line and headers are in (the body is the caller's).

        Only this stage is retried: once the status line arrived the upstream has the request, so
        any later failure is the caller's to handle. ``on_stale`` is told before the retry.
        """
        try:
            return await self.pooled.post(url, json=json, headers=headers, timeout=timeout)
        except aiohttp.ClientError as e:
            if not is_stale_connection(e):
                raise
            on_stale(e)
        return await self.fresh.post(url, json=json, headers=headers, timeout=timeout)


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
        return error_response(
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


def error_response(status: int, message: str, etype: str, **extra: Any) -> web.Response:
    # vLLM's ErrorResponse shape (ErrorInfo requires param and code): what OpenAI clients parse.
    return web.json_response({"error": {"message": message, "type": etype, "param": None,
                                        "code": status, **extra}}, status=status)


def describe_body(raw: bytes, limit: int = 500) -> str:
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


def request_id_of(request: web.Request) -> str:
    """The client's ``X-Request-Id``, or a fresh one; P and D get the same id."""
    return request.headers.get("X-Request-Id") or f"pd-{uuid.uuid4().hex}"


def upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {"X-Request-Id": request_id}
    # Servers started with --api-key need the client's credentials on both hops.
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    return headers


async def prefill_once(
    client: UpstreamClient, url: str, path: str, body: dict, headers: dict, timeout: float,
    on_stale: Callable[[BaseException], None],
) -> dict:
    """One prefill attempt (a stale pooled connection aside): P's JSON answer, or UpstreamError /
    UpstreamRejected."""
    try:
        resp = await client.post(url + path, json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=timeout), on_stale=on_stale)
        async with resp:
            raw = await resp.read()
            if 400 <= resp.status < 500:
                raise UpstreamRejected(url, resp.status, raw, resp.headers.get("Content-Type"))
            if not 200 <= resp.status < 300:
                raise UpstreamError(
                    "prefill", url, resp.status if resp.status >= 500 else 502,
                    f"HTTP {resp.status}: {describe_body(raw)}", retryable=True,
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


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _response_like(d_resp: aiohttp.ClientResponse, request_id: str) -> web.StreamResponse:
    """The client's stream with D's status and content type."""
    out = web.StreamResponse(status=d_resp.status)
    out.content_type = d_resp.content_type
    if d_resp.charset:
        out.charset = d_resp.charset
    out.headers["X-Request-Id"] = request_id
    out.headers["Cache-Control"] = "no-cache"
    return out


_DONE = b"data: [DONE]"
# Set on the client's request once its stream carried "[DONE]": a disconnect after it is a whole
# answer (the OpenAI client hangs up on "[DONE]"), not a client that left.
STREAM_DONE = "pd_stream_done"


class Rewriter(Protocol):
    """Turns D's streamed bytes into the client's (``first_token.StreamAssembler``)."""

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


# Long: one read loop, four exits (client gone, D broke, D ended, cancelled), one "[DONE]" tail.
async def relay_stream(
    request: web.Request, d_resp: aiohttp.ClientResponse, request_id: str, *,
    out: web.StreamResponse | None = None, rewrite: Rewriter | None = None,
) -> tuple[web.StreamResponse, str | None]:
    """Copy D's body to the client chunk by chunk (through ``rewrite`` when given).

    ``out``: the client's stream when it is already open (zero replay sent P's token first);
    else one is opened like D's. Returns the response and why the relay stopped early (None when
    D's body ended). Once the client is gone, D's connection is closed rather than read to the
    end: closing (not releasing) it is what aborts the request on D and frees its KV blocks.
    """
    out, opened = (out, True) if out is not None else (_response_like(d_resp, request_id), False)
    read: asyncio.Task | None = None
    # The client may hang up once it has read "[DONE]" (the OpenAI client does), before D's body
    # ends here: that is a whole answer, not a disconnect.
    tail = b""

    def gone(why: str) -> tuple[web.StreamResponse, str | None]:
        d_resp.close()
        return out, None if _DONE in tail else why

    def mark_whole() -> None:
        if _DONE in tail:
            request[STREAM_DONE] = True  # read by the handler when a disconnect cancels it

    try:
        try:
            if not opened:
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
                    return gone("client disconnected, D aborted")
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
                if data := (chunk if rewrite is None else rewrite.feed(chunk)):
                    await out.write(data)
                    tail = (tail + data)[-len(_DONE) - 8:]
                    mark_whole()
            except ConnectionResetError:
                return gone("client disconnected, D aborted")
        try:
            if rewrite is not None and (rest := rewrite.flush()):
                await out.write(rest)
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

