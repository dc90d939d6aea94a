"""Which of P's blocks feed which of D's blocks, per KV-cache group, for one replay offset.

Pure: ints, tuples and msgspec Structs. The adapters turn vLLM's ``KVCacheGroupSpec`` into
``GroupLayout``; D's scheduler hands its vLLM block tables over with a converter
(``BlockIdsOf``), so that only the blocks it pairs become ints.

Invariants (property-tested in tests/unit/test_pairing.py):
- vLLM's null block (id 0) and Mamba speculative scratch slots are never shipped or written.
- Attention-type groups pair *by token position*: P's block holding tokens [i*B, (i+1)*B) feeds
  D's block for the same tokens, for the blocks D did not already hit in its own prefix cache.
- Each Mamba group ships exactly one slot, the state after ``offset`` tokens, into the slot D
  resumes from. Trims are written as forward slices: ``lst[-n:]`` is the whole list for n = 0.
- Attention groups whose block sizes differ between P and D (one an integral multiple of the
  other) pair *sub-blocks* of the smaller size: each pair names the *phase* (which sub-block of
  the larger side's block) next to the two block ids (``BlockPairs.phases``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

NULL_BLOCK = 0
ATTENTION = "attention"
SLIDING_WINDOW = "sliding_window"
MAMBA = "mamba"
GROUP_KINDS = (ATTENTION, SLIDING_WINDOW, MAMBA)


class PairingError(ValueError):
    """The block tables cannot carry this handoff (a bug or tampered input, never silent)."""


def recut_ratio(kind: str, remote_block_size: int, local_block_size: int) -> int | None:
    """``block_ratio`` for a group of ``kind`` whose sizes differ, or None where its blocks
    cannot be re-cut (a Mamba group, or neither size dividing the other)."""
    if kind not in (ATTENTION, SLIDING_WINDOW):
        return None
    try:
        return block_ratio(remote_block_size, local_block_size)
    except PairingError:
        return None


def block_ratio(remote_block_size: int, local_block_size: int) -> int:
    """How many of the smaller side's blocks one of the larger side's holds (1: equal sizes);
    ``PairingError`` when neither size divides the other (no sub-block is whole on both)."""
    small, large = sorted((remote_block_size, local_block_size))
    if small <= 0 or large % small:
        raise PairingError(
            f"block sizes {remote_block_size} (prefill) and {local_block_size} (decode): "
            "not an integral ratio"
        )
    return large // small


class GroupLayout(msgspec.Struct, frozen=True):
    kind: str
    block_size: int
    sliding_window: int = 0
    # Mamba: trailing speculative scratch slots in the request's block table (vLLM's
    # ``MambaSpec.num_speculative_blocks``). They hold draft states, never the prompt's state.
    num_speculative_blocks: int = 0
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {self.kind!r}; expected one of {GROUP_KINDS}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")


def wire_block_sizes(layouts: Sequence[GroupLayout]) -> list[int]:
    """Block sizes as the params and the handshake carry them: 0 for a Mamba group, whose one
    state per block does not depend on it."""
    return [0 if layout.kind == MAMBA else layout.block_size for layout in layouts]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_first_block(layout: GroupLayout, offset: int) -> int:
    """First block a sliding-window group still needs to resume at ``offset``: the window of
    token ``offset`` covers tokens [offset - W + 1, offset]. vLLM nulls the blocks before it
    (SlidingWindowManager.get_num_skipped_tokens) before the table reaches the connector."""
    return max(0, offset - layout.sliding_window + 1) // layout.block_size


def mamba_state_index(layout: GroupLayout, table_len: int) -> int | None:
    """Position of the running state in a Mamba block table of ``table_len`` slots.

    Mirrors vLLM's ``clip_ssm_state_blocks`` (kv_connector/utils.py): drop up to
    ``num_speculative_blocks`` trailing scratch slots (keeping at least one), then take the last.
    None for an empty table.
    """
    if table_len <= 0:
        return None
    return table_len - 1 - min(layout.num_speculative_blocks, table_len - 1)


def mamba_state_slot(layout: GroupLayout, ids: Sequence[int]) -> int | None:
    """The slot of a Mamba block table that holds the running state (``mamba_state_index``).
    Returns None when the table holds no usable slot (empty or null)."""
    index = mamba_state_index(layout, len(ids))
    if index is None:
        return None
    slot = ids[index]
    return None if slot == NULL_BLOCK else slot


def select_source_blocks(
    layouts: tuple[GroupLayout, ...], block_ids: tuple[list[int], ...], offset: int
) -> list[list[int]]:
    """P side: the blocks that carry KV of tokens [0, offset) and the recurrent state at offset.

    ``block_ids`` is P's per-group table at finish (vLLM ``request_finished_all_groups``).
    Attention groups: the first ``cdiv(offset, B)`` blocks. Sliding-window groups: the trailing
    blocks of that range that the window still needs. Mamba groups: the state slot.
    """
    if len(layouts) != len(block_ids):
        raise PairingError(f"{len(block_ids)} block lists for {len(layouts)} KV-cache groups")
    if offset <= 0:
        return [[] for _ in layouts]
    out: list[list[int]] = []
    for group, (layout, ids) in enumerate(zip(layouts, block_ids)):
        if layout.kind == MAMBA:
            slot = mamba_state_slot(layout, list(ids))
            if slot is None:
                raise PairingError(f"group {group}: no Mamba state slot in {ids}")
            out.append([slot])
            continue
        n = cdiv(offset, layout.block_size)
        if len(ids) < n:
            raise PairingError(
                f"group {group}: {len(ids)} blocks cannot hold {offset} tokens of "
                f"block size {layout.block_size}"
            )
        blocks = list(ids[:n])
        if layout.kind == SLIDING_WINDOW:
            blocks = blocks[window_first_block(layout, offset) :]
        if NULL_BLOCK in blocks:
            raise PairingError(f"group {group}: null block among the blocks to send {blocks}")
        out.append(blocks)
    return out


class BlockPairs:
    """One group's ``(P block, D block)`` pairs, held as two equal-length id lists.

    D pairs every handoff inside vLLM's scheduling step; building these from two list slices
    (or P's list itself) instead of one tuple per block is what keeps long prompts cheap there
    (``python -m benchmarks scheduler``). It reads as the sequence of pairs (``len``,
    iteration, indexing, ``==`` with a list of tuples), and ``numpy.array(pairs)`` is the
    ``(n, 2)`` array the worker's descriptor arithmetic (``descriptors.descriptor_indices``) wants.

    ``phases`` (unequal block sizes only, else None): per pair, which sub-block of the larger
    side's block the pair moves (``block_ratio`` of them per block, phase 0 first).
    """

    __slots__ = ("remote", "local", "phases")

    def __init__(self, remote: list[int], local: list[int], phases: list[int] | None = None):
        if len(remote) != len(local) or (phases is not None and len(phases) != len(local)):
            raise PairingError(f"{len(remote)} P blocks for {len(local)} D blocks")
        self.remote = remote
        self.local = local
        self.phases = phases

    def __len__(self) -> int:
        return len(self.local)

    def __iter__(self):
        return zip(self.remote, self.local)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return self.remote[i], self.local[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockPairs):
            return (self.remote, self.local, self.phases) == (other.remote, other.local, other.phases)
        if self.phases is not None:
            return NotImplemented
        try:
            return list(self) == list(other)  # type: ignore[call-overload]
        except TypeError:
            return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.array([self.remote, self.local], dtype=dtype).T.reshape(len(self), 2)

    def __reduce__(self):
        return BlockPairs, (self.remote, self.local, self.phases)

    def __repr__(self) -> str:
        phases = "" if self.phases is None else f", phases={self.phases!r}"
        return f"BlockPairs({list(self)!r}{phases})"


def pair_blocks(
    layouts: tuple[GroupLayout, ...],
    remote_ids: list[list[int]],
    local_ids: tuple[list[int], ...],
    offset: int,
    local_hit: int,
) -> list[list[tuple[int, int]]]:
    """``pair_block_lists`` as plain lists of ``(P block, D block)`` tuples."""
    return [list(group_pairs) for group_pairs in pair_block_lists(layouts, remote_ids, local_ids, offset, local_hit)]


# Long: one loop over the groups inside vLLM's scheduling step, where each Python frame costs.
def pair_block_lists(
    layouts: tuple[GroupLayout, ...],
    remote_ids: list[list[int]],
    local_tables: Sequence[Sequence[Any]],
    offset: int,
    local_hit: int,
    *,
    block_ids: Callable[[Sequence[Any]], list[int]] = list,
    remote_checked: bool = False,
    remote_block_sizes: Sequence[int] | None = None,
) -> list[BlockPairs]:
    """D side: ``(P block, D block)`` pairs per group for a load of tokens [local_hit, offset).

    ``remote_ids`` is what P sent (``select_source_blocks``); ``local_tables`` is D's per-group
    block table after allocation (local prefix hit included); ``local_hit`` is the block-aligned
    number of tokens D already had. ``block_ids`` turns a run of table entries into block ids
    (default: the tables hold ids); D's scheduler passes vLLM's own tables of ``KVCacheBlock``
    so that only the blocks paired are converted: a 4k-token prompt has 256 blocks per group,
    and a Mamba group's table is as long as an attention group's though one slot is read.

    ``remote_checked``: the caller guarantees every remote id is a positive int (D's scheduler:
    ``params.BlockId``, checked by msgspec when the params were decoded), so the per-id
    re-check is skipped (it costs as much as the conversion: docs/benchmarks.md, "Scheduler-side
    cost"); every shape check, and every check of D's own table, still runs.

    Raises ``PairingError`` when the shapes cannot be reconciled (tampered params or a P with a
    different layout) so the caller recomputes instead.

    One loop over the groups (D pairs inside vLLM's scheduling step, where each Python frame
    costs; ``python -m benchmarks scheduler``), but the slot rule stays in mamba_state_index.
    Attention-type groups pair ``(remote[pos - base], local[pos])`` for ``pos`` in
    ``[first, n)``, as two slices (P's list itself when all of it is paired: nobody mutates a
    handoff's block lists).

    ``remote_block_sizes``: P's block size per group (``pd_block_sizes``; None: D's own). An
    attention group whose size differs pairs sub-blocks (``sub_block_pairs``).
    """
    if remote_block_sizes is not None and len(remote_block_sizes) != len(layouts):
        raise PairingError(f"{len(remote_block_sizes)} prefill block sizes for {len(layouts)} groups")
    if len(layouts) != len(remote_ids) or len(layouts) != len(local_tables):
        raise PairingError(
            f"group count mismatch: {len(layouts)} local groups, {len(remote_ids)} remote "
            f"lists, {len(local_tables)} local lists"
        )
    if not 0 <= local_hit < offset:
        raise PairingError(f"nothing to load: local hit {local_hit}, offset {offset}")
    pairs: list[BlockPairs] = []
    for group, (layout, remote, local) in enumerate(zip(layouts, remote_ids, local_tables)):
        if layout.kind == MAMBA:
            if len(remote) != 1 or remote[0] <= NULL_BLOCK:
                raise PairingError(f"group {group}: P sent {len(remote)} Mamba slots, expected 1")
            # One rule for the state slot (scratch slots excluded): mamba_state_index.
            index = mamba_state_index(layout, len(local))
            slot = NULL_BLOCK if index is None else block_ids(local[index : index + 1])[0]
            if slot == NULL_BLOCK:
                raise PairingError(f"group {group}: D has no Mamba state slot in {block_ids(local)}")
            pairs.append(BlockPairs([remote[0]], [slot]))
            continue
        block_size = layout.block_size
        if remote_block_sizes is not None and remote_block_sizes[group] != block_size:
            pairs.append(
                sub_block_pairs(group, layout, remote_block_sizes[group], remote, block_ids(local), offset, local_hit)
            )
            continue
        n = cdiv(offset, block_size)
        if len(local) < n:
            raise PairingError(f"group {group}: D allocated {len(local)} blocks for {offset} tokens")
        if not remote_checked and remote and min(remote) <= NULL_BLOCK:
            raise PairingError(f"group {group}: P sent a null or negative block id: {remote}")
        # Position of remote[0] in the token sequence (sliding windows send only the window).
        base = window_first_block(layout, offset) if layout.kind == SLIDING_WINDOW else 0
        if len(remote) != n - base:
            raise PairingError(f"group {group}: P sent {len(remote)} blocks, offset {offset} needs {n - base}")
        first = max(local_hit // block_size, base)
        targets = block_ids(local if first == 0 and n == len(local) else local[first:n])
        if NULL_BLOCK in targets:
            pos = first + targets.index(NULL_BLOCK)
            raise PairingError(f"group {group}: D's block table has a null at {pos}: {block_ids(local)}")
        pairs.append(BlockPairs(remote if first == base else remote[first - base :], targets))
    return pairs


def sub_block_pairs(
    group: int,
    layout: GroupLayout,
    remote_block_size: int,
    remote: Sequence[int],
    local: Sequence[int],
    offset: int,
    local_hit: int,
) -> BlockPairs:
    """One attention group's pairs when P's block size differs from D's (``layout``'s): per
    sub-block of the smaller size s holding tokens [u*s, (u+1)*s), P's block and D's block
    holding them, and the sub-block's phase in the larger one. The same tokens as equal sizes
    pair: from D's own hit (or the window's first token) up to the one holding token
    ``offset - 1``, P's list starting at its own window's first block."""
    if layout.kind not in (ATTENTION, SLIDING_WINDOW):
        raise PairingError(f"group {group}: {layout.kind} groups have no token blocks to re-cut")
    ratio = block_ratio(remote_block_size, layout.block_size)
    small = min(remote_block_size, layout.block_size)
    per_remote, per_local = remote_block_size // small, layout.block_size // small
    first_token = max(0, offset - layout.sliding_window + 1) if layout.kind == SLIDING_WINDOW else 0
    base = first_token // remote_block_size if layout.kind == SLIDING_WINDOW else 0
    if len(remote) != cdiv(offset, remote_block_size) - base:
        raise PairingError(
            f"group {group}: P sent {len(remote)} blocks of {remote_block_size} tokens, offset "
            f"{offset} needs {cdiv(offset, remote_block_size) - base}"
        )
    if min(remote, default=1) <= NULL_BLOCK:
        raise PairingError(f"group {group}: P sent a null or negative block id: {list(remote)}")
    if len(local) < cdiv(offset, layout.block_size):
        raise PairingError(f"group {group}: D allocated {len(local)} blocks for {offset} tokens")
    units = range(max(local_hit, first_token) // small, cdiv(offset, small))
    targets = [local[u // per_local] for u in units]
    if NULL_BLOCK in targets:
        pos = units[targets.index(NULL_BLOCK)] // per_local
        raise PairingError(f"group {group}: D's block table has a null at {pos}: {list(local)}")
    sources = [remote[u // per_remote - base] for u in units]
    phases = [u % ratio for u in units]
    return BlockPairs(sources, targets, phases)
