"""``pd-connector check`` against in-process fake P and D apps that answer like vLLM 0.32.0 (no
vLLM). ``run_check`` is blocking (urllib), so it runs in a thread next to the fake servers' loop.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pd_connector.core.protocol import PROTOCOL_VERSION
from pd_connector.check import run as check

from pd_connector.check import client as check_client

from pd_connector import cli
from pd_connector.proxy import server as proxy_mod
from rig.fake_upstreams import async_test, dead_url, serve


@pytest.fixture(autouse=True)
def _short_metrics_wait(monkeypatch):
    monkeypatch.setattr(check, "METRICS_WAIT_S", 0.2)


def pd_params(n: int) -> dict:
    """What pd_connector's P returns (NixlConnector's fields plus ours)."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4], [9]], "remote_engine_id": "engine-p",
        "remote_request_id": "cmpl-x-0", "remote_host": "127.0.0.1", "remote_port": 5660,
        "remote_num_tokens": n - 1, "remote_blocks_expiry_time": None, "tp_size": 1,
        "dcp_size": 1, "pp_size": 1, "transfer_mode": "pull",
        "replay_offset": n - 1, "pd_protocol_version": PROTOCOL_VERSION,
    }


class FakeVllm:
    """Answers /health, /v1/models, /metrics and /v1/completions like vLLM.

    params: what a prefill returns: "pd" (pd_connector), "nixl" (no replay_offset/version),
    "none" (kv_transfer_params null: no connector), "other" (another protocol version).
    On decode: greedy tokens derived from the prompt; ``corrupt`` changes token 2 when params
    came along; ``margin`` is the top-1/top-2 logprob gap; ``event`` is what /metrics counts for
    a decode with params (None: no /metrics).
    """

    def __init__(self, model="tiny", *, params="pd", corrupt=False, margin=2.0,
                 event="handoff_accepted", healthy=True, dp=1, corrupt_rank=None):
        self.model, self.params, self.corrupt, self.margin = model, params, corrupt, margin
        # dp: DP engines behind the API server (X-data-parallel-rank past them: HTTP 400, as
        # vLLM's input processor answers); corrupt_rank: the D engine whose loads are wrong.
        self.dp, self.corrupt_rank = dp, corrupt_rank
        self.ranks: list[int | None] = []
        self.event, self.healthy = event, healthy
        self.events: dict[str, int] = {}
        self.received: list[dict] = []
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/completions", self.completions)

    async def health(self, request):
        return web.Response(status=200 if self.healthy else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "vllm", "max_model_len": 1024}]})

    async def metrics(self, request):
        if self.event is None:
            return web.Response(status=404)
        lines = ["# HELP vllm:pd_events_total pd_connector events",
                 "# TYPE vllm:pd_events_total counter"]
        lines += [f'vllm:pd_events_total{{engine="0",event="{e}",model_name="{self.model}"}} '
                  f"{float(n)}" for e, n in self.events.items()]
        return web.Response(text="\n".join(lines) + "\n")

    async def completions(self, request):
        body = await request.json()
        rank = request.headers.get("X-data-parallel-rank")
        rank = None if rank is None else int(rank)
        if rank is not None and not 0 <= rank < self.dp:
            return web.json_response({"error": {
                "message": f"data_parallel_rank {rank} is out of range [0, {self.dp}).",
                "type": "BadRequestError", "code": 400}}, status=400)
        self.received.append(body)
        self.ranks.append(rank)
        if body.get("model") != self.model:
            return web.json_response({"error": {
                "message": f"The model `{body.get('model')}` does not exist.",
                "type": "NotFoundError", "code": 404}}, status=404)
        kv = body.get("kv_transfer_params")
        prompt = body["prompt"]
        if kv and kv.get("do_remote_decode"):  # a prefill
            out_params = {"pd": pd_params(len(prompt)), "other": {**pd_params(len(prompt)),
                                                                 "pd_protocol_version": PROTOCOL_VERSION + 1},
                          "none": None}.get(self.params)
            if out_params and self.dp > 1:
                out_params = {**out_params, "remote_engine_id": f"engine-p_dp{rank or 0}",
                              "remote_port": 5660 + (rank or 0)}
            if self.params == "nixl":
                out_params = {k: v for k, v in pd_params(len(prompt)).items()
                              if k not in ("replay_offset", "pd_protocol_version")}
            return web.json_response({"id": "cmpl-p", "object": "text_completion", "choices": [
                {"index": 0, "text": "x", "token_ids": [11], "finish_reason": "length"}],
                "kv_transfer_params": out_params})
        if kv and self.event:
            self.events[self.event] = self.events.get(self.event, 0) + 1
        base = sum(prompt) % 500
        ids = [base + 3 * i for i in range(body["max_tokens"])]
        if kv and (self.corrupt or (self.corrupt_rank is not None and rank == self.corrupt_rank)):
            ids[2] += 1
        top = [{f"token_id:{t}": -0.1, f"token_id:{t + 1}": -0.1 - self.margin} for t in ids]
        return web.json_response({"id": "cmpl-d", "object": "text_completion", "choices": [{
            "index": 0, "text": "y" * len(ids), "token_ids": ids, "finish_reason": "length",
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                         "token_logprobs": [-0.1] * len(ids), "top_logprobs": top}}],
            "kv_transfer_params": None})


