"""vllm-router (PyPI ``vllm-router``, the production P/D router) in front of test servers.

It lives in its own venv, ``.venv-router`` at the checkout root (``scripts/setup_router_venv.sh``,
called by ``scripts/setup_venv.sh``), or wherever ``PD_VLLM_ROUTER`` points. Its P/D mode
(``--vllm-pd-disaggregation``, NIXL flow) sends P the client's body with ``max_tokens=1``,
``stream=false`` and ``kv_transfer_params`` replaced by NixlConnector's prefill request, then D
the client's body plus the ``kv_transfer_params`` P returned: nothing of the client's
``kv_transfer_params`` reaches P, so no ``pd_min_recompute_tokens`` either (P's
``min_recompute_tokens`` setting stands in for it).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
from pathlib import Path
from typing import Sequence

from rig.ports import free_port
from rig.process_groups import group_alive, signal_group
from pd_connector.urls import OPENER

__all__ = ["VllmRouter", "router_binary"]

ROUTER_ENV = "PD_VLLM_ROUTER"


def router_binary() -> Path | None:
    """The vllm-router executable, or None when it is not installed."""
    configured = os.environ.get(ROUTER_ENV)
    path = Path(configured) if configured else Path(__file__).resolve().parents[1] / ".venv-router/bin/vllm-router"
    return path if path.is_file() and os.access(path, os.X_OK) else None


class VllmRouter:
    """``with VllmRouter(prefill_urls, decode_urls, log_path=...) as router:`` starts vllm-router
    in P/D mode on loopback and waits for ``/health``; leaving the block stops its process group."""

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], log_path: str | os.PathLike,
                 policy: str = "round_robin", extra_args: Sequence[str] = ()):
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError(f"vllm-router is not installed: run scripts/setup_router_venv.sh or set {ROUTER_ENV}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.cmd = [
            str(binary), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            *[arg for url in prefill_urls for arg in ("--prefill", url)],
            *[arg for url in decode_urls for arg in ("--decode", url)],
            "--host", "127.0.0.1", "--port", str(self.port),
            # Its own metrics port defaults to 29000: one per router, never a shared fixed port.
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", policy, "--worker-startup-check-interval", "1",
            *extra_args,
        ]  # fmt: skip
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> "VllmRouter":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self._proc.returncode}): {self.log_tail()}")
            try:
                with OPENER.open(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm-router not healthy after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.3)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        signal_group(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, 9)
            proc.wait()
        end = time.monotonic() + 5
        while group_alive(proc.pid) and time.monotonic() < end:
            signal_group(proc.pid, 9)
            time.sleep(0.1)
        self._proc = None

    def __enter__(self) -> "VllmRouter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
