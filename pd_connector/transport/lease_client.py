"""D's side-channel calls to a prefill engine (ZMQ only, never NIXL; they run on the
receiver's background threads): the handshake, the claim before a READ, and the release and
lease extensions after or around it."""

from __future__ import annotations

import logging
import time

import msgspec

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.compat import compat_differences
from pd_connector.core.protocol import (
    MAX_CLAIM_PARK_MS,
    CheckpointBlocks,
    Claim,
    EngineCompat,
    Extend,
    Extended,
    Granted,
    Hello,
    Pending,
    Reject,
    Release,
    Welcome,
)
from pd_connector.transport import side_channel

logger = logging.getLogger("vllm.pd_connector")

# Longest a claim asks P to hold its answer for a lease still on its way (Claim.wait_ms): half
# of what P allows, so P's answer arrives well inside this call's timeout.
CLAIM_PARK_S = MAX_CLAIM_PARK_MS / 2000


class PeerRefused(side_channel.SideChannelError):
    """P answered the handshake but D cannot use it (``kind``: ``engine_id``, ``tp_mismatch``,
    ``incompatible``): unlike an unanswered handshake, P can be told to release."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ClaimRequest(msgspec.Struct, frozen=True):
    """What D claims from one P rank before reading its share."""

    lease: LeaseRef
    rank: int
    replay_offset: int
    block_ids: list[list[int]]
    reader: str
    readers: int
    fingerprint: str = ""
    # The prompt checkpoints D reads besides the offset's blocks (a subset of P's).
    checkpoints: list[CheckpointBlocks] = []


class LeaseClient:
    def __init__(self, settings: ConnectorSettings, engine_id: str, compat: EngineCompat, max_idle_per_peer: int):
        self.settings = settings
        self.engine_id = engine_id
        self.compat = compat
        self._client = side_channel.Client(max_idle_per_peer=max_idle_per_peer)

    def _call(self, host: str, port: int, message):
        return self._client.call(host, port, message, self.settings.handshake_timeout_seconds, self.settings.secret)

    def handshake(self, prefill: LeaseRef, rank: int) -> tuple[Welcome, float]:
        """P rank ``rank``'s Welcome, checked against what the params promised."""
        started = time.monotonic()
        port = prefill.rank_port(rank)
        reply = self._call(prefill.host, port, Hello(engine_id=self.engine_id, compat=self.compat))
        if isinstance(reply, Reject):
            raise PeerRefused("incompatible", reply.reason)
        if not isinstance(reply, Welcome):
            raise side_channel.SideChannelError(f"unexpected reply {type(reply).__name__}")
        if reply.engine_id != prefill.engine_id:
            raise PeerRefused(
                "engine_id",
                f"{prefill.host}:{port} is engine {reply.engine_id}, not "
                f"{prefill.engine_id} named in kv_transfer_params",
            )
        if (reply.tp_rank, reply.tp_size) != (rank, prefill.tp_size):
            raise PeerRefused(
                "tp_mismatch",
                f"{prefill.host}:{port} is TP rank {reply.tp_rank} of {reply.tp_size}, not rank "
                f"{rank} of {prefill.tp_size} as kv_transfer_params say (side_channel_port + rank)",
            )
        diffs = compat_differences(self.compat, reply.compat)
        if diffs:
            raise PeerRefused("incompatible", "incompatible prefill engine: " + "; ".join(diffs))
        return reply, time.monotonic() - started

    def claim(self, request: ClaimRequest) -> tuple[Granted, float]:
        """P's grant, and when it arrived (``time.monotonic()``)."""
        deadline = time.monotonic() + self.settings.claim_wait_seconds
        delay = 0.005
        while True:
            # P's grant can be one engine step behind the router: P holds the answer up to
            # wait_ms and replies the moment the lease lands (within our call timeout); a P
            # that predates wait_ms answers Pending at once and we poll with backoff.
            wait_s = min(CLAIM_PARK_S, deadline - time.monotonic(), self.settings.handshake_timeout_seconds / 2)
            claim = Claim(
                engine_id=self.engine_id,
                request_id=request.lease.request_id,
                replay_offset=request.replay_offset,
                block_ids=request.block_ids,
                wait_ms=max(0, int(wait_s * 1000)),
                reader=request.reader,
                readers=request.readers,
                fingerprint=request.fingerprint,
                checkpoints=request.checkpoints,
            )
            reply = self._call(request.lease.host, request.lease.rank_port(request.rank), claim)
            if not isinstance(reply, Pending) or time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        if isinstance(reply, Pending):
            raise side_channel.SideChannelError(f"P refused the claim: {reply.reason}")
        if isinstance(reply, Reject):
            raise side_channel.SideChannelError(f"P refused the claim: {reply.reason}")
        if not isinstance(reply, Granted):
            raise side_channel.SideChannelError(f"unexpected reply {type(reply).__name__}")
        return reply, time.monotonic()

    def release(self, prefill: LeaseRef, rank: int, reason: str, reader: str = "", readers: int = 1) -> None:
        """Tell P rank ``rank`` that ``reader`` (none: every reader) will not read ``prefill``."""
        message = Release(request_ids=[prefill.request_id], reason=reason, reader=reader, readers=readers)
        try:
            self._call(prefill.host, prefill.rank_port(rank), message)
        except side_channel.SideChannelError as exc:
            # P frees the blocks at lease expiry anyway.
            logger.info("pd_connector: release of %s not delivered: %s", prefill.request_id, exc)

    def extend(self, host: str, port: int, request_ids: list[str]) -> Extended | None:
        """P's answer (which requests it still holds, and how long), or None if none came."""
        try:
            reply = self._call(host, port, Extend(request_ids=request_ids))
        except side_channel.SideChannelError as exc:
            logger.info("pd_connector: lease extension not delivered to %s:%d: %s", host, port, exc)
            return None
        if not isinstance(reply, Extended):
            logger.info("pd_connector: %s:%d answered a lease extension with %s", host, port, type(reply).__name__)
            return None
        return reply

    def forget(self, peers) -> None:
        """Close the idle sockets to these ``(host, port)`` side channels."""
        self._client.forget(peers)

    def idle_sockets(self) -> int:
        return self._client.idle_sockets()

    def close(self) -> None:
        self._client.close()
