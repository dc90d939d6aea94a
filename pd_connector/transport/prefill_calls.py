"""D's side-channel calls to a prefill engine (ZMQ only, never NIXL; they run on the
receiver's background threads): the handshake, the claim before a READ, and the release and
lease extensions after or around it."""

from __future__ import annotations

import logging
import time

from pd_connector.transport import side_channel
from pd_connector.core.config import ConnectorSettings
from pd_connector.engine.metadata import ExtendTask, ReleaseTask, RecvTask
from pd_connector.core.protocol import (
    Claim,
    EngineCompat,
    Extend,
    Granted,
    Hello,
    Pending,
    Reject,
    Release,
    Welcome,
    compat_differences,
)

logger = logging.getLogger("vllm.pd_connector")

# Longest a claim asks P to hold its answer for a lease still on its way (Claim.wait_ms).
CLAIM_PARK_S = 1.0


class PrefillCalls:
    def __init__(self, settings: ConnectorSettings, engine_id: str, compat: EngineCompat, max_idle_per_peer: int):
        self.settings = settings
        self.engine_id = engine_id
        self.compat = compat
        self._client = side_channel.Client(max_idle_per_peer=max_idle_per_peer)

    def _call(self, task, message):
        return self._client.call(
            task.remote_host,
            task.remote_port,
            message,
            self.settings.handshake_timeout_seconds,
            self.settings.secret,
        )

    def handshake(self, task: RecvTask) -> tuple[Welcome, float]:
        started = time.monotonic()
        reply = self._call(task, Hello(engine_id=self.engine_id, compat=self.compat))
        if isinstance(reply, Reject):
            raise side_channel.SideChannelError(reply.reason)
        if not isinstance(reply, Welcome):
            raise side_channel.SideChannelError(f"unexpected reply {type(reply).__name__}")
        if reply.engine_id != task.remote_engine_id:
            raise side_channel.SideChannelError(
                f"{task.remote_host}:{task.remote_port} is engine {reply.engine_id}, not "
                f"{task.remote_engine_id} named in kv_transfer_params"
            )
        diffs = compat_differences(self.compat, reply.compat)
        if diffs:
            raise side_channel.SideChannelError("incompatible prefill engine: " + "; ".join(diffs))
        return reply, time.monotonic() - started

    def claim(self, task: RecvTask) -> tuple[Granted, float]:
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
                request_id=task.remote_request_id,
                replay_offset=task.replay_offset,
                block_ids=task.remote_block_ids or [],
                wait_ms=max(0, int(wait_s * 1000)),
            )
            reply = self._call(task, claim)
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

    def release(self, task: ReleaseTask) -> None:
        try:
            self._call(task, Release(request_ids=[task.remote_request_id]))
        except side_channel.SideChannelError as exc:
            # P frees the blocks at lease expiry anyway.
            logger.info("pd_connector: release of %s not delivered: %s", task.remote_request_id, exc)

    def extend(self, task: ExtendTask) -> None:
        try:
            self._call(task, Extend(request_ids=task.remote_request_ids))
        except side_channel.SideChannelError as exc:
            logger.info("pd_connector: lease extension not delivered to %s:%d: %s", task.remote_host, task.remote_port, exc)

    def close(self) -> None:
        self._client.close()
