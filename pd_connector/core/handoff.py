"""The replay-offset rule: where decode (D) resumes, decided once by prefill (P).

``replay_offset`` R is the number of prompt tokens whose attention KV *and* recurrent (SSM /
linear-attention) state P hands over. D recomputes tokens ``[R, N)`` of an N-token prompt.

Why one number, chosen by P and sent explicitly: vLLM 0.32 derives the resume point separately
on each side (``_prefill_backoff`` / ``_get_remote_prefill_token_count`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``) from each side's own
speculative config and cache mode. When they differ, D resumes on top of a recurrent state that
belongs to another position: a phantom or a skipped token, silently. Here P picks R, truncates its
own prompt to exactly R tokens (so the state it holds is the state at R), and D only *validates*.

Pure: ints and msgspec Structs only. No vLLM, torch, NIXL or sockets.
"""

from __future__ import annotations

import msgspec

from pd_connector.core.protocol import (
    KEY_MIN_RECOMPUTE,
    PROTOCOL_VERSION,
    HandoffParams,
    ProtocolError,
    decode_handoff_params,
)


class RecomputeProfile(msgspec.Struct, frozen=True):
    """What one engine's configuration demands of the prompt tail it recomputes itself.

    Extracted from vLLM config by the adapter (``scheduler.profile_from_vllm``); kept as plain
    fields so the rule is testable without vLLM.
    """

    # Any Mamba/SSM/GDN/linear-attention group: its state cannot be rolled back, so D must
    # recompute at least the last prompt token on top of the state it receives.
    has_recurrent_state: bool = False
    # vLLM's ``VllmConfig.num_prefill_lookahead_tokens``: 0 without EAGLE-family drafting, 1 for
    # EAGLE/EAGLE3/single-module MTP, K for multi-module MTP with K speculative tokens. The last
    # ``lookahead - 1`` prompt positions of the drafter's KV depend on tokens P never had.
    prefill_lookahead: int = 0
    # Sliding-window groups with bounded replay (``prefix_replay_tokens > 0``).
    bounded_replay_tokens: int = 0
    # Prefix caching in Mamba ``align`` mode: vLLM looks Mamba state up (and registers it) only
    # at multiples of this many tokens, the Mamba group's cache-hit alignment: the
    # ``prefix_match_unit`` when it is finer than the block, else the block size. 0 = no
    # prefix caching of recurrent state.
    replay_grid: int = 0
    # vLLM's ``SpeculativeConfig.use_eagle_block_drop()`` (EAGLE-family drafter with prefix
    # caching): the prompt checkpoint sits one unit earlier
    # (``get_mamba_prefill_checkpoint_position``: floor(N/u)*u - u, "the EAGLE drop").
    eagle_drop: bool = False
    # The Mamba group's block size in align mode: states P can pin for its own next turn
    # (``HandoffPlan.retain``) live on whole blocks. 0 = unknown (nothing pinned).
    mamba_block_size: int = 0


def min_recompute_tokens(profile: RecomputeProfile) -> int:
    """The fewest prompt tokens an engine with ``profile`` must recompute after a handoff.

    Always >= 1: vLLM needs at least one computed prompt token to produce logits (it rewinds a
    full hit by one token in ``Scheduler._update_waiting_for_remote_kv``); making that explicit
    keeps "D recomputes exactly N - R tokens" true for attention-only models too.
    """
    return max(1, profile.prefill_lookahead - 1, profile.bounded_replay_tokens)


def mamba_checkpoint_position(num_tokens: int, unit: int, drop: bool) -> int:
    """Where vLLM keeps a prompt's reusable Mamba state: ``get_mamba_prefill_checkpoint_position``
    (vllm/v1/kv_cache_interface.py), restated so the core needs no vLLM (tests compare them).
    The last multiple of ``unit`` below ``num_tokens``, one unit earlier with the EAGLE drop."""
    limit = num_tokens if drop else num_tokens - 1
    position = limit // unit * unit - (unit if drop else 0)
    return max(position, 0)


class HandoffPlan(msgspec.Struct, frozen=True):
    """What P does with one prompt: compute and hand over ``offset`` tokens (D recomputes the
    rest), and keep the prompt checkpoint ``retain`` in its own prefix cache (0: nothing to
    pin beyond what vLLM keeps for the truncated prompt)."""

    offset: int
    # vLLM's prompt checkpoint for the whole prompt (where an engine that served it alone would
    # keep the Mamba state for the next turn); 0 without prefix caching of recurrent state.
    checkpoint: int = 0
    retain: int = 0


