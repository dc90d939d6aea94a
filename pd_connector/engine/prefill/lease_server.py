"""P's half of a handoff, on one TP rank: the lease table and the side-channel answers over it.

Every P rank runs its own side channel (``core/ranks.py``: ``side_channel_port + dp_index * tp_size +
tp_rank``) and its own lease table;
all ranks receive the same grants from P's scheduler. D's readers claim, read and complete per
rank (``leases.LeaseTable``), and vLLM frees a request's blocks once every rank has reported it
in ``finished_sending`` (vLLM's KVOutputAggregator).

Threads: the side-channel thread answers (``serve``) and the engine thread grants and collects
completions; they share only the lease table, under ``_lock``. No NIXL call happens here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pd_connector.core import trust
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.leases import GRANTED, UNKNOWN, LeaseTable
from pd_connector.core.compat import compat_differences
from pd_connector.core.protocol import (
    MAX_CLAIM_PARK_MS,
    Ack,
    Claim,
    EngineCompat,
    Extend,
    Extended,
    Granted,
    Hello,
    Message,
    Pending,
    ProtocolError,
    Reject,
    Release,
    Welcome,
    decode_read_done,
)
from pd_connector.core.ranks import side_channel_port
from pd_connector.engine.metadata import SendLease
from pd_connector.engine.metrics import Recorder
from pd_connector.transport import side_channel

logger = logging.getLogger("vllm.pd_connector")


class LeaseServer:
    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        compat: EngineCompat,
        welcome: Welcome,
        state_digest: Callable[[list[list[int]]], bytes] | None,
        wake: threading.Event,
        dp_index: int = 0,
    ):
        self.settings = settings
        self.engine_id = engine_id
        self.compat = compat
        self._welcome = welcome
        self._state_digest = state_digest
        self._wake = wake
        # Readers still due once every granted reader is done get the time a claim needs.
        self._leases = LeaseTable(claim_seconds=settings.claim_deadline_seconds, max_hold=settings.max_hold_seconds)
        self._lock = threading.Lock()
        # Written under _lock: the side-channel thread counts too.
        self.recorder = Recorder()
        self._rejected_seen: dict[str, int] = {}
        self._stalls_seen = 0
        self._expired_reading_seen = 0
        port = side_channel_port(settings.side_channel_port, dp_index, welcome.tp_rank, welcome.tp_size)
        self.server = side_channel.SideChannelServer(settings.side_channel_host, port, self.serve, settings.secret)
        logger.info(
            "pd_connector: side channel of engine %s, TP rank %d/%d listening on %s:%d (%s, %s)",
            engine_id,
            welcome.tp_rank,
            welcome.tp_size,
            settings.side_channel_host,
            port,
            "authenticated" if settings.secret else "unauthenticated",
            # side_channel.prefer_thread: set by the serving thread as it starts.
            "real-time threads" if self.server.preferred() else "normal-priority threads",
        )
        exposure = trust.exposure_warning(settings.side_channel_host, bool(settings.secret))
        if exposure and welcome.tp_rank == 0:
            logger.warning("pd_connector: %s", exposure)

    # -- engine thread ---------------------------------------------------------------------

    def grant(self, leases: dict[str, SendLease]) -> None:
        now = time.monotonic()
        with self._lock:
            for request_id, lease in leases.items():
                self._leases.grant(
                    request_id, lease.deadline, lease.replay_offset, lease.block_ids, lease.fingerprint, lease.requests, now,
                    checkpoints=lease.checkpoints,
                )
        self.server.kick()  # claims that overtook these leases are answered now

    def held(self) -> int:
        with self._lock:
            return len(self._leases)

    def blocks_to_free(self, notifications: list[bytes]) -> set[str]:
        """Where P frees blocks: the requests whose leases ended (every reader's READ
        notification or release, or expiry), which vLLM frees once every rank reports them
        (``finished_sending``)."""
        now = time.monotonic()
        dones = []
        for note in notifications:
            try:
                dones.append(decode_read_done(note))
            except ProtocolError as exc:
                logger.warning("pd_connector: ignoring a READ notification: %s", exc)
        with self._lock:
            for done in dones:
                self._leases.complete(done.request_id, now, done.reader, done.readers)
            for request_id in self._leases.expire(now):
                self.recorder.count("lease_expired")
                logger.warning(
                    "pd_connector: lease of %s expired without the decode instance finishing "
                    "its read; freeing its blocks",
                    request_id,
                )
            under_read = self._leases.expired_reading_total - self._expired_reading_seen
            if under_read:
                # D fails such a READ when it completes (it lies outside the hold P confirmed).
                self.recorder.count("lease_expired_while_reading", under_read)
                self._expired_reading_seen = self._leases.expired_reading_total
            return self._leases.take_to_free()

    def take_stats(self, into: Recorder) -> None:
        with self._lock:
            for kind, n in dict(self.server.rejected).items():
                seen = self._rejected_seen.get(kind, 0)
                if n > seen:
                    self.recorder.count(f"side_channel_rejected:{kind}", n - seen)
                    self._rejected_seen[kind] = n
            stalls = self.server.stalls
            if stalls > self._stalls_seen:
                self.recorder.count("side_channel_stalled", stalls - self._stalls_seen)
                self._stalls_seen = stalls
            into.interval.aggregate(self.recorder.interval)
            self.recorder.interval.reset()

    def close(self) -> None:
        self.server.close()

    # -- side-channel thread ---------------------------------------------------------------

    def serve(self, message: Message) -> "Message | side_channel.Deferred":
        try:
            return self._answer(message)
        finally:
            self._wake.set()  # a claim, release or extension: an idle step looks again now

    def _answer(self, message: Message) -> "Message | side_channel.Deferred":
        if isinstance(message, Hello):
            diffs = compat_differences(self.compat, message.compat)
            if diffs:
                reason = (
                    f"prefill engine {self.engine_id} and decode engine {message.engine_id} "
                    f"are incompatible: {'; '.join(diffs)}"
                )
                logger.warning("pd_connector: %s", reason)
                return Reject(reason=reason)
            return self._welcome
        if isinstance(message, Claim):
            return self._serve_claim(message)
        now = time.monotonic()
        if isinstance(message, Extend):
            held = {}
            with self._lock:
                for request_id in message.request_ids:
                    if self._leases.extend(request_id, now, now + self.settings.lease_seconds):
                        held[request_id] = self._leases.held_seconds(request_id, now)
            return Extended(held=held)
        if isinstance(message, Release):
            if message.reason:
                logger.info(
                    "pd_connector: decode %s released %s: %s",
                    message.reader or "scheduler",
                    ", ".join(message.request_ids),
                    message.reason,
                )
            with self._lock:
                for request_id in message.request_ids:
                    self._leases.complete(request_id, now, message.reader, message.readers)
            return Ack()
        return Reject(reason=f"unexpected message {type(message).__name__}")

    def _serve_claim(self, claim: Claim) -> "Message | side_channel.Deferred":
        reply = self._claim_reply(claim)
        if not isinstance(reply, Pending) or claim.wait_ms <= 0:
            return reply
        # The grant travels with the next engine step's metadata and a claim can overtake it.
        # Park the claim (the side-channel thread keeps serving every peer) and answer when
        # grant() kicks the server, or Pending when D's wait runs out (D asks again).
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
        """vllm:pd_claim_held_seconds: how long P held a claim that overtook its lease."""
        with self._lock:
            self.recorder.observe("claim_held_seconds", time.monotonic() - parked)

    def _claim_reply(self, claim: Claim) -> Message:
        """Granted, Reject, or Pending while P does not know the lease yet."""
        now = time.monotonic()
        with self._lock:
            outcome, why = self._leases.claim(
                claim.request_id,
                claim.replay_offset,
                claim.block_ids,
                now,
                now + self.settings.lease_seconds,
                claim.readers,
                claim.reader,
                claim.fingerprint,
                claim.checkpoints,
            )
            held = self._leases.held_seconds(claim.request_id, now)
        if outcome == UNKNOWN:
            return Pending(reason=why)
        if outcome != GRANTED:
            with self._lock:
                self.recorder.count(f"claim_refused:{outcome}")
            logger.warning("pd_connector: refused a claim from %s: %s", claim.engine_id, why)
            return Reject(reason=why)
        digest = self._state_digest(claim.block_ids) if self._state_digest is not None else b""
        return Granted(
            lease_seconds=held, state_digest=digest, agent_name=self._welcome.agent_name
        )
