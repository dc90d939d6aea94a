"""Proxy tests against in-process fake P and D servers (no vLLM).

Plain asyncio (no pytest plugin): each test body runs under ``asyncio.run`` with a hard timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import types

import aiohttp
import pytest
from aiohttp import web

from pd_connector import cli
from pd_connector.proxy import server as proxy_mod
from pd_connector.proxy.server import PREFILL_KV_PARAMS, build_app
from rig.fake_upstreams import SSE_CHUNKS, FakeUpstream, async_test, dead_url, serve

# What a NIXL P returns (shape from vLLM 0.32.0), plus our replay offset.
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3], [6]],
    "remote_engine_id": "engine-p0",
    "remote_request_id": "abc-1234abcd",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "remote_num_tokens": 39,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
    "replay_offset": 32,
}


@contextlib.asynccontextmanager
async def stack(n_p=1, n_d=1, p_kwargs=None, d_kwargs=None, proxy_kwargs=None,
                proxy_cancellation=True):
    ps = [FakeUpstream(f"p{i}", **{"kv_params": P_PARAMS, **(p_kwargs or {})}) for i in range(n_p)]
    ds = [FakeUpstream(f"d{i}", **(d_kwargs or {})) for i in range(n_d)]
    async with contextlib.AsyncExitStack() as es:
        p_urls = [await es.enter_async_context(serve(f.app)) for f in ps]
        d_urls = [await es.enter_async_context(serve(f.app)) for f in ds]
        app = build_app(p_urls, d_urls, **(proxy_kwargs or {}))
        url = await es.enter_async_context(serve(app, handler_cancellation=proxy_cancellation))
        session = await es.enter_async_context(aiohttp.ClientSession())
        yield types.SimpleNamespace(url=url, ps=ps, ds=ds, p_urls=p_urls, d_urls=d_urls,
                                    session=session)


CLIENT_BODY = {
    "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0,
    "ignore_eos": True, "min_tokens": 4, "logprobs": 1,
}


@async_test
async def test_completion_p_and_d_bodies(caplog):
    caplog.set_level(logging.INFO, logger="pd_connector.proxy.server")
    async with stack() as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY,
                                  headers={"X-Request-Id": "req-42"}) as r:
            assert r.status == 200
            assert await r.json() == {"id": "cmpl-d0", "choices": [{"text": "from d0"}]}
        (p,), (d,) = s.ps[0].received, s.ds[0].received
        assert p["path"] == d["path"] == "/v1/completions"
        assert p["headers"]["X-Request-Id"] == d["headers"]["X-Request-Id"] == "req-42"
        pb = p["body"]
        assert pb["max_tokens"] == 1 and pb["stream"] is False
        assert "stream_options" not in pb
        assert "max_completion_tokens" not in pb  # only set when the client used it
        # Zero replay (the default --resume first-token): P is asked for its first token, samples
        # it under the client's min_tokens (capped at its one token) and returns the prompt ids.
        assert pb["kv_transfer_params"] == {**PREFILL_KV_PARAMS, "pd_resume": "first_token"}
        assert pb["min_tokens"] == 1 and pb["return_token_ids"] is True
        assert pb["prompt"] == CLIENT_BODY["prompt"] and pb["logprobs"] == 1
        # This P returned no pd_first_token (standard flow): D gets the client's body,
        # untouched, plus exactly what P returned.
        assert d["body"] == {**CLIENT_BODY, "kv_transfer_params": P_PARAMS}
    line = [rec.getMessage() for rec in caplog.records if "req=req-42" in rec.getMessage()]
    assert len(line) == 1
    assert "p_status=200" in line[0] and "params=True" in line[0]
    assert "replay_offset=32" in line[0] and "d_status=200" in line[0]
    assert "resume=replay(prefill_declined)" in line[0]


@async_test
async def test_resume_replay_mode_sends_the_standard_prefill():
    async with stack(proxy_kwargs={"resume": "replay"}) as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 200
            assert await r.json() == {"id": "cmpl-d0", "choices": [{"text": "from d0"}]}
        pb, db = s.ps[0].received[0]["body"], s.ds[0].received[0]["body"]
        assert pb["max_tokens"] == 1 and pb["stream"] is False
        assert "min_tokens" not in pb and "stream_options" not in pb
        assert "return_token_ids" not in pb
        assert pb["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert db == {**CLIENT_BODY, "kv_transfer_params": P_PARAMS}
        async with s.session.get(s.url + "/metrics") as r:
            text = await r.text()
        assert 'pd_proxy_resume_total{mode="replay",reason="disabled"} 1' in text


@async_test
async def test_generated_request_id_is_shared():
    async with stack() as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
        assert rid
        assert s.ps[0].received[0]["headers"]["X-Request-Id"] == rid
        assert s.ds[0].received[0]["headers"]["X-Request-Id"] == rid


@async_test
async def test_streaming_passthrough_in_order():
    body = {**CLIENT_BODY, "stream": True, "stream_options": {"include_usage": True}}
    async with stack() as s:
        async with s.session.post(s.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            got = b""
            async for chunk in r.content.iter_any():
                got += chunk
        assert got == b"".join(SSE_CHUNKS)
        pb = s.ps[0].received[0]["body"]
        assert pb["stream"] is False and "stream_options" not in pb and pb["max_tokens"] == 1
        assert s.ds[0].received[0]["body"] == {**body, "kv_transfer_params": P_PARAMS}


@async_test
async def test_chat_completions_route():
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9, "min_completion_tokens": 2}
    async with stack() as s:
        async with s.session.post(s.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
        p, d = s.ps[0].received[0], s.ds[0].received[0]
        assert p["path"] == d["path"] == "/v1/chat/completions"
        assert p["body"]["max_tokens"] == 1 and p["body"]["max_completion_tokens"] == 1
        assert "min_completion_tokens" not in p["body"]
        assert d["body"] == {**body, "kv_transfer_params": P_PARAMS}


@async_test
async def test_prefill_http_error_names_prefill_and_skips_decode():
    async with stack(p_kwargs={"status": 500}) as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 500
            err = (await r.json())["error"]
        assert err["type"] == "prefill_error" and err["upstream"] == s.p_urls[0]
        assert "prefill" in err["message"] and s.p_urls[0] in err["message"]
        assert "p0 says 500" in err["message"]  # P's own reason is relayed
        assert s.ds[0].received == []


@async_test
async def test_prefill_connection_refused_gives_502():
    dead = dead_url()
    d = FakeUpstream("d0")
    async with serve(d.app) as d_url, serve(build_app([dead], [d_url])) as url:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=CLIENT_BODY) as r:
                assert r.status == 502
                err = (await r.json())["error"]
    assert err["type"] == "prefill_error" and dead in err["message"]
    assert d.received == []


@pytest.mark.parametrize("kv_params", [None, {}])
@async_test
async def test_no_params_from_prefill_forwards_plain_body(kv_params):
    async with stack(p_kwargs={"kv_params": kv_params}) as s:
        body = {**CLIENT_BODY, "kv_transfer_params": {"client": "junk"}}
        async with s.session.post(s.url + "/v1/completions", json=body) as r:
            assert r.status == 200
        # The proxy owns kv_transfer_params: the client's value never reaches D.
        assert s.ds[0].received[0]["body"] == CLIENT_BODY


@async_test
async def test_round_robin_alternates():
    async with stack(n_p=2, n_d=2) as s:
        for _ in range(4):
            async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
                assert r.status == 200
        assert [len(f.received) for f in s.ps + s.ds] == [2, 2, 2, 2]
        ids = [f.received[0]["headers"]["X-Request-Id"] for f in s.ps]
        assert ids[0] != ids[1]


@async_test
async def test_decode_min_recompute_reaches_prefill():
    async with stack(proxy_kwargs={"decode_min_recompute": 7}) as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 200
        pb = s.ps[0].received[0]["body"]
        assert pb["kv_transfer_params"] == {**PREFILL_KV_PARAMS, "pd_min_recompute_tokens": 7,
                                            "pd_resume": "first_token"}
        assert s.ds[0].received[0]["body"] == {**CLIENT_BODY, "kv_transfer_params": P_PARAMS}


@async_test
async def test_decode_error_status_passed_through():
    async with stack(d_kwargs={"status": 400}) as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "d0 says 400"


@async_test
async def test_bad_json_is_400():
    async with stack() as s:
        async with s.session.post(s.url + "/v1/completions", data=b"{nope") as r:
            assert r.status == 400
        assert s.ps[0].received == []


@async_test
async def test_proxy_errors_have_vllms_error_shape():
    """Every error the proxy writes itself has vLLM's ErrorResponse fields (ErrorInfo: message,
    type, param, code = the HTTP status), as OpenAI clients expect; upstream and request_id are
    extras. The cases: a body that is not JSON or not an object, P's 5xx, P and D unreachable."""
    def check(status: int, err: dict) -> None:
        assert {"message", "type", "param", "code"} <= set(err), err
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        assert err["param"] is None and err["code"] == status, err

    async with stack() as s:
        for data in (b"{nope", b"[1, 2]"):
            async with s.session.post(s.url + "/v1/completions", data=data) as r:
                assert r.status == 400
                check(400, (await r.json())["error"])
    async with stack(p_kwargs={"status": 500}) as s:
        async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
            assert r.status == 500
            check(500, (await r.json())["error"])
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    async with serve(p.app) as p_url, serve(FakeUpstream("d0").app) as d_url:
        for p_urls, d_urls in (([dead_url()], [d_url]), ([p_url], [dead_url()])):
            async with serve(build_app(p_urls, d_urls)) as url, aiohttp.ClientSession() as session:
                for stream in (False, True):
                    async with session.post(url + "/v1/completions",
                                            json={**CLIENT_BODY, "stream": stream}) as r:
                        assert r.status == 502
                        check(502, (await r.json())["error"])


