"""Tests of rig.servers (and .prometheus) without vLLM: metric parsing and
process-group teardown.

The lifecycle tests run a stub "api_server" (a tiny HTTP server that spawns a child in its own
process group and ignores the first SIGTERM), which is what a real vLLM server looks like to
VllmServer: several processes in one group, a /health endpoint, and a log.
"""

import os
import sys
import textwrap
import time

import pytest

from rig.prometheus import parse_metric, parse_metric_labels
from rig.ports import free_port
from rig.servers import ServerError, VllmServer, start_many

METRICS = """\
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 12.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:cache_config_info{block_size="32",mamba_block_size="1024",odd="a\\"b"} 1.0
"""


def test_parse_metric_sums_series_and_filters_labels():
    assert parse_metric(METRICS, "vllm:prompt_tokens_total") == 15.0
    assert parse_metric(METRICS, "vllm:prompt_tokens") == 15.0  # counter _total suffix optional
    assert parse_metric(METRICS, "vllm:prompt_tokens", {"engine": "1"}) == 3.0
    assert parse_metric(METRICS, "vllm:num_requests_running") == 0.0
    assert parse_metric(METRICS, "vllm:absent") is None
    assert parse_metric(METRICS, "vllm:prompt_tokens", {"engine": "7"}) is None


def test_parse_metric_labels():
    (labels,) = parse_metric_labels(METRICS, "vllm:cache_config_info")
    assert labels == {"block_size": "32", "mamba_block_size": "1024", "odd": 'a"b'}


def test_free_port_does_not_repeat():
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20


STUB = textwrap.dedent(
    """\
    import http.server, signal, subprocess, sys, time
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    if "--die" in argv:
        print("stub: dying on purpose", flush=True)
        sys.exit(3)
    # A child in the same process group, like EngineCore/Worker.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"stub child {child.pid}", flush=True)
    hits = []
    signal.signal(signal.SIGTERM, lambda *a: hits.append(1) if not hits else sys.exit(0))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    srv.timeout = 0.1
    while True:
        srv.handle_request()
    """
)


@pytest.fixture
def stub_python(tmp_path):
    """An executable that VllmServer runs as `<python> -m vllm.entrypoints... --port P ...`."""
    script = tmp_path / "stub.py"
    script.write_text(STUB)
    exe = tmp_path / "stubpython"
    # Drop the "-m module" pair and run the stub with the remaining arguments.
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    return str(exe)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_lifecycle_kills_whole_group(stub_python, tmp_path):
    server = VllmServer("/nonexistent", python=stub_python, log_path=tmp_path / "s.log", stop_grace_s=3)
    with server:
        assert server.ready_after_s is not None
        pids = server.group_pids()
        assert server.pid in pids and len(pids) >= 2
        assert server.rss_bytes() > 0
        assert "--served-model-name tiny" in server.log_text()
    # The stub ignores the first SIGTERM; stop() must still have removed every group member.
    assert not any(_alive(p) for p in pids)
    assert server.stop() is not None or True  # idempotent, no exception
    assert server.group_pids() == []


def test_a_server_in_a_session_of_its_own_kept_its_share_of_the_cores(stub_python, tmp_path):
    """Regression: each server used to start a session of its own, so Linux made it a scheduling
    group of its own (autogroup) and its spinning workers, whose sched_yield gives way only within
    their group, kept 1/N of the cores however little they had to do (docs/testing.md, "One
    scheduling group"). A server is its own process group (stop() kills it) in our session."""
    server = VllmServer("/nonexistent", python=stub_python, log_path=tmp_path / "g.log", stop_grace_s=3)
    with server:
        assert os.getpgid(server.pid) == server.pid
        assert os.getsid(server.pid) == os.getsid(0)
        # The file is empty for a task in the kernel's default autogroup (a session that no task
        # began since boot, as in a CI container; proc_sched_autogroup_show_task): compare it whole.
        autogroup = "/proc/{}/autogroup"
        if os.path.exists(autogroup.format("self")):
            with open(autogroup.format("self")) as ours, open(autogroup.format(server.pid)) as its:
                assert its.read() == ours.read()


def test_env_precedence(stub_python, tmp_path):
    os.environ["PD_TEST_INHERITED"] = "x"
    try:
        s = VllmServer(
            "/m", python=stub_python, omp_threads_bind="1",
            env={"VLLM_CPU_KVCACHE_SPACE": "2", "PD_TEST_INHERITED": None},
        )  # fmt: skip
    finally:
        del os.environ["PD_TEST_INHERITED"]
    assert s.env["HF_HUB_OFFLINE"] == "1" and s.env["TRANSFORMERS_OFFLINE"] == "1"
    assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "PD_TEST_INHERITED" not in s.env


def test_wait_ready_fails_fast_with_log(stub_python, tmp_path):
    server = VllmServer("/m", python=stub_python, extra_args=["--die"], log_path=tmp_path / "d.log")
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="dying on purpose"):
        server.__enter__()
    assert time.monotonic() - t0 < 30
    server.stop()


def test_start_many_stops_all_on_failure(stub_python, tmp_path):
    good = VllmServer("/m", python=stub_python, log_path=tmp_path / "g.log", stop_grace_s=3)
    bad = VllmServer("/m", python=stub_python, extra_args=["--die"], log_path=tmp_path / "b.log")
    with pytest.raises(ServerError):
        start_many([good, bad], timeout=60)
    assert not good.is_running() and good.group_pids() == []



@pytest.mark.parametrize(
    "args, parallel",
    [
        ([], False),
        (["--block-size", "32"], False),
        (["--tensor-parallel-size", "1"], False),
        (["--tensor-parallel-size", "2"], True),
        (["-tp=2"], True),
        (["--data-parallel-size=2"], True),
        (["--data-parallel-size", "2", "--tensor-parallel-size", "1"], True),
    ],
)
def test_only_single_worker_servers_run_the_worker_in_the_engine_core(args, parallel, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    in_engine_core = VllmServer("/m", extra_args=args).env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    assert in_engine_core == (not parallel)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in VllmServer("/m", extra_args=args, worker_process=True).env
