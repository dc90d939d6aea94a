"""Tensor-parallel P x D cells on vLLM CPU: one ``kv_both`` instance per TP size of one model.

Each instance is P for requests with ``do_remote_decode``, D for requests carrying P's
``kv_transfer_params`` and the aggregated reference for plain requests, so with a TP-1 and a
TP-2 instance every cell of {1, 2} x {1, 2} is a handoff from one to the other (or to itself,
NIXL loopback), and the oracle is the D instance serving the same prompt itself, at D's TP.
D's own accounting, ``vllm:prompt_tokens_by_source``, shows how many prompt tokens came from P.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_connector.core.params import PREFILL_REQUEST_PARAMS
from rig.cpu_matrix import WARM_UP_SEED, random_prompt
from rig.oracle import Completion, complete
from rig.placement import cpu_binds
from rig.ports import free_ports
from rig.servers import VllmServer, source_checkout_env, start_many
from rig.stack import kv_transfer_config, tp_args

# Generous timeouts: three worker processes of two instances share two cores.
TP_EXTRA_CONFIG = {"handshake_timeout_seconds": 20, "lease_seconds": 120}


@dataclass
class TPInstance:
    tp: int
    server: VllmServer
    served_model_name: str = "tiny"

    def reference(self, prompt: Sequence[int], max_tokens: int, **kw: Any) -> Completion:
        return complete(self.server.base_url, self.served_model_name, prompt, max_tokens, **kw)

    def prefill(self, prompt: Sequence[int], **kw: Any) -> dict[str, Any]:
        out = complete(
            self.server.base_url, self.served_model_name, prompt, 1, logprobs=None,
            kv_transfer_params=dict(PREFILL_REQUEST_PARAMS), **kw,
        )  # fmt: skip
        return out.kv_transfer_params or {}

    def decode(self, prompt: Sequence[int], params: dict[str, Any], max_tokens: int, **kw: Any) -> Completion:
        return complete(self.server.base_url, self.served_model_name, prompt, max_tokens, kv_transfer_params=params, **kw)

    def prompt_tokens(self) -> dict[str, float]:
        """D's cumulative ``vllm:prompt_tokens_by_source`` per source."""
        return self.server.prompt_tokens_by_source()

    def events(self) -> dict[str, float]:
        from rig.prometheus import read_metric_labels

        return {
            labels["event"]: self.server.metric("vllm:pd_events_total", {"event": labels["event"]}) or 0.0
            for labels in read_metric_labels(self.server.base_url, "vllm:pd_events_total")
            if "event" in labels
        }


def make_instances(
    model: str,
    log_dir: Path,
    sizes: Sequence[int] = (1, 2),
    dtype: str = "float32",
    server_args: Sequence[str] = (),
    extra_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    names: Sequence[str] | None = None,
    faults: bool = False,
) -> dict:
    """Unstarted kv_both instances, one per TP size (side channels on consecutive ports), keyed
    by their TP size or, where several share one, by ``names``. ``faults``: the rig's
    FaultInjectingConnector (rig/faults.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for (bind, bind_env), tp, name in zip(cpu_binds(list(sizes)), sizes, names or sizes):
        extra = {**TP_EXTRA_CONFIG, **(extra_config or {})}
        config = kv_transfer_config("kv_both", free_ports(tp), "cpu", faults=faults, **extra)
        server = VllmServer(
            model,
            dtype=dtype,
            max_model_len=1024,
            extra_args=[*server_args, *tp_args(tp), "--kv-transfer-config", config],
            env={**source_checkout_env(), **bind_env, **(env or {})},
            omp_threads_bind=bind,
            log_path=log_dir / (f"{name}.log" if names else f"tp{tp}.log"),
        )
        out[name] = TPInstance(tp, server)
    return out


def warm_up(instances: dict, timeout: float = 600.0) -> None:
    """One handoff per ordered pair of instances (each to itself too), outcome unchecked, before
    the tests: the first READ between two instances has stalled for 15-131 s on a 2-core CI box
    (more vLLM workers than cores: docs/operations.md, "Unanswered first calls"), past the
    claim's timeout, and a cell that counts D's loaded tokens must not race it."""
    prompt = random_prompt(40, seed=WARM_UP_SEED)
    for p in instances.values():
        for d in instances.values():
            d.decode(prompt, p.prefill(prompt, timeout=timeout), 1, timeout=timeout)


@contextmanager
def running(instances: dict, timeout: float = 900.0):
    servers = [inst.server for inst in instances.values()]
    try:
        start_many(servers, timeout=timeout)
        yield instances
    finally:
        for server in servers:
            server.stop()
