"""Upstream selection, health state, prefill retries, the decode fallback and /metrics of the proxy,
against in-process fake P and D servers (no vLLM).

Plain asyncio (no pytest plugin): each async test body runs under ``asyncio.run`` with a hard
timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import types

import aiohttp
import pytest
from aiohttp import web

from pd_connector import cli
from pd_connector.proxy import server as proxy_mod
from pd_connector.proxy.server import STATE, build_app
from pd_connector.proxy.routing import Pool, ProxyMetrics
from rig.fake_upstreams import FakeUpstream, async_test, dead_url, serve

P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_num_tokens": 3, "replay_offset": 3, "pd_protocol_version": 1}
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}


@contextlib.asynccontextmanager
async def stack(ps, ds, **proxy_kwargs):
    """Serve the fakes (a str entry is used as a URL as is) and a proxy in front of them."""
    proxy_kwargs.setdefault("health_interval", 0)
    async with contextlib.AsyncExitStack() as es:
        async def url_of(f):
            return f if isinstance(f, str) else await es.enter_async_context(serve(f.app))
        p_urls = [await url_of(f) for f in ps]
        d_urls = [await url_of(f) for f in ds]
        app = build_app(p_urls, d_urls, **proxy_kwargs)
        url = await es.enter_async_context(serve(app))
        session = await es.enter_async_context(aiohttp.ClientSession())
        yield types.SimpleNamespace(url=url, app=app, state=app[STATE], session=session,
                                    p_urls=p_urls, d_urls=d_urls)


def P(name="p", **kw):
    return FakeUpstream(name, kv_params=kw.pop("kv_params", P_PARAMS), **kw)


async def post(s, body=BODY, **kw):
    async with s.session.post(s.url + "/v1/completions", json=body, **kw) as r:
        return r.status, await r.read(), r.headers


async def wait_for(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def metrics_text(s) -> str:
    async with s.session.get(s.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return await r.text()


def sample(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


# ---- Pool (pure) --------------------------------------------------------------------------------

def test_least_loaded_picks_fewest_in_flight_and_breaks_ties_round_robin():
    pool = Pool("decode", ["a", "b", "c"])
    assert [pool.select().url for _ in range(4)] == ["a", "b", "c", "a"]
    a, b, c = pool.upstreams
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 2
    assert [pool.select().url for _ in range(2)] == ["b", "b"]
    b.in_flight = 2  # all tied again: round-robin resumes after the last pick
    assert [pool.select().url for _ in range(3)] == ["c", "a", "b"]


def test_round_robin_ignores_load():
    pool = Pool("prefill", ["a", "b"], "round-robin")
    pool.upstreams[0].in_flight = 5
    assert [pool.select().url for _ in range(4)] == ["a", "b", "a", "b"]


def test_unhealthy_skipped_but_tried_when_all_are_down():
    pool = Pool("decode", ["a", "b", "c"])
    pool.mark_unhealthy(pool.upstreams[1], "refused")
    assert [pool.select().url for _ in range(4)] == ["a", "c", "a", "c"]
    for up in pool.upstreams:
        pool.mark_unhealthy(up, "refused")
    assert pool.all_down
    assert sorted(pool.select().url for _ in range(3)) == ["a", "b", "c"]
    pool.mark_healthy(pool.upstreams[2])
    assert {pool.select().url for _ in range(3)} == {"c"}
    assert [u.marked_unhealthy for u in pool.upstreams] == [1, 1, 1]


def test_exclude_prefers_another_instance_and_falls_back_when_none_is_left():
    pool = Pool("prefill", ["a", "b"])
    assert pool.select(exclude=["a"]).url == "b"
    assert pool.select(exclude=["a", "b"]).url in ("a", "b")
    assert Pool("prefill", ["a"]).select(exclude=["a"]).url == "a"


def test_passive_recovery_without_health_polls():
    pool = Pool("decode", ["a", "b"], recover_after_s=0.05)
    pool.mark_unhealthy(pool.upstreams[0], "refused")
    assert {pool.select().url for _ in range(3)} == {"b"}
    time.sleep(0.06)
    assert {pool.select().url for _ in range(3)} == {"a", "b"}
    assert not pool.upstreams[0].healthy  # selectable again, still reported unhealthy


def test_track_counts_in_flight_and_bad_policy_is_refused():
    pool = Pool("decode", ["a", "a/"[:1], "b"])  # duplicate dropped
    assert pool.urls == ["a", "b"]
    with pool.track(pool.upstreams[0]) as up:
        assert up.in_flight == 1
    assert pool.upstreams[0].in_flight == 0 and pool.upstreams[0].requests == 1
    with pytest.raises(ValueError, match="unknown policy"):
        Pool("decode", ["a"], "random")


def test_metrics_render_is_valid_prometheus_text():
    pool = Pool("decode", ['http://h:1/"x\\'])
    m = ProxyMetrics()
    m.count_request("/v1/completions", "ok")
    m.count_request("/v1/completions", "ok")
    m.prefill_retries = 3
    text = m.render([pool])
    assert text.endswith("\n")
    assert 'pd_proxy_requests_total{route="/v1/completions",outcome="ok"} 2' in text
    assert "pd_proxy_prefill_retries_total 3" in text
    assert 'upstream="http://h:1/\\"x\\\\"' in text  # escaped quote and backslash
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge") and name not in names
            names.add(name)
        elif not line.startswith("# HELP "):
            assert re.match(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? \d+$', line), line
    assert {"pd_proxy_requests_total", "pd_proxy_prefill_retries_total",
            "pd_proxy_upstream_marked_unhealthy_total", "pd_proxy_upstream_in_flight",
            "pd_proxy_decode_fallbacks_total", "pd_proxy_upstream_healthy"} <= names


# ---- selection through the proxy ----------------------------------------------------------------

@pytest.mark.parametrize("policy,expect", [("least-loaded", [1, 3]), ("round-robin", [2, 2])])
@async_test
async def test_busy_decode_is_avoided_by_least_loaded(policy, expect):
    d0, d1 = FakeUpstream("d0"), FakeUpstream("d1")
    d0.gate = asyncio.Event()
    async with stack([P()], [d0, d1], policy=policy) as s:
        held = asyncio.ensure_future(post(s))  # -> d0 (tie, first), held open
        await asyncio.wait_for(d0.arrived.wait(), 3)
        if policy == "least-loaded":
            text = await metrics_text(s)
            assert sample(text, "pd_proxy_upstream_in_flight", upstream=s.d_urls[0]) == 1
            assert sample(text, "pd_proxy_upstream_in_flight", upstream=s.d_urls[1]) == 0
        gate, d0.gate = d0.gate, None  # only the first request is held
        for _ in range(3):  # one after the other: d0 still has one in flight each time
            assert (await post(s))[0] == 200
        gate.set()
        assert (await held)[0] == 200
        assert [len(d0.received), len(d1.received)] == expect


@async_test
async def test_health_poll_skips_unhealthy_prefill_and_recovers():
    p0, p1 = P("p0"), P("p1")
    p1.healthy = False  # serves requests, but its /health says 503
    async with stack([p0, p1], [FakeUpstream("d0")], health_interval=0.05, health_timeout=1) as s:
        pool = s.state.prefill
        await wait_for(lambda: not pool.upstreams[1].healthy)
        for _ in range(4):
            assert (await post(s))[0] == 200
        assert [len(p0.received), len(p1.received)] == [4, 0]
        p1.healthy = True
        await wait_for(lambda: pool.upstreams[1].healthy)
        for _ in range(4):
            assert (await post(s))[0] == 200
        assert len(p1.received) >= 1
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_upstream_marked_unhealthy_total",
                      role="prefill", upstream=s.p_urls[1]) == 1


@async_test
async def test_whole_pool_unhealthy_is_still_tried():
    p0 = P("p0")
    p0.healthy = False
    async with stack([p0], [FakeUpstream("d0")], health_interval=0.05, health_timeout=1) as s:
        await wait_for(lambda: s.state.prefill.all_down)
        assert (await post(s))[0] == 200
        assert len(p0.received) == 1


@async_test
async def test_proxy_health_is_503_when_a_whole_pool_is_down():
    d0, d1 = FakeUpstream("d0"), FakeUpstream("d1")
    async with stack([P()], [d0, d1]) as s:
        async with s.session.get(s.url + "/health") as r:
            assert r.status == 200
            assert (await r.json())["status"] == "ok"
        d0.healthy = False
        async with s.session.get(s.url + "/health") as r:
            assert r.status == 200  # one D is enough
            h = await r.json()
        assert [(x["url"], x["healthy"], x["status"]) for x in h["decode"]] == [
            (s.d_urls[0], False, 503), (s.d_urls[1], True, 200)]
        d1.healthy = False
        async with s.session.get(s.url + "/health") as r:
            assert r.status == 503
            h = await r.json()
        assert "decode" in h["status"] and not any(x["healthy"] for x in h["decode"])
        assert h["prefill"][0]["healthy"] is True and h["prefill"][0]["in_flight"] == 0


@async_test
async def test_models_skips_an_unreachable_decode():
    dead = dead_url()
    async with stack([P()], [dead, FakeUpstream("d1")]) as s:
        for _ in range(2):
            async with s.session.get(s.url + "/v1/models") as r:
                assert r.status == 200
                assert (await r.json())["data"][0]["id"] == "model-d1"
        assert not s.state.decode.upstreams[0].healthy


# ---- prefill retries ----------------------------------------------------------------------------

@async_test
async def test_prefill_connection_refused_is_retried_and_marks_unhealthy():
    dead, p1, d0 = dead_url(), P("p1"), FakeUpstream("d0")
    async with stack([dead, p1], [d0]) as s:
        status, _, headers = await post(s, headers={"X-Request-Id": "rid-1"})
        assert status == 200
        assert p1.received[0]["headers"]["X-Request-Id"] == "rid-1"
        assert d0.received[0]["body"]["kv_transfer_params"] == P_PARAMS
        assert not s.state.prefill.upstreams[0].healthy
        for _ in range(3):  # the dead P is no longer picked
            assert (await post(s))[0] == 200
        assert len(p1.received) == 4
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_prefill_retries_total") == 1
        assert sample(text, "pd_proxy_upstream_marked_unhealthy_total", upstream=dead) == 1
        assert sample(text, "pd_proxy_upstream_healthy", upstream=dead) == 0
        assert sample(text, "pd_proxy_requests_total", outcome="ok") == 4


@async_test
async def test_prefill_5xx_retried_on_a_different_instance_each_time():
    ps = [P(f"p{i}", status=500) for i in range(3)]
    d0 = FakeUpstream("d0")
    async with stack(ps, [d0], prefill_retries=2) as s:
        status, raw, _ = await post(s)
        assert status == 500 and b"prefill_error" in raw and b"says 500" in raw
        assert [len(p.received) for p in ps] == [1, 1, 1] and d0.received == []
        ps[1].status = 200
        ps[0].received.clear(), ps[1].received.clear(), ps[2].received.clear()
        assert (await post(s))[0] == 200  # p0 (500) then p1
        assert [len(p.received) for p in ps] == [1, 1, 0]
        # 5xx does not mark unhealthy (the health poll decides), it only retries.
        assert all(u.healthy for u in s.state.prefill.upstreams)
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_prefill_retries_total") == 3
        assert sample(text, "pd_proxy_requests_total", outcome="prefill_failed") == 1


@async_test
async def test_prefill_retries_bounded_and_zero_means_none():
    ps = [P(f"p{i}", status=503) for i in range(3)]
    async with stack(ps, [FakeUpstream("d0")], prefill_retries=0) as s:
        assert (await post(s))[0] == 503
        assert sum(len(p.received) for p in ps) == 1
    ps = [P("p0", status=502)]
    async with stack(ps, [FakeUpstream("d0")], prefill_retries=2) as s:  # one P: retried in place
        assert (await post(s))[0] == 502
        assert len(ps[0].received) == 3


@async_test
async def test_prefill_timeout_is_retried_elsewhere():
    p0, p1 = P("p0"), P("p1")
    p0.gate = asyncio.Event()  # never answers
    async with stack([p0, p1], [FakeUpstream("d0")], timeout=0.3) as s:
        assert (await post(s))[0] == 200
        assert len(p0.received) == len(p1.received) == 1
        assert "timed out" in s.state.prefill.upstreams[0].last_error
        assert not s.state.prefill.upstreams[0].healthy
    async with stack([p0], [FakeUpstream("d0")], timeout=0.3, prefill_retries=2) as s:
        status, raw, _ = await post(s)  # the only P timed out: not waited for a second time
        assert status == 504 and b"timed out" in raw
        assert len(p0.received) == 2  # one above, one here


@async_test
async def test_prefill_4xx_is_returned_as_is_and_not_retried():
    p0, p1, d0 = P("p0", status=400), P("p1"), FakeUpstream("d0")
    async with stack([p0, p1], [d0]) as s:
        status, raw, headers = await post(s, headers={"X-Request-Id": "bad-1"})
        assert status == 400
        assert raw == b'{"error": {"message": "p0 says 400", "code": 400}}'
        assert headers["X-Request-Id"] == "bad-1"
        assert len(p0.received) == 1 and p1.received == [] and d0.received == []
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_prefill_retries_total") == 0
        assert sample(text, "pd_proxy_requests_total", outcome="prefill_rejected") == 1


# ---- decode fallback ----------------------------------------------------------------------------

@pytest.mark.parametrize("first", ["dead", "503"])
@async_test
async def test_decode_failing_before_answering_goes_once_to_another_d_without_params(first):
    d0 = dead_url() if first == "dead" else FakeUpstream("d0", status=503)
    d1 = FakeUpstream("d1")
    async with stack([P()], [d0, d1]) as s:
        status, raw, _ = await post(s, body={**BODY, "stream": False})
        assert status == 200 and b"from d1" in raw
        (got,) = d1.received
        assert got["body"] == {**BODY, "stream": False}  # no kv_transfer_params: d1 computes
        if first == "503":
            assert d0.received[0]["body"]["kv_transfer_params"] == P_PARAMS
        assert (not s.state.decode.upstreams[0].healthy) == (first == "dead")
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_decode_fallbacks_total") == 1
        assert sample(text, "pd_proxy_requests_total", outcome="ok") == 1


@async_test
async def test_decode_fallback_is_tried_only_once():
    d0, d1 = FakeUpstream("d0", status=500), FakeUpstream("d1", status=500)
    async with stack([P()], [d0, d1]) as s:
        status, raw, _ = await post(s)
        assert status == 500 and b"d1 says 500" in raw
        assert len(d0.received) == len(d1.received) == 1


@async_test
async def test_single_decode_has_no_fallback():
    dead = dead_url()
    async with stack([P()], [dead]) as s:
        status, raw, _ = await post(s)
        assert status == 502 and b"decode_error" in raw and dead.encode() in raw
        text = await metrics_text(s)
        assert sample(text, "pd_proxy_decode_fallbacks_total") == 0
        assert sample(text, "pd_proxy_requests_total", outcome="decode_failed") == 1


@async_test
async def test_decode_4xx_and_timeout_are_not_sent_elsewhere():
    d0, d1 = FakeUpstream("d0", status=400), FakeUpstream("d1")
    async with stack([P()], [d0, d1]) as s:
        assert (await post(s))[0] == 400
        assert d1.received == []
    d0 = FakeUpstream("d0")
    d0.gate = asyncio.Event()  # never answers: D may be generating, so no second D
    d1 = FakeUpstream("d1")
    async with stack([P()], [d0, d1], timeout=0.3) as s:
        status, raw, _ = await post(s)
        assert status == 504 and b"timed out" in raw
        assert d1.received == []


@async_test
async def test_decode_stream_broken_after_first_bytes_is_not_retried():
    async def breaking(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await asyncio.sleep(0.05)
        request.transport.close()  # D dies mid-stream
        return resp

    async def health(request):
        return web.json_response({})

    d0_app = web.Application()
    d0_app.router.add_post("/v1/completions", breaking)
    d0_app.router.add_get("/health", health)
    d1 = FakeUpstream("d1")
    async with serve(d0_app) as d0_url:
        async with stack([P()], [d0_url, d1]) as s:
            async with s.session.post(s.url + "/v1/completions",
                                      json={**BODY, "stream": True}) as r:
                assert r.status == 200
                got = b""
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for chunk in r.content.iter_any():
                        got += chunk
            assert got.startswith(b"data: first")
            assert d1.received == []
            await wait_for(lambda: not s.state.decode.upstreams[0].healthy)
            text = await metrics_text(s)
            assert sample(text, "pd_proxy_requests_total", outcome="decode_failed") == 1
            assert sample(text, "pd_proxy_upstream_in_flight", upstream=d0_url) == 0


# ---- metrics and CLI ----------------------------------------------------------------------------

@async_test
async def test_metrics_count_routes_and_outcomes():
    async with stack([P()], [FakeUpstream("d0")]) as s:
        assert (await post(s))[0] == 200
        async with s.session.post(s.url + "/v1/chat/completions",
                                  json={"messages": []}) as r:
            assert r.status == 200
        async with s.session.post(s.url + "/v1/completions", data=b"{no") as r:
            assert r.status == 400
        text = await metrics_text(s)
    assert sample(text, "pd_proxy_requests_total", route="/v1/completions", outcome="ok") == 1
    assert sample(text, "pd_proxy_requests_total", route="/v1/chat/completions",
                  outcome="ok") == 1
    assert sample(text, "pd_proxy_requests_total", route="/v1/completions",
                  outcome="invalid_request") == 1
    assert sample(text, "pd_proxy_upstream_requests_total", role="decode") == 2
    assert sample(text, "pd_proxy_prefill_without_params_total") == 0


def test_cli_proxy_operator_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(proxy_mod, "run_proxy", lambda *a, **kw: calls.append(kw))
    base = ["proxy", "--prefill", "a:1", "--decode", "b:2", "--port", "9"]
    assert cli.main(base) == 0
    assert calls[-1]["policy"] == "least-loaded" and calls[-1]["health_interval"] == 5.0
    assert calls[-1]["prefill_retries"] == 2 and calls[-1]["health_timeout"] == 2.0
    assert cli.main([*base, "--policy", "round-robin", "--health-interval", "0",
                     "--prefill-retries", "0", "--health-timeout", "0.5"]) == 0
    kw = calls[-1]
    assert (kw["policy"], kw["health_interval"], kw["prefill_retries"],
            kw["health_timeout"]) == ("round-robin", 0.0, 0, 0.5)
    for bad in (["--policy", "random"], ["--health-interval", "-1"],
                ["--prefill-retries", "-1"], ["--timeout", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main([*base, *bad])
        assert e.value.code == 2


def test_build_app_accepts_the_operator_options():
    app = build_app(["a:1"], ["b:2", "c:3"], policy="round-robin", health_interval=0,
                    prefill_retries=4)
    st = app[STATE]
    assert st.decode.policy == "round-robin" and st.prefill_retries == 4
    assert st.decode.recover_after_s == proxy_mod.PASSIVE_RECOVERY_S  # polling off
    assert build_app(["a:1"], ["b:2"])[STATE].prefill.recover_after_s is None
    with pytest.raises(ValueError):
        build_app(["a:1"], ["b:2"], prefill_retries=-1)