@async_test
async def test_health_and_models():
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    dead = dead_url()
    async with serve(p.app) as p_url, serve(FakeUpstream("d0").app) as d_url:
        async with serve(build_app([p_url], [d_url, dead], health_timeout=1.0)) as url:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/health") as r:
                    assert r.status == 200
                    h = await r.json()
                async with session.get(url + "/v1/models") as r:
                    assert r.status == 200
                    assert (await r.json())["data"][0]["id"] == "model-d0"
    assert [x["healthy"] for x in h["prefill"]] == [True]
    assert [(x["url"], x["healthy"]) for x in h["decode"]] == [(d_url, True), (dead, False)]


@pytest.mark.parametrize("proxy_cancellation", [True, False])
@pytest.mark.parametrize("chatty", [True, False])
@async_test
async def test_client_disconnect_aborts_decode(proxy_cancellation, chatty):
    """Client leaves mid-stream -> the proxy drops D's connection, whether or not D is sending
    and whether or not the hosting server cancels handlers on disconnect."""
    aborted = asyncio.Event()
    sent_after_first = 0

    async def d_handler(request):
        nonlocal sent_after_first
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        try:
            for _ in range(400):  # ~20 s if never aborted
                await asyncio.sleep(0.05)
                if chatty:
                    await resp.write(b"data: more\n\n")
                    sent_after_first += 1
        except (ConnectionResetError, asyncio.CancelledError):
            aborted.set()
            raise
        return resp

    d_app = web.Application()
    d_app.router.add_post("/v1/completions", d_handler)
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    async with serve(p.app) as p_url, serve(d_app) as d_url:
        app = build_app([p_url], [d_url])
        async with serve(app, handler_cancellation=proxy_cancellation) as url:
            async with aiohttp.ClientSession() as session:
                r = await session.post(url + "/v1/completions",
                                       json={**CLIENT_BODY, "stream": True})
                assert (await r.content.readany()).startswith(b"data: first")
                r.close()  # drop the connection, like a client that went away
            await asyncio.wait_for(aborted.wait(), timeout=3)
    if chatty:
        assert sent_after_first < 60  # stopped well before D finished


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_proxy_args_reach_prefill(monkeypatch):
    calls = []
    monkeypatch.setattr(proxy_mod, "run_proxy", lambda *a, **kw: calls.append((a, kw)))
    argv = ["proxy", "--prefill", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
            "--decode", "http://127.0.0.1:3/", "--port", "9", "--decode-min-recompute", "5"]
    assert cli.main(argv) == 0
    (args, kw), = calls
    assert args == (["127.0.0.1:1", "127.0.0.1:2"], ["http://127.0.0.1:3/"])
    assert kw["port"] == 9 and kw["host"] == "127.0.0.1" and kw["decode_min_recompute"] == 5

    @async_test
    async def check():
        async with stack(proxy_kwargs={"decode_min_recompute": kw["decode_min_recompute"],
                                       "timeout": kw["timeout"]}) as s:
            async with s.session.post(s.url + "/v1/completions", json=CLIENT_BODY) as r:
                assert r.status == 200
            assert s.ps[0].received[0]["body"]["kv_transfer_params"][
                "pd_min_recompute_tokens"] == 5
    check()


