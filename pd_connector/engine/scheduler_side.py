"""The scheduler side of PDConnector (in vLLM's EngineCore process): routes each request to
P's half (``do_remote_decode``: engine/prefill/prefill_scheduler.py) or D's (``do_remote_prefill``:
engine/decode/decode_scheduler.py) and gathers both halves' work into one ``PDMetadata`` a step. A
``kv_both`` instance runs both. Both share the prompt checkpoints' blocks in vLLM's block pool
(engine/checkpoint_pool.py): P pins the ones it hands over, D registers the ones it reads."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pd_connector.core import ranks, trust
from pd_connector.core.recompute_profile import min_recompute_tokens
from pd_connector.core.settings import ConnectorSettings
from pd_connector.engine.checkpoint_pool import CheckpointPool
from pd_connector.engine.decode.decode_scheduler import DecodeScheduler
from pd_connector.engine.from_vllm import identity
from pd_connector.engine.from_vllm.vllm_config import (
    checkpoint_rule_from_vllm,
    dp_placement,
    layouts_from_kv_cache_config,
    profile_from_vllm,
)
from pd_connector.engine.metadata import PDMetadata
from pd_connector.engine.metrics import Recorder
from pd_connector.engine.prefill.prefill_scheduler import PrefillScheduler
from pd_connector.transport.host_addresses import local_host_names

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")


def trust_from_settings(settings: ConnectorSettings) -> trust.Trust:
    """D's trust (core/trust.py): the seal key from the shared secret and the allowed P hosts,
    this host's own names resolved once here."""
    hosts = settings.prefill_hosts()
    local = local_host_names() if trust.LOCAL_HOST in hosts else ()
    allowed = trust.parse_allow_list(hosts, local)
    if not settings.secret:
        logger.info(
            "pd_connector: no shared secret: as a decode instance this engine loads only from "
            "prefill hosts on allowed_prefill_hosts (%s)", allowed.describe()
        )
    return trust.Trust(key=trust.seal_key(settings.secret), hosts=allowed)


class SchedulerSide:
    # D's half; a connector subclass may substitute its own (engine/decode/decode_scheduler.py's seams).
    decode_scheduler_class = DecodeScheduler

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings):
        self.settings = settings
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.profile = profile_from_vllm(vllm_config, kv_cache_config)
        self.group_ids = tuple(kv_cache_config.transfer_group_ids)
        self.layouts = layouts_from_kv_cache_config(kv_cache_config, self.group_ids)
        self.recorder = Recorder()
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size or 1)
        # vLLM's engine id already ends in _dp<rank> under DP; the port is this DP rank's.
        self.dp_index, _ = dp_placement(vllm_config)
        form = identity.fingerprint_form(vllm_config, kv_cache_config)
        rule = checkpoint_rule_from_vllm(vllm_config, kv_cache_config, self.profile, self.layouts, self.group_ids)
        self.checkpoints = CheckpointPool(self.layouts, self.group_ids, rule, self.recorder, vllm_config.cache_config)
        self.prefill = PrefillScheduler(
            settings,
            self.engine_id,
            self.profile,
            self.layouts,
            self.group_ids,
            tp_size,
            self.recorder,
            form,
            side_channel_port=ranks.engine_base_port(settings.side_channel_port, self.dp_index, tp_size),
            checkpoint_pool=self.checkpoints,
        )
        self.decode = self.decode_scheduler_class(
            settings,
            self.profile,
            self.layouts,
            self.group_ids,
            self.group_ids == tuple(range(len(kv_cache_config.kv_cache_groups))),
            tp_size,
            self.recorder,
            form,
            checkpoint_pool=self.checkpoints,
            trust_in=trust_from_settings(settings),
        )
        logger.info(
            "pd_connector scheduler: engine %s (DP rank %d), groups %s, min recompute %d token(s), "
            "prefix-cache checkpoint unit %d (%s)",
            self.engine_id,
            self.dp_index,
            [layout.kind for layout in self.layouts],
            min_recompute_tokens(self.profile),
            self.profile.checkpoint_unit,
            rule,
        )

    @property
    def stats(self):
        """Cumulative event counts (see metrics.py for the labels)."""
        return self.recorder.totals

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return
        if params.get("do_remote_decode"):
            self.prefill.prepare(request, params)
        elif params.get("do_remote_prefill"):
            self.decode.accept(request, params)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        self.prefill.keep_prompt_checkpoint(request)
        return self.decode.num_tokens_to_load(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self.decode.admit(request, blocks, num_external_tokens)

    def bind_block_pool(self, pool: Any) -> None:
        self.checkpoints.bind(pool)

    def build_connector_meta(self, block_state: Any = None) -> PDMetadata:
        self.checkpoints.take_offers(block_state)
        to_recv, to_release, to_extend = self.decode.take_tasks()
        return PDMetadata(
            to_send=self.prefill.take_leases(), to_recv=to_recv, to_release=to_release, to_extend=to_extend
        )

    def update_connector_output(
        self, finished_recving: "Iterable[str]", finished_sending: "Iterable[str]" = (), failed: "Iterable[str]" = ()
    ) -> None:
        """Loads every D rank ended: nothing to keep alive, and the checkpoints read are
        registered (not a failed load's). Leases every P rank ended: their checkpoints unpinned."""
        self.decode.loads_ended(finished_recving)
        self.checkpoints.settle(finished_recving, failed)
        self.checkpoints.release(finished_sending)

    def request_finished(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        self.decode.finished(request)
        if not params.get("do_remote_decode"):
            return False, None
        return self.prefill.finish(request, block_ids)
