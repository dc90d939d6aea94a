"""Prompt checkpoints below the offset in vLLM's block pool (core/checkpoints.py decides which).

P: vLLM frees a checkpoint state from the request's Mamba table before ``request_finished``
(``remove_skipped_blocks`` in ``Scheduler._connector_finished``: the block stays in the prefix
cache, evictable), so P pins each one when vLLM offers it: a Mamba ``align`` boundary-state
hand-off of the step that cached it (``SchedulerOutput.kv_connector_block_state.
boundary_state_offloads``: group, block id, boundary tokens; the exact block, never resolved
positionally), pinned with ``BlockPool.touch`` as vLLM's MooncakeStore connector pins its saves,
and freed when the lease ends.

D: vLLM gives a handoff's request null Mamba blocks below its tip (``MambaManager.
allocate_new_blocks``), and nothing in the connector API makes it allocate one at a checkpoint,
so D takes a block of its own from the pool for each placed state, the READ fills it, and once
read D registers it under the request's block hash exactly as vLLM's caching of that state does
(``BlockPool.cache_full_blocks`` for a block state, ``cache_partial_block`` for a sub-block one)
and frees it: an evictable cached block, as the aggregated server's is once its request moves on.

The block pool comes from ``KVConnectorBase_V1.bind_gpu_block_pool`` (0.32 and 0.33: "inc/dec
ref counts, or iterate over the prefix cache blocks"). Everything runs in EngineCore's scheduler
thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from pd_connector.core import checkpoints
from pd_connector.core.checkpoints import CheckpointRule
from pd_connector.core.handoff import Accepted
from pd_connector.core.pairing import MAMBA, GroupLayout
from pd_connector.core.params import decode_checkpoints
from pd_connector.core.protocol import CheckpointBlocks, ProtocolError
from pd_connector.engine.metrics import Recorder

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.pd_connector")


class CheckpointPool:
    """Both halves' checkpoint blocks. ``group_ids``: vLLM's group id of each transfer group;
    ``cache_config``: vLLM's, whose ``block_size`` the scheduler splits prefill chunks on."""

    def __init__(
        self,
        layouts: tuple[GroupLayout, ...],
        group_ids: tuple[int, ...],
        rule: CheckpointRule,
        recorder: Recorder,
        cache_config: Any = None,
    ):
        self.layouts, self.group_ids, self._rule, self.recorder = layouts, group_ids, rule, recorder
        self._cache_config = cache_config
        self._index = {vllm_group: i for i, vllm_group in enumerate(group_ids) if layouts[i].kind == MAMBA}
        self.pool: BlockPool | None = None
        # P: positions wanted per handoff, pinned blocks per request -> position -> group index,
        # and the pinned blocks of leases still held.
        self._wanted: dict[str, frozenset[int]] = {}
        self._pins: dict[str, dict[int, dict[int, KVCacheBlock]]] = {}
        self._leased: dict[str, list[KVCacheBlock]] = {}
        # D: blocks reserved for a load, registered when it ends: (request, [(position, group, block)]).
        self._placing: dict[str, tuple[Request, list[tuple[int, int, KVCacheBlock]]]] = {}

    def bind(self, pool: "BlockPool") -> None:
        self.pool = pool

    @property
    def rule(self) -> CheckpointRule:
        """The rule, with the split granularity as the scheduler reads it now: vLLM 0.32's
        EngineCoreProc re-runs ``VllmConfig.__post_init__`` after its start-up handshake, where
        the CPU platform (``CpuPlatform.check_and_update_config``) puts ``block_size`` back to
        128 when the user gave none, after the hybrid alignment raised it (640 on the tiny
        Qwen3-Next); the KV-cache groups keep their 640."""
        split = int(getattr(self._cache_config, "block_size", 0) or 0)
        if self._rule.keeps_states and split and split != self._rule.split_block:
            self._rule = msgspec.structs.replace(self._rule, split_block=split)
        return self._rule

    # -- P ---------------------------------------------------------------------------------

    def want(self, request_id: str, positions: Sequence[int]) -> None:
        if positions and self.pool is not None:
            self._wanted[request_id] = frozenset(positions)

    def take_offers(self, block_state: Any) -> None:
        """Pin the wanted states vLLM offered this step (any earlier pin of the same state, from
        before a preemption, is freed)."""
        offers = getattr(block_state, "boundary_state_offloads", None) if self._wanted else None
        for request_id, entries in (offers or {}).items():
            wanted = self._wanted.get(request_id)
            if not wanted:
                continue
            for vllm_group, block_id, tokens in entries:
                group = self._index.get(vllm_group)
                if group is None or tokens not in wanted:
                    continue
                block = self.pool.blocks[block_id]
                self.pool.touch([block])
                old = self._pins.setdefault(request_id, {}).setdefault(tokens, {}).get(group)
                if old is not None:
                    self.pool.free_blocks([old])
                self._pins[request_id][tokens][group] = block

    def hand_over(self, request: "Request") -> list[CheckpointBlocks]:
        """At finish: the wanted states pinned for every Mamba group, in the wire form; their pins
        go with the lease (``release``). A state vLLM did not offer because the request's prefix
        hit covered it is pinned from the prefix cache; a wanted state in neither is counted."""
        request_id = request.request_id
        wanted = self._wanted.pop(request_id, frozenset())
        pins = self._pins.pop(request_id, {})
        out, keep = [], []
        for position in sorted(wanted):
            by_group = pins.pop(position, {})
            if len(by_group) < len(self._index):
                cached = self._cached_blocks(request, position)
                if cached is not None:
                    self.pool.touch(list(cached.values()))
                    self.pool.free_blocks(by_group.values())
                    by_group = cached
            state = checkpoints.state_blocks(self.layouts, position, {g: b.block_id for g, b in by_group.items()})
            if state is None:
                self.recorder.count("p_checkpoint_not_pinned")
                self.pool.free_blocks(by_group.values())
                continue
            out.append(state)
            keep.extend(by_group.values())
        for by_group in pins.values():
            self.pool.free_blocks(by_group.values())
        if keep:
            self._leased[request_id] = keep
        return out

    def drop(self, request_id: str) -> None:
        """A request that hands over nothing (aborted, no offset, a sibling's lease): unpin."""
        self._wanted.pop(request_id, None)
        for by_group in self._pins.pop(request_id, {}).values():
            self.pool.free_blocks(by_group.values())
        self.release((request_id,))

    def release(self, request_ids: Iterable[str]) -> None:
        """The leases of ``request_ids`` ended (finished_sending): unpin their checkpoints."""
        for request_id in request_ids:
            blocks = self._leased.pop(request_id, None)
            if blocks:
                self.pool.free_blocks(blocks)

    # -- D ---------------------------------------------------------------------------------

    def placeable(
        self, params: dict, decision: Accepted, num_prompt_tokens: int, withheld: bool
    ) -> tuple[CheckpointBlocks, ...]:
        """P's checkpoints D registers for ``decision`` on its ``num_prompt_tokens``-token prompt
        (core ``place_checkpoints``, for ``checkpoint_prompt_length``); each refusal is counted
        and logged once, and never refuses the handoff."""
        try:
            states = decode_checkpoints(params)
        except ProtocolError as exc:
            self._refuse([(0, exc.kind)], str(exc))
            return ()
        if not states:
            return ()
        if withheld or self.pool is None:
            self._refuse([(s.position, "withheld" if withheld else "no_block_pool") for s in states])
            return ()
        prompt_len = checkpoints.checkpoint_prompt_length(decision, num_prompt_tokens)
        placement = checkpoints.place_checkpoints(states, prompt_len, decision.replay_offset, self.layouts, self.rule)
        self._refuse(placement.refused)
        return placement.placed

    def _refuse(self, refused: Sequence[tuple[int, str]], why: str = "") -> None:
        for position, kind in refused:
            self.recorder.count(f"checkpoint_refused:{kind}")
            logger.info("pd_connector: not placing the prompt checkpoint at %d (%s) %s", position, kind, why)

    def reserve(self, request: "Request", placed: Sequence[CheckpointBlocks]) -> tuple[list[CheckpointBlocks], list]:
        """D blocks for the placed states not already in D's prefix cache: (the states to claim,
        their pairs per transfer group). Held until ``settle``, since the READ writes them."""
        if not placed:
            return [], None
        todo = [s for s in placed if not self._cached(request, s.position)]
        free = self.pool.get_num_free_blocks()
        mamba = sorted(self._index.values())
        if len(todo) * len(mamba) >= free:
            self._refuse([(s.position, "no_free_block") for s in todo])
            todo = []
        if not todo:
            return [], None
        blocks = self.pool.get_new_blocks(len(todo) * len(mamba))
        local = [[b.block_id for b in blocks[i * len(mamba) : (i + 1) * len(mamba)]] for i in range(len(todo))]
        self._placing[request.request_id] = (
            request,
            [(s.position, g, blocks[i * len(mamba) + j]) for i, s in enumerate(todo) for j, g in enumerate(mamba)],
        )
        return todo, checkpoints.checkpoint_pairs(self.layouts, todo, local)

    def _cached(self, request: "Request", position: int) -> bool:
        """This engine's prefix cache already holds the state at ``position`` in every Mamba group."""
        return self._cached_blocks(request, position) is not None

    def _cached_blocks(self, request: "Request", position: int) -> "dict[int, KVCacheBlock] | None":
        """The prefix cache's blocks holding ``request``'s state at ``position`` (transfer-group
        index -> block), looked up by the hash vLLM's caching keys it under; None unless every
        Mamba group has one."""
        from vllm.v1.core.kv_cache_utils import resolve_block_hashes

        pool = self.pool
        found: dict[int, KVCacheBlock] = {}
        for group, vllm_group in zip(range(len(self.layouts)), self.group_ids):
            layout = self.layouts[group]
            if layout.kind != MAMBA:
                continue
            index, partial = checkpoints.checkpoint_slot(position, layout.block_size)
            if partial:
                block_hash = request.block_hashes[position // pool.hash_block_size - 1]
            else:
                block_hash = resolve_block_hashes(request.block_hashes, pool.hash_block_size, layout.block_size)[index]
            cached = pool.get_cached_block(block_hash, [vllm_group])
            if not cached:
                return None
            found[group] = cached[0]
        return found

    def settle(self, finished: Iterable[str], failed: Iterable[str]) -> None:
        """Loads that ended: register what was read (not a failed load's blocks), then free."""
        failed = set(failed)
        for request_id in finished:
            entry = self._placing.pop(request_id, None)
            if entry is None:
                continue
            request, blocks = entry
            if request_id not in failed:
                for position, group, block in blocks:
                    self._register(request, position, group, block)
                self.recorder.count("checkpoint_registered", len({p for p, _, _ in blocks}))
            self.pool.free_blocks([block for _, _, block in blocks])

    def _register(self, request: "Request", position: int, group: int, block: "KVCacheBlock") -> None:
        """Key ``block`` as vLLM's caching keys the state at ``position`` of ``request``."""
        block_size, vllm_group = self.layouts[group].block_size, self.group_ids[group]
        index, partial = checkpoints.checkpoint_slot(position, block_size)
        if partial:
            self.pool.cache_partial_block(request, block, position, vllm_group, block_size)
        else:
            table = [self.pool.null_block] * index + [block]
            self.pool.cache_full_blocks(request, table, index, index + 1, block_size, vllm_group)
