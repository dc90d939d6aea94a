"""Regression tests for the keep-alive race: an upstream (uvicorn, 5 s keep-alive timeout) closes
an idle pooled connection just as the proxy sends the next request on it. That request never
reached the application, so the proxy resends it once on a new connection instead of answering
502; failures after the upstream started answering, and timeouts, are never resent.

Plain asyncio (no pytest plugin), against the raw-socket fake in ``fake_upstreams``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import re

import aiohttp
import pytest

from pd_connector.proxy.server import build_app
from pd_connector.proxy.relay import is_stale_connection
from rig.fake_upstreams import SSE_CHUNKS, FakeUpstream, RawUpstream, async_test, serve

P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_num_tokens": 3, "replay_offset": 3}
CLIENT_BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}
P_ANSWER = json.dumps({"id": "cmpl-p", "choices": [{"text": "x"}],
                       "kv_transfer_params": P_PARAMS}).encode()
D_ANSWER = json.dumps({"id": "cmpl-raw-d", "choices": [{"text": "from raw d"}]}).encode()
D_STREAM = b"".join(SSE_CHUNKS)


def raw_decode(stream: bool, **kwargs) -> RawUpstream:
    if stream:
        return RawUpstream(D_STREAM, content_type="text/event-stream", **kwargs)
    return RawUpstream(D_ANSWER, **kwargs)


@contextlib.asynccontextmanager
async def proxied(p_url: str, d_url: str, **proxy_kwargs):
    """The proxy in front of one P and one D (no health polls: every upstream request counts)."""
    app = build_app([p_url], [d_url], health_interval=0, **proxy_kwargs)
    async with serve(app) as url, aiohttp.ClientSession() as session:
        yield url, session


async def complete(url: str, session: aiohttp.ClientSession, stream=False) -> tuple[int, bytes]:
    async with session.post(url + "/v1/completions", json={**CLIENT_BODY, "stream": stream}) as r:
        return r.status, await r.read()


async def metric(url: str, session: aiohttp.ClientSession, name: str, role: str) -> int:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    found = re.search(rf'^{name}{{role="{role}",[^}}]*}} (\d+)$', text, re.M)
    assert found, f"{name} for {role} missing from /metrics"
    return int(found.group(1))


@async_test
async def test_stale_keepalive_connection_to_prefill_is_retried_not_502(caplog):
    caplog.set_level(logging.INFO, logger="pd_connector.proxy.server")
    p = RawUpstream(P_ANSWER, drop_on=2)  # drops the 2nd request of every connection
    d = FakeUpstream("d0")
    # prefill_retries=0: the resend must not depend on (nor use up) the prefill retries.
    async with p.serve() as p_url, serve(d.app) as d_url, \
            proxied(p_url, d_url, prefill_retries=0) as (url, s):
        for _ in range(2):  # the second request reuses P's kept-alive connection
            status, body = await complete(url, s)
            assert status == 200
            assert json.loads(body) == {"id": "cmpl-d0", "choices": [{"text": "from d0"}]}
        assert await metric(url, s, "pd_proxy_upstream_stale_connection_retries_total",
                            "prefill") == 1
        assert await metric(url, s, "pd_proxy_upstream_marked_unhealthy_total", "prefill") == 0
    assert len(p.received) == 3 and p.connections == 2  # the retry went on a new connection
    assert [r["body"]["kv_transfer_params"] for r in d.received] == [P_PARAMS, P_PARAMS]
    retried = [r for r in caplog.records if "retrying once on a new connection" in r.getMessage()]
    assert len(retried) == 1 and retried[0].levelno == logging.INFO


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_stale_keepalive_connection_to_single_decode_is_retried_not_502(stream):
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    d = raw_decode(stream, drop_on=2)
    async with serve(p.app) as p_url, d.serve() as d_url, proxied(p_url, d_url) as (url, s):
        for _ in range(2):  # the second request reuses D's kept-alive connection
            status, body = await complete(url, s, stream)
            assert status == 200
            assert body == (D_STREAM if stream else D_ANSWER)
        assert await metric(url, s, "pd_proxy_upstream_stale_connection_retries_total",
                            "decode") == 1
        assert await metric(url, s, "pd_proxy_upstream_marked_unhealthy_total", "decode") == 0
    assert len(d.received) == 3 and d.connections == 2
    # The resent request keeps P's params: it never reached D, so nothing was claimed.
    assert all(r["kv_transfer_params"] == P_PARAMS for r in d.received)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@async_test
async def test_stale_connection_retry_happens_only_once(leg):
    """An upstream that drops every request fails the request after one resend, as before."""
    dropping = RawUpstream(P_ANSWER if leg == "prefill" else D_ANSWER, drop_on=1)
    healthy = FakeUpstream("ok", kv_params=P_PARAMS)
    async with dropping.serve() as bad_url, serve(healthy.app) as ok_url:
        p_url, d_url = (bad_url, ok_url) if leg == "prefill" else (ok_url, bad_url)
        async with proxied(p_url, d_url, prefill_retries=0) as (url, s):
            status, _ = await complete(url, s)
            assert status == 502
            assert await metric(url, s, "pd_proxy_upstream_stale_connection_retries_total",
                                leg) == 1
    assert len(dropping.received) == 2


@pytest.mark.parametrize("stream", [False, True])
@async_test
async def test_decode_failing_after_status_line_is_not_resent(stream):
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    d = raw_decode(stream, cut_after_headers=True)
    async with serve(p.app) as p_url, d.serve() as d_url, proxied(p_url, d_url) as (url, s):
        status, body = await complete(url, s, stream)
        if stream:  # the status went to the client already; it sees a stream that stops
            assert status == 200 and body == b""
        else:
            assert status == 502 and json.loads(body)["error"]["type"] == "decode_error"
        assert await metric(url, s, "pd_proxy_upstream_stale_connection_retries_total",
                            "decode") == 0
    assert len(d.received) == 1


@pytest.mark.parametrize("exc, stale", [
    (aiohttp.ServerDisconnectedError(), True),
    (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), True),
    (aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"), True),
    (aiohttp.ClientOSError(errno.EPIPE, "Broken pipe"), True),
    (aiohttp.ClientOSError(errno.ETIMEDOUT, "Connection timed out"), False),
    (aiohttp.ServerTimeoutError("Timeout on reading data from socket"), False),
    (aiohttp.ClientPayloadError("Response payload is not completed"), False),
])
def test_only_connection_drops_before_an_answer_count_as_stale(exc, stale):
    assert is_stale_connection(exc) is stale


def _wrapped_body_write_error(cause: BaseException | None) -> aiohttp.ClientOSError:
    """What aiohttp raises when writing a request body fails (ClientRequest.write_bytes)."""
    exc = aiohttp.ClientOSError(None, "Can not write request body for http://d/v1/completions")
    exc.__cause__ = cause
    return exc


def test_a_body_write_on_a_pooled_connection_the_upstream_is_closing_is_stale():
    """Regression (a 502 in tests/e2e/test_data_parallel.py): D's API server came back from a
    27 s stall and closed its idle keep-alive connections as the proxy wrote a request body on
    one; aiohttp wrapped the "closing transport" error, and the proxy answered 502 instead of
    retrying on a new connection."""
    closing = aiohttp.ClientConnectionResetError("Cannot write to closing transport")
    assert is_stale_connection(_wrapped_body_write_error(closing))
    # Negative controls: a wrapped error that is not a connection drop, or none at all.
    assert not is_stale_connection(_wrapped_body_write_error(ValueError("bad body")))
    assert not is_stale_connection(_wrapped_body_write_error(None))


def test_connect_errors_are_not_stale():
    key = aiohttp.client_reqrep.ConnectionKey("h", 1, False, False, None, None, None)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(errno.ECONNREFUSED, "no"))
    reset = aiohttp.ClientConnectorError(key, ConnectionResetError(errno.ECONNRESET, "reset"))
    assert not is_stale_connection(refused) and not is_stale_connection(reset)
