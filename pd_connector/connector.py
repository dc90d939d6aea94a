"""PDConnector: the vLLM-facing facade. Role dispatch only; decisions live in the core.

Load with::

    --kv-transfer-config '{"kv_connector":"PDConnector",
        "kv_connector_module_path":"pd_connector.connector",
        "kv_role":"kv_producer" | "kv_consumer" | "kv_both",
        "kv_buffer_device":"cpu" | "cuda",
        "kv_connector_extra_config":{"side_channel_host":"10.0.0.5","side_channel_port":5660}}'
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from pd_connector.core.settings import parse_settings
from pd_connector.engine.metrics import PDPromMetrics, PDStats
from pd_connector.engine.metadata import PDMetadata
from pd_connector.engine.from_vllm.refusals import check_supported

if TYPE_CHECKING:
    from pd_connector.engine.scheduler_side import SchedulerSide
    from pd_connector.engine.worker_side import WorkerSide
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        kv_transfer = vllm_config.kv_transfer_config
        self.settings = parse_settings(kv_transfer.kv_connector_extra_config)
        check_supported(vllm_config)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM's Scheduler reads kv_load_failure_policy right after constructing the
            # connector (Scheduler.__init__): our default is to recompute, never to fail or
            # return text computed on a bad state.
            kv_transfer.kv_load_failure_policy = self.settings.load_failure_policy
            self._scheduler = self.make_scheduler_side(vllm_config, kv_cache_config)
        else:
            from pd_connector.transport.backends import check_backends

            # Before any NIXL agent or socket exists: NIXL itself only warns about a missing
            # plugin and every transfer would fail later.
            check_backends(self.settings.nixl_backends)
            self._worker = self.make_worker_side(vllm_config, kv_cache_config)

    # Each role imports only its own side. A subclass may return its own side classes.

    def make_scheduler_side(self, vllm_config: Any, kv_cache_config: Any) -> "SchedulerSide":
        from pd_connector.engine.scheduler_side import SchedulerSide

        return SchedulerSide(vllm_config, kv_cache_config, self.settings)

    def make_worker_side(self, vllm_config: Any, kv_cache_config: Any) -> "WorkerSide":
        from pd_connector.engine.worker_side import WorkerSide

        return WorkerSide(vllm_config, kv_cache_config, self.settings)

    # -- scheduler side --------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        # A P/D handoff restores every transfer group, not only the prefix-cacheable ones.
        # SchedulerSide keeps them: KVCacheConfig.transfer_group_ids rebuilds the tuple per call.
        return self._scheduler.group_ids

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # Prompt checkpoints: P pins the states it hands over, D registers the ones it receives.
        if self._scheduler is not None:
            self._scheduler.bind_block_pool(gpu_block_pool)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        # This step's Mamba boundary states (vLLM clears the field once we return).
        meta = self._scheduler.build_connector_meta(getattr(scheduler_output, "kv_connector_block_state", None))
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_connector_output(
            connector_output.finished_recving or (),
            connector_output.finished_sending or (),
            getattr(connector_output, "failed_recving", None) or (),
        )

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete asynchronously, before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # D pulls from P's KV cache in place; nothing to save

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker.get_transfer_results()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self._worker.get_transfer_results()
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- metrics (both roles) -------------------------------------------------------------------

    def get_kv_connector_stats(self) -> PDStats | None:
        if self._scheduler is not None:
            return self._scheduler.recorder.interval.take()
        return self._worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDStats:
        return PDStats(data=dict(data)) if data else PDStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33's default is True; with False VllmConfig refuses --enable-sleep-mode
        # (_verify_kv_transfer_compat). vLLM 0.32 never asks: check_supported refuses it there.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        # vLLM's engine core asks this (resolve_kv_cache_layout, vllm/v1/engine/core.py
        # _initialize_kv_caches) before it builds the KV-cache groups: the first point where we
        # see the config. Refuse what vLLM would otherwise fail on with an unrelated message
        # (a hybrid model without the hybrid KV-cache manager) here, not in __init__, which
        # runs only after the KV cache exists.
        check_supported(vllm_config)
        model = getattr(vllm_config, "model_config", None)
        if model is not None and getattr(model, "use_mla", False):
            return None  # one latent per token, no heads: any layout both sides share works
        # Heads outermost in a block's page, so a decode rank's KV heads are one byte range of a
        # prefill rank's page whatever the two TP sizes (as vLLM's NixlConnector asks).
        return "LBHNC"
