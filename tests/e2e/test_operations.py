"""Operator tooling against live vLLM CPU servers: `pd-connector check`, the proxy's retries,
health-based routing and metrics with dead upstreams in its pools, and compatibility with a router
that forwards kv_transfer_params opaquely (vLLM's toy proxy flow)."""

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from rig.cpu_matrix import random_prompt
from rig.oracle import complete, compare
from rig.ports import free_port

pytestmark = pytest.mark.e2e


def _only_llama(stack):
    if stack.kind != "llama":
        pytest.skip("operator tooling is model-independent: checked once")


def test_check_command_passes_against_live_servers(stack):
    _only_llama(stack)
    out = subprocess.run(
        [sys.executable, "-m", "pd_connector.cli", "check", "--prefill", stack.prefill.base_url,
         "--decode", stack.decode.base_url, "--prompt-tokens", "70"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "replay" in out.stdout.lower() and "OK" in out.stdout


def test_check_command_names_a_decode_instance_given_as_prefill(stack):
    _only_llama(stack)
    out = subprocess.run(
        [sys.executable, "-m", "pd_connector.cli", "check", "--prefill", stack.baseline.base_url,
         "--decode", stack.decode.base_url],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1
    assert "PROBLEM" in out.stdout


def _get(url):
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read().decode()


def test_proxy_routes_around_dead_instances(stack):
    """Pools with a dead P and a dead D next to the live ones: every request is still answered
    correctly, /health stays 200 and reports the dead ones, /metrics counts what happened."""
    _only_llama(stack)
    dead_p, dead_d = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    port = free_port()
    log = open(stack.log_dir / "proxy-dead-upstreams.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd_connector.cli", "proxy", "--prefill", dead_p, "--prefill",
         stack.prefill.base_url, "--decode", stack.decode.base_url, "--decode", dead_d,
         "--port", str(port), "--health-interval", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                _get(url + "/health")
                break
            except OSError:
                time.sleep(0.2)
        for i in range(6):
            prompt = random_prompt(40 + 13 * i, seed=9)
            ref = stack.reference(prompt, 8)
            got = complete(url, "tiny", prompt, 8)
            assert compare(ref, got, tie_margin=1e-5, logprob_tol=1e-4).ok
        status, body = _get(url + "/health")
        assert status == 200
        assert dead_p in body and dead_d in body
        _, metrics = _get(url + "/metrics")
        assert "pd_proxy_" in metrics
        assert any(
            line.startswith("pd_proxy_upstream_marked_unhealthy_total") and dead_p in line and not line.endswith(" 0")
            for line in metrics.splitlines()
        ), metrics
    finally:
        proc.terminate()
        proc.wait(10)


# --- compatibility: a router that only forwards kv_transfer_params opaquely -------------------


class _ToyProxy(http.server.ThreadingHTTPServer):
    """vLLM's toy proxy flow (examples/online_serving/disaggregated_serving), standard library
    only and knowing nothing of pd_connector: P gets the request with NixlConnector's prefill
    params, ``max_tokens=1`` and ``stream=False``; D gets the client's original request plus
    whatever ``kv_transfer_params`` P returned, untouched; D's answer goes back byte for byte."""

    daemon_threads = True

    def __init__(self, prefill_url: str, decode_url: str):
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.forwarded: list[dict] = []  # the params P returned, as handed to D
        super().__init__(("127.0.0.1", 0), _ToyProxyHandler)


class _ToyProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _ToyProxy

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prefill = {
            **body,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
            "max_tokens": 1,
            "stream": False,
        }
        prefill.pop("stream_options", None)
        p_answer = json.loads(_post(self.server.prefill_url + self.path, prefill).read())
        params = p_answer.get("kv_transfer_params")
        self.server.forwarded.append(params)
        with _post(self.server.decode_url + self.path, {**body, "kv_transfer_params": params}) as d:
            self.send_response(d.status)
            self.send_header("Content-Type", d.headers["Content-Type"])
            self.end_headers()
            while chunk := d.read1(65536):
                self.wfile.write(chunk)

    def log_message(self, *args):
        pass


def _post(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=120)


def test_toy_proxy_that_forwards_params_opaquely_matches_aggregated_serving(stack):
    """A router that knows nothing about pd_connector (only vLLM's NixlConnector flow) drives
    real handoffs, D accepts them, and the output equals the aggregated baseline's."""
    _only_llama(stack)
    toy = _ToyProxy(stack.prefill.base_url, stack.decode.base_url)
    thread = threading.Thread(target=toy.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{toy.server_address[1]}"
    accepted = stack.decode.metric("vllm:pd_events_total", {"event": "handoff_accepted"}) or 0
    try:
        for i, n in enumerate((31, 32, 33, 70)):
            prompt = random_prompt(n, seed=11 + i)
            verdict = compare(stack.reference(prompt, 8), complete(url, "tiny", prompt, 8),
                              tie_margin=1e-5, logprob_tol=1e-4)
            assert verdict.ok, verdict
        # Streamed, as the toy proxy's clients usually ask.
        prompt = random_prompt(45, seed=17)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        ref = json.loads(_post(stack.baseline.base_url + "/v1/completions", body).read())
        with _post(url + "/v1/completions", {**body, "stream": True}) as streamed:
            events = [line[6:] for line in streamed.read().decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"])
        assert text == ref["choices"][0]["text"]
    finally:
        toy.shutdown()
        toy.server_close()
    assert len(toy.forwarded) == 5 and all(p and "replay_offset" in p for p in toy.forwarded)
    # D used P's KV every time (it did not silently recompute the prompts itself).
    assert stack.decode.metric("vllm:pd_events_total", {"event": "handoff_accepted"}) >= accepted + 5


def test_client_leaving_a_stream_aborts_the_request_on_the_live_decode(stack):
    """The proxy closes D's connection when its client goes away; vLLM then aborts the request,
    so D stops generating long before max_tokens (and frees its blocks)."""
    _only_llama(stack)
    d = stack.decode
    max_tokens = 900
    generated = d.metric("vllm:generation_tokens") or 0
    body = {"model": "tiny", "prompt": random_prompt(40, seed=23), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    stream = _post(stack.proxy_url + "/v1/completions", body)
    assert stream.readline().startswith(b"data: ")  # D is generating
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 120
    while d.metric("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert d.metric("vllm:num_requests_running") == 0
    assert (d.metric("vllm:generation_tokens") or 0) - generated < max_tokens
