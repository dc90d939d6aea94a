"""D's half of the scheduler side (in vLLM's EngineCore process): what D accepts and reads.

``accept`` (on_new_request) validates P's offset and the prompt fingerprint once, logging and
counting a refusal once and releasing P with the reason; ``num_tokens_to_load``
(get_num_new_matched_tokens) reports ``R - local_hit``; ``admit`` (update_state_after_alloc)
queues the request, and ``pair_admitted`` (the step's end) maps P's blocks onto D's for the
worker, with the prompt checkpoints below R that D places (engine/checkpoint_pool.py).
``due_extensions`` is D's one keep-alive clock for P's leases meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pd_connector.core import handoff, pairing, trust
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.leases import extension_interval
from pd_connector.core.pairing import GroupLayout
from pd_connector.core.params import LeaseRef
from pd_connector.core.recompute_profile import RecomputeProfile
from pd_connector.engine.checkpoint_pool import CheckpointPool
from pd_connector.engine.from_vllm import identity
from pd_connector.engine.metadata import ExtendTask, ReleaseTask, RecvTask, extend_tasks
from pd_connector.engine.metrics import Recorder

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")


def _vllm_block_ids(blocks: "Sequence[KVCacheBlock]") -> list[int]:
    """Ids of a run of one group of vLLM's ``KVCacheBlocks.blocks``: what
    ``KVCacheBlocks.get_block_ids`` (vllm/v1/core/kv_cache_manager.py) does for every block of
    every group (a list comprehension: the fastest form on 3.11, docs/benchmarks.md)."""
    return [block.block_id for block in blocks]


def _prompt_token_at(request: "Request"):
    """D's prompt token i (zero replay checks P's first token there); None without token ids."""
    tokens = request.prompt_token_ids
    if tokens is None:
        return None
    return lambda i: tokens[i] if 0 <= i < len(tokens) else -1


class Admitted(msgspec.Struct):
    """A handoff D admitted this step, paired at the step's end (``pair_admitted``)."""

    request_id: str
    decision: handoff.Accepted
    tables: Any  # D's KVCacheBlock lists per transfer group
    num_external_tokens: int
    num_prompt_tokens: int
    request: Any = None  # D registers the checkpoints it reads under this request's hashes


