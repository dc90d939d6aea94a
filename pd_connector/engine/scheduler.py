"""Scheduler-side half of PDConnector (runs in vLLM's EngineCore process).

Translates vLLM ``Request`` / block tables into plain values, asks the pure core
(``handoff``, ``pairing``) what to do, and hands the worker a ``PDMetadata`` each step.

P (``do_remote_decode``): engine/prefill_half.py chooses and fingerprints R, truncates the
prompt, and leases the blocks at finish.

D (``do_remote_prefill``): ``on_new_request`` validates P's offset and the prompt fingerprint
once (logging and counting a refusal once, releasing P with the reason);
``get_num_new_matched_tokens`` reports ``R - local_hit``; after allocation the pairing maps P's
blocks onto D's and the worker reads them, with the prompt checkpoints below R that D places
(engine/checkpoint_pool.py); the keep-alive clock extends P's leases meanwhile.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from pd_connector.core import handoff, pairing
from pd_connector.core.config import ConnectorSettings
from pd_connector.core.leases import extension_interval
from pd_connector.core.params import PrefillRef, release_target
from pd_connector.core.prompt_digest import TOKENS, form_of
from pd_connector.engine import identity
from pd_connector.core import ranks
from pd_connector.engine.checkpoint_pool import CheckpointPool, checkpoint_rule_from_vllm
from pd_connector.engine.compat import dp_placement, layouts_from_kv_cache_config, profile_from_vllm
from pd_connector.engine.faults import Faults
from pd_connector.engine.metadata import ExtendTask, PDMetadata, ReleaseTask, RecvTask, extend_tasks
from pd_connector.engine.metrics import Recorder
from pd_connector.engine.prefill_half import PrefillHalf

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")


def _vllm_block_ids(blocks: "Sequence[KVCacheBlock]") -> list[int]:
    """Ids of a run of one group of vLLM's ``KVCacheBlocks.blocks``: what
    ``KVCacheBlocks.get_block_ids`` (vllm/v1/core/kv_cache_manager.py) does for every block of
    every group. A list comprehension: faster than map(attrgetter) on 3.11's specialised slot
    access, also inside the scheduling step (pd_connector.dev.benchmarks.scheduler)."""
    return [block.block_id for block in blocks]


class Admitted(msgspec.Struct):
    """A handoff D admitted this step, paired at the step's end (``_pair_admitted``)."""

    request_id: str
    decision: handoff.Accepted
    tables: Any  # D's KVCacheBlock lists per transfer group
    num_external_tokens: int
    num_prompt_tokens: int
    corrupt_state: bool
    request: Any = None  # D registers the checkpoints it reads under this request's hashes


