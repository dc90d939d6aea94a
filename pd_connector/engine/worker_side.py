"""The worker side of PDConnector (one per vLLM worker process, i.e. per TP rank): dispatch.

Registers this rank's KV pages with NIXL, then hands each engine step's metadata to P's
``LeaseServer`` (leases, side-channel answers) and D's ``Receiver`` (handshake, claim, READ), and
reports their outcomes to vLLM. D's failures are reported per request as ``failed_recving``
*and* ``finished_recving``, for all groups at once (vLLM raises on block-level errors for
multi-group models, Scheduler._handle_invalid_blocks). vLLM counts a request finished (sent or
received) only once every TP rank has reported it (KVOutputAggregator).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pd_connector.core import ranks
from pd_connector.core.settings import ConnectorSettings, UnsupportedConfig
from pd_connector.core.idle_wait import idle_step_wait, idle_wait_seconds
from pd_connector.core.pairing import MAMBA
from pd_connector.core.protocol import Welcome
from pd_connector.engine.from_vllm.vllm_config import dp_placement, tp_rank_and_size
from pd_connector.engine.from_vllm.engine_compat import engine_compat
from pd_connector.engine.from_vllm.regions import regions_from_kv_caches
from pd_connector.engine.state_digest import StateDigester
from pd_connector.engine.metadata import PDMetadata
from pd_connector.engine.metrics import PDStats, Recorder
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.prefill.lease_server import LeaseServer
from pd_connector.engine.from_vllm.shard_layout import describe_shards
from pd_connector.transport.nixl import NixlTransport
from pd_connector.transport.side_channel import SideChannelError

logger = logging.getLogger("vllm.pd_connector")


class WorkerSide:
    # D's load pipeline on this rank; a connector subclass may substitute its own (``make_receiver``).
    receiver_class = Receiver

    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings):
        self.settings = settings
        self.vllm_config = vllm_config
        kv_transfer = vllm_config.kv_transfer_config
        self.engine_id = kv_transfer.engine_id
        self.is_producer = kv_transfer.is_kv_producer
        self.kv_cache_config = kv_cache_config
        self.group_ids = tuple(kv_cache_config.transfer_group_ids)
        self.compat = engine_compat(vllm_config, kv_cache_config, self.group_ids)
        self.tp_rank, self.tp_size = tp_rank_and_size(vllm_config)
        self.dp_index, lockstep = dp_placement(vllm_config)
        self.mamba_groups = [i for i, g in enumerate(self.compat.groups) if g.kind == MAMBA]
        self.mem_type = "DRAM" if kv_transfer.kv_buffer_device == "cpu" else "VRAM"
        self.transport: NixlTransport | None = None
        self.lease_server: LeaseServer | None = None
        self.receiver: Receiver | None = None
        self.recorder = Recorder()
        # Idle steps (nothing scheduled, only connector work pending) wait on this instead of
        # spinning; side-channel news sets it. See ConnectorSettings.idle_step_wait_ms.
        self._wake = threading.Event()
        self._idle_step = False
        self._idle_wait_s = idle_wait_seconds(settings.idle_step_wait_ms, lockstep)

    # -- set-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        allocations, regions = regions_from_kv_caches(self.kv_cache_config, kv_caches, self.group_ids)
        regions = describe_shards(
            self.vllm_config, self.kv_cache_config, self.group_ids, regions, self.tp_rank, self.tp_size, kv_caches
        )
        self.transport = NixlTransport(
            mem_type=self.mem_type,
            backends=self.settings.nixl_backends,
            num_threads=self.settings.nixl_num_threads,
            progress_delay_us=self.settings.progress_delay_for(self.mem_type),
            ucx_error_handling=self.settings.nixl_ucx_error_handling,
        )
        self.transport.register(allocations, regions)
        digest = None
        # Page views only where something reads them: the digest of the recurrent state.
        if self.mamba_groups and self.settings.verify_state_digest:
            digester = StateDigester(kv_caches, regions)
            digest = lambda blocks: digester.digest(blocks, self.mamba_groups)  # noqa: E731
        logger.info(
            "pd_connector worker: DP rank %d, TP rank %d/%d registered %d layer(s) in %d allocation(s) as %s memory",
            self.dp_index,
            self.tp_rank,
            self.tp_size,
            len(regions),
            len(allocations),
            self.mem_type,
        )
        self.receiver = self.make_receiver(kv_caches, regions, digest)
        if self.is_producer:
            welcome = Welcome(
                engine_id=self.engine_id,
                agent_name=self.transport.name,
                agent_metadata=self.transport.agent_metadata,
                regions=list(regions),
                compat=self.compat,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
            self.lease_server = self._start_lease_server(welcome, digest)

    def make_receiver(self, kv_caches: dict[str, Any], regions: Any, digest: Any) -> Receiver:
        """This rank's ``receiver_class``; ``kv_caches`` and ``regions`` (its registered pages)
        are for a subclass whose receiver reads them."""
        return self.receiver_class(
            self.transport,
            self.settings,
            self.engine_id,
            self.compat,
            digest,
            wake=self._wake,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )

    def _start_lease_server(self, welcome: Welcome, digest: Any) -> LeaseServer:
        """P's side channel for this (DP, TP) rank, on its port of core/ranks.py's scheme; a port
        past 65535 or one another process holds is refused naming the scheme and the setting."""
        base = self.settings.side_channel_port
        problem = ranks.port_scheme_problem(base, self.dp_index, self.tp_size)
        if problem is not None:
            raise UnsupportedConfig(f"pd_connector: {problem}")
        try:
            return LeaseServer(self.settings, self.engine_id, self.compat, welcome, digest, self._wake, dp_index=self.dp_index)
        except SideChannelError as exc:
            raise SideChannelError(f"{exc}. {ranks.describe_scheme(base, self.dp_index, self.tp_size)}") from None

    # -- per step (engine thread) --------------------------------------------------------------

    def start_load_kv(self, meta: PDMetadata) -> None:
        self._idle_step = meta.idle
        if meta.to_send and self.lease_server is not None:
            self.lease_server.grant(meta.to_send)
        assert self.receiver is not None or not (meta.to_recv or meta.to_release or meta.to_extend)
        for request_id, task in meta.to_recv.items():
            self.receiver.add(request_id, task)
        for release in meta.to_release:
            self.receiver.release_all(release)
        for extension in meta.to_extend:
            self.receiver.extend(extension)
        if self.receiver is not None:
            self.receiver.advance()

    def _wait_if_idle(self) -> None:
        """In a step that scheduled nothing, wait (bounded) for side-channel news instead of
        returning at once; how long, see ``idle_wait.idle_step_wait`` (READs in flight included)."""
        if not self._idle_step:
            return  # the common case, decided without the lease lock (a step that did work)
        receiver = self.receiver
        wait = idle_step_wait(
            self._idle_step,
            self._idle_wait_s,
            leases_held=self.lease_server.held() if self.lease_server is not None else 0,
            loads_pending=receiver is not None and receiver.pending() > 0,
            reads=receiver.reads_in_nixl() if receiver is not None else (),
        )
        if wait > 0:
            self._wake.wait(wait)
            self._wake.clear()  # whatever set it is polled right below

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._wait_if_idle()
        finished_recving: set[str] = set()
        failed: set[str] = set()
        if self.receiver is not None:
            self.receiver.advance()
            finished_recving, failed = self.receiver.take_results()
        finished_sending: set[str] = set()
        if self.lease_server is not None and self.transport is not None:
            finished_sending = self.lease_server.blocks_to_free(self.transport.take_notifications())
        return KVConnectorTransferResults(
            finished_sending=finished_sending,
            finished_recving=finished_recving | failed,
            failed_recving=failed,
        )

    def take_stats(self) -> PDStats | None:
        if self.lease_server is not None:
            self.lease_server.take_stats(self.recorder)
        stats = self.recorder.interval
        if self.receiver is not None:
            stats.aggregate(self.receiver.recorder.interval)
            self.receiver.recorder.interval.reset()
        return stats.take()

    def shutdown(self) -> None:
        if self.lease_server is not None:
            self.lease_server.close()
            self.lease_server = None
        if self.receiver is not None:
            self.receiver.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
