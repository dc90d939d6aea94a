"""P's half of the scheduler side (in vLLM's EngineCore process): what P hands over.

``prepare`` (on_new_request) chooses the replay offset R and what P computes: the whole prompt
as aggregated serving does where a prefix of it can be handed over (``HandoffPlan.whole_prompt``),
else the prompt truncated to exactly R tokens *before* any prefix lookup (vLLM's NIXL truncated
later and tripped ``assert num_new_tokens > 0``, vllm#53514), idempotently under preemption; it
fingerprints the R tokens (core/fingerprint.py). ``finish`` (request_finished) leases the blocks
carrying [0, R) and the state at R (a hybrid's checkpoint there when P computed past R) for the
claim deadline, with the prompt checkpoints below R that it pinned (engine/checkpoint_pool.py),
and returns them in ``kv_transfer_params``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from pd_connector.core import checkpoints, handoff, pairing, trust
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.leases import initial_lease
from pd_connector.core.pairing import GroupLayout
from pd_connector.core.recompute_profile import RecomputeProfile
from pd_connector.core.params import (
    KEY_DECODE_REQUESTS,
    KEY_MIN_RECOMPUTE,
    KEY_RESUME,
    RESUME_FIRST_TOKEN,
    RESUME_MODES,
    encode_handoff_params,
)
from pd_connector.engine.checkpoint_pool import CheckpointPool
from pd_connector.engine.from_vllm import identity
from pd_connector.engine.metadata import SendLease
from pd_connector.engine.metrics import Recorder

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")

_FINISHED_OK = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


class _Chosen(NamedTuple):
    """What was decided for a request when it arrived (kept here, not in the request's
    kv_transfer_params, which the client controls)."""

    replay_offset: int
    fingerprint: str = ""
    decode_requests: int = 1
    # The shared-prefix junction P pins: the whole prompt's checkpoint, kept past the truncation
    # (checkpoints.checkpoint_to_keep), or a checkpoint below R for D (checkpoints.checkpoint_to_pin).
    keep: int = 0
    # Zero replay: P computed the whole prompt, and its first sampled token goes with the handoff.
    first_token: bool = False
    # The prompt tokens P computes: the offset, or the whole prompt (HandoffPlan.whole_prompt).
    computes: int = 0


_NOTHING = _Chosen(0)


class PrefillScheduler:
    def __init__(
        self,
        settings: ConnectorSettings,
        engine_id: str,
        profile: RecomputeProfile,
        layouts: tuple[GroupLayout, ...],
        group_ids: tuple[int, ...],
        tp_size: int,
        recorder: Recorder,
        fingerprint_form: tuple[str, int] = (identity.TOKENS, 0),
        side_channel_port: int | None = None,
        checkpoint_pool: CheckpointPool | None = None,
    ):
        self.settings = settings
        self.engine_id = engine_id
        # The port the params name: this DP rank's TP rank 0 (core/ranks.py).
        self._port = settings.side_channel_port if side_channel_port is None else side_channel_port
        self.profile = profile
        self.layouts = layouts
        self._block_sizes = pairing.wire_block_sizes(layouts)
        self.group_ids = group_ids
        self._tp_size = tp_size  # in the params: D reads each rank's shard
        self.recorder = recorder
        self.fingerprint_form = fingerprint_form
        self.checkpoints = checkpoint_pool or CheckpointPool(layouts, group_ids, checkpoints.CheckpointRule(), recorder)
        self.offsets: dict[str, _Chosen] = {}
        # Leases granted this step, drained by the scheduler's build_connector_meta.
        self.to_send: dict[str, SendLease] = {}
        # Handoffs of n > 1 siblings (one client request, vLLM's children "i_<parent>") by
        # (parent, fingerprint), until their initial lease runs out: the first sibling's lease
        # serves them all (vLLM returns one child's params for the whole request).
        self._sibling_params: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
        # P children sharing each lease still in to_send (the first included).
        self._children: dict[str, int] = {}
        # How long P keeps a handoff before D claims or extends it (P returns it in the params).
        self._initial_lease = initial_lease(settings.claim_deadline_seconds, settings.lease_seconds)
        # Seals every handoff P issues when P and D share a secret (core/trust.py).
        self._seal_key = trust.seal_key(settings.secret)

    def take_leases(self) -> dict[str, SendLease]:
        leases, self.to_send = self.to_send, {}
        self._children.clear()
        return leases

    def prepare(self, request: "Request", params: dict[str, Any]) -> None:
        """Choose R and what P computes (before any prefix lookup, idempotently under
        preemption); fingerprint the R tokens."""
        if request.request_id in self.offsets:
            return  # already truncated (preempted and re-added)
        requested = self._router_hint(
            request, params, KEY_MIN_RECOMPUTE, handoff.requested_min_recompute, 0, "a non-negative integer",
            "bad_min_recompute",
        )
        decode_requests = self._router_hint(
            request, params, KEY_DECODE_REQUESTS, handoff.requested_decode_requests, 1,
            f"an integer from 1 to {handoff.MAX_DECODE_REQUESTS}", "bad_decode_requests",
        )
        resume = params.get(KEY_RESUME)
        if resume is not None and resume not in RESUME_MODES:
            logger.warning("pd_connector: request %s: ignoring %s=%r (expected one of %s)", request.request_id,
                           KEY_RESUME, resume, ", ".join(RESUME_MODES))
            self.recorder.count("bad_resume")
        plan = handoff.HandoffPlan(0)
        # Prompt-logprob requests skip prefix reads on D as well, and prompt embeddings have no
        # fingerprint D could check (prompt_extra_keys): nothing to hand over.
        if (
            request.prompt_token_ids is not None
            and getattr(request, "prompt_embeds", None) is None
            and not request.get_skip_reading_prefix_cache()
        ):
            plan = handoff.plan_handoff(
                request.num_prompt_tokens,
                self.profile,
                requested,
                self.settings.min_recompute_tokens,
                self.settings.max_checkpoint_recompute,
                first_token=resume == RESUME_FIRST_TOKEN,
                whole_prompt_states=checkpoints.whole_prompt_states(request.num_prompt_tokens, self.checkpoints.rule, self.layouts),
            )
        offset = plan.replay_offset
        fingerprint = ""
        if offset > 0:
            # None (a multimodal item's data is not in this engine): nothing D could check.
            fingerprint = identity.fingerprint_to_offer(request, offset, self.fingerprint_form)
            if fingerprint is None:
                self.recorder.count("p_no_fingerprint")
                offset, plan, fingerprint = 0, handoff.HandoffPlan(0), ""
        keep, computes = self._prefill(request, plan) if offset > 0 else (0, 0)
        self.offsets[request.request_id] = _Chosen(offset, fingerprint, decode_requests, keep, plan.first_token, computes)
        # P samples one token: the router throws it away (replay) or carries it to D (zero replay).
        request.max_tokens = 1

    def _prefill(self, request: "Request", plan: handoff.HandoffPlan) -> tuple[int, int]:
        """Set up P's prefill for handing over ``plan.replay_offset`` tokens: the checkpoints to pin and the
        junction to keep; truncate the prompt unless the plan computes it whole. Returns (the
        junction, the prompt tokens P computes)."""
        n = request.num_prompt_tokens
        prefill = checkpoints.prefill_checkpoints(n, plan, self.profile, self.checkpoints.rule)
        computes = prefill.computes
        self.checkpoints.want(request.request_id, prefill.wanted)
        if prefill.missing:
            self.recorder.count("p_checkpoint_not_computed", len(prefill.missing))
        if computes < n:
            del request.prompt_token_ids[computes:]
            del request._all_token_ids[computes:]
            request.num_prompt_tokens = computes
        logger.debug("pd_connector: %s prefills %d of %d tokens, hands over %d", request.request_id, computes, n, plan.replay_offset)
        return prefill.junction, computes

    def keep_prompt_checkpoint(self, request: "Request") -> None:
        """Right after vLLM's local prefix lookup (get_num_new_matched_tokens): pin the whole
        prompt's checkpoint as the request's shared-prefix boundary, which the Mamba manager
        keeps besides the truncated prompt's own (``cache_blocks``, reachable boundaries), unless
        vLLM set a junction of its own there (``checkpoints.pinned_boundary``)."""
        chosen = self.offsets.get(request.request_id)
        if chosen is None or not chosen.keep:
            return
        boundary = checkpoints.pinned_boundary(request.shared_prefix_boundary, chosen.keep)
        if boundary is None:
            self.recorder.count("p_checkpoint_not_kept")
        else:
            request.shared_prefix_boundary = boundary

    def _router_hint(self, request, params, key, parse, default: int, expected: str, event: str) -> int:
        """A router's optional hint, parsed by the core; a malformed one is logged, counted
        and replaced by ``default``."""
        raw = params.get(key)
        value = parse(raw)
        if value is None:
            logger.warning("pd_connector: request %s: ignoring %s=%r (expected %s)", request.request_id, key, raw, expected)
            self.recorder.count(event)
            return default
        return value

    def finish(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """At request_finished: lease the blocks carrying [0, R) and the state at R (True: vLLM
        keeps them until finished_sending) and return the params for D."""
        chosen = self.offsets.pop(request.request_id, _NOTHING)
        if request.status.name not in _FINISHED_OK:
            self.checkpoints.drop(request.request_id)
            return False, None  # aborted or errored: nothing to hand over
        first_token = self._first_token(request) if chosen.first_token else None
        if chosen.first_token and first_token is None:
            self.checkpoints.drop(request.request_id)
            return False, self._returned_params(request, 0, [], "")
        offset, source = self._source_blocks(request, chosen, block_ids)
        now = time.monotonic()
        if offset:
            shared = self._shared_sibling_params(request.request_id, chosen.fingerprint, now)
            if shared is not None:
                # This sibling's blocks are freed now; D reads its sibling's identical ones.
                self.checkpoints.drop(request.request_id)
                self.recorder.count("handoff_shared")
                self._count_sibling_reader(shared["remote_request_id"])
                return False, shared
        if not offset:
            self.checkpoints.drop(request.request_id)
            return False, self._returned_params(request, offset, source, "")
        resumed = self._hand_over_states(request, offset, chosen.computes, source)
        if resumed is None:
            return False, self._returned_params(request, 0, [], "")
        source, states = resumed
        out = self._returned_params(request, offset, source, chosen.fingerprint, states, first_token)
        self.to_send[request.request_id] = SendLease(
            deadline=now + self._initial_lease,
            replay_offset=offset,
            block_ids=source,
            fingerprint=chosen.fingerprint,
            requests=chosen.decode_requests,
            checkpoints=states,
        )
        parent = identity.sibling_group(request.request_id)
        if parent is not None:
            self._sibling_params[(parent, chosen.fingerprint)] = (now + self._initial_lease, out)
        self.recorder.count("handoff_offered")
        return True, out

    def _source_blocks(self, request: "Request", chosen: _Chosen, block_ids: tuple[list[int], ...]):
        """(the offset P may hand over, the blocks carrying it); offset 0: nothing."""
        offset = handoff.offered_offset(chosen.replay_offset, request.num_computed_tokens, chosen.computes)
        if offset != chosen.replay_offset:
            logger.warning(
                "pd_connector: %s computed %d tokens, not the %d planned for the replay offset %d; "
                "handing over nothing (the decode instance will prefill locally)",
                request.request_id,
                request.num_computed_tokens,
                chosen.computes,
                chosen.replay_offset,
            )
            self.recorder.count("p_offset_not_computed")
        source: list[list[int]] = []
        if offset:
            transfer_ids = tuple(block_ids[g] for g in self.group_ids)
            try:
                source = pairing.select_source_blocks(self.layouts, transfer_ids, offset)
            except pairing.PairingError as exc:
                # Inside EngineCore's request_finished: an exception here would take the engine
                # down. Hand over nothing; D recomputes.
                logger.warning("pd_connector: %s: cannot select the blocks to hand over: %s", request.request_id, exc)
                self.recorder.count("p_pairing_failed")
                offset = 0
        return offset, source

    def _hand_over_states(self, request: "Request", offset: int, computed: int, source: list[list[int]]):
        """The blocks and checkpoints to lease: a hybrid that computed past the offset resumes on
        its checkpoint there (``checkpoints.resume_state``). None (nothing pinned is kept) when
        P holds no state at the offset."""
        states = self.checkpoints.hand_over(request)
        if not checkpoints.resumes_on_checkpoint(offset, computed, self.profile.has_recurrent_state):
            return source, states
        resumed = checkpoints.resume_state(source, states, offset)
        if resumed is None:
            logger.warning("pd_connector: %s: no state kept at the replay offset %d; handing over nothing",
                           request.request_id, offset)
            self.recorder.count("p_resume_state_not_kept")
            self.checkpoints.drop(request.request_id)
        return resumed

    def _first_token(self, request: "Request") -> int | None:
        """Zero replay: the token P sampled, which travels with the handoff; None when it ended
        the generation (EOS, a stop token or string): the router answers from P alone and no D
        reads, so nothing is leased."""
        if request.output_token_ids and request.status.name == "FINISHED_LENGTH_CAPPED":
            return request.output_token_ids[0]
        self.recorder.count("p_finished_at_first_token")
        return None

    def _count_sibling_reader(self, leased_id: str) -> None:
        """One more P child shares ``leased_id``'s lease, so one more decode request will read
        it (a router that sent P the client's n, not ``pd_decode_requests``): the lease waits
        for max(announced, children) readers. Only while the lease is still on its way to the
        worker: vLLM finishes a request's children in the same step (one prompt, one token
        each); a later child's reader is then one the lease did not expect, and D recomputes
        if it claims after the lease ended."""
        lease = self.to_send.get(leased_id)
        if lease is not None:
            self._children[leased_id] = children = self._children.get(leased_id, 1) + 1
            lease.requests = max(lease.requests, children)

    def _shared_sibling_params(self, request_id: str, fingerprint: str, now: float) -> dict[str, Any] | None:
        """The params of an n > 1 sibling's live handoff of the same prompt, if any. vLLM
        returns one child's kv_transfer_params for the whole request (the last to finish,
        vllm/v1/engine/output_processor.py), so a lease per child left n - 1 of them orphaned.
        Entries are forgotten when their initial lease runs out (oldest first)."""
        stale = []
        for key, (until, _) in self._sibling_params.items():
            if until > now:
                break
            stale.append(key)
        for key in stale:
            del self._sibling_params[key]
        parent = identity.sibling_group(request_id)
        if parent is None:
            return None
        shared = self._sibling_params.get((parent, fingerprint))
        return dict(shared[1]) if shared is not None else None

    def _returned_params(
        self, request, offset: int, source: list[list[int]], fingerprint: str, states=(), first_token: int | None = None
    ) -> dict[str, Any]:
        return encode_handoff_params(
            offset,
            source,
            engine_id=self.engine_id,
            request_id=request.request_id,
            host=self.settings.side_channel_host,
            port=self._port,
            tp_size=self._tp_size,
            fingerprint=fingerprint,
            lease_seconds=self._initial_lease if offset else None,
            checkpoints=list(states),
            block_sizes=self._block_sizes,
            first_token=first_token if offset else None,
            # Past P's hold cap no lease can remain: D refuses the params without a round trip.
            expires_at=time.time() + self.settings.max_hold_seconds,
            seal_key=self._seal_key,
        )