class SchedulerHalf:
    def __init__(self, vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings):
        self.settings = settings
        self.engine_id = vllm_config.kv_transfer_config.engine_id
        self.profile = profile_from_vllm(vllm_config, kv_cache_config)
        self.group_ids = tuple(kv_cache_config.transfer_group_ids)
        self._all_groups_transfer = self.group_ids == tuple(range(len(kv_cache_config.kv_cache_groups)))
        self.layouts = layouts_from_kv_cache_config(kv_cache_config, self.group_ids)
        self.recorder = Recorder()
        self._faults = Faults()
        rule = checkpoint_rule_from_vllm(vllm_config, kv_cache_config, self.profile, self.layouts, self.group_ids)
        self._checkpoints = CheckpointPool(self.layouts, self.group_ids, rule, self.recorder, vllm_config.cache_config)
        # This engine's TP size: P sends it in kv_transfer_params; D logs and counts the pair.
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size or 1)
        # This engine's DP rank (vLLM's engine id already ends in _dp<rank> under DP).
        self.dp_index, _ = dp_placement(vllm_config)
        # D: validated handoffs waiting for admission.
        self._decisions: dict[str, handoff.Accepted] = {}
        # D: handoffs handed to the worker and not yet reported loaded, by D request.
        self._loading: dict[str, PrefillRef] = {}
        # P's decisions (prepare, finish), and its leases for this step.
        self._prefill = PrefillHalf(
            settings,
            self.engine_id,
            self.profile,
            self.layouts,
            self.group_ids,
            self._tp_size,
            self.recorder,
            identity.fingerprint_form(vllm_config, kv_cache_config),
            side_channel_port=ranks.engine_base_port(settings.side_channel_port, self.dp_index, self._tp_size),
            checkpoint_pool=self._checkpoints,
        )
        # Per-step outboxes, drained by build_connector_meta.
        self._to_recv: dict[str, RecvTask] = {}
        self._to_release: list[ReleaseTask] = []
        # D: handoffs admitted this step, paired in one pass at its end (build_connector_meta).
        self._to_pair: list[Admitted] = []
        self._last_extend = time.monotonic()
        # D: the shortest lease a P said it keeps a queued handoff (pd_lease_seconds), so the
        # extensions of queued handoffs come every third of what P grants, not of our own.
        self._shortest_p_lease = settings.lease_seconds
        # D: prefill engines a handoff was accepted from (one INFO line each).
        self._peers_seen: set[str] = set()
        logger.info(
            "pd_connector scheduler: engine %s (DP rank %d), groups %s, min recompute %d token(s), "
            "prefix-cache checkpoint unit %d (%s)",
            self.engine_id,
            self.dp_index,
            [layout.kind for layout in self.layouts],
            handoff.min_recompute_tokens(self.profile),
            self.profile.replay_grid,
            rule,
        )

    @property
    def stats(self):
        """Cumulative event counts (see metrics.py for the labels)."""
        return self.recorder.totals

    # -- shared ----------------------------------------------------------------------------

    def on_new_request(self, request: "Request") -> None:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return
        if params.get("do_remote_decode"):
            self._prefill.prepare(request, params)
        elif params.get("do_remote_prefill"):
            if getattr(request, "abort_immediately", False):
                self._release_rejected(request, params)
            else:
                self._validate_handoff(request, params)

    def bind_block_pool(self, pool: Any) -> None:
        self._checkpoints.bind(pool)

    def build_connector_meta(self, block_state: Any = None) -> PDMetadata:
        self._checkpoints.take_offers(block_state)
        if self._to_pair:
            self._pair_admitted()
        meta = PDMetadata(
            to_send=self._prefill.take_leases(),
            to_recv=self._to_recv,
            to_release=self._to_release,
            to_extend=self._due_extensions(),
        )
        self._to_recv, self._to_release = {}, []
        return meta

    def _due_extensions(self) -> list[ExtendTask]:
        """D's one keep-alive clock: every ``leases.extension_interval`` of the shortest lease a
        P said it keeps a handoff (``pd_lease_seconds``; this instance's lease_seconds for a P
        that does not say), every handoff D still depends on, per P: from acceptance, through
        admission, claim and READ, until the worker reports the load ended. A READ that
        outlived the lease would copy blocks P has freed and reused (a stalled READ cannot be
        cancelled); P grants a claim at least that long, so the same cadence covers it."""
        now = time.monotonic()
        if not (self._decisions or self._loading) or now - self._last_extend < extension_interval(
            self._shortest_p_lease
        ):
            return []
        self._last_extend = now
        refs = [d.params.prefill for d in self._decisions.values()]
        refs.extend(self._loading.values())
        return extend_tasks(refs)

    def update_connector_output(
        self, finished_recving: "Iterable[str]", finished_sending: "Iterable[str]" = (), failed: "Iterable[str]" = ()
    ) -> None:
        """The loads every D rank ended (read, or failed and to be recomputed): nothing to keep
        alive for them any more, and the checkpoints read are registered. The leases every P
        rank ended: their pinned checkpoints are freed."""
        for request_id in finished_recving:
            self._loading.pop(request_id, None)
        self._checkpoints.settle(finished_recving, failed)
        self._checkpoints.release(finished_sending)

    def request_finished(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if not isinstance(params, dict):
            return False, None
        pending = self._decisions.pop(request.request_id, None)
        if pending is not None:
            # D finished (aborted) before admission: P still holds the blocks for us.
            self._release(request.request_id, pending, "decode request finished before its KV was loaded")
        if not params.get("do_remote_decode"):
            return False, None
        return self._prefill.finish(request, block_ids)

    # -- P ---------------------------------------------------------------------------------

    # -- D ---------------------------------------------------------------------------------

    def _validate_handoff(self, request: "Request", params: dict[str, Any]) -> None:
        check_prompt = not self._faults.skips_prompt_check(params)
        decision = handoff.decide_on_decode(
            params,
            request.num_prompt_tokens,
            self.profile,
            num_groups=len(self.layouts),
            prompt_digest=(lambda length, theirs: self._fingerprint(request, length, theirs)) if check_prompt else None,
        )
        if isinstance(decision, handoff.Refused):
            self.recorder.count(f"refused:{decision.kind}")
            logger.warning(
                "pd_connector: request %s: refusing the handoff (%s): %s",
                request.request_id,
                decision.kind,
                decision.reason,
            )
            target = decision.params.prefill if decision.params is not None else release_target(params)
            if target is not None:
                self._queue_release(target, f"refused ({decision.kind}): {decision.reason}", request.request_id)
            return
        if not check_prompt:
            logger.warning("pd_connector: FAULT INJECTION: %s skips the prompt fingerprint check", request.request_id)
        if decision.offset == 0:
            self.recorder.count("handoff_empty")
            return
        lease = decision.params.pd_lease_seconds
        if lease is not None and lease < self._shortest_p_lease:
            self._shortest_p_lease = lease
        shift = self._faults.resume_shift(params)
        if shift and 0 < decision.offset + shift < request.num_prompt_tokens:
            logger.warning("pd_connector: FAULT INJECTION: %s resumes %+d tokens off", request.request_id, shift)
            decision = handoff.Accepted(offset=decision.offset + shift, params=decision.params)
        placed = self._checkpoints.placeable(
            params, request.num_prompt_tokens, decision.offset, self._faults.withholds_checkpoints(params)
        )
        if placed:
            decision = msgspec.structs.replace(decision, checkpoints=placed)
        self._decisions[request.request_id] = decision

    def _fingerprint(self, request: "Request", length: int, theirs: str) -> str | None:
        """This instance's fingerprint of the request's first ``length`` tokens in the form P
        used (``theirs``): our own block-hash form, another hash block size of it (rehashed),
        or every token folded; None for a form we cannot compute (another hash algorithm or
        seed)."""
        form = form_of(theirs)
        if form == TOKENS:
            return identity.prompt_fingerprint(request, length)
        mine = self._prefill.fingerprint_form
        if form == mine[0]:
            return identity.prompt_fingerprint(request, length, *mine)
        return identity.prompt_fingerprint_rehashed(request, length, form, mine[0])

    def _release_rejected(self, request: "Request", params: dict[str, Any]) -> None:
        """vLLM's notice that D's serving layer rejected a request before it reached the engine
        (a validation error, a client gone during tokenization): ``notify_kv_transfer_request_
        rejected`` in vllm/v1/engine/async_llm.py submits a pre-aborted stand-in (prompt
        ``[0]``, ``abort_immediately``, the original kv_transfer_params) so the connector frees
        what P holds. Release P's lease now (not at expiry), and count it as what it is, not as
        a refused offset (the 1-token stand-in would otherwise fail validation as
        ``offset_out_of_range``)."""
        target = release_target(params)
        self.recorder.count("rejected_before_engine")
        logger.info(
            "pd_connector: request %s was rejected before reaching the engine; %s",
            request.request_id,
            f"releasing {target.request_id} on P" if target else "no prefill lease to release",
        )
        if target is not None:
            self._queue_release(target, "rejected before reaching the engine")

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        self._prefill.keep_prompt_checkpoint(request)
        decision = self._decisions.get(request.request_id)
        if decision is None or decision.offset <= num_computed_tokens:
            return 0, False
        return decision.offset - num_computed_tokens, True

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        decision = self._decisions.pop(request.request_id, None)
        if decision is None:
            return
        if num_external_tokens <= 0:
            # A local prefix hit (or the scheduler) covered everything P offered.
            self._release(request.request_id, decision, "the local prefix cache covered the handoff")
            return
        # KVCacheBlocks.blocks holds the request's KVCacheBlock list per group (the manager's
        # own lists); pairing turns into ids only the blocks it pairs (get_block_ids() would
        # convert every block of every group, Mamba tables included).
        tables = blocks.blocks
        if not self._all_groups_transfer:
            tables = tuple(tables[g] for g in self.group_ids)
        corrupt = self._faults.corrupts_state(request.kv_transfer_params)
        self._to_pair.append(
            Admitted(request.request_id, decision, tables, num_external_tokens, request.num_prompt_tokens, corrupt, request)
        )

    def _pair_admitted(self) -> None:
        """Pair this step's admitted handoffs and hand them to the worker, in one pass.

        Deferred from ``update_state_after_alloc`` to the end of the same ``Scheduler.schedule``
        call (vllm/v1/core/sched/scheduler.py calls ``build_connector_meta`` last): vLLM's
        admission loop runs between our calls, so pairing there ran cold, ~20 µs a request
        against ~5 µs in one pass (pd_connector.dev.benchmarks.scheduler). Safe because a request
        waiting for remote KVs keeps the blocks it was just given until the worker reports the
        load: schedule() preempts only running requests, and request_finished is never called
        inside schedule().
        """
        tails = []
        tp_pairs: dict[str, int] = {}
        for admitted in self._to_pair:
            request_id, decision = admitted.request_id, admitted.decision
            num_external_tokens = admitted.num_external_tokens
            params = decision.params
            try:
                pairs = pairing.pair_block_lists(
                    self.layouts,
                    params.remote_block_ids,
                    admitted.tables,
                    decision.offset,
                    decision.offset - num_external_tokens,  # D's own (block-aligned) prefix hit
                    block_ids=_vllm_block_ids,
                    # HandoffParams.remote_block_ids are params.BlockId: msgspec range-checked
                    # every id when on_new_request decoded them.
                    remote_checked=True,
                )
            except pairing.PairingError as exc:
                # The load is already admitted; the worker reports it failed and vLLM's
                # "recompute" policy (set by PDConnector) re-prefills the prompt locally.
                logger.warning("pd_connector: request %s: cannot pair blocks: %s", request_id, exc)
                self.recorder.count("refused:pairing")
                pairs = None
            claimed, extra = self._checkpoints.reserve(admitted.request, decision.checkpoints) if pairs else ([], None)
            self._loading[request_id] = params.prefill
            self._to_recv[request_id] = RecvTask(
                prefill=params.prefill,
                pairs=pairs,
                num_tokens=num_external_tokens,
                replay_offset=params.replay_offset,
                remote_block_ids=params.remote_block_ids,
                corrupt_state=admitted.corrupt_state,
                prompt_digest=params.pd_prompt_digest,
                checkpoints=claimed,
                checkpoint_pairs=extra,
            )
            recompute = admitted.num_prompt_tokens - decision.offset
            tails.append(recompute)
            pair = f"{params.tp_size}->{self._tp_size}"
            tp_pairs[pair] = tp_pairs.get(pair, 0) + 1
            # Per request at DEBUG only: formatting an INFO record on every handoff was the
            # largest cost of this path (pd_connector.dev.benchmarks.scheduler). The figures are in
            # the vllm:pd_recompute_tokens histogram and vllm:pd_events_total; operators get one
            # INFO line per prefill engine, on its first handoff.
            first = params.remote_engine_id not in self._peers_seen
            if first or logger.isEnabledFor(logging.DEBUG):
                self._peers_seen.add(params.remote_engine_id)
                logger.log(
                    logging.INFO if first else logging.DEBUG,
                    "pd_connector: request %s: loading %d token(s) from %s (TP %s), replay_offset=%d, "
                    "recomputing %d token(s)%s",
                    request_id,
                    num_external_tokens,
                    params.remote_engine_id,
                    pair,
                    decision.offset,
                    recompute,
                    " (first handoff from this prefill engine; the next ones are logged at DEBUG)"
                    if first
                    else "",
                )
        self._to_pair = []
        self.recorder.count("handoff_accepted", len(tails))
        for pair, count in tp_pairs.items():
            self.recorder.count(f"handoff_tp:{pair}", count)
        self.recorder.observe_all("recompute_tokens", tails)

    def _release(self, request_id: str, decision: handoff.Accepted, why: str) -> None:
        logger.info("pd_connector: releasing %s on P: %s", decision.params.remote_request_id, why)
        self._queue_release(decision.params.prefill, why, request_id)

    def _queue_release(self, prefill: PrefillRef, why: str, request_id: str = "") -> None:
        """Tell P that D request ``request_id`` will not read ``prefill`` ("" : no D request
        will), with the reason P logs."""
        self._to_release.append(ReleaseTask(prefill, why, request_id))
