"""A ``pd-connector proxy`` process in front of one P and one D, for the test stacks and the
end-to-end benchmark: started in its own session (group id == its PID), stopped by that PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Mapping, Sequence

from rig.ports import free_port
from pd_connector.urls import OPENER

HEALTHY_WITHIN_S = 60.0


class ProxyProcess:
    def __init__(self, prefill_url: str, decode_url: str, log_path: Path,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 unhealthy_ok: bool = False):  # fmt: skip
        # unhealthy_ok: up once /health answers at all (a 503 too: a proxy whose upstreams are down).
        self._unhealthy_ok = unhealthy_ok
        port = free_port()
        self.log_path = Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "wb") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pd_connector.cli", "proxy", "--prefill", prefill_url,
                 "--decode", decode_url, "--port", str(port), *extra_args],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log_path.read_text()[-2000:]}")
            try:
                with OPENER.open(self.url + "/health", timeout=2):
                    return
            except urllib.error.HTTPError as e:
                e.close()
                if self._unhealthy_ok:
                    return
                time.sleep(0.2)
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"proxy not healthy within {HEALTHY_WITHIN_S:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM by PID (the process started here), SIGKILL after 10 s."""
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