class DecodeScheduler:
    def __init__(
        self,
        settings: ConnectorSettings,
        profile: RecomputeProfile,
        layouts: tuple[GroupLayout, ...],
        group_ids: tuple[int, ...],
        all_groups_transfer: bool,
        tp_size: int,
        recorder: Recorder,
        fingerprint_form: tuple[str, int],
        checkpoint_pool: CheckpointPool | None = None,
        trust_in: trust.Trust = trust.Trust(),
    ):
        self.settings = settings
        # Whom D may act on and contact (core/trust.py); SchedulerSide passes the settings'.
        self.trust = trust_in
        self.profile = profile
        self.layouts = layouts
        self._wire_block_sizes = tuple(pairing.wire_block_sizes(layouts))
        self.group_ids = group_ids
        self._all_groups_transfer = all_groups_transfer
        self._tp_size = tp_size  # logged and counted per (P TP -> D TP) pair
        self.recorder = recorder
        self.fingerprint_form = fingerprint_form
        self._checkpoints = checkpoint_pool
        # Validated handoffs waiting for admission.
        self._decisions: dict[str, handoff.Accepted] = {}
        # Handoffs handed to the worker and not yet reported loaded, by D request.
        self._loading: dict[str, LeaseRef] = {}
        # Handoffs admitted this step, paired in one pass at its end.
        self._to_pair: list[Admitted] = []
        # Per-step outboxes, drained by take_tasks.
        self._to_recv: dict[str, RecvTask] = {}
        self._to_release: list[ReleaseTask] = []
        self._last_extend = time.monotonic()
        # The shortest lease a P said it keeps a queued handoff (pd_lease_seconds), so the
        # extensions of queued handoffs come every third of what P grants, not of our own.
        self._shortest_p_lease = settings.lease_seconds
        # Prefill engines a handoff was accepted from (one INFO line each).
        self._peers_seen: set[str] = set()

    def take_tasks(self) -> tuple[dict[str, RecvTask], list[ReleaseTask], list[ExtendTask]]:
        """This step's work for the worker: reads, releases, extensions."""
        if self._to_pair:
            self.pair_admitted()
        out = self._to_recv, self._to_release, self.due_extensions()
        self._to_recv, self._to_release = {}, []
        return out

    # -- arrival ------------------------------------------------------------------------------

    def accept(self, request: "Request", params: dict[str, Any]) -> None:
        """Validate P's handoff once; a refusal is logged, counted and released to P."""
        if getattr(request, "abort_immediately", False):
            self._release_rejected(request, params)
            return
        decision = handoff.decide_on_decode(
            params,
            request.num_prompt_tokens,
            self.profile,
            num_groups=len(self.layouts),
            trust_in=self.trust,
            now=time.time(),
            prompt_token_at=_prompt_token_at(request),
            prompt_fingerprint=self.prompt_fingerprint_check(request, params),
        )
        if isinstance(decision, handoff.Refused):
            self.recorder.count(f"refused:{decision.kind}")
            logger.warning(
                "pd_connector: request %s: refusing the handoff (%s): %s",
                request.request_id,
                decision.kind,
                decision.reason,
            )
            if decision.release is not None:
                self._queue_release(decision.release, f"refused ({decision.kind}): {decision.reason}", request.request_id)
            return
        if decision.replay_offset == 0:
            self.recorder.count("handoff_empty")
            return
        lease = decision.params.pd_lease_seconds
        if lease is not None and lease < self._shortest_p_lease:
            self._shortest_p_lease = lease
        decision = self.resume_decision(request, params, decision)
        if self._checkpoints is not None:
            withheld = not self.places_checkpoints(request, params)
            placed = self._checkpoints.placeable(params, decision, request.num_prompt_tokens, withheld)
            if placed:
                decision = msgspec.structs.replace(decision, checkpoints=placed)
        self._decisions[request.request_id] = decision

    # Per-request seams: each returns the rule above as is; a connector subclass may override
    # them (the class SchedulerSide builds: ``decode_scheduler_class``).

    def prompt_fingerprint_check(self, request: "Request", params: dict[str, Any]):
        """How ``decide_on_decode`` checks P's prompt fingerprint against ``request``'s own."""
        return lambda length, theirs: identity.fingerprint_to_check(request, length, theirs, self.fingerprint_form)

    def resume_decision(
        self, request: "Request", params: dict[str, Any], decision: handoff.Accepted
    ) -> handoff.Accepted:
        """The accepted handoff D loads for ``request``: P's offset, as decided."""
        return decision

    def places_checkpoints(self, request: "Request", params: dict[str, Any]) -> bool:
        """Whether D places P's prompt checkpoints below the offset (else each is counted
        ``checkpoint_refused:withheld`` and the rest loads)."""
        return True

    def _release_rejected(self, request: "Request", params: dict[str, Any]) -> None:
        """vLLM's notice that D's serving layer rejected a request before it reached the engine
        (``notify_kv_transfer_request_rejected``, vllm/v1/engine/async_llm.py: a pre-aborted
        stand-in with prompt ``[0]`` and the original params). Release P's lease now, counted
        as what it is, not as a refused offset."""
        target = handoff.trusted_release_target(params, self.trust, time.time())
        self.recorder.count("rejected_before_engine")
        logger.info(
            "pd_connector: request %s was rejected before reaching the engine; %s",
            request.request_id,
            f"releasing {target.request_id} on P" if target else "no prefill lease to release",
        )
        if target is not None:
            self._queue_release(target, "rejected before reaching the engine")

    # -- admission ----------------------------------------------------------------------------

    def num_tokens_to_load(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        decision = self._decisions.get(request.request_id)
        if decision is None or decision.replay_offset <= num_computed_tokens:
            return 0, False
        return decision.replay_offset - num_computed_tokens, True

    def admit(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        decision = self._decisions.pop(request.request_id, None)
        if decision is None:
            return
        if num_external_tokens <= 0:
            # A local prefix hit (or the scheduler) covered everything P offered.
            self._release(request.request_id, decision, "the local prefix cache covered the handoff")
            return
        # KVCacheBlocks.blocks holds the request's KVCacheBlock list per group (the manager's
        # own lists); pairing turns into ids only the blocks it pairs.
        tables = blocks.blocks
        if not self._all_groups_transfer:
            tables = tuple(tables[g] for g in self.group_ids)
        self._to_pair.append(
            Admitted(request.request_id, decision, tables, num_external_tokens, request.num_prompt_tokens, request)
        )

    def pair_admitted(self) -> None:
        """Pair this step's admitted handoffs and hand them to the worker, in one pass.

        Deferred from ``admit`` to the end of the same ``Scheduler.schedule`` call (vLLM calls
        ``build_connector_meta`` last), where one pass runs warm (docs/benchmarks.md). Safe
        because a request waiting for remote KVs keeps the blocks it was just given until the
        worker reports the load: schedule() preempts only running requests, and
        request_finished is never called inside schedule().
        """
        tails = []
        tp_pairs: dict[str, int] = {}
        for admitted in self._to_pair:
            self._to_recv[admitted.request_id] = self.recv_task(admitted)
            params = admitted.decision.params
            recompute = admitted.num_prompt_tokens - admitted.decision.replay_offset
            tails.append(recompute)
            pair = f"{params.tp_size}->{self._tp_size}"
            tp_pairs[pair] = tp_pairs.get(pair, 0) + 1
            self._log_first_handoff(admitted, pair, recompute)
        self._to_pair = []
        self.recorder.count("handoff_accepted", len(tails))
        for pair, count in tp_pairs.items():
            self.recorder.count(f"handoff_tp:{pair}", count)
        self.recorder.observe_all("recompute_tokens", tails)

    def recv_task(self, admitted: Admitted) -> RecvTask:
        """The worker's task for one admitted handoff (a connector subclass may mark it)."""
        request_id, decision = admitted.request_id, admitted.decision
        params = decision.params
        try:
            pairs = pairing.pair_block_lists(
                self.layouts,
                params.remote_block_ids,
                admitted.tables,
                decision.replay_offset,
                decision.replay_offset - admitted.num_external_tokens,  # D's own (block-aligned) prefix hit
                block_ids=_vllm_block_ids,
                # HandoffParams.remote_block_ids are params.BlockId: range-checked when decoded.
                remote_checked=True,
                remote_block_sizes=params.pd_block_sizes,
            )
        except pairing.PairingError as exc:
            # The load is already admitted; the worker reports it failed and vLLM's "recompute"
            # policy (set by PDConnector) re-prefills the prompt locally.
            logger.warning("pd_connector: request %s: cannot pair blocks: %s", request_id, exc)
            self.recorder.count("refused:pairing")
            pairs = None
        claimed, extra = [], None
        if pairs is not None and decision.checkpoints and self._checkpoints is not None:
            claimed, extra = self._checkpoints.reserve(admitted.request, decision.checkpoints)
        self._loading[request_id] = params.lease
        return RecvTask(
            lease=params.lease,
            pairs=pairs,
            num_tokens=admitted.num_external_tokens,
            replay_offset=params.replay_offset,
            remote_block_ids=params.remote_block_ids,
            fingerprint=params.pd_prompt_fingerprint,
            checkpoints=claimed,
            checkpoint_pairs=extra,
            remote_block_sizes=self._wire_block_sizes if params.pd_block_sizes is None else tuple(params.pd_block_sizes),
        )

    def _log_first_handoff(self, admitted: Admitted, pair: str, recompute: int) -> None:
        """One INFO line per prefill engine, on its first handoff; DEBUG after (formatting a
        record per handoff was this path's largest cost; the figures are in the metrics)."""
        params = admitted.decision.params
        first = params.remote_engine_id not in self._peers_seen
        if not (first or logger.isEnabledFor(logging.DEBUG)):
            return
        self._peers_seen.add(params.remote_engine_id)
        logger.log(
            logging.INFO if first else logging.DEBUG,
            "pd_connector: request %s: loading %d token(s) from %s (TP %s), replay_offset=%d, "
            "recomputing %d token(s)%s",
            admitted.request_id,
            admitted.num_external_tokens,
            params.remote_engine_id,
            pair,
            admitted.decision.replay_offset,
            recompute,
            " (first handoff from this prefill engine; the next ones are logged at DEBUG)" if first else "",
        )

    # -- while loading ------------------------------------------------------------------------

    def due_extensions(self) -> list[ExtendTask]:
        """D's one keep-alive clock: every ``leases.extension_interval`` of the shortest lease a
        P said it keeps a handoff, every handoff D still depends on, per P: from acceptance
        until the worker reports the load ended (a stalled READ cannot be cancelled, so it must
        never outlive P's lease)."""
        now = time.monotonic()
        if not (self._decisions or self._loading) or now - self._last_extend < extension_interval(
            self._shortest_p_lease
        ):
            return []
        self._last_extend = now
        refs = [d.params.lease for d in self._decisions.values()]
        refs.extend(self._loading.values())
        return extend_tasks(refs)

    def loads_ended(self, finished_recving: "Iterable[str]") -> None:
        """The loads every D rank ended (read, or failed and to be recomputed)."""
        for request_id in finished_recving:
            self._loading.pop(request_id, None)

    def finished(self, request: "Request") -> None:
        """D finished (aborted) before admission: P still holds the blocks for us."""
        pending = self._decisions.pop(request.request_id, None)
        if pending is not None:
            self._release(request.request_id, pending, "decode request finished before its KV was loaded")

    def _release(self, request_id: str, decision: handoff.Accepted, why: str) -> None:
        logger.info("pd_connector: releasing %s on P: %s", decision.params.remote_request_id, why)
        self._queue_release(decision.params.lease, why, request_id)

    def _queue_release(self, lease: LeaseRef, why: str, request_id: str = "") -> None:
        """Tell P that D request ``request_id`` will not read ``lease`` ("": no D request
        will), with the reason P logs."""
        self._to_release.append(ReleaseTask(lease, why, request_id))
