"""Worker-side half of PDConnector (runs in each vLLM worker process).

P: registers the KV cache with NIXL, serves handshakes and claims on the side channel, holds
leases and reports ``finished_sending`` when D is done (or the lease ends).
D: the ``Receiver`` pipeline (handshake, claim, READ); failures are reported per request as
``failed_recving`` *and* ``finished_recving``, for all groups at once (vLLM raises on
block-level errors for multi-group models, Scheduler._handle_invalid_blocks).

The side-channel thread shares only the lease table (under a lock) with the engine thread;
every NIXL call happens on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from pd_connector.transport import side_channel
from pd_connector.core.config import ConnectorSettings
from pd_connector.engine.digest import PageDigester
from pd_connector.core.idle_wait import should_wait_for_news
from pd_connector.core.leases import GRANTED, UNKNOWN, LeaseTable
from pd_connector.engine.metadata import PDMetadata
from pd_connector.engine.metrics import PDStats, Recorder
from pd_connector.core.pairing import MAMBA
from pd_connector.core.protocol import (
    Ack,
    Claim,
    Extend,
    Granted,
    Hello,
    Message,
    Pending,
    Reject,
    Release,
    Welcome,
    compat_differences,
)
from pd_connector.engine.receiver import Receiver
from pd_connector.transport.nixl import NixlTransport
from pd_connector.engine.compat import engine_compat, regions_from_kv_caches

logger = logging.getLogger("vllm.pd_connector")

# D asks P to hold a claim for at most 1 s (prefill_calls.CLAIM_PARK_S); P never holds one longer
# than this, whatever a peer asks.
MAX_CLAIM_PARK_MS = 2000


class WorkerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings):
        self.settings = settings
        kv_transfer = vllm_config.kv_transfer_config
        self.engine_id = kv_transfer.engine_id
        self.is_producer = kv_transfer.is_kv_producer
        self.kv_cache_config = kv_cache_config
        self.group_ids = tuple(kv_cache_config.transfer_group_ids)
        self.compat = engine_compat(vllm_config, kv_cache_config, self.group_ids)
        self.mamba_groups = [i for i, g in enumerate(self.compat.groups) if g.kind == MAMBA]
        self.mem_type = "DRAM" if kv_transfer.kv_buffer_device == "cpu" else "VRAM"
        self.transport: NixlTransport | None = None
        self.server: side_channel.SideChannelServer | None = None
        self.receiver: Receiver | None = None
        self._welcome: Welcome | None = None
        self._digester: PageDigester | None = None
        # P side: the lease table is shared with the side-channel thread.
        self._leases = LeaseTable()
        self._lease_lock = threading.Lock()
        # P-side events; written under _lease_changed (the side-channel thread counts too).
        self.recorder = Recorder()
        self._rejected_seen: dict[str, int] = {}
        # Idle steps (nothing scheduled, only connector work pending) wait on this instead of
        # spinning; side-channel news sets it. See ConnectorSettings.idle_step_wait_ms.
        self._wake = threading.Event()
        self._idle_step = False
        self._idle_wait_s = settings.idle_step_wait_ms / 1000.0

    # -- set-up ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        allocations, regions = regions_from_kv_caches(self.kv_cache_config, kv_caches, self.group_ids)
        self.transport = NixlTransport(
            mem_type=self.mem_type,
            backends=self.settings.nixl_backends,
            num_threads=self.settings.nixl_num_threads,
            progress_delay_us=self.settings.progress_delay_for(self.mem_type),
            ucx_error_handling=self.settings.nixl_ucx_error_handling,
        )
        self.transport.register(allocations, regions)
        if self.settings.verify_state_digest and self.mamba_groups:
            self._digester = PageDigester(kv_caches, regions)
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
        digest = corrupt = None
        if self._digester is not None:
            digest = lambda blocks: self._digester.digest(blocks, self.mamba_groups)  # noqa: E731
            corrupt = lambda blocks: self._digester.corrupt(blocks, self.mamba_groups)  # noqa: E731
        self.receiver = Receiver(
            self.transport, self.settings, self.engine_id, self.compat, digest, corrupt, wake=self._wake
        )
        if self.is_producer:
            self.server = side_channel.SideChannelServer(
                self.settings.side_channel_host,
                self.settings.side_channel_port,
                self._serve,
                self.settings.secret,
            )
            logger.info(
                "pd_connector: side channel listening on %s:%d (%s)",
                self.settings.side_channel_host,
                self.settings.side_channel_port,
                "authenticated" if self.settings.secret else "unauthenticated",
            )

    # -- P: side-channel thread ----------------------------------------------------------------

    def _serve(self, message: Message) -> Message:
        try:
            return self._answer(message)
        finally:
            self._wake.set()  # a claim, release or extension: an idle step looks again now

    def _answer(self, message: Message) -> Message:
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
        if isinstance(message, Claim):
            return self._serve_claim(message)
        if isinstance(message, Extend):
            now = time.monotonic()
            with self._lease_lock:
                for request_id in message.request_ids:
                    self._leases.extend(request_id, now, now + self.settings.lease_seconds)
            return Ack()
        if isinstance(message, Release):
            now = time.monotonic()
            with self._lease_lock:
                for request_id in message.request_ids:
                    self._leases.complete(request_id, now)
            return Ack()
        return Reject(reason=f"unexpected message {type(message).__name__}")

    def _serve_claim(self, claim: Claim) -> "Message | side_channel.Deferred":
        reply = self._claim_reply(claim)
        if not isinstance(reply, Pending) or claim.wait_ms <= 0:
            return reply
        # The grant travels with the next engine step's metadata and a claim can overtake it.
        # Park the claim (the side-channel thread keeps serving every peer) and answer when
        # start_load_kv grants the lease (it kicks the server), or Pending when D's wait runs
        # out (D then asks again for up to claim_wait_seconds).
        parked = time.monotonic()

        def answer_once_known() -> Message | None:
            answer = self._claim_reply(claim)
            if isinstance(answer, Pending):
                return None
            self._observe_held(parked)
            return answer

        def timed_out() -> Message:
            self._observe_held(parked)
            return reply

        return side_channel.Deferred(
            poll=answer_once_known,
            deadline=parked + min(claim.wait_ms, MAX_CLAIM_PARK_MS) / 1000,
            on_timeout=timed_out,
            unparked=reply,  # P is past MAX_PARKED: Pending now, D asks again; nothing was held
        )

    def _observe_held(self, parked: float) -> None:
        """vllm:pd_claim_held_seconds: how long P held a claim that overtook its lease (the
        lease travels with P's next engine step); long holds mean P's steps come late."""
        with self._lease_lock:
            self.recorder.observe("claim_held_seconds", time.monotonic() - parked)

    def _claim_reply(self, claim: Claim) -> Message:
        """Granted, Reject, or Pending while P does not know the lease yet."""
        now = time.monotonic()
        with self._lease_lock:
            outcome, why = self._leases.claim(
                claim.request_id, claim.replay_offset, claim.block_ids, now, now + self.settings.lease_seconds
            )
        if outcome == UNKNOWN:
            return Pending(reason=why)
        if outcome != GRANTED:
            with self._lease_lock:
                self.recorder.count(f"claim_refused:{outcome}")
            logger.warning("pd_connector: refused a claim from %s: %s", claim.engine_id, why)
            return Reject(reason=why)
        digest = b""
        if self._digester is not None:
            digest = self._digester.digest(claim.block_ids, self.mamba_groups)
        return Granted(lease_seconds=self.settings.lease_seconds, state_digest=digest)

    # -- per step (engine thread) --------------------------------------------------------------

    def start_load_kv(self, meta: PDMetadata) -> None:
        self._idle_step = meta.idle
        if meta.to_send:
            with self._lease_lock:
                for request_id, lease in meta.to_send.items():
                    self._leases.grant(request_id, lease.deadline, lease.offset, lease.block_ids)
            if self.server is not None:
                self.server.kick()  # claims that overtook these leases are answered now
        assert self.receiver is not None or not (meta.to_recv or meta.to_release or meta.to_extend)
        for request_id, task in meta.to_recv.items():
            self.receiver.add(request_id, task)
        for release in meta.to_release:
            self.receiver.release(release)
        for extension in meta.to_extend:
            self.receiver.extend(extension)
        if self.receiver is not None:
            self.receiver.advance()

    def _wait_if_idle(self) -> None:
        """In a step that scheduled nothing, wait (bounded) for side-channel news instead of
        returning at once; when, see ``idle_wait.should_wait_for_news``."""
        if not self._idle_step:
            return  # the common case, decided without the lease lock (a step that did work)
        receiver = self.receiver
        with self._lease_lock:
            leases_held = len(self._leases)
        if should_wait_for_news(
            self._idle_step,
            self._idle_wait_s,
            reading=receiver is not None and receiver.reading(),
            leases_held=leases_held,
            loads_pending=receiver is not None and receiver.pending() > 0,
        ):
            self._wake.wait(self._idle_wait_s)
            self._wake.clear()  # whatever set it is polled right below

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._wait_if_idle()
        finished_recving: set[str] = set()
        failed: set[str] = set()
        if self.receiver is not None:
            self.receiver.advance()
            finished_recving, failed = self.receiver.take_results()
        finished_sending: set[str] = set()
        if self.is_producer and self.transport is not None:
            notes = self.transport.take_notifications()
            now = time.monotonic()
            with self._lease_lock:
                for note in notes:
                    self._leases.complete(note.decode(errors="replace"), now)
                for request_id in self._leases.expire(now):
                    self.recorder.count("lease_expired")
                    logger.warning(
                        "pd_connector: lease of %s expired without the decode instance "
                        "finishing its read; freeing its blocks",
                        request_id,
                    )
                finished_sending = self._leases.take_finished()
        return KVConnectorTransferResults(
            finished_sending=finished_sending,
            finished_recving=finished_recving | failed,
            failed_recving=failed,
        )

    def take_stats(self) -> PDStats | None:
        with self._lease_lock:
            if self.server is not None:
                for kind, n in dict(self.server.rejected).items():
                    if n > self._rejected_seen.get(kind, 0):
                        self.recorder.count(f"side_channel_rejected:{kind}", n - self._rejected_seen.get(kind, 0))
                        self._rejected_seen[kind] = n
            stats = self.recorder.interval
            if self.receiver is not None:
                stats.aggregate(self.receiver.recorder.interval)
                self.receiver.recorder.interval.reset()
            return stats.take()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.receiver is not None:
            self.receiver.close()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
