"""The two P/D deployments of the end-to-end benchmark (``benchmarks.e2e``) and
its streaming client: P and D with one connector (pd_connector or vLLM's NixlConnector) behind
one or more ``pd-connector proxy`` processes (pd_connector: the default zero-replay proxy and a
second one with ``--resume replay``), paused and resumed by process group for ``--isolate``, the
proxies with their servers; one streaming ``/v1/completions`` request timed to each token and
its end, sent once more after an error."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from rig.process_groups import signal_group
from rig.proxy_process import ProxyProcess
from pd_connector.urls import OPENER


def nixl_transfer_config(role: str) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"})


class Deployment:
    """P + D (one connector) and ``pd-connector proxy`` processes in front of them, one per
    name in ``start_proxies`` (their URLs in ``urls``; ``urls["prefill"]`` is P itself)."""

    def __init__(self, system: str, model: str, server_args: list[str], log_dir: Path, max_model_len: int,
                 placement: list[tuple[str, dict[str, str]]], dtype: str = "float32"):
        from rig.ports import free_port
        from rig.servers import VllmServer, source_checkout_env
        from rig.stack import kv_transfer_config

        self.system = system
        self.log_dir = log_dir
        env = source_checkout_env()
        servers = {}
        for role, (bind, bind_env) in zip(("prefill", "decode"), placement):
            kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
            if system == "pd":
                config, extra_env = kv_transfer_config(kv_role, free_port()), {}
            else:
                config = nixl_transfer_config(kv_role)
                extra_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
            servers[role] = VllmServer(
                model,
                extra_args=[*server_args, "--kv-transfer-config", config],
                env={**env, **bind_env, **extra_env},
                omp_threads_bind=bind,
                max_model_len=max_model_len,
                dtype=dtype,
                log_path=log_dir / f"{system}-{role}.log",
                worker_process=True,  # timed as deployed: scheduler and worker in two processes
            )
        self.prefill, self.decode = servers["prefill"], servers["decode"]
        self.proxies: dict[str, ProxyProcess] = {}
        self.urls: dict[str, str] = {}
        self._env = env

    def start_proxies(self, proxies: dict[str, list[str]]) -> None:
        """One ``pd-connector proxy`` per name, with those extra arguments (e.g. ``--resume
        replay``), all in front of this P and D."""
        for name, extra in proxies.items():
            proxy = ProxyProcess(self.prefill.base_url, self.decode.base_url,
                                 self.log_dir / f"{name}-proxy.log", self._env, extra)  # fmt: skip
            self.proxies[name] = proxy
            self.urls[name] = proxy.url
        self.urls["prefill"] = self.prefill.base_url

    def _groups(self) -> list[int]:
        # Each server and each proxy run in their own session: group id == the PID started.
        pids = [self.prefill.pid, self.decode.pid, *(p.pid for p in self.proxies.values())]
        return [pid for pid in pids if pid is not None]

    def pause(self) -> None:
        """SIGSTOP every process of this deployment (--isolate): while the other system serves
        a request, nothing of this one (engine loops, post-step spin, NIXL/UCX threads, a
        handshake retrying) competes for the two cores."""
        for pgid in self._groups():
            signal_group(pgid, signal.SIGSTOP)

    def resume(self) -> None:
        for pgid in self._groups():
            signal_group(pgid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()  # a stopped process would hold its SIGTERM until SIGCONT
        for proxy in self.proxies.values():
            proxy.stop()
        for server in (self.prefill, self.decode):
            server.stop()


def stream_completion(url: str, prompt: list[int], max_tokens: int, cache_salt: str | None = None) -> dict[str, Any]:
    """One streaming completion; times every generated token's arrival and the end of the
    stream. vLLM merges tokens into one chunk when its stream falls behind the engine (a loaded
    box), so each chunk's tokens are counted from its ``token_ids`` (``return_token_ids``; a chunk
    without them counts one). ``cache_salt`` (vLLM's): a prompt sent to several systems of one
    deployment hits no prefix cache another system's request filled."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    if cache_salt:
        body["cache_salt"] = cache_salt
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    token_s: list[float] = []
    token_ids: list[int] = []
    text, chunks, done = [], 0, False
    with OPENER.open(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                resp.read()  # to the end of the response: closing earlier reads as a client abort
                break
            choices = json.loads(data).get("choices") or []
            if choices:
                at = time.perf_counter() - t0
                ids = choices[0].get("token_ids")
                chunk_text = choices[0].get("text") or ""
                if ids is None and not chunk_text:
                    continue  # e.g. a finish_reason-only chunk: no token
                chunks += 1
                token_s += [at] * (len(ids) if ids is not None else 1)
                token_ids += ids or []
                text.append(chunk_text)
    total = time.perf_counter() - t0
    if not done or not token_s:
        raise RuntimeError(f"incomplete stream from {url}: done={done}, tokens={len(token_s)}")
    return {"ttft_s": token_s[0], "total_s": total, "chunks": chunks, "tokens": len(token_s), **stream_timings(token_s),
            "token_s": token_s, "token_ids": token_ids, "text": "".join(text)}  # fmt: skip


def stream_timings(token_s: list[float]) -> dict[str, float | None]:
    """From the generated tokens' arrival times (seconds after send): the second token's and
    the inter-token latency, (last - first) / (tokens - 1) (None with one token)."""
    if len(token_s) < 2:
        return {"token2_s": None, "itl_s": None}
    return {"token2_s": token_s[1], "itl_s": (token_s[-1] - token_s[0]) / (len(token_s) - 1)}


def send(url: str, prompt: list[int], max_tokens: int, errors: list[dict], system: str,
         cache_salt: str | None = None) -> dict[str, Any]:
    """``stream_completion``, sent once more after an HTTP or connection error (recorded in
    ``errors`` and printed: e.g. a 502 when the proxy reuses a keep-alive connection D just
    closed). The retry's timings are the ones recorded."""
    try:
        return stream_completion(url, prompt, max_tokens, cache_salt)
    except (OSError, RuntimeError) as exc:  # urllib's HTTPError/URLError are OSErrors
        errors.append({"system": system, "prompt_len": len(prompt), "error": repr(exc)})
        print(f"  {system}: {exc!r}; sending once more", flush=True)
        return stream_completion(url, prompt, max_tokens, cache_salt)
