"""Every prompt-checkpoint decision: the recurrent states an aggregated server keeps in its
prefix cache for a prompt, the one P keeps for its own next turn and the junction it pins, which
checkpoints below the replay offset P hands over besides the state at R, and which of those D
registers, for which prompt length (docs/architecture.md, "Prefix caching across the handoff").
R itself is core/handoff.py's; the engine facts both read are core/recompute_profile.py's.

vLLM's rule (Mamba ``align`` mode, the only mode that keeps states; 0.32 and 0.33 have no
``all``): prefilling a prompt of N tokens in one chunk, ``Scheduler._mamba_block_aligned_split``
ends a chunk at the last cacheable block position ``get_mamba_prefill_checkpoint_position(N, B,
drop)`` and, with fine-grained hits (a ``prefix_match_unit`` u below the Mamba block B), at the
prompt's tail checkpoint ``get_mamba_prefill_checkpoint_position(N, u, drop)``; a backend that
exports checkpoints inside a chunk (``num_prefill_checkpoint_blocks > 0``: Mamba2, KDA; not GDN)
writes the tail checkpoint without a split instead. ``MambaManager.cache_blocks`` keeps the
block state (``reachable_block_mask`` over ``replay_boundaries``, every retention interval) and
``_cache_partial_tail_block`` the sub-block one. Multi-module MTP moves a chunk end within
``num_prefill_lookahead`` of the prompt's end (``_reserve_prefill_lookahead``) and caches
nothing in the last ``lookahead - 1`` computed tokens (``get_num_cacheable_tokens``).

P, truncated to R, keeps the checkpoints of an R-token prompt, plus one block state it pins as
the request's shared-prefix junction (a chunk stop that ``reachable_block_mask`` retains); D
registers a received state where its own vLLM would have kept it for the N-token prompt. Pure:
ints and msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pd_connector.core.handoff import Accepted, HandoffPlan
from pd_connector.core.pairing import MAMBA, NULL_BLOCK, SLIDING_WINDOW, GroupLayout, cdiv
from pd_connector.core.protocol import CheckpointBlocks
from pd_connector.core.recompute_profile import RecomputeProfile, mamba_checkpoint_position


class CheckpointRule(msgspec.Struct, frozen=True):
    """What decides where one engine keeps a prompt's recurrent states (from its vLLM config,
    engine/from_vllm/vllm_config.py ``checkpoint_rule_from_vllm``): the engine's ``profile`` (its unit
    u, EAGLE drop and lookahead, described once there) plus what only checkpoints depend on.
    Unit 0: no prefix caching of recurrent state (``mamba_cache_mode`` none), no checkpoint."""

    block_size: int = 0  # the Mamba groups' block size B
    profile: RecomputeProfile = msgspec.field(default_factory=RecomputeProfile)
    exports: bool = False  # every Mamba backend exports prefill checkpoints (Mamba2, KDA)
    # The granularity the scheduler ends prefill chunks on: ``cache_config.block_size``, which
    # ``_mamba_block_aligned_split`` reads. 0: the Mamba block. vLLM CPU's API server leaves it
    # at 128 while it raises the hybrid's blocks to 640 (tiny Qwen3-Next), so a chunk end is a
    # Mamba block boundary, and its state kept, only where a multiple of 128 is one of 640.
    split_block: int = 0

    @property
    def unit(self) -> int:
        return self.profile.checkpoint_unit

    @property
    def eagle_drop(self) -> bool:
        return self.profile.eagle_drop

    @property
    def prefill_lookahead(self) -> int:
        return self.profile.prefill_lookahead

    @property
    def keeps_states(self) -> bool:
        return self.unit > 0 and self.block_size > 0

    @property
    def fine_grained(self) -> bool:
        """Hits (and the tail checkpoint) at a unit below the block: sub-block states."""
        return 0 < self.unit < self.block_size

    @property
    def split(self) -> int:
        return self.split_block or self.block_size


def _export_valid(start: int, prompt_len: int, checkpoint: int, rule: CheckpointRule) -> bool:
    """``is_mamba_prefill_checkpoint_valid`` for the final chunk [start, prompt_len) (alignment
    1), as the scheduler (split granularity) and the manager (Mamba block) both check it."""
    if start % rule.unit or not start + rule.unit <= checkpoint < prompt_len:
        return False
    return all(cdiv(prompt_len, b) - 2 > (start - 1) // b for b in {rule.block_size, rule.split})


def _replay_blocks(prompt_len: int, rule: CheckpointRule, junction: int) -> set[int]:
    """Block states ``reachable_block_mask`` retains: ``replay_boundaries`` (N - 1; under the
    EAGLE drop a resend's and a sibling's, one block down) and the junction, each aligned down
    to the unit, then to its block."""
    B, u = rule.block_size, rule.unit
    if rule.eagle_drop:
        out = {max((prompt_len - 1) // B * B - B, 0), max(prompt_len // B * B - B, 0)}
    else:
        out = {(prompt_len - 1) // u * u // B * B}
    if junction:
        out.add(junction // u * u // B * B)
    return out


def _chunk_ends(prompt_len: int, rule: CheckpointRule, junction: int) -> list[tuple[int, bool]]:
    """Where ``Scheduler._mamba_block_aligned_split`` ends the chunks of an unbounded budget
    (and ``_reserve_prefill_lookahead`` moves them): (position, exported) per state written,
    ``exported`` for a checkpoint a backend writes inside the final chunk."""
    drop, S = rule.eagle_drop, rule.split
    tail = mamba_checkpoint_position(prompt_len, rule.unit, drop)
    block = mamba_checkpoint_position(prompt_len, S, drop)
    start, out = 0, []
    while start < prompt_len and len(out) < 8:
        internal = rule.exports and _export_valid(start, prompt_len, tail, rule)
        stops = [] if internal else [(start // S + 1) * S if start % S else 0, block]
        if not internal and rule.fine_grained and block < tail:
            stops.append(tail)  # the prompt's hash-unit checkpoint
        if start < junction < prompt_len:
            stops.append(start + (junction - start) // S * S)  # block-floored junction
        end = min((p for p in stops if start < p < prompt_len), default=prompt_len)
        if 0 < prompt_len - end < rule.prefill_lookahead:
            end -= rule.prefill_lookahead - (prompt_len - end)
        if end <= start:
            break
        if internal and end == prompt_len:
            out.append((tail, True))
        out.append((end, False))
        start = end
    return out


def kept_checkpoints(
    prompt_len: int, rule: CheckpointRule, computed: int | None = None, junction: int = 0
) -> tuple[int, ...]:
    """Positions (ascending, in (0, prompt_len)) whose recurrent state an engine with ``rule``
    keeps in its prefix cache after prefilling a ``prompt_len``-token prompt and computing
    ``computed`` tokens in all (None: it decoded past its multi-module MTP tail, as an
    aggregated server does; P stops at exactly its prompt). ``junction``: the request's
    shared-prefix boundary (the one P pins). Chunks end only where the scheduler must end them:
    a state a token budget smaller than the prompt would add depends on the rest of the batch,
    and is not predicted."""
    if not rule.keeps_states or prompt_len <= 1:
        return ()
    reprefillable = max(0, rule.prefill_lookahead - 1)
    tail = mamba_checkpoint_position(prompt_len, rule.unit, rule.eagle_drop)
    retained = _replay_blocks(prompt_len, rule, max(junction, 0))
    cacheable = prompt_len + 10**9 if computed is None else computed - reprefillable
    kept = set()
    for p, exported in _chunk_ends(prompt_len, rule, junction):
        if not 0 < p < prompt_len:
            continue
        if exported:
            kept.add(p)  # re-keyed at the prompt checkpoint by every caching step
        elif p % rule.block_size == 0 and p in retained and p <= cacheable:
            kept.add(p)  # a retained block state (reachable_block_mask)
        elif rule.fine_grained and p == tail and not reprefillable:
            # The sub-block tail, registered by a caching step that ends exactly on it, which
            # the re-prefillable tail moves off it (_cache_partial_tail_block).
            kept.add(p)
    return tuple(sorted(kept))


def checkpoint_to_keep(plan: HandoffPlan, profile: RecomputeProfile) -> int:
    """The prompt checkpoint P must ask vLLM to keep for its own next turn, or 0.

    P computes a prompt truncated to the offset, and under vLLM's default retention interval 0
    the Mamba manager keeps only the truncated prompt's checkpoint
    (``MambaManager.reachable_block_mask`` over ``replay_boundaries(num_prompt_tokens)``): at
    ``N - 1 = kB`` that is ``(k-1)B``, one unit below the whole prompt's ``C = kB``, the
    position where the conversation's next turn resumes. When the two differ and P computed
    ``C``, P names ``C`` (vLLM's ``shared_prefix_boundary`` pin; engine/prefill/prefill_scheduler.py). Never
    with the EAGLE drop: a hit at ``C`` then also needs the attention block above it, past what P
    computed whenever the two checkpoints differ, and a pin inside P's chunk would split it."""
    checkpoint, unit = plan.checkpoint, profile.checkpoint_unit
    needed = checkpoint + (unit if profile.eagle_drop else 0)
    if unit <= 0 or checkpoint <= 0 or needed > plan.replay_offset:
        return 0
    if checkpoint == mamba_checkpoint_position(plan.replay_offset, unit, profile.eagle_drop):
        return 0  # vLLM keeps it anyway
    return checkpoint


def pinned_boundary(current: int, keep: int) -> int | None:
    """The shared-prefix boundary P sets to keep checkpoint ``keep`` (``junction_to_pin``),
    given the one vLLM's lookup left on the request: ``keep`` over none (0) or over itself; None
    (leave it, and count it) over a junction vLLM found itself, such as a system prompt shared
    with other cached requests. A request carries one boundary, and that junction serves every
    sibling request, where ours would serve only this conversation."""
    return keep if current in (0, keep) else None


def checkpoint_to_pin(num_prompt_tokens: int, offset: int, rule: CheckpointRule) -> int:
    """A block state below R the aggregated server keeps and P's truncated prefill would not
    (the EAGLE drop on a block-aligned prompt: N - B, where P's R = N - 1 checkpoints at N - 2B),
    which P computes and keeps when pinned as its shared-prefix junction: the scheduler ends a
    chunk there (``_mamba_block_aligned_split``, floored to its split) and the manager retains
    it (``reachable_block_mask``), where aggregated serving's own prefill ends one. 0 if none:
    P caches nothing in its re-prefillable tail, and moves a chunk end within the lookahead."""
    if offset <= 0 or not rule.keeps_states:
        return 0
    held = set(kept_checkpoints(offset, rule, computed=offset))
    pins = [
        p
        for p in kept_checkpoints(num_prompt_tokens, rule)
        if p < offset and p not in held and p % rule.block_size == 0 and p % rule.split == 0
        and p in kept_checkpoints(offset, rule, computed=offset, junction=p)
    ]
    return pins[-1] if pins else 0


def junction_to_pin(num_prompt_tokens: int, plan: HandoffPlan, profile: RecomputeProfile, rule: CheckpointRule) -> int:
    """The shared-prefix boundary P pins for a handoff: the whole prompt's checkpoint for its own
    next turn (``checkpoint_to_keep``), else one for D (``checkpoint_to_pin``); 0: none.
    A whole-prompt plan pins only what a prefill of the whole prompt would not keep."""
    if plan.replay_offset <= 0:
        return 0
    if plan.whole_prompt:
        return checkpoint_to_pin(num_prompt_tokens, num_prompt_tokens, rule)
    return checkpoint_to_keep(plan, profile) or checkpoint_to_pin(num_prompt_tokens, plan.replay_offset, rule)


def whole_prompt_states(
    num_prompt_tokens: int, rule: CheckpointRule, layouts: Sequence[GroupLayout] = ()
) -> tuple[int, ...] | None:
    """The states P keeps when it prefills the whole prompt (and stops there, as P does), with
    the junction a whole-prompt plan pins: where a replay can resume on a hybrid
    (``handoff.plan_handoff``). None with a sliding-window group: vLLM frees its KV below the
    last window before ``request_finished`` (``remove_skipped_blocks``), so no prefix of the
    prompt stays whole."""
    if any(layout.kind == SLIDING_WINDOW for layout in layouts):
        return None
    junction = checkpoint_to_pin(num_prompt_tokens, num_prompt_tokens, rule)
    return kept_checkpoints(num_prompt_tokens, rule, computed=num_prompt_tokens, junction=junction)


class PrefillCheckpoints(msgspec.Struct, frozen=True):
    """P's checkpoints for one plan (``prefill_checkpoints``)."""

    computes: int  # the prompt tokens P computes (``prefill_length``)
    junction: int = 0  # the shared-prefix boundary P pins (``junction_to_pin``); 0: none
    wanted: tuple[int, ...] = ()  # the states P pins to hand over
    missing: tuple[int, ...] = ()  # the aggregated server's checkpoints below R P will not have


def prefill_checkpoints(
    num_prompt_tokens: int, plan: HandoffPlan, profile: RecomputeProfile, rule: CheckpointRule
) -> PrefillCheckpoints:
    """P's answer for a plan, in one: how much it computes, the junction it pins, the states it
    pins to hand over and the checkpoints below R it will not have. A hybrid that prefills past R
    (a whole-prompt plan) resumes on its checkpoint at R, not its tip, so that state is pinned too."""
    offset = plan.replay_offset
    computes = prefill_length(num_prompt_tokens, plan)
    junction = junction_to_pin(num_prompt_tokens, plan, profile, rule)
    wanted = checkpoints_to_hand_over(num_prompt_tokens, offset, rule, junction, computes)
    if resumes_on_checkpoint(offset, computes, profile.has_recurrent_state):
        wanted += (offset,)
    missing = checkpoints_not_computed(num_prompt_tokens, offset, rule, junction, computes)
    return PrefillCheckpoints(computes, junction, wanted, missing)


def resumes_on_checkpoint(offset: int, computed: int, recurrent: bool) -> bool:
    """A hybrid that computed past the offset hands over its checkpoint there, not its tip
    (which holds the state after all ``computed`` tokens): ``resume_state``."""
    return recurrent and 0 < offset < computed


def prefill_length(num_prompt_tokens: int, plan: HandoffPlan) -> int:
    """The prompt tokens P computes under ``plan``: all of them, or the offset it truncates to."""
    return num_prompt_tokens if plan.whole_prompt else plan.replay_offset


def checkpoints_to_hand_over(
    num_prompt_tokens: int, offset: int, rule: CheckpointRule, junction: int = 0, computed: int | None = None
) -> tuple[int, ...]:
    """P's choice: the checkpoints an aggregated server keeps for the whole prompt that lie
    below the offset R (R itself is the state handed over anyway) and that P, prefilling
    ``computed`` prompt tokens (the prompt truncated to R by default; N under a whole-prompt
    plan) with ``junction`` pinned (``junction_to_pin``), computes and keeps too."""
    if offset <= 0 or not rule.keeps_states:
        return ()
    prefilled = offset if computed is None else computed
    held = set(kept_checkpoints(prefilled, rule, computed=prefilled, junction=junction))
    return tuple(p for p in kept_checkpoints(num_prompt_tokens, rule) if p < offset and p in held)


def checkpoints_not_computed(
    num_prompt_tokens: int, offset: int, rule: CheckpointRule, junction: int = 0, computed: int | None = None
) -> tuple[int, ...]:
    """The aggregated server's checkpoints below R that P's prefill never keeps, pin included
    (truncated: the EAGLE drop's sub-block tail N - u on a prompt of whole units, which a
    junction cannot stop at; multi-module MTP's re-prefillable tail). Nothing to hand over: D
    keeps them only as before, where the offset lands on one."""
    if offset <= 0 or not rule.keeps_states:
        return ()
    handed = set(checkpoints_to_hand_over(num_prompt_tokens, offset, rule, junction, computed))
    return tuple(p for p in kept_checkpoints(num_prompt_tokens, rule) if p < offset and p not in handed)


def resume_state(
    source: list[list[int]], states: Sequence[CheckpointBlocks], offset: int
) -> tuple[list[list[int]], list[CheckpointBlocks]] | None:
    """P side, a hybrid's whole-prompt replay plan: the blocks to hand over with each Mamba
    group's state taken from P's checkpoint at the offset (not the request's tip, which holds the
    state after the whole prompt), and the checkpoints below it. None if P holds no state there
    (vLLM did not offer it): nothing can be handed over."""
    at = [s for s in states if s.position == offset]
    if not at:
        return None
    blocks = [list(state_ids) if state_ids else list(ids) for ids, state_ids in zip(source, at[0].block_ids)]
    return blocks, [s for s in states if s.position < offset]


def checkpoint_prompt_length(decision: Accepted, num_prompt_tokens: int) -> int:
    """The prompt whose checkpoints D registers (those aggregated serving keeps for it): P's R
    tokens under zero replay, where D's prompt is them plus P's first token; else D's own."""
    return decision.replay_offset if decision.params.pd_first_token is not None else num_prompt_tokens


class Placement(msgspec.Struct, frozen=True):
    """D's answer to P's checkpoints: the ones it registers, and why it refuses the others
    (``(position, kind)``; the handoff itself is never refused for them)."""

    placed: tuple[CheckpointBlocks, ...] = ()
    refused: tuple[tuple[int, str], ...] = ()


def place_checkpoints(
    states: Sequence[CheckpointBlocks],
    num_prompt_tokens: int,
    offset: int,
    layouts: tuple[GroupLayout, ...],
    rule: CheckpointRule,
) -> Placement:
    """Which of P's checkpoint states D registers: each must name, per transfer group, no block
    for an attention group and exactly one for each Mamba group, lie below the offset, and be a
    position D's own vLLM keeps for this prompt (another block size or unit on D keeps others)."""
    mine = set(kept_checkpoints(num_prompt_tokens, rule))
    placed, refused = [], []
    seen: set[int] = set()
    for state in states:
        p = state.position
        if not rule.keeps_states:
            kind = "no_prefix_cache"
        elif len(state.block_ids) != len(layouts) or any(
            len(ids) != (1 if layout.kind == MAMBA else 0) for layout, ids in zip(layouts, state.block_ids)
        ):
            kind = "groups"
        elif not 0 < p < offset or p in seen:
            kind = "out_of_range"
        elif p not in mine:
            kind = "not_kept_here"
        else:
            seen.add(p)
            placed.append(state)
            continue
        refused.append((p, kind))
    return Placement(tuple(placed), tuple(refused))


def checkpoint_slot(position: int, block_size: int) -> tuple[int, bool]:
    """Where vLLM keeps the state at ``position`` in a Mamba table: block index (slot p holds
    the state after (p + 1) * B tokens), and whether it is a sub-block state (registered under
    its fine-grained hash, ``BlockPool.cache_partial_block``) rather than a full block's."""
    return cdiv(position, block_size) - 1, position % block_size != 0


def checkpoint_pairs(
    layouts: tuple[GroupLayout, ...], placed: Sequence[CheckpointBlocks], local: Sequence[Sequence[int]]
) -> list[list[tuple[int, int]]]:
    """D side: per transfer group, the ``(P block, D block)`` pairs that carry the placed
    checkpoints, ``local[i]`` being D's block per Mamba group (transfer-group order) for
    ``placed[i]``. Attention groups get none: D has their KV from the main pairs."""
    mamba = [g for g, layout in enumerate(layouts) if layout.kind == MAMBA]
    pairs: list[list[tuple[int, int]]] = [[] for _ in layouts]
    if len(local) != len(placed):
        raise ValueError(f"{len(local)} block lists for {len(placed)} checkpoints")
    for state, blocks in zip(placed, local):
        if len(blocks) != len(mamba) or NULL_BLOCK in blocks:
            raise ValueError(f"checkpoint {state.position}: D blocks {list(blocks)} for {len(mamba)} Mamba groups")
        for g, block in zip(mamba, blocks):
            pairs[g].append((state.block_ids[g][0], block))
    return pairs


def state_blocks(layouts: tuple[GroupLayout, ...], position: int, by_group: dict[int, int]) -> CheckpointBlocks | None:
    """P side: the wire form of the checkpoint at ``position`` from the blocks P pinned for it
    (transfer-group index -> block); None unless every Mamba group has one."""
    ids: list[list[int]] = []
    for g, layout in enumerate(layouts):
        if layout.kind != MAMBA:
            ids.append([])
        elif by_group.get(g, NULL_BLOCK) > NULL_BLOCK:
            ids.append([by_group[g]])
        else:
            return None
    return CheckpointBlocks(position, ids)


__all__ = [
    "CheckpointRule",
    "Placement",
    "PrefillCheckpoints",
    "checkpoint_pairs",
    "checkpoint_prompt_length",
    "checkpoint_slot",
    "checkpoint_to_keep",
    "checkpoint_to_pin",
    "checkpoints_not_computed",
    "checkpoints_to_hand_over",
    "junction_to_pin",
    "kept_checkpoints",
    "pinned_boundary",
    "place_checkpoints",
    "prefill_checkpoints",
    "prefill_length",
    "resume_state",
    "resumes_on_checkpoint",
    "state_blocks",
    "whole_prompt_states",
]
