"""Operator tooling against live vLLM CPU servers: `pd-connector check`, and the proxy's
retries, health-based routing and metrics with dead upstreams in its pools."""

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from pd_connector.testing.cpu_matrix import random_prompt
from pd_connector.testing.oracle import complete, compare
from pd_connector.testing.servers import free_port

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