async def run(p: FakeVllm, d: FakeVllm, **kw) -> check.CheckReport:
    async with serve(p.app) as p_url, serve(d.app) as d_url:
        return await asyncio.to_thread(check.run_check, p_url, d_url, **kw)


def one(problems: list[str], needle: str) -> str:
    hits = [p for p in problems if needle in p]
    assert len(hits) == 1, problems
    return hits[0]


@async_test(timeout=15)
async def test_healthy_pair_passes_and_reports_the_numbers():
    p, d = FakeVllm(), FakeVllm()
    rep = await run(p, d)
    assert rep.ok, rep.format()
    assert rep.model == "tiny"
    assert (rep.replay_offset, rep.recompute_tokens, rep.blocks_per_group) == (63, 1, [4, 1])
    assert rep.p_ms > 0 and rep.d_ms_handoff > 0 and rep.d_ms_plain > 0
    assert rep.tokens_match and len(rep.tokens_handoff) == check.MAX_TOKENS
    assert rep.d_events == {"handoff_accepted": 1.0}
    # What P and D were sent.
    (pb,) = p.received
    assert pb["kv_transfer_params"] == check.PREFILL_KV_PARAMS and pb["max_tokens"] == 1
    assert len(pb["prompt"]) == 64 and all(4 <= t <= 999 for t in pb["prompt"])
    with_params, plain = d.received
    assert with_params["kv_transfer_params"] == pd_params(64)
    assert "kv_transfer_params" not in plain
    for b in (with_params, plain):
        assert b["prompt"] == pb["prompt"] and b["max_tokens"] == 8
        assert b["temperature"] == 0 and b["ignore_eos"] is True and b["stream"] is False
    # Fresh prefix-cache namespaces: the plain run cannot reuse the handoff's blocks.
    assert pb["cache_salt"] == with_params["cache_salt"] != plain["cache_salt"]
    text = rep.format()
    for needle in ("replay_offset 63", "D recomputes 1 token", "[4, 1]", "with the handoff",
                   "D accepted the handoff", "OK:"):
        assert needle in text


@async_test(timeout=15)
async def test_every_dp_engine_behind_p_is_reached_and_reported():
    p, d = FakeVllm(dp=3), FakeVllm(dp=2)
    rep = await run(p, d)
    assert rep.ok, rep.format()
    # The main check's prefill (no header), then engines 1, 2, the refused 3, and 0.
    assert p.ranks == [None, 1, 2, 0]
    assert d.ranks[-3:] == [1, 0, 0]  # P engine k -> D engine k % 2
    line = next(i for i in rep.info if i.startswith("P's DP engines reached"))
    for k in range(3):
        assert f"engine-p_dp{k} at 127.0.0.1:{5660 + k}" in line
    assert "(3; D has 2)" in line and "DIFFER" not in line


@async_test(timeout=15)
async def test_a_dp_engine_whose_handoff_differs_is_named():
    p, d = FakeVllm(dp=2), FakeVllm(dp=2, corrupt_rank=1)
    rep = await run(p, d)
    problem = one(rep.problems, "P's DP engine 1")
    assert "engine-p_dp1" in problem and "D (engine 1)" in problem


@async_test(timeout=15)
async def test_one_engine_behind_p_costs_one_refused_probe():
    p, d = FakeVllm(), FakeVllm()
    rep = await run(p, d)
    assert rep.ok and p.ranks == [None] and not any("DP engines" in i for i in rep.info)


@async_test(timeout=15)
async def test_prompt_tokens_option():
    p, d = FakeVllm(), FakeVllm()
    rep = await run(p, d, prompt_tokens=200, model="tiny")
    assert rep.ok and rep.replay_offset == 199 and len(p.received[0]["prompt"]) == 200


@async_test(timeout=15)
async def test_prefill_without_params_is_not_a_kv_producer():
    rep = await run(FakeVllm(params="none"), FakeVllm())
    assert not rep.ok
    line = one(rep.problems, "P is not configured with a kv_producer connector")
    assert "kv_role" in line and len(rep.problems) == 1
    assert rep.d_ms_plain is not None  # D was still checked on its own


@async_test(timeout=15)
async def test_nixl_style_params_are_named():
    d = FakeVllm(event="refused:missing_offset")
    rep = await run(FakeVllm(params="nixl"), d)
    line = one(rep.problems, "NixlConnector or another connector, not pd_connector")
    assert "PDConnector" in line and len(rep.problems) == 1
    assert "kv_transfer_params" in d.received[0]  # D still gets a try with them