def plan_handoff(
    num_prompt_tokens: int,
    profile: RecomputeProfile,
    requested_min_recompute: int = 0,
    max_checkpoint_recompute: int = 0,
) -> HandoffPlan:
    """P's single decision: how many prompt tokens to compute and hand over, and which prompt
    checkpoint to keep for the next turn.

    The offset is ``N - tail``: D recomputes only its minimum (``min_recompute_tokens``, or
    ``requested_min_recompute``, D's own requirement passed by the router as
    ``pd_min_recompute_tokens``), in every cache mode. D registers the state it receives at the
    offset only, because vLLM's MambaManager gives a handoff's request a state block at its tip
    and null blocks below (``MambaManager.allocate_new_blocks``): D keeps the prompt checkpoint
    ``C`` only when the offset is ``C``. ``max_checkpoint_recompute`` trades D compute for that:
    when ``N - tail - C`` is at most this many tokens, the offset is ``C`` instead.

    ``retain``: P's prompt is truncated to the offset, and vLLM derives its own checkpoint (and,
    under sparse retention, which states to keep) from the truncated prompt, so P would keep the
    state one unit short of ``C`` on some lengths. P pins ``C`` (as vLLM's shared-prefix junction)
    when it lies on a whole Mamba block below the offset or at it, where vLLM can register it.

    The offset lies in ``[0, N)``; 0 means "nothing worth handing over": D recomputes the whole
    prompt.
    """
    if num_prompt_tokens <= 0:
        return HandoffPlan(0)
    tail = max(min_recompute_tokens(profile), max(0, requested_min_recompute))
    offset = max(0, num_prompt_tokens - tail)
    unit = profile.replay_grid
    if unit <= 0:
        return HandoffPlan(offset)
    checkpoint = mamba_checkpoint_position(num_prompt_tokens, unit, profile.eagle_drop)
    if 0 < checkpoint <= offset and offset - checkpoint <= max_checkpoint_recompute:
        offset = checkpoint
    block = profile.mamba_block_size
    retain = checkpoint if block > 0 and 0 < checkpoint <= offset and checkpoint % block == 0 else 0
    return HandoffPlan(offset, checkpoint, retain)


def choose_replay_offset(
    num_prompt_tokens: int,
    profile: RecomputeProfile,
    requested_min_recompute: int = 0,
    max_checkpoint_recompute: int = 0,
) -> int:
    """``plan_handoff``'s offset."""
    return plan_handoff(num_prompt_tokens, profile, requested_min_recompute, max_checkpoint_recompute).offset


def offered_offset(chosen: int, num_computed_tokens: int) -> int:
    """What P may hand over at finish: the chosen offset only if P computed exactly that many
    tokens. The recurrent state in P's slot is the state after ``num_computed_tokens``; calling
    it the state at another position is the silent desync this project exists to prevent."""
    return chosen if chosen > 0 and num_computed_tokens == chosen else 0


def requested_min_recompute(raw: object) -> int | None:
    """The router's ``pd_min_recompute_tokens``: a non-negative int, 0 when absent, None when
    malformed (the caller logs and ignores it)."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        return None
    return raw


class Accepted(msgspec.Struct, frozen=True):
    """D honours P's offset: load ``offset`` tokens, recompute ``[offset, N)``."""

    offset: int
    params: HandoffParams


class Refused(msgspec.Struct, frozen=True):
    """D cannot honour the handoff; it recomputes the prompt locally.

    ``kind`` is a stable label for metrics; ``reason`` is the human-readable log text.
    ``params`` is set when the handoff itself decoded (so P can still be told to release).
    """

    kind: str
    reason: str
    params: HandoffParams | None = None


Decision = Accepted | Refused


def decide_on_decode(
    raw_params: object, num_prompt_tokens: int, profile: RecomputeProfile, num_groups: int | None = None
) -> Decision:
    """D's validation of P's ``kv_transfer_params``. Never raises on bad input.

    D never derives an offset of its own. A P that sends none (e.g. vLLM's NixlConnector) gets
    the documented rule for that case: the handoff is refused with kind ``missing_offset`` and D
    prefills the prompt itself. Wrong output is never an option, a local recompute always is.

    ``num_groups`` is D's number of transferred KV-cache groups. A different count means the two
    engines lay out their caches differently (e.g. a drafter with its own KV on one side only);
    that is checked before the offset, so the refusal names the structural cause, which no
    routing hint can fix, rather than an offset a hint would only move.
    """
    try:
        params = decode_handoff_params(raw_params)
    except ProtocolError as exc:
        return Refused(kind=exc.kind, reason=str(exc))
    offset = params.replay_offset
    if offset > 0 and num_groups is not None and len(params.remote_block_ids) != num_groups:
        return Refused(
            kind="group_mismatch",
            reason=(
                f"P sent {len(params.remote_block_ids)} block lists, this instance has {num_groups} "
                "KV-cache groups (different cache layouts, e.g. a drafter with its own KV on one "
                "side only)"
            ),
            params=params,
        )
    if offset >= num_prompt_tokens:
        return Refused(
            kind="offset_out_of_range",
            reason=(
                f"replay_offset={offset} is not below the prompt length {num_prompt_tokens} "
                "(the decode instance must recompute at least one prompt token)"
            ),
            params=params,
        )
    need = min_recompute_tokens(profile)
    if offset > 0 and num_prompt_tokens - offset < need:
        return Refused(
            kind="offset_above_requirement",
            reason=(
                f"replay_offset={offset} leaves {num_prompt_tokens - offset} token(s) to "
                f"recompute but this decode instance needs at least {need} "
                f"(recurrent state={profile.has_recurrent_state}, "
                f"prefill lookahead={profile.prefill_lookahead}); route with "
                f"{KEY_MIN_RECOMPUTE}={need} so the prefill instance backs off further"
            ),
            params=params,
        )
    if params.remote_num_tokens is not None and params.remote_num_tokens != offset:
        return Refused(
            kind="inconsistent_params",
            reason=(
                f"remote_num_tokens={params.remote_num_tokens} disagrees with "
                f"replay_offset={offset}: the parameters were altered in transit"
            ),
            params=params,
        )
    return Accepted(offset=offset, params=params)


__all__ = [
    "PROTOCOL_VERSION",
    "Accepted",
    "Decision",
    "HandoffPlan",
    "RecomputeProfile",
    "Refused",
    "choose_replay_offset",
    "decide_on_decode",
    "mamba_checkpoint_position",
    "min_recompute_tokens",
    "offered_offset",
    "plan_handoff",
    "requested_min_recompute",
]