def test_cli_rejects_negative_min_recompute(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["proxy", "--prefill", "a", "--decode", "b", "--port", "1",
                  "--decode-min-recompute", "-1"])
    assert e.value.code == 2


def test_n_samples_are_prefilled_once_and_announced_to_p():
    """With n > 1 vLLM's P prefilled n children and returned one child's params: n - 1 leases
    orphaned. The proxy asks P for one prefill and tells it how many decode requests read it."""
    pb = proxy_mod.build_prefill_body({**CLIENT_BODY, "n": 3})
    assert pb["n"] == 1 and pb["kv_transfer_params"] == {**PREFILL_KV_PARAMS, "pd_decode_requests": 3}
    assert proxy_mod.build_decode_body({**CLIENT_BODY, "n": 3}, P_PARAMS)["n"] == 3
    for n in (1, None, "2", True):
        body = {**CLIENT_BODY, "n": n}
        assert proxy_mod.build_prefill_body(body)["kv_transfer_params"] == PREFILL_KV_PARAMS
        assert proxy_mod.build_prefill_body(body)["n"] == n  # left to vLLM's own validation


def test_prefill_body_does_not_mutate_client_body():
    body = {"prompt": "x", "stream": True, "stream_options": {"a": 1}, "max_tokens": 5}
    before = json.loads(json.dumps(body))
    proxy_mod.build_prefill_body(body, 3)
    proxy_mod.build_decode_body(body, P_PARAMS)
    assert body == before


