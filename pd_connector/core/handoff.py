"""The replay-offset rule: where decode (D) resumes, decided once by prefill (P).

``replay_offset`` R is the number of prompt tokens whose attention KV *and* recurrent (SSM /
linear-attention) state P hands over. D recomputes tokens ``[R, N)`` of an N-token prompt.

Why one number, chosen by P and sent explicitly: vLLM 0.32 derives the resume point separately
on each side (``_prefill_backoff`` / ``_get_remote_prefill_token_count`` in
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``) from each side's own
speculative config and cache mode. When they differ, D resumes on top of a recurrent state that
belongs to another position: a phantom or a skipped token, silently. Here P picks R, truncates its
own prompt to exactly R tokens (so the state it holds is the state at R), and D only *validates*.

The prompt checkpoints (which positions keep state, what P pins, what D registers) are
core/checkpoints.py's; the engine facts both rules read, core/recompute_profile.py's.

Pure: ints and msgspec Structs only. No vLLM, torch, NIXL or sockets.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from pd_connector.core import trust
from pd_connector.core.params import (
    KEY_BLOCK_SIZES,
    KEY_FIRST_TOKEN,
    KEY_MIN_RECOMPUTE,
    MAX_DECODE_REQUESTS,
    HandoffParams,
    LeaseRef,
    decode_checkpoints,
    decode_handoff_params,
    release_target,
    sealed_fields,
)
from pd_connector.core.fingerprint import FINGERPRINT_VERSION, form_of
from pd_connector.core.protocol import PROTOCOL_VERSION, CheckpointBlocks, ProtocolError
from pd_connector.core.recompute_profile import RecomputeProfile, mamba_checkpoint_position, min_recompute_tokens


class HandoffPlan(msgspec.Struct, frozen=True):
    """What P does with one prompt: compute and hand over ``replay_offset`` (R) tokens (D
    recomputes the rest). ``checkpoint``: vLLM's prompt checkpoint for the whole prompt (where an engine that
    served it alone keeps the Mamba state for the next turn); 0 without prefix caching of
    recurrent state. ``first_token``: zero replay: the offset is the whole prompt and P's first
    sampled token travels with the handoff (D's prompt is the N tokens plus it)."""

    replay_offset: int
    checkpoint: int = 0
    first_token: bool = False
    # P computes all N prompt tokens, as aggregated serving does (same chunk ends, same
    # checkpoints in its prefix cache), and hands over a prefix R of them: the attention KV of
    # [0, R) and, on a hybrid, the state at R from the prompt checkpoint P keeps there. False: P
    # truncates its prompt to R, and the state at R is its request's own.
    whole_prompt: bool = False


def plan_handoff(
    num_prompt_tokens: int,
    profile: RecomputeProfile,
    requested_min_recompute: int = 0,
    configured_min_recompute: int = 0,
    max_checkpoint_recompute: int | None = 0,
    first_token: bool = False,
    whole_prompt_states: tuple[int, ...] | None = None,
) -> HandoffPlan:
    """P's single decision: how many prompt tokens to compute and hand over.

    ``first_token``: the router carries P's first sampled token to D (``pd_resume``). When
    the tail is one token, that token's position is the one D computes: P computes the whole
    prompt as aggregated serving does (same chunks, same checkpoints) and hands over R = N
    (zero replay). A longer tail (multi-module MTP's lookahead, a D or setting that asks for
    more) needs prompt positions recomputed on D: the replay plan below.

    The recompute tail left to D is the largest of three floors: P's own
    (``min_recompute_tokens(profile)``), ``requested_min_recompute``, D's requirement when the
    router passes it (the ``pd_min_recompute_tokens`` field), and ``configured_min_recompute``,
    P's ``min_recompute_tokens`` setting, for routers that pass no hint (vllm-router replaces
    the whole ``kv_transfer_params`` it sends P) in front of decode instances that need a longer
    tail than P's own.

    Replay: P computes the whole prompt whenever a prefix of it can be handed over
    (``whole_prompt_states`` is not None: the positions whose recurrent state P keeps when it
    prefills the whole prompt, ``checkpoints.kept_checkpoints``; None where vLLM frees KV below
    the last window before the handoff, sliding-window groups, or the caller plans a truncated
    prefill). Attention KV is positional, so R = N - tail. A hybrid's state exists only where P
    keeps one: R is vLLM's prompt checkpoint C (``mamba_checkpoint_position``, the state
    aggregated serving keeps for the next turn), so P reuses what aggregated serving does and
    adds no chunk stop, and D recomputes N - C tokens (at most a unit, two with the EAGLE drop)
    instead of the tail; D registers C, so its next turn hits C too.
    ``max_checkpoint_recompute`` bounds those extra tokens (None: unbounded). Beyond the bound,
    with no checkpoint (prefix caching off) or one P does not keep, P truncates its prompt to
    R = N - tail, or to C when the bound covers it, and hands over its own tip state.

    The offset lies in ``[0, N)``; 0 means "nothing worth handing over": D recomputes the whole
    prompt.
    """
    if num_prompt_tokens <= 0:
        return HandoffPlan(0)
    tail = max(min_recompute_tokens(profile), requested_min_recompute, configured_min_recompute, 0)
    unit = profile.checkpoint_unit
    checkpoint = mamba_checkpoint_position(num_prompt_tokens, unit, profile.eagle_drop) if unit > 0 else 0
    if first_token and tail == 1:
        return HandoffPlan(num_prompt_tokens, checkpoint, first_token=True, whole_prompt=True)
    offset = max(0, num_prompt_tokens - tail)
    whole = whole_prompt_states is not None and offset > 0
    if unit > 0 and 0 < checkpoint <= offset:
        within = max_checkpoint_recompute is None or offset - checkpoint <= max_checkpoint_recompute
        if within and whole and checkpoint in whole_prompt_states:
            return HandoffPlan(checkpoint, checkpoint, whole_prompt=True)
        if within and max_checkpoint_recompute is not None:
            return HandoffPlan(checkpoint, checkpoint)
    # Attention KV is positional: any prefix of the whole prompt's is the prefix's own.
    return HandoffPlan(offset, checkpoint, whole_prompt=whole and not profile.has_recurrent_state)


def offered_offset(chosen: int, num_computed_tokens: int, planned: int | None = None) -> int:
    """What P may hand over at finish: the chosen offset only if P computed exactly the tokens
    it planned to (``planned``: the whole prompt's N under a whole-prompt plan, else the offset
    itself). The recurrent state in P's slot is the state after ``num_computed_tokens``; calling
    it the state at another position is the silent desync this project exists to prevent."""
    return chosen if chosen > 0 and num_computed_tokens == (chosen if planned is None else planned) else 0


def requested_decode_requests(raw: object) -> int | None:
    """The router's ``pd_decode_requests``: an int in [1, MAX_DECODE_REQUESTS], 1 when absent,
    None when malformed (the caller logs and uses 1)."""
    if raw is None:
        return 1
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= MAX_DECODE_REQUESTS:
        return None
    return raw


def requested_min_recompute(raw: object) -> int | None:
    """The router's ``pd_min_recompute_tokens``: a non-negative int, 0 when absent, None when
    malformed (the caller logs and ignores it)."""
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        return None
    return raw


class Accepted(msgspec.Struct, frozen=True):
    """D honours P's offset: load ``replay_offset`` (R) tokens, recompute ``[R, N)``; and
    registers ``checkpoints``, the prompt checkpoints below it that it places (core/checkpoints.py)."""

    replay_offset: int
    params: HandoffParams
    checkpoints: tuple[CheckpointBlocks, ...] = ()


class Refused(msgspec.Struct, frozen=True):
    """D cannot honour the handoff; it recomputes the prompt locally.

    ``kind`` is a stable label for metrics; ``reason`` is the human-readable log text.
    ``params`` is set when the handoff itself decoded. ``release`` is the P D may tell to free
    the blocks now: only one it trusts (core/trust.py), else None and P frees them at its claim
    deadline, so a forged handoff never makes D contact the address it names.
    """

    kind: str
    reason: str
    params: HandoffParams | None = None
    release: LeaseRef | None = None


Decision = Accepted | Refused


def decide_on_decode(
    raw_params: object,
    num_prompt_tokens: int,
    profile: RecomputeProfile,
    num_groups: int | None = None,
    prompt_fingerprint: Callable[[int, str], str | None] | None = None,
    trust_in: trust.Trust = trust.Trust(),
    now: float = 0.0,
    prompt_token_at: Callable[[int], int] | None = None,
) -> Decision:
    """D's validation of P's ``kv_transfer_params``. Never raises on bad input.

    D never derives an offset of its own. A P that sends none (e.g. vLLM's NixlConnector) gets
    the documented rule for that case: the handoff is refused with kind ``missing_offset`` and D
    prefills the prompt itself. Wrong output is never an option, a local recompute always is.

    Trust comes first (``trust_in``: the seal under a shared secret, P's host against the
    allow-list, at wall-clock ``now``): every later refusal releases P, and only a trusted P may
    be contacted at all.

    ``num_groups`` is D's number of transferred KV-cache groups. A different count means the two
    engines lay out their caches differently (e.g. a drafter with its own KV on one side only);
    that is checked before the offset, so the refusal names the structural cause, which no
    routing hint can fix, rather than an offset a hint would only move.

    ``prompt_token_at(i)`` is D's prompt token i: with zero replay (``pd_first_token``) D's
    prompt must be P's R tokens plus that token.

    ``prompt_fingerprint(R, P's fingerprint)`` is this instance's fingerprint of its own first R
    prompt tokens in the form P used (core/fingerprint.py; None: it cannot compute one in that
    form). Computed last, once everything cheaper passed; a handoff of another prompt is refused
    as ``prompt_mismatch``. None skips the check.
    """
    try:
        params = decode_handoff_params(raw_params)
    except ProtocolError as exc:
        return Refused(kind=exc.kind, reason=str(exc), release=_untrusted_release(raw_params, trust_in))
    distrust = trust_refusal(params, raw_params, trust_in, now)
    if distrust is not None:
        return Refused(kind=distrust[0], reason=distrust[1], params=params)
    offset = params.replay_offset
    # The first-token check names the cause (a router that did not carry P's token) before the
    # offset check would call the same prompt merely too short.
    refused = _first_token_refusal(params, num_prompt_tokens, prompt_token_at) or _offset_refusal(
        params, num_prompt_tokens, profile, num_groups
    )
    if refused is not None:
        return msgspec.structs.replace(refused, release=params.lease)
    if offset > 0 and prompt_fingerprint is not None:
        theirs = params.pd_prompt_fingerprint
        mismatch = _prompt_mismatch(prompt_fingerprint(offset, theirs), theirs, offset, num_prompt_tokens)
        if mismatch:
            return Refused(kind="prompt_mismatch", reason=mismatch, params=params, release=params.lease)
    return Accepted(replay_offset=offset, params=params)


def trust_refusal(
    params: HandoffParams, raw_params: object, trust_in: trust.Trust, now: float
) -> tuple[str, str] | None:
    """Why D may not act on (or contact the P of) decoded params: the seal under a shared
    secret, then P's host against the allow-list; None when D may."""
    if trust_in.key:
        try:
            checkpoints = decode_checkpoints(raw_params)
        except ProtocolError as exc:
            return "unauthenticated", f"the sealed handoff's checkpoints do not decode ({exc})"
        refusal = trust.seal_refusal(trust_in.key, sealed_fields(params, checkpoints), params.pd_handoff_seal, now)
        if refusal is not None:
            return refusal
    return trust.host_refusal(trust_in.hosts, params.remote_host, sealed=bool(trust_in.key))


def trusted_release_target(raw_params: object, trust_in: trust.Trust, now: float) -> LeaseRef | None:
    """The P D may release for params it will not load (a request rejected before reaching the
    engine): decoded and trusted ones, or without a secret broken ones on an allowed host."""
    try:
        params = decode_handoff_params(raw_params)
    except ProtocolError:
        return _untrusted_release(raw_params, trust_in)
    return params.lease if trust_refusal(params, raw_params, trust_in, now) is None else None


def _untrusted_release(raw_params: object, trust_in: trust.Trust) -> LeaseRef | None:
    """Params too broken to decode: under a secret nothing can vouch for their address (P frees
    at its claim deadline); without one, released only on an allowed host."""
    if trust_in.key:
        return None
    target = release_target(raw_params)
    return target if target is not None and trust_in.hosts.allows(target.host) else None


def _first_token_refusal(
    params: HandoffParams, num_prompt_tokens: int, prompt_token_at: Callable[[int], int] | None
) -> Refused | None:
    """Zero replay: D's prompt must be P's R tokens plus P's first token, so D's first forward
    is that token's position on top of the state after R."""
    first = params.pd_first_token
    if first is None:
        return None
    offset = params.replay_offset
    if num_prompt_tokens != offset + 1:
        return Refused(
            kind="resume_mismatch",
            reason=(
                f"the prefill instance resumed at its first token ({KEY_FIRST_TOKEN}) after {offset} "
                f"prompt tokens, so this instance's prompt must be those plus that token ({offset + 1} "
                f"tokens), not {num_prompt_tokens}: the router sent the client's prompt instead of "
                "carrying P's first token"
            ),
            params=params,
        )
    if prompt_token_at is not None and prompt_token_at(offset) != first:
        return Refused(
            kind="first_token_mismatch",
            reason=(
                f"token {offset} of this instance's prompt is {prompt_token_at(offset)}, but the prefill "
                f"instance sampled {first} there ({KEY_FIRST_TOKEN}): altered in transit"
            ),
            params=params,
        )
    return None


def _offset_refusal(
    params: HandoffParams, num_prompt_tokens: int, profile: RecomputeProfile, num_groups: int | None
) -> Refused | None:
    """``decide_on_decode``'s structural and offset checks, in the order their refusals name the
    cause (groups before the offset: no routing hint fixes a layout difference)."""
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
    sizes = params.pd_block_sizes
    if offset > 0 and num_groups is not None and sizes is not None and len(sizes) != num_groups:
        return Refused(
            kind="group_mismatch",
            reason=f"P sent {len(sizes)} block sizes ({KEY_BLOCK_SIZES}), this instance has {num_groups} KV-cache groups",
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
    return None


def _prompt_mismatch(mine: str | None, theirs: str, offset: int, num_prompt_tokens: int) -> str:
    """Why the fingerprints differ ("" if they agree): both lengths, never a token."""
    if not theirs:
        return f"the prefill instance sent no prompt fingerprint for its {offset} tokens"
    if mine is None:
        return (
            f"this instance cannot fingerprint its {num_prompt_tokens}-token prompt in the form the "
            f"prefill instance used ({form_of(theirs) or theirs[:40]!r}) to check the {offset} "
            "tokens it computed: P and D differ in --prefix-caching-hash-algo, hash block size, "
            f"PYTHONHASHSEED or fingerprint version (this instance's: {FINGERPRINT_VERSION}), the prompt "
            "has embeddings, or a multimodal item's data is not in this engine"
        )
    if mine == theirs:
        return ""
    return (
        f"the first {offset} tokens of this {num_prompt_tokens}-token prompt are not the prompt the "
        f"prefill instance computed (fingerprint {mine}, P's {theirs}): the router sent the two "
        "instances different prompts (a re-rendered chat template, another tokenizer, another "
        "conversation)"
    )


__all__ = [
    "PROTOCOL_VERSION",
    "Accepted",
    "Decision",
    "HandoffPlan",
    "Refused",
    "decide_on_decode",
    "offered_offset",
    "plan_handoff",
    "requested_decode_requests",
    "requested_min_recompute",
    "trust_refusal",
    "trusted_release_target",
]
