"""In-process fake P and D servers for the proxy and ``check`` tests (no vLLM), and the plumbing
to serve them: aiohttp apps on loopback, run by plain asyncio (no pytest plugin).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json

from aiohttp import web
from multidict import CIMultiDict

from pd_connector.proxy.bodies import ROUTES
from rig.ports import free_port

SSE_CHUNKS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
              b'data: {"choices":[{"text":"c"}]}\n\n', b"data: [DONE]\n\n"]


def async_test(fn=None, *, timeout: float = 10.0):
    """Run an async test body under ``asyncio.run`` with a hard timeout (``@async_test`` or
    ``@async_test(timeout=...)``)."""
    if fn is None:
        return functools.partial(async_test, timeout=timeout)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=timeout))
    return wrapper


@contextlib.asynccontextmanager
async def serve(app: web.Application, *, handler_cancellation: bool = True):
    """Serve ``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


def dead_url() -> str:
    """A loopback URL nobody listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


class FakeUpstream:
    """A fake vLLM instance that records every generate request it gets.

    ``status``: HTTP status of generate answers; ``kv_params``: the ``kv_transfer_params`` a
    non-streamed answer carries (None: none); ``stream_chunks``: the SSE body of a streamed
    answer; ``healthy``: what ``/health`` says; ``gate``: when set, requests wait for it.
    ``answer``: the whole non-streamed JSON answer instead of the default one (a dict, or a
    function of the request body returning one; ``kv_params`` is added when it has none);
    ``max_model_len``: what ``/v1/models`` reports for the model (None: nothing, as before).
    """

    def __init__(self, name, *, status=200, kv_params=None, stream_chunks=SSE_CHUNKS,
                 answer=None, max_model_len=None):
        self.name, self.status, self.kv_params, self.stream_chunks = (
            name, status, kv_params, stream_chunks)
        self.answer, self.max_model_len = answer, max_model_len
        self.models_requests = 0
        self.healthy = True
        self.gate: asyncio.Event | None = None
        self.received: list[dict] = []  # {"path", "headers", "body"} per request
        self.arrived = asyncio.Event()
        self.app = web.Application()
        for path in ROUTES:
            self.app.router.add_post(path, self.generate)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)

    async def health(self, request):
        return web.json_response({}, status=200 if self.healthy else 503)

    async def models(self, request):
        self.models_requests += 1
        entry = {"id": f"model-{self.name}"}
        if self.max_model_len is not None:
            entry["max_model_len"] = self.max_model_len
        return web.json_response({"object": "list", "data": [entry]})

    async def generate(self, request):
        body = await request.json()
        self.received.append({"path": request.path, "headers": CIMultiDict(request.headers),
                              "body": body})
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.json_response(
                {"error": {"message": f"{self.name} says {self.status}", "code": self.status}},
                status=self.status)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for chunk in self.stream_chunks:
                await resp.write(chunk)
                await asyncio.sleep(0.01)  # separate TCP writes, so chunking is exercised
            await resp.write_eof()
            return resp
        if self.answer is not None:
            out = dict(self.answer(body) if callable(self.answer) else self.answer)
            if self.kv_params is not None and "kv_transfer_params" not in out:
                out["kv_transfer_params"] = self.kv_params
            return web.json_response(out)
        out = {"id": f"cmpl-{self.name}", "choices": [{"text": f"from {self.name}"}]}
        if self.kv_params is not None:
            out["kv_transfer_params"] = self.kv_params
        return web.json_response(out)


class RawUpstream:
    """A fake upstream on a raw asyncio server, for failures aiohttp's server will not produce.

    Every connection is kept alive and its requests answered with ``status`` and ``body``
    (``content_type``), except that:

    - ``drop_on``: the request with this number *on its connection* (1-based) is read and the
      socket then closed without a byte of answer: what a client sees when uvicorn closes an idle
      keep-alive connection just as a new request is sent on it;
    - ``cut_after_headers``: every answer stops after its status line and headers (the body is
      announced but never sent) and the connection is closed.

    ``received``: the JSON body of every request read, answered or not.
    """

    def __init__(self, body: bytes, *, content_type="application/json", status=200,
                 drop_on: int | None = None, cut_after_headers=False):
        self.body, self.content_type, self.status = body, content_type, status
        self.drop_on, self.cut_after_headers = drop_on, cut_after_headers
        self.received: list[dict] = []
        self.connections = 0
        self._writers: set[asyncio.StreamWriter] = set()

    @contextlib.asynccontextmanager
    async def serve(self):
        """Serve on a free loopback port; yields the base URL."""
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        host, port = server.sockets[0].getsockname()[:2]
        try:
            yield f"http://{host}:{port}"
        finally:
            server.close()
            for writer in list(self._writers):
                writer.close()
            await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        self._writers.add(writer)
        try:
            for number in itertools.count(1):
                head = await reader.readuntil(b"\r\n\r\n")
                headers = dict(line.split(": ", 1) for line in
                               head.decode("latin-1").split("\r\n")[1:] if ": " in line)
                length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
                self.received.append(json.loads(await reader.readexactly(length) or b"{}"))
                if number == self.drop_on:
                    return
                reason = "OK" if self.status == 200 else "Error"
                writer.write(f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: "
                             f"{self.content_type}\r\nContent-Length: {len(self.body)}\r\n"
                             "Connection: keep-alive\r\n\r\n".encode("latin-1"))
                if self.cut_after_headers:
                    await writer.drain()
                    return
                writer.write(self.body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            self._writers.discard(writer)
            writer.close()
