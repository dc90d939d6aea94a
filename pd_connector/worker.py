"""Worker-side half of PDConnector (runs in each vLLM worker process).

P: registers the KV cache with NIXL, serves handshakes on the side channel, holds leases and
reports ``finished_sending`` when D is done (or the lease ends).
D: handshakes once per P engine (background thread, cached), then one prepared READ per request;
reports ``finished_recving`` and, on any failure, ``failed_recving`` too, per request for all
groups (vLLM raises on block-level errors for multi-group models, Scheduler._handle_invalid_blocks).

Every NIXL call happens on the engine's thread; the background thread only speaks ZMQ.
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pd_connector import side_channel
from pd_connector.config import ConnectorSettings
from pd_connector.leases import LeaseTable
from pd_connector.metadata import PDMetadata, RecvTask
from pd_connector.protocol import (
    Ack,
    Hello,
    Message,
    Reject,
    Release,
    Welcome,
    compat_differences,
)
from pd_connector.transport import DONE, FAILED, NixlTransport
from pd_connector.vllm_compat import engine_compat, regions_from_kv_caches

logger = logging.getLogger("vllm.pd_connector")


@dataclass
class _Read:
    handle: Any
    task: RecvTask
    started: float
    descriptors: int


class WorkerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings):
        self.settings = settings
        kv_transfer = vllm_config.kv_transfer_config
        self.engine_id = kv_transfer.engine_id
        self.is_producer = kv_transfer.is_kv_producer
        self.kv_cache_config = kv_cache_config
        self.group_ids = tuple(kv_cache_config.transfer_group_ids)
        self.compat = engine_compat(vllm_config, kv_cache_config, self.group_ids)
        self.mem_type = "DRAM" if kv_transfer.kv_buffer_device == "cpu" else "VRAM"
        self.transport: NixlTransport | None = None
        self.server: side_channel.SideChannelServer | None = None
        self._welcome: Welcome | None = None
        # P side
        self.leases = LeaseTable()
        self._released: queue.Queue[str] = queue.Queue()
        # D side
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-handshake")
        self._handshakes: dict[str, Future] = {}
        self._peer_errors: dict[str, str] = {}
        self._waiting: dict[str, RecvTask] = {}
        self._reads: dict[str, _Read] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.stats: dict[str, float] = {}

    # -- set-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        allocations, regions = regions_from_kv_caches(self.kv_cache_config, kv_caches, self.group_ids)
        self.transport = NixlTransport(
            mem_type=self.mem_type,
            backends=self.settings.nixl_backends,
            num_threads=self.settings.nixl_num_threads,
        )
        self.transport.register(allocations, regions)
        self._welcome = Welcome(
            engine_id=self.engine_id,
            agent_name=self.transport.name,
            agent_metadata=self.transport.agent_metadata,
            regions=list(regions),
            compat=self.compat,
        )
        logger.info(
            "pd_connector worker: registered %d layer(s) in %d allocation(s) as %s memory",
            len(regions),
            len(allocations),
            self.mem_type,
        )
        if self.is_producer:
            self.server = side_channel.SideChannelServer(
                self.settings.side_channel_host, self.settings.side_channel_port, self._serve
            )
            logger.info(
                "pd_connector: side channel listening on %s:%d",
                self.settings.side_channel_host,
                self.settings.side_channel_port,
            )

    def _serve(self, message: Message) -> Message:
        """Side-channel thread: no NIXL calls here."""
        if isinstance(message, Hello):
            diffs = compat_differences(self.compat, message.compat)
            if diffs:
                reason = (
                    f"prefill engine {self.engine_id} and decode engine {message.engine_id} "
                    f"are incompatible: {'; '.join(diffs)}"
                )
                logger.warning("pd_connector: %s", reason)
                return Reject(reason=reason)
            assert self._welcome is not None
            return self._welcome
        if isinstance(message, Release):
            for request_id in message.request_ids:
                self._released.put(request_id)
            return Ack()
        return Reject(reason=f"unexpected message {type(message).__name__}")

    # -- per step --------------------------------------------------------------------------

    def start_load_kv(self, meta: PDMetadata) -> None:
        for request_id, lease in meta.to_send.items():
            self.leases.grant(request_id, lease.deadline)
        for request_id, task in meta.to_recv.items():
            if task.pairs is None:
                self._fail(request_id, "blocks could not be paired")
            else:
                self._waiting[request_id] = task
                self._ensure_handshake(task)
        for release in meta.to_release:
            self._executor.submit(self._send_release, release)
        self._start_ready_reads()

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._start_ready_reads()
        self._poll_reads()
        now = time.monotonic()
        while True:
            try:
                self.leases.complete(self._released.get_nowait(), now)
            except queue.Empty:
                break
        if self.transport is not None and self.is_producer:
            for note in self.transport.take_notifications():
                self.leases.complete(note.decode(errors="replace"), now)
        for request_id in self.leases.expire(now):
            logger.warning(
                "pd_connector: lease of %s expired after %.0f s without the decode instance "
                "finishing its read; freeing its blocks",
                request_id,
                self.settings.lease_seconds,
            )
        results = KVConnectorTransferResults(
            finished_sending=self.leases.take_finished(),
            finished_recving=self._finished_recving | self._failed_recving,
            failed_recving=self._failed_recving,
        )
        self._finished_recving, self._failed_recving = set(), set()
        return results

    # -- D: handshake and reads ------------------------------------------------------------

    def _ensure_handshake(self, task: RecvTask) -> None:
        key = task.remote_engine_id
        if self.transport is not None and self.transport.has_peer(key):
            return
        if key not in self._handshakes:
            self._handshakes[key] = self._executor.submit(self._handshake, task)

    def _handshake(self, task: RecvTask) -> Welcome:
        reply = side_channel.call(
            task.remote_host,
            task.remote_port,
            Hello(engine_id=self.engine_id, compat=self.compat),
            self.settings.handshake_timeout_seconds,
        )
        if isinstance(reply, Reject):
            raise side_channel.SideChannelError(reply.reason)
        if not isinstance(reply, Welcome):
            raise side_channel.SideChannelError(f"unexpected reply {type(reply).__name__}")
        if reply.engine_id != task.remote_engine_id:
            raise side_channel.SideChannelError(
                f"{task.remote_host}:{task.remote_port} is engine {reply.engine_id}, "
                f"not {task.remote_engine_id} named in kv_transfer_params"
            )
        diffs = compat_differences(self.compat, reply.compat)
        if diffs:
            raise side_channel.SideChannelError("incompatible prefill engine: " + "; ".join(diffs))
        return reply

    def _send_release(self, release) -> None:
        try:
            side_channel.call(
                release.remote_host,
                release.remote_port,
                Release(request_ids=[release.remote_request_id]),
                self.settings.handshake_timeout_seconds,
            )
        except side_channel.SideChannelError as exc:
            # P frees the blocks at lease expiry anyway.
            logger.info("pd_connector: release of %s not delivered: %s", release.remote_request_id, exc)

    def _start_ready_reads(self) -> None:
        if not self._waiting:
            return
        for key, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[key]
            try:
                welcome = future.result()
                assert self.transport is not None
                self.transport.add_peer(key, welcome.agent_metadata, welcome.regions)
                self._peer_errors.pop(key, None)
                logger.info("pd_connector: connected to prefill engine %s", key)
            except Exception as exc:
                self._peer_errors[key] = str(exc)
                logger.warning("pd_connector: handshake with %s failed: %s", key, exc)
        for request_id, task in list(self._waiting.items()):
            key = task.remote_engine_id
            if key in self._peer_errors:
                del self._waiting[request_id]
                self._fail(request_id, f"handshake failed: {self._peer_errors[key]}")
            elif self.transport is not None and self.transport.has_peer(key):
                del self._waiting[request_id]
                self._start_read(request_id, task)
        if self._peer_errors and not self._waiting:
            # Let a later request retry a peer that failed (it may have restarted).
            self._peer_errors.clear()

    def _start_read(self, request_id: str, task: RecvTask) -> None:
        assert self.transport is not None
        try:
            local_idx, remote_idx = self.transport.plan(task.remote_engine_id, task.pairs)
            handle = self.transport.read(
                task.remote_engine_id, local_idx, remote_idx, task.remote_request_id.encode()
            )
        except Exception as exc:
            self._fail(request_id, f"could not post the READ: {exc}")
            return
        self._reads[request_id] = _Read(handle, task, time.monotonic(), int(local_idx.size))

    def _poll_reads(self) -> None:
        assert self.transport is not None or not self._reads
        for request_id, read in list(self._reads.items()):
            state = self.transport.state(read.handle)
            if state == DONE:
                self.transport.release(read.handle)
                del self._reads[request_id]
                self._finished_recving.add(request_id)
                logger.debug(
                    "pd_connector: %s loaded %d descriptors in %.2f ms",
                    request_id,
                    read.descriptors,
                    (time.monotonic() - read.started) * 1e3,
                )
            elif state == FAILED:
                self.transport.release(read.handle)
                del self._reads[request_id]
                self._fail(request_id, "NIXL reported the READ failed")

    def _fail(self, request_id: str, why: str) -> None:
        logger.warning(
            "pd_connector: loading KV for %s failed (%s); the prompt is recomputed locally "
            "(load_failure_policy=%s)",
            request_id,
            why,
            self.settings.load_failure_policy,
        )
        self._failed_recving.add(request_id)

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()
            self.transport = None