@pytest.mark.parametrize("proxy_cancellation", [True, False])
@async_test
async def test_a_client_that_hangs_up_after_done_got_a_whole_answer(proxy_cancellation):
    """Regression: the OpenAI client closes its connection on "[DONE]", before D's body ends at
    the proxy; that was counted (and logged) as a client that left mid-answer. Negative control:
    a client that leaves before "[DONE]" is still counted as gone."""
    served = 0

    async def d_handler(request):
        nonlocal served
        served += 1
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n" + (b"data: [DONE]\n\n" if served == 1 else b""))
        await asyncio.sleep(2)  # D's body has not ended yet when the client hangs up
        return resp

    d_app = web.Application()
    d_app.router.add_post("/v1/completions", d_handler)
    p = FakeUpstream("p0", kv_params=P_PARAMS)
    async with serve(p.app) as p_url, serve(d_app) as d_url:
        app = build_app([p_url], [d_url], resume="replay")
        async with serve(app, handler_cancellation=proxy_cancellation) as url:
            for until in (b"[DONE]", b"first"):
                async with aiohttp.ClientSession() as session:
                    r = await session.post(url + "/v1/completions", json={**CLIENT_BODY, "stream": True})
                    got = b""
                    while until not in got:
                        got += await r.content.readany()
                    r.close()
                await asyncio.sleep(0.6)
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/metrics") as m:
                    text = await m.text()
    outcomes = {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("pd_proxy_requests_total")}
    assert outcomes.get("ok") == 1 and outcomes.get("client_disconnected") == 1, outcomes
