"""Data-parallel P x D cells on vLLM CPU: ``kv_both`` instances of one model with their own (DP, TP)
shapes, each behind one API server (vLLM's internal load balancer).

Each instance is P for requests with ``do_remote_decode``, D for requests carrying P's params and
aggregated serving for plain requests, so every ordered pair of (instance, DP rank) is a cell. A
request is steered to DP rank k with vLLM's ``X-data-parallel-rank`` header (the API server
honours it: ``_get_data_parallel_rank`` in vllm/entrypoints/generate/base/serving.py); D's
``vllm:prompt_tokens_by_source`` is labelled by engine (``engine="k"``), so a cell reads what that
one D rank loaded and computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_connector.core import ranks
from pd_connector.core.params import PREFILL_REQUEST_PARAMS
from rig.cpu_matrix import WARM_UP_SEED, random_prompt
from rig.oracle import Completion, complete
from rig.placement import cpu_binds
from rig.ports import free_ports
from rig.servers import VllmServer, source_checkout_env
from rig.stack import kv_transfer_config, tp_args
# The same lifecycle as the TP matrix's: start together, stop every one.
from rig.tp_matrix import running  # noqa: F401

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
RANK_HEADER = "X-data-parallel-rank"
# Generous: several engines share two cores.
DP_EXTRA_CONFIG = {"handshake_timeout_seconds": 20, "lease_seconds": 120, "claim_deadline_seconds": 30}


def rank_header(rank: int | None) -> dict[str, str]:
    return {} if rank is None else {RANK_HEADER: str(rank)}


@dataclass
class DPInstance:
    name: str
    dp: int
    tp: int
    side_channel_port: int
    server: VllmServer
    served_model_name: str = "tiny"

    def _complete(self, prompt: Sequence[int], max_tokens: int, rank: int | None, **kw: Any) -> Completion:
        return complete(
            self.server.base_url, self.served_model_name, prompt, max_tokens, headers=rank_header(rank), **kw
        )

    def reference(self, prompt: Sequence[int], max_tokens: int, rank: int | None = None, **kw: Any) -> Completion:
        return self._complete(prompt, max_tokens, rank, **kw)

    def prefill(self, prompt: Sequence[int], rank: int | None = None, **kw: Any) -> dict[str, Any]:
        out = self._complete(prompt, 1, rank, logprobs=None, kv_transfer_params=dict(PREFILL_REQUEST_PARAMS), **kw)
        return out.kv_transfer_params or {}

    def decode(
        self, prompt: Sequence[int], params: dict[str, Any], max_tokens: int, rank: int | None = None, **kw: Any
    ) -> Completion:
        return self._complete(prompt, max_tokens, rank, kv_transfer_params=params, **kw)

    def prompt_tokens(self, rank: int | None = None) -> dict[str, float]:
        """Cumulative ``vllm:prompt_tokens_by_source`` per source, of one DP engine or all."""
        engine = {} if rank is None else {"engine": str(rank)}
        return {
            s: self.server.metric("vllm:prompt_tokens_by_source_total", {"source": s, **engine}) or 0.0
            for s in SOURCES
        }

    def events(self, rank: int | None = None) -> dict[str, float]:
        from rig.prometheus import read_metric_labels

        engine = {} if rank is None else {"engine": str(rank)}
        names = {lab["event"] for lab in read_metric_labels(self.server.base_url, "vllm:pd_events_total") if "event" in lab}
        return {e: self.server.metric("vllm:pd_events_total", {"event": e, **engine}) or 0.0 for e in names}

    def port_of(self, rank: int) -> int:
        """The port P's params name for DP rank ``rank`` (core/ranks.py)."""
        return ranks.engine_base_port(self.side_channel_port, rank, self.tp)


def make_instances(
    model: str,
    log_dir: Path,
    shapes: dict[str, tuple[int, int]],
    dtype: str = "float32",
    server_args: Sequence[str] = (),
    per_instance_args: dict[str, Sequence[str]] | None = None,
    extra_config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    faults: bool = False,
) -> dict[str, DPInstance]:
    """Unstarted kv_both instances, ``name -> (dp, tp)``; each takes ``dp * tp`` consecutive
    side-channel ports. ``faults``: the rig's FaultInjectingConnector (rig/faults.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    binds = cpu_binds([dp * tp for dp, tp in shapes.values()])
    for (bind, bind_env), (name, (dp, tp)) in zip(binds, shapes.items()):
        base = free_ports(dp * tp)
        extra = {**DP_EXTRA_CONFIG, **(extra_config or {})}
        config = kv_transfer_config("kv_both", base, "cpu", faults=faults, **extra)
        dp_args = ["--data-parallel-size", str(dp)] if dp > 1 else []
        server = VllmServer(
            model,
            dtype=dtype,
            max_model_len=1024,
            extra_args=[
                *server_args, *tp_args(tp), *dp_args, *(per_instance_args or {}).get(name, ()),
                "--kv-transfer-config", config,
            ],  # fmt: skip
            env={**source_checkout_env(), **bind_env, **(env or {})},
            omp_threads_bind=bind,
            log_path=log_dir / f"{name}.log",
        )
        out[name] = DPInstance(name, dp, tp, base, server)
    return out


def engines(instances: dict[str, DPInstance]) -> list[tuple[DPInstance, int]]:
    """Every (instance, DP rank)."""
    return [(inst, k) for inst in instances.values() for k in range(inst.dp)]


def warm_up(instances: dict[str, DPInstance], timeout: float = 600.0) -> None:
    """One unchecked handoff per ordered pair of DP engines before the tests (a new pair's first
    READ can stall on a loaded 2-core box: tp_matrix.warm_up)."""
    prompt = random_prompt(40, seed=WARM_UP_SEED)
    for p, k in engines(instances):
        for d, j in engines(instances):
            d.decode(prompt, p.prefill(prompt, rank=k, timeout=timeout), 1, rank=j, timeout=timeout)