@async_test(timeout=15)
async def test_other_protocol_version():
    rep = await run(FakeVllm(params="other"), FakeVllm())
    one(rep.problems, f"protocol version {PROTOCOL_VERSION + 1}")


@async_test(timeout=15)
async def test_mismatched_models():
    rep = await run(FakeVllm("model-a"), FakeVllm("model-b"))
    line = one(rep.problems, "model-a")
    assert "model-b" in line and "--served-model-name" in line
    rep = await run(FakeVllm("tiny"), FakeVllm("tiny"), model="other")
    assert len(rep.problems) == 2 and all("--model" in p for p in rep.problems)


@async_test(timeout=15)
async def test_unreachable_decode_and_unhealthy_prefill():
    p = FakeVllm(healthy=False)
    dead = dead_url()
    async with serve(p.app) as p_url:
        rep = await asyncio.to_thread(check.run_check, p_url, dead)
    assert not rep.ok
    one(rep.problems, "answered /health with HTTP 503")
    line = one(rep.problems, f"D at {dead} is not reachable (connection refused)")
    assert "running" in line
    assert p.received == []  # nothing sent before both are known


@async_test(timeout=15)
async def test_pointing_at_the_proxy_is_named():
    p, d = FakeVllm(), FakeVllm()
    async with serve(p.app) as p_url, serve(d.app) as d_url:
        proxy = proxy_mod.build_app([p_url], [d_url], health_interval=0)
        async with serve(proxy) as proxy_url:
            rep = await asyncio.to_thread(check.run_check, proxy_url, d_url)
    line = one(rep.problems, "is a pd-connector proxy, not a vLLM server")
    assert line.startswith("P URL") and len(rep.problems) == 1


@async_test(timeout=15)
async def test_handoff_output_mismatch_fails_unless_near_tie():
    rep = await run(FakeVllm(), FakeVllm(corrupt=True))
    line = one(rep.problems, "differs from D computing the prompt itself at token 2")
    assert "dtype" in line and rep.tokens_match is False
    rep = await run(FakeVllm(), FakeVllm(corrupt=True, margin=1e-4))
    assert rep.ok and any("near-tie" in n for n in rep.notes)


@async_test(timeout=15)
async def test_decode_refusal_seen_in_metrics():
    rep = await run(FakeVllm(), FakeVllm(event="refused:offset_above_requirement"))
    one(rep.problems, "D refused P's handoff (offset_above_requirement)")
    rep = await run(FakeVllm(), FakeVllm(event="load_failed:nixl"))
    one(rep.problems, "D could not load P's KV (nixl)")


@async_test(timeout=15)
async def test_decode_without_pd_metrics_is_a_note_not_a_failure():
    rep = await run(FakeVllm(), FakeVllm(event=None))
    assert rep.ok and any("/metrics could not be read" in n for n in rep.notes)


def test_parse_pd_events():
    text = ('# TYPE vllm:pd_events_total counter\n'
            'vllm:pd_events_total{engine="0",event="handoff_accepted",model_name="m"} 3.0\n'
            'vllm:pd_events_total{engine="1",event="handoff_accepted",model_name="m"} 2.0\n'
            'vllm:pd_events_created{engine="0",event="x"} 1.7e9\n'
            'vllm:pd_events_total{engine="0",event="refused:malformed"} 1.0\n')
    assert check_client.parse_pd_events(text) == {"handoff_accepted": 5.0, "refused:malformed": 1.0}


def test_prefill_params_match_the_proxy():
    assert check.PREFILL_KV_PARAMS == proxy_mod.PREFILL_KV_PARAMS


def test_prompt_ids_in_range():
    ids = check.make_prompt(500)
    assert len(ids) == 500 and min(ids) >= 4 and max(ids) <= 999 and len(set(ids)) > 100


def test_cli_check_exit_codes_and_output(capsys):
    async def body(p, d):
        async with serve(p.app) as p_url, serve(d.app) as d_url:
            argv = ["--log-level", "WARNING", "check", "--prefill", p_url, "--decode", d_url,
                    "--prompt-tokens", "32"]
            return await asyncio.to_thread(cli.main, argv)

    assert asyncio.run(body(FakeVllm(), FakeVllm())) == 0
    out = capsys.readouterr().out
    assert "replay_offset 31" in out and "OK:" in out
    assert asyncio.run(body(FakeVllm(params="none"), FakeVllm())) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: P is not configured with a kv_producer connector" in out
    assert "FAILED: 1 problem(s)" in out


@pytest.mark.parametrize("argv,expect", [
    (["check", "--help"], "--prompt-tokens"),
    (["proxy", "--help"], "--health-interval"),
    (["proxy", "--help"], "/metrics"),
    (["--help"], "check"),
])
def test_cli_help_mentions_the_options(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert expect in capsys.readouterr().out


def test_cli_check_validates_arguments(capsys):
    for argv in (["check", "--prefill", "a"], ["check", "--prefill", "a", "--decode", "b",
                                                "--prompt-tokens", "1"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
