"""A P/D deployment for tests, the demo and the integration script: an aggregated baseline,
P and D vLLM servers with PDConnector, and our proxy, all on loopback.

Shared by ``tests/e2e``, ``examples/demo.py`` and ``scripts/integration.py`` so that each
server configuration is started once per run and driven the same way everywhere.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pd_connector.core.params import PREFILL_REQUEST_PARAMS
from rig.faults import FAULT_CONNECTOR
from rig.cpu_matrix import WARM_UP_SEED, random_prompt
from rig.oracle import Completion, complete
from rig.placement import cpu_binds
from rig.ports import free_port, free_ports
from rig.proxy_process import ProxyProcess
from rig.servers import VllmServer, source_checkout_env, start_many


def kv_transfer_config(
    role: str,
    side_channel_port: int,
    device: str = "cpu",
    engine_id: str | None = None,
    faults: bool = False,
    **extra: Any,
) -> str:
    """``engine_id``: pinned (vLLM's default is a new uuid per start), e.g. for a P restarted
    under the same identity. ``faults``: load the rig's FaultInjectingConnector, which honours
    the negative controls' keys (rig/faults.py), instead of PDConnector."""
    config = {
        "kv_connector": "PDConnector",
        "kv_connector_module_path": "pd_connector.connector",
        **(FAULT_CONNECTOR if faults else {}),
        "kv_role": role,
        "kv_buffer_device": device,
        "kv_connector_extra_config": {"side_channel_port": side_channel_port, **extra},
    }
    if engine_id is not None:
        config["engine_id"] = engine_id
    return json.dumps(config)


def tp_args(size: int) -> list[str]:
    return ["--tensor-parallel-size", str(size)] if size > 1 else []


@dataclass
class StackConfig:
    model: str
    served_model_name: str = "tiny"
    # Extra vLLM arguments for all three servers (same model config on each side).
    server_args: Sequence[str] = ()
    dtype: str = "float32"
    max_model_len: int = 1024
    baseline_args: Sequence[str] = ()
    prefill_args: Sequence[str] = ()
    decode_args: Sequence[str] = ()
    extra_config: dict[str, Any] = field(default_factory=dict)
    # P's kv_transfer_config engine_id (None: vLLM picks a new one at every start).
    prefill_engine_id: str | None = None
    device: str = "cpu"
    # Per-server environment (e.g. CUDA_VISIBLE_DEVICES on GPUs).
    baseline_env: dict[str, str] = field(default_factory=dict)
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    # D loads the rig's FaultInjectingConnector (the negative controls' faults, inert unless a
    # request asks: rig/faults.py).
    decode_faults: bool = False
    with_baseline: bool = True
    with_proxy: bool = True
    # Extra `pd-connector proxy` arguments (e.g. --decode-min-recompute K).
    proxy_args: Sequence[str] = ()
    log_dir: str | None = None
    # Tensor-parallel sizes; the baseline runs at D's (the oracle is aggregated serving there).
    prefill_tp: int = 1
    decode_tp: int = 1
    # Namespaced hosts (netns.Host) for P and D: each server runs on its host and listens on its
    # address, P's side channel included. None: loopback of this machine.
    prefill_host: Any = None
    decode_host: Any = None


def _placed(host) -> dict[str, Any]:
    """VllmServer arguments that run a server on a namespaced host (netns.Host), or nothing."""
    return {"host": host.address, "command_prefix": host.prefix} if host is not None else {}


class PDStack:
    """Starts baseline, P, D (in parallel) and the proxy; ``close()`` stops all by PID."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="pd-stack-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.side_channel_port = free_ports(config.prefill_tp)  # rank r listens on port + r
        common = dict(
            served_model_name=config.served_model_name,
            max_model_len=config.max_model_len,
            dtype=config.dtype,
        )
        env = source_checkout_env()
        # All of them run at once (start_many, then for the whole stack's life): on CPU, one core
        # each while there are enough, else all unpinned (placement.cpu_binds); "auto" elsewhere.
        roles = (["baseline"] if config.with_baseline else []) + ["prefill", "decode"]
        tp = {"baseline": config.decode_tp, "prefill": config.prefill_tp, "decode": config.decode_tp}
        if config.device == "cpu":
            binds = dict(zip(roles, cpu_binds([tp[role] for role in roles])))
        else:
            binds = {role: ("auto", {}) for role in roles}
        p_host, d_host = config.prefill_host, config.decode_host
        p_extra = {**config.extra_config, **({"side_channel_host": p_host.address} if p_host else {})}
        self.prefill = VllmServer(
            config.model,
            extra_args=[
                *config.server_args,
                *tp_args(config.prefill_tp),
                *config.prefill_args,
                "--kv-transfer-config",
                kv_transfer_config(
                    "kv_producer",
                    self.side_channel_port,
                    config.device,
                    engine_id=config.prefill_engine_id,
                    **p_extra,
                ),
            ],
            env={**env, **binds["prefill"][1], **config.prefill_env},
            omp_threads_bind=binds["prefill"][0],
            log_path=self.log_dir / "prefill.log",
            # The stack's P and D run as in production: the connector's scheduler and worker
            # sides in two processes (vLLM pickles the metadata between them).
            worker_process=True,
            **_placed(p_host),
            **common,
        )
        self.decode = VllmServer(
            config.model,
            extra_args=[
                *config.server_args,
                *tp_args(config.decode_tp),
                *config.decode_args,
                "--kv-transfer-config",
                kv_transfer_config(
                    "kv_consumer", free_port(), config.device, faults=config.decode_faults, **config.extra_config
                ),
            ],
            env={**env, **binds["decode"][1], **config.decode_env},
            omp_threads_bind=binds["decode"][0],
            log_path=self.log_dir / "decode.log",
            worker_process=True,
            **_placed(d_host),
            **common,
        )
        self.baseline = None
        if config.with_baseline:
            self.baseline = VllmServer(
                config.model,
                extra_args=[*config.server_args, *tp_args(config.decode_tp), *config.baseline_args],
                env={**env, **binds["baseline"][1], **config.baseline_env},
                omp_threads_bind=binds["baseline"][0],
                log_path=self.log_dir / "baseline.log",
                **common,
            )
        self.proxy_url: str | None = None
        self._proxy: ProxyProcess | None = None

    @property
    def servers(self) -> list[VllmServer]:
        return [s for s in (self.baseline, self.prefill, self.decode) if s is not None]

    def start(self, timeout: float = 600.0) -> "PDStack":
        try:
            start_many(self.servers, timeout=timeout)
            if self.config.with_proxy:
                self._proxy = ProxyProcess(
                    self.prefill.base_url, self.decode.base_url, self.log_dir / "proxy.log",
                    {"PYTHONPATH": self.prefill.env.get("PYTHONPATH", "")}, self.config.proxy_args,
                )
                self.proxy_url = self._proxy.url
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "PDStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- driving ---------------------------------------------------------------------------

    def reference(self, prompt: Sequence[int], max_tokens: int, **kw) -> Completion:
        assert self.baseline is not None
        return complete(self.baseline.base_url, self.config.served_model_name, prompt, max_tokens, **kw)

    def prefill_only(self, prompt: Sequence[int], **extra_params) -> dict[str, Any]:
        """Step 1 of the P/D flow: P's returned kv_transfer_params."""
        out = complete(
            self.prefill.base_url,
            self.config.served_model_name,
            prompt,
            1,
            logprobs=None,
            kv_transfer_params={**PREFILL_REQUEST_PARAMS, **extra_params},
        )
        return out.kv_transfer_params or {}

    def decode_with(self, prompt: Sequence[int], params: dict[str, Any] | None, max_tokens: int, **kw) -> Completion:
        """Step 2: D with (possibly edited) params."""
        return complete(
            self.decode.base_url,
            self.config.served_model_name,
            prompt,
            max_tokens,
            kv_transfer_params=params,
            **kw,
        )

    def handoff(self, prompt: Sequence[int], max_tokens: int, **kw) -> tuple[dict[str, Any], Completion]:
        params = self.prefill_only(prompt)
        return params, self.decode_with(prompt, params, max_tokens, **kw)

    def warm_up(self) -> None:
        """One handoff whose outcome is not checked, before the tests that share this stack: D's
        first handoff from a new P (handshake, NIXL agent and endpoints, P's first claim) has
        taken 8 s on a loaded 2-core CI box, past the e2e claim deadline, and a test that counts
        one handoff's events must not race it (docs/operations.md, "Unanswered first calls").
        Connection set-up has tests of its own."""
        prompt = random_prompt(48, seed=WARM_UP_SEED)
        self.decode_with(prompt, self.prefill_only(prompt), 1, timeout=600.0)

    def via_proxy(self, prompt: Sequence[int], max_tokens: int, **kw) -> Completion:
        assert self.proxy_url is not None
        return complete(self.proxy_url, self.config.served_model_name, prompt, max_tokens, **kw)
