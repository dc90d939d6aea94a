"""``FaultInjectingConnector``: PDConnector plus the negative controls' faults (rig/faults.py), for
tests only. A D loads it instead of the product's class::

    {"kv_connector": "FaultInjectingConnector", "kv_connector_module_path": "rig.fault_connector", ...}

(``rig.faults.FAULT_CONNECTOR``; the server's PYTHONPATH holds the checkout:
``rig.servers.source_checkout_env``), and a request then asks for a fault by a key in its
``kv_transfer_params``; without one it behaves as PDConnector. The faults go through the
product's own seams (DecodeScheduler, SchedulerSide, WorkerSide, Receiver), so no product module
knows they exist (tests/unit/test_house.py).
"""

from __future__ import annotations

import logging
from typing import Any

from pd_connector.connector import PDConnector
from pd_connector.core import handoff
from pd_connector.engine.decode.decode_scheduler import Admitted, DecodeScheduler
from pd_connector.engine.metadata import RecvTask
from pd_connector.engine.scheduler_side import SchedulerSide
from pd_connector.engine.state_digest import StateDigester
from pd_connector.engine.worker_side import WorkerSide
from rig import faults
from rig.fault_receiver import StateCorruptingReceiver, corrupted

logger = logging.getLogger("vllm.pd_connector")


class FaultInjectingDecodeScheduler(DecodeScheduler):
    """D's scheduler half with RESUME_SHIFT, SKIP_PROMPT_CHECK, WITHHOLD_CHECKPOINTS and the
    marking of CORRUPT_STATE's task."""

    def prompt_fingerprint_check(self, request: Any, params: dict[str, Any]):
        if faults.asks(params, faults.SKIP_PROMPT_CHECK):
            logger.warning("pd_connector: FAULT INJECTION: %s skips the prompt fingerprint check", request.request_id)
            return None  # decide_on_decode then checks no fingerprint; the claim carries P's
        return super().prompt_fingerprint_check(request, params)

    def resume_decision(self, request: Any, params: dict[str, Any], decision: handoff.Accepted) -> handoff.Accepted:
        shifted = faults.shifted(decision, params, request.num_prompt_tokens)
        if shifted is not decision:
            logger.warning("pd_connector: FAULT INJECTION: %s resumes %+d tokens off", request.request_id,
                           shifted.replay_offset - decision.replay_offset)
        return shifted

    def places_checkpoints(self, request: Any, params: dict[str, Any]) -> bool:
        return not faults.asks(params, faults.WITHHOLD_CHECKPOINTS)

    def recv_task(self, admitted: Admitted) -> RecvTask:
        task = super().recv_task(admitted)
        request = admitted.request
        if request is not None and faults.asks(request.kv_transfer_params, faults.CORRUPT_STATE):
            return corrupted(task)
        return task


class FaultInjectingSchedulerSide(SchedulerSide):
    decode_scheduler_class = FaultInjectingDecodeScheduler


class FaultInjectingWorkerSide(WorkerSide):
    """Each rank's receiver flips a CORRUPT_STATE task's recurrent state through page views of
    its registered memory (built here, with the digest off too: the negative controls corrupt
    what D keeps and serves)."""

    receiver_class = StateCorruptingReceiver

    def make_receiver(self, kv_caches: dict[str, Any], regions: Any, digest: Any) -> StateCorruptingReceiver:
        receiver = super().make_receiver(kv_caches, regions, digest)
        if self.mamba_groups:
            views = StateDigester(kv_caches, regions)
            receiver.state_pages = lambda blocks: views.pages(blocks, self.mamba_groups)
        return receiver


class FaultInjectingConnector(PDConnector):
    def make_scheduler_side(self, vllm_config: Any, kv_cache_config: Any) -> SchedulerSide:
        return FaultInjectingSchedulerSide(vllm_config, kv_cache_config, self.settings)

    def make_worker_side(self, vllm_config: Any, kv_cache_config: Any) -> WorkerSide:
        return FaultInjectingWorkerSide(vllm_config, kv_cache_config, self.settings)
