"""Pure tests of pd_connector.core.pairing: which of P's blocks feed which of D's blocks.

Block tables are generated the way vLLM 0.32 shapes them (docs/architecture.md, "vLLM 0.32 behaviour the core mirrors"):
- attention: >= cdiv(R, B) unique non-null ids;
- sliding window: the same, with null (0) ids for the blocks vLLM's
  ``SlidingWindowManager.remove_skipped_blocks`` already dropped: blocks [0, skipped // B) with
  skipped = max(0, R - W + 1 - extra_retained_tokens) (``get_num_skipped_tokens``);
- Mamba ``none`` mode: [state] + scratch slots; ``align`` mode: position-indexed
  [null or checkpoint..., state] + scratch slots.
No vLLM, NIXL, torch or sockets.
"""

from __future__ import annotations

import itertools
import math
import pickle
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.pairing import (
    ATTENTION,
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupLayout,
    BlockPairs,
    PairingError,
    pair_block_lists,
    cdiv,
    mamba_state_index,
    mamba_state_slot,
    pair_blocks,
    select_source_blocks,
    window_first_block,
)

# Example counts keep the six pure-core files under ~20 s of CPU together; the cheap exhaustive
# loops below cover the small configurations.
SETTINGS = settings(max_examples=300, deadline=None)
FEWER = settings(max_examples=150, deadline=None)
FEWEST = settings(max_examples=100, deadline=None)

block_sizes = st.one_of(
    st.integers(1, 64), st.sampled_from([1, 2, 3, 5, 7, 12, 16, 24, 32, 48, 63, 64])
)


@st.composite
def layouts(draw, kinds=(ATTENTION, SLIDING_WINDOW, MAMBA)):
    kind = draw(st.sampled_from(kinds))
    if kind == MAMBA:
        return GroupLayout(
            kind=MAMBA,
            block_size=draw(block_sizes),
            num_speculative_blocks=draw(st.integers(0, 3)),
            mamba_cache_mode=draw(st.sampled_from(["none", "align"])),
        )
    if kind == SLIDING_WINDOW:
        return GroupLayout(
            kind=SLIDING_WINDOW, block_size=draw(block_sizes), sliding_window=draw(st.integers(1, 300))
        )
    return GroupLayout(kind=ATTENTION, block_size=draw(block_sizes))


class Ids:
    """Unique non-null block ids with random gaps (one allocator per engine). Driven by a
    hypothesis-drawn seed: drawing every id through hypothesis is needlessly slow."""

    def __init__(self, draw):
        self.rng = random.Random(draw(st.integers(0, 2**32 - 1)))
        self.next = self.rng.randint(1, 1000)

    def take(self, k: int = 1) -> list[int]:
        out = []
        for _ in range(k):
            out.append(self.next)
            self.next += self.rng.randint(1, 3)
        return out


def vllm_skipped_tokens(layout: GroupLayout, computed: int, extra_retained: int = 0) -> int:
    """vLLM's ``SlidingWindowManager.get_num_skipped_tokens``."""
    return max(0, computed - layout.sliding_window + 1 - extra_retained)


def vllm_null_blocks(layout: GroupLayout, computed: int, extra_retained: int = 0) -> int:
    """Blocks [0, k) that ``remove_skipped_blocks`` has replaced by the null block."""
    return vllm_skipped_tokens(layout, computed, extra_retained) // layout.block_size


@dataclass
class Table:
    ids: list[int]
    state: int | None = None  # Mamba: the slot holding the running state
    scratch: list[int] = field(default_factory=list)


def make_table(ids: Ids, layout: GroupLayout, offset: int, nulls: int) -> Table:
    """A per-request block table for ``offset`` computed tokens (plus 0..2 spare blocks)."""
    if layout.kind == MAMBA:
        scratch = ids.take(layout.num_speculative_blocks)
        state = ids.take()[0]
        if layout.mamba_cache_mode == "none":
            return Table([state] + scratch, state, scratch)
        slots = cdiv(offset, layout.block_size)
        # Earlier positions: null (skipped) or a retained checkpoint state.
        prefix = [ids.rng.choice([NULL_BLOCK, ids.take()[0]]) for _ in range(slots - 1)]
        return Table(prefix + [state] + scratch, state, scratch)
    n = cdiv(offset, layout.block_size) + ids.rng.randint(0, 2)
    table = ids.take(n)
    for i in range(min(nulls, n)):
        table[i] = NULL_BLOCK
    return Table(table)


@dataclass
class Scenario:
    layouts: tuple[GroupLayout, ...]
    offset: int
    local_hit: int
    p: list[Table]
    d: list[Table]

    def p_ids(self):
        return tuple(t.ids for t in self.p)

    def d_ids(self):
        return tuple(t.ids for t in self.d)


@st.composite
def scenarios(draw, kinds=(ATTENTION, SLIDING_WINDOW, MAMBA), max_groups=4):
    groups = tuple(draw(st.lists(layouts(kinds), min_size=1, max_size=max_groups)))
    offset = draw(st.integers(1, 400))
    attn_sizes = [g.block_size for g in groups if g.kind != MAMBA]
    unit = math.lcm(*attn_sizes) if attn_sizes else 1
    local_hit = unit * draw(st.integers(0, (offset - 1) // unit))
    p_ids, d_ids = Ids(draw), Ids(draw)
    p_tables, d_tables = [], []
    for g in groups:
        if g.kind == SLIDING_WINDOW:
            # Both sides computed (P) or allocated for (D) `offset` tokens: vLLM nulls what the
            # window skips, minus its extra retained tokens (often 0, hence the weight on 0).
            extra = st.one_of(st.just(0), st.integers(0, 2 * g.sliding_window))
            p_nulls = vllm_null_blocks(g, offset, draw(extra))
            d_nulls = vllm_null_blocks(g, offset, draw(extra))
        else:
            p_nulls = d_nulls = 0
        p_tables.append(make_table(p_ids, g, offset, p_nulls))
        d_tables.append(make_table(d_ids, g, offset, d_nulls))
    return Scenario(groups, offset, local_hit, p_tables, d_tables)


def first_paired_block(layout: GroupLayout, offset: int, local_hit: int) -> int:
    """The first token-block position D loads for an attention-type group."""
    start = local_hit // layout.block_size
    if layout.kind == SLIDING_WINDOW:
        start = max(start, window_first_block(layout, offset))
    return start


# --- helpers ----------------------------------------------------------------------------------


def test_cdiv():
    for a, b in itertools.product(range(0, 200), range(1, 70)):
        assert cdiv(a, b) == math.ceil(a / b)


def test_group_layout_validates_kind_and_block_size():
    with pytest.raises(ValueError):
        GroupLayout(kind="full_attention", block_size=16)
    with pytest.raises(ValueError):
        GroupLayout(kind=ATTENTION, block_size=0)


@pytest.mark.parametrize(
    "nsb, ids, expected",
    [
        (0, [7], 7),
        (2, [7, 8, 9], 7),  # none mode: [state, scratch, scratch]
        (2, [7], 7),  # fewer slots than scratch: keep at least one
        (1, [0, 0, 7, 8], 7),  # align mode: [null, null, state, scratch]
        (0, [0, 3, 7], 7),
        (1, [0, 8], None),  # only a null left after clipping
        (3, [], None),
    ],
)
def test_mamba_state_slot_examples(nsb, ids, expected):
    layout = GroupLayout(kind=MAMBA, block_size=16, num_speculative_blocks=nsb)
    assert mamba_state_slot(layout, ids) == expected


def test_window_first_block_is_the_block_of_the_first_token_the_window_reads():
    """Exhaustive: token R (the first one D recomputes) attends to [R - W + 1, R]; the first
    needed block is the one holding max(0, R - W + 1), it never lies past the blocks of R
    tokens, and it is exactly where vLLM's nulls end when no extra tokens are retained."""
    for b, w, r in itertools.product(range(1, 20), range(1, 60), range(1, 120)):
        layout = GroupLayout(kind=SLIDING_WINDOW, block_size=b, sliding_window=w)
        k = window_first_block(layout, r)
        first_token = max(0, r - w + 1)
        assert k == first_token // b
        assert k * b <= first_token < (k + 1) * b
        assert 0 <= k <= cdiv(r, b)
        assert k == vllm_null_blocks(layout, r)
        if w > 1:
            assert k < cdiv(r, b)  # some KV before R is still needed
        # Monotone in R, antitone in W.
        assert window_first_block(layout, r + 1) >= k
        wider = GroupLayout(kind=SLIDING_WINDOW, block_size=b, sliding_window=w + 1)
        assert window_first_block(wider, r) <= k


@pytest.mark.parametrize(
    "b, w, r, expected",
    [
        (4, 6, 22, 4),  # window of token 22 is [17, 22]: block 4 = tokens 16..19
        (16, 32, 96, 4),  # [65, 96] -> block 4 (64..79)
        (16, 32, 95, 4),  # [64, 95] -> block 4
        (16, 32, 94, 3),  # [63, 94] -> block 3
        (16, 4096, 100, 0),  # window longer than the prompt
        (1, 3, 10, 8),
        (16, 1, 32, 2),  # W = 1: nothing before R is read
    ],
)
def test_window_first_block_examples(b, w, r, expected):
    assert window_first_block(GroupLayout(SLIDING_WINDOW, b, sliding_window=w), r) == expected


# --- select_source_blocks ---------------------------------------------------------------------


@FEWER
@given(scenarios())
def test_select_source_blocks_never_ships_null_or_scratch(sc):
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    assert len(sent) == len(sc.layouts)
    for layout, table, blocks in zip(sc.layouts, sc.p, sent):
        assert NULL_BLOCK not in blocks
        assert not set(blocks) & set(table.scratch)
        n = cdiv(sc.offset, layout.block_size)
        if layout.kind == ATTENTION:
            assert blocks == table.ids[:n]
        elif layout.kind == SLIDING_WINDOW:
            assert blocks == table.ids[window_first_block(layout, sc.offset) : n]
            assert len(blocks) == n - window_first_block(layout, sc.offset)
        else:
            assert blocks == [table.state]
    assert select_source_blocks(sc.layouts, sc.p_ids(), 0) == [[] for _ in sc.layouts]


def test_select_source_blocks_group_count_mismatch():
    layouts_ = (GroupLayout(ATTENTION, 16), GroupLayout(MAMBA, 16))
    with pytest.raises(PairingError):
        select_source_blocks(layouts_, ([1, 2],), 20)
    with pytest.raises(PairingError):
        select_source_blocks(layouts_, ([1, 2], [3], [4]), 20)


@pytest.mark.parametrize("kind", [ATTENTION, SLIDING_WINDOW])
def test_select_source_blocks_too_short_table(kind):
    with pytest.raises(PairingError):
        select_source_blocks((GroupLayout(kind, 16, sliding_window=8),), ([1],), 17)


@pytest.mark.parametrize("table", [[], [0], [0, 5], [0, 5, 6]])
def test_select_source_blocks_mamba_without_state_slot(table):
    layout = GroupLayout(MAMBA, 16, num_speculative_blocks=len(table) - 1 if table else 0)
    with pytest.raises(PairingError):
        select_source_blocks((layout,), (table,), 10)


def test_select_source_blocks_null_in_attention_prefix_raises():
    with pytest.raises(PairingError):
        select_source_blocks((GroupLayout(ATTENTION, 4),), ([3, 0, 5],), 9)


def test_select_source_blocks_null_inside_sliding_window_range_raises_exhaustive():
    """A null at any position of [window_first_block, cdiv(R, B)) is refused; a null before it
    (what vLLM dropped) is not shipped at all."""
    for b, w, r in itertools.product((1, 2, 3, 4, 7), (1, 2, 5, 8, 13), range(1, 40)):
        layout = GroupLayout(SLIDING_WINDOW, b, sliding_window=w)
        n, k = cdiv(r, b), window_first_block(layout, r)
        table = list(range(100, 100 + n + 1))
        for i in range(n + 1):
            holed = table[:i] + [NULL_BLOCK] + table[i + 1 :]
            if k <= i < n:
                with pytest.raises(PairingError):
                    select_source_blocks((layout,), (holed,), r)
            else:
                assert select_source_blocks((layout,), (holed,), r) == [holed[k:n]], (b, w, r, i)


@pytest.mark.parametrize(
    "offset, block_size, window",
    [(96, 16, 32), (95, 16, 32), (64, 8, 16), (10, 1, 3), (8192, 16, 4096)],
)
def test_select_source_blocks_accepts_sliding_window_table_nulled_before_window(
    offset, block_size, window
):
    """Regression: the old rule shipped the trailing cdiv(W, B) + 1 blocks, whose first one
    could be a block vLLM had already nulled (Scheduler._connector_finished ->
    remove_skipped_blocks), so select_source_blocks raised on a perfectly valid table."""
    layout = GroupLayout(SLIDING_WINDOW, block_size, sliding_window=window)
    n = cdiv(offset, block_size)
    skipped = vllm_null_blocks(layout, offset)  # what vLLM nulls at request_finished
    assert skipped == window_first_block(layout, offset)
    p_table = [NULL_BLOCK] * skipped + list(range(100, 100 + n - skipped))
    sent = select_source_blocks((layout,), (p_table,), offset)
    # Exactly the blocks holding tokens the window of token R still reads.
    assert sent == [p_table[skipped:n]]
    d_table = [NULL_BLOCK] * skipped + list(range(500, 500 + n - skipped))
    pairs = pair_blocks((layout,), sent, (d_table,), offset, 0)
    assert pairs[0] == [(p_table[i], d_table[i]) for i in range(skipped, n)]


# --- pair_blocks ------------------------------------------------------------------------------


def expected_pairs(sc: Scenario) -> list[list[tuple[int, int]]]:
    out = []
    for layout, p, d in zip(sc.layouts, sc.p, sc.d):
        if layout.kind == MAMBA:
            out.append([(p.state, d.state)])
            continue
        n = cdiv(sc.offset, layout.block_size)
        start = first_paired_block(layout, sc.offset, sc.local_hit)
        out.append([(p.ids[i], d.ids[i]) for i in range(start, n)])
    return out


@SETTINGS
@given(scenarios())
def test_pair_blocks_is_position_consistent_and_complete(sc):
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    pairs = pair_blocks(sc.layouts, sent, sc.d_ids(), sc.offset, sc.local_hit)
    assert pairs == expected_pairs(sc)
    written = []
    for layout, p, d, group_pairs in zip(sc.layouts, sc.p, sc.d, pairs):
        for src, dst in group_pairs:
            assert src != NULL_BLOCK and dst != NULL_BLOCK
            assert src not in p.scratch and dst not in d.scratch
            written.append(dst)
        if layout.kind == MAMBA:
            assert group_pairs == [(p.state, d.state)]
            continue
        b = layout.block_size
        n = cdiv(sc.offset, b)
        first_needed = sc.local_hit // b
        p_pos = {b: i for i, b in enumerate(p.ids) if b != NULL_BLOCK}  # ids are unique
        d_pos = {b: i for i, b in enumerate(d.ids) if b != NULL_BLOCK}
        positions = []
        for src, dst in group_pairs:
            i = d_pos[dst]
            # P block at token-block index i feeds D block at index i.
            assert p_pos[src] == i
            # Never a D block below the local hit, never past the offset.
            assert first_needed <= i < n
            positions.append(i)
        if layout.kind == ATTENTION:
            # Exactly the blocks D lacks: [local_hit / B, cdiv(R, B)).
            assert positions == list(range(first_needed, n))
        else:
            # Exactly the blocks of D's the window of token R reads ([R - W + 1, R]) that D
            # did not already hit.
            needed_from = max(first_needed, max(0, sc.offset - layout.sliding_window + 1) // b)
            assert positions == list(range(needed_from, n))
    assert len(written) == len(set(written)), "a D block is written twice"


@FEWEST
@given(scenarios(kinds=(ATTENTION,), max_groups=2))
def test_attention_pairs_cover_tokens_local_hit_to_offset(sc):
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    pairs = pair_blocks(sc.layouts, sent, sc.d_ids(), sc.offset, sc.local_hit)
    for layout, group_pairs in zip(sc.layouts, pairs):
        b = layout.block_size
        covered = len(group_pairs) * b
        # Loaded blocks span [local_hit, cdiv(R,B)*B): every token of [local_hit, R) and no
        # more than one partial block beyond R.
        assert sc.local_hit + covered >= sc.offset
        assert sc.local_hit + covered - sc.offset < b


def test_pair_blocks_mamba_ships_state_slot_not_scratch():
    """Regression for vLLM #50153's failure modes: P's scratch slot must never be written over
    D's scratch, nor loaded instead of the state slot, in either cache mode."""
    none_mode = GroupLayout(MAMBA, 1024, num_speculative_blocks=2)
    align = GroupLayout(MAMBA, 16, num_speculative_blocks=1, mamba_cache_mode="align")
    attn = GroupLayout(ATTENTION, 16)
    p = ([1, 2, 3, 4], [10, 11, 12], [0, 0, 20, 21])
    d = ([5, 6, 7, 8], [40, 41, 42], [0, 0, 50, 51])
    sent = select_source_blocks((attn, none_mode, align), p, 40)
    assert sent == [[1, 2, 3], [10], [20]]
    pairs = pair_blocks((attn, none_mode, align), sent, d, 40, 16)
    assert pairs == [[(2, 6), (3, 7)], [(10, 40)], [(20, 50)]]


def test_pair_blocks_sliding_window_pairs_only_the_window():
    layout = GroupLayout(SLIDING_WINDOW, 4, sliding_window=6)
    # R = 22: token 22 reads 17..22, i.e. blocks 4 (16..19) and 5 (20..23) of n = 6.
    sent = select_source_blocks((layout,), ([1, 2, 3, 4, 5, 6],), 22)
    assert sent == [[5, 6]]
    d = [0, 0, 0, 0, 70, 71]  # vLLM nulled the blocks wholly before token 17
    assert pair_blocks((layout,), sent, (d,), 22, 0) == [[(5, 70), (6, 71)]]
    # A local hit inside the window: only the block past it is loaded.
    assert pair_blocks((layout,), sent, (d,), 22, 20) == [[(6, 71)]]
    # The old tail rule's length (cdiv(W, B) + 1 = 3 blocks) is refused.
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[4, 5, 6]], (d,), 22, 0)


@pytest.mark.parametrize("d", [[0, 0, 0, 0, 0, 71], [0, 0, 0, 0, 70, 0]])
def test_pair_blocks_sliding_window_null_inside_window_raises(d):
    """A null where the window still reads: D would count those tokens as loaded."""
    layout = GroupLayout(SLIDING_WINDOW, 4, sliding_window=6)
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[5, 6]], (d,), 22, 0)


def test_pair_blocks_sliding_window_w1_block_aligned_ships_nothing():
    """W = 1 at a block boundary: token R reads only itself, so no block is shipped or paired
    (and any remote block is refused)."""
    layout = GroupLayout(SLIDING_WINDOW, 4, sliding_window=1)
    assert select_source_blocks((layout,), ([0, 0, 0, 0],), 16) == [[]]
    assert pair_blocks((layout,), [[]], ([0, 0, 0, 0],), 16, 0) == [[]]
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[9]], ([0, 0, 0, 7],), 16, 0)


# --- mismatched or tampered inputs raise ------------------------------------------------------


def some_positions(k: int) -> list[int]:
    """Both ends and the middle of range(k): every kind of position, at O(1) cost per list
    (tampering every position makes the test quadratic in the table length)."""
    return sorted({i for i in (0, 1, k // 2, k - 2, k - 1) if 0 <= i < k})


def tampered_variants(sc: Scenario, sent: list[list[int]]):
    """Every way of mismatching P's lists, D's lists and the offsets that must be refused."""
    remote, local = [list(x) for x in sent], [list(x) for x in sc.d_ids()]
    yield "drop remote group", remote[:-1], local, sc.local_hit
    yield "extra remote group", remote + [[12345]], local, sc.local_hit
    yield "drop local group", remote, local[:-1], sc.local_hit
    yield "extra local group", remote, local + [[12345]], sc.local_hit
    for g, layout in enumerate(sc.layouts):
        grown = [list(x) for x in remote]
        grown[g].append(99999)
        yield f"group {g}: one remote block too many", grown, local, sc.local_hit
        for i in some_positions(len(remote[g])):
            shrunk = [list(x) for x in remote]
            del shrunk[g][i]
            yield f"group {g}: remote block {i} dropped", shrunk, local, sc.local_hit
            for bad in (NULL_BLOCK, -1):
                nulled = [list(x) for x in remote]
                nulled[g][i] = bad
                yield f"group {g}: remote block {i} replaced by {bad}", nulled, local, sc.local_hit
        if layout.kind != MAMBA:
            n = cdiv(sc.offset, layout.block_size)
            short = [list(x) for x in local]
            short[g] = short[g][: n - 1]
            yield f"group {g}: D table one block short", remote, short, sc.local_hit
            first = first_paired_block(layout, sc.offset, sc.local_hit)
            for pos in some_positions(n - first):
                holed = [list(x) for x in local]
                holed[g][first + pos] = NULL_BLOCK
                yield f"group {g}: D null at paired position {first + pos}", remote, holed, sc.local_hit
    for hit in (-1, -sc.offset, sc.offset, sc.offset + 1):
        yield f"local hit {hit}", remote, local, hit


@FEWER
@given(scenarios())
def test_pair_blocks_rejects_mismatched_inputs(sc):
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    for what, remote, local, hit in tampered_variants(sc, sent):
        with pytest.raises(PairingError):
            pair_blocks(sc.layouts, remote, tuple(local), sc.offset, hit)
            pytest.fail(f"paired silently: {what}")


@pytest.mark.parametrize("remote", [[], [1, 2]])
def test_pair_blocks_mamba_wants_exactly_one_slot(remote):
    layout = GroupLayout(MAMBA, 16)
    with pytest.raises(PairingError):
        pair_blocks((layout,), [remote], ([5],), 10, 0)


@pytest.mark.parametrize("local", [[], [0], [0, 9]])
def test_pair_blocks_mamba_without_local_state_slot(local):
    layout = GroupLayout(MAMBA, 16, num_speculative_blocks=1)
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[3]], (local,), 10, 0)


@pytest.mark.parametrize(
    "local, hit",
    [([5, 0, 7], 0), ([0, 6, 7], 0), ([5, 6, 0], 0), ([5, 6, 0], 8)],
)
def test_pair_blocks_refuses_null_block_in_attention_table(local, hit):
    """Regression: a null D block in an *attention* group was skipped as if it were a
    sliding-window gap: never written although D counts its tokens as loaded."""
    layout = GroupLayout(ATTENTION, 4)
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[1, 2, 3]], (local,), 12, hit)


def test_pair_blocks_ignores_null_below_the_local_hit():
    """Positions D already holds are not written, so what D's table has there is not read."""
    layout = GroupLayout(ATTENTION, 4)
    assert pair_blocks((layout,), [[1, 2, 3]], ([0, 6, 7],), 12, 4) == [[(2, 6), (3, 7)]]


@pytest.mark.parametrize(
    "layout, remote, local, offset",
    [
        (GroupLayout(ATTENTION, 4), [[1, 0, 3]], ([5, 6, 7],), 12),
        (GroupLayout(ATTENTION, 4), [[1, 2, -3]], ([5, 6, 7],), 12),
        # Below the local hit: never read, still refused (P never ships a null).
        (GroupLayout(ATTENTION, 4), [[0, 2, 3]], ([5, 6, 7],), 12),
        (GroupLayout(SLIDING_WINDOW, 4, sliding_window=6), [[0, 6]], ([0, 0, 0, 0, 70, 71],), 22),
        (GroupLayout(MAMBA, 16), [[0]], ([5],), 12),
        (GroupLayout(MAMBA, 16), [[-1]], ([5],), 12),
    ],
    ids=["attention", "attention-negative", "attention-below-hit", "sliding-window", "mamba", "mamba-negative"],
)
def test_pair_blocks_refuses_null_remote_block(layout, remote, local, offset):
    """Regression: P's ids were not checked, so a null (0) remote block was paired and read."""
    for hit in (0, 4) if layout.kind == ATTENTION else (0,):
        with pytest.raises(PairingError):
            pair_blocks((layout,), remote, local, offset, hit)


@FEWER
@given(st.data())
def test_sliced_pairing_is_the_per_position_definition(data):
    """The sliced pairing (no Python loop per block) equals its definition, position by
    position, and refuses a null D block at the first null position. One token per block, so
    positions are tokens: ``base`` (where P's list starts) comes from a sliding window."""
    end = data.draw(st.integers(1, 40))
    base = data.draw(st.integers(0, end - 1))
    first = data.draw(st.integers(base, end - 1))
    layout = GroupLayout(SLIDING_WINDOW, 1, sliding_window=end - base + 1) if base else GroupLayout(ATTENTION, 1)
    assert layout.kind == ATTENTION or window_first_block(layout, end) == base
    remote = data.draw(st.lists(st.integers(1, 10**6), min_size=end - base, max_size=end - base))
    local = data.draw(st.lists(st.integers(0, 3), min_size=end, max_size=end + 3))
    as_vllm = data.draw(st.booleans())
    table, convert = (as_blocks([local])[0], CountingIds()) if as_vllm else (local, list)

    def pair():
        return pair_block_lists((layout,), [remote], (table,), end, first, block_ids=convert)

    nulls = [pos for pos in range(first, end) if local[pos] == NULL_BLOCK]
    if nulls:
        with pytest.raises(PairingError, match=f"null at {nulls[0]}:"):
            pair()
    else:
        expected = [(remote[pos - base], local[pos]) for pos in range(first, end)]
        assert pair() == [expected]


def test_block_pairs_read_as_the_list_of_pairs():
    pairs = BlockPairs([4, 5, 6], [9, 8, 7])
    assert pairs == [(4, 9), (5, 8), (6, 7)] and [(4, 9), (5, 8), (6, 7)] == pairs
    assert len(pairs) == 3 and list(pairs) == [(4, 9), (5, 8), (6, 7)] and pairs[1] == (5, 8)
    assert pairs != [(4, 9)] and not BlockPairs([], [])
    assert pickle.loads(pickle.dumps(pairs)) == pairs
    with pytest.raises(PairingError):
        BlockPairs([1, 2], [3])


@pytest.mark.parametrize("remote, local", [([4, 5, 6], [9, 8, 7]), ([3], [2]), ([], [])])
def test_block_pairs_give_the_worker_the_same_descriptors_as_tuples(remote, local):
    """The worker turns pairs into NIXL descriptor indices with numpy
    (descriptors.descriptor_indices): BlockPairs must give exactly what a list of tuples gives."""
    np = pytest.importorskip("numpy")
    from pd_connector.core.descriptors import descriptor_indices

    regions = {0: np.array([0, 1])}
    offsets, blocks = np.array([0, 100]), np.array([50, 50])
    as_tuples = descriptor_indices([list(zip(remote, local))], regions, offsets, offsets, blocks, blocks)
    as_lists = descriptor_indices([BlockPairs(remote, local)], regions, offsets, offsets, blocks, blocks)
    assert all((a == b).all() and a.dtype == b.dtype for a, b in zip(as_tuples, as_lists))


@FEWER
@given(scenarios())
def test_pair_block_lists_are_pair_blocks(sc):
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    lists = pair_block_lists(sc.layouts, sent, sc.d_ids(), sc.offset, sc.local_hit)
    assert all(isinstance(g, BlockPairs) for g in lists)
    assert [list(g) for g in lists] == pair_blocks(sc.layouts, sent, sc.d_ids(), sc.offset, sc.local_hit)


# --- vLLM-shaped tables (D's scheduler) -------------------------------------------------------


@dataclass(frozen=True)
class FakeBlock:
    """Stands in for vLLM's ``KVCacheBlock``: D's scheduler pairs its tables of these."""

    block_id: int
    pos: int  # position in its table (what the tests check was converted)


class CountingIds:
    """A ``block_ids`` converter for ``FakeBlock`` tables that records each run it converts."""

    def __init__(self):
        self.converted: list[list[int]] = []

    def __call__(self, blocks):
        self.converted.append([block.pos for block in blocks])
        return [block.block_id for block in blocks]


def as_blocks(tables):
    return tuple([FakeBlock(block_id, pos) for pos, block_id in enumerate(t)] for t in tables)


@FEWER
@given(scenarios(), st.booleans())
def test_pairing_vllm_block_tables_equals_pairing_their_ids(sc, remote_checked):
    """D's scheduler hands over vLLM's block tables with a converter (and P's ids, already
    range-checked when decoded): the pairs, or the refusal, are exactly those of the ids."""
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    convert = CountingIds()
    try:
        expected = pair_blocks(sc.layouts, sent, sc.d_ids(), sc.offset, sc.local_hit)
    except PairingError:
        with pytest.raises(PairingError):
            pair_block_lists(
                sc.layouts, sent, as_blocks(sc.d_ids()), sc.offset, sc.local_hit,
                block_ids=convert, remote_checked=remote_checked,
            )
        return
    got = pair_block_lists(
        sc.layouts, sent, as_blocks(sc.d_ids()), sc.offset, sc.local_hit,
        block_ids=convert, remote_checked=remote_checked,
    )
    assert [list(g) for g in got] == expected


@FEWER
@given(scenarios())
def test_pairing_converts_only_the_blocks_it_pairs(sc):
    """Regression (issue #5): D converted every block of every group to ids (vLLM's
    get_block_ids), Mamba tables included, inside vLLM's scheduling step; now one slice per
    attention-type group, exactly the paired positions, and one slot per Mamba group."""
    sent = select_source_blocks(sc.layouts, sc.p_ids(), sc.offset)
    tables = as_blocks(sc.d_ids())
    convert = CountingIds()
    try:
        pairs = pair_block_lists(sc.layouts, sent, tables, sc.offset, sc.local_hit, block_ids=convert)
    except PairingError:
        return
    assert len(convert.converted) == len(sc.layouts), "one conversion per group"
    for layout, table, positions, group_pairs in zip(sc.layouts, tables, convert.converted, pairs):
        assert len(positions) == len(group_pairs)
        if layout.kind == MAMBA:
            assert positions == [mamba_state_index(layout, len(table))]
        else:
            start = first_paired_block(layout, sc.offset, sc.local_hit)
            assert positions == list(range(start, cdiv(sc.offset, layout.block_size)))


@pytest.mark.parametrize(
    "layout, remote, local, offset",
    [
        (GroupLayout(ATTENTION, 4), [[1, 2, 3]], ([5, 0, 7],), 12),
        (GroupLayout(ATTENTION, 4), [[1, 2]], ([5, 6, 7],), 12),
        (GroupLayout(ATTENTION, 4), [[1, 2, 3]], ([5, 6],), 12),
        (GroupLayout(MAMBA, 16), [[3, 4]], ([5],), 12),
        (GroupLayout(MAMBA, 16), [[0]], ([5],), 12),
        (GroupLayout(MAMBA, 16), [[3]], ([0],), 12),
        (GroupLayout(MAMBA, 16), [[3]], ([],), 12),
    ],
    ids=["null-local", "short-remote", "short-local", "two-mamba-slots", "null-mamba-remote",
         "null-mamba-local", "empty-mamba-table"],
)
def test_remote_checked_skips_only_the_per_id_recheck_of_p_ids(layout, remote, local, offset):
    """``remote_checked`` trusts P's ids to be positive (params.BlockId); every shape check
    and every check of D's own table still refuses."""
    with pytest.raises(PairingError):
        pair_block_lists((layout,), remote, as_blocks(local), offset, 0, block_ids=CountingIds(), remote_checked=True)


@pytest.mark.parametrize("nsb", [0, 1, 2, 5])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])
def test_mamba_state_index_is_where_mamba_state_slot_reads(nsb, n):
    layout = GroupLayout(MAMBA, 16, num_speculative_blocks=nsb)
    ids = list(range(1, n + 1))
    index = mamba_state_index(layout, n)
    assert mamba_state_slot(layout, ids) == (None if index is None else ids[index])


# --- unequal block sizes (sub-block pairs) ------------------------------------------------------


@st.composite
def recut_cases(draw):
    small = draw(st.sampled_from([1, 2, 16, 32, 48]))
    ratio = draw(st.integers(2, 5))
    bp, bd = (small * ratio, small) if draw(st.booleans()) else (small, small * ratio)
    window = draw(st.sampled_from([0, 1, 7, 64, 500]))
    offset = draw(st.integers(1, 40 * small))
    hit = draw(st.integers(0, offset - 1)) // bd * bd
    return bp, bd, window, offset, hit


@FEWER
@given(recut_cases())
def test_sub_block_pairs_cover_each_token_d_lacks_once_from_the_p_block_holding_it(case):
    """Every token in [max(hit, window start), offset) of D is written once, from the P block
    and phase holding the same token; nothing else is paired."""
    bp, bd, window, offset, hit = case
    kind = SLIDING_WINDOW if window else ATTENTION
    p_layout, d_layout = GroupLayout(kind, bp, sliding_window=window), GroupLayout(kind, bd, sliding_window=window)
    p_table = [100 + i for i in range(cdiv(offset, bp))]
    sent = select_source_blocks((p_layout,), (p_table,), offset)[0]
    d_table = [1000 + i for i in range(cdiv(offset, bd))]
    pairs = pair_block_lists((d_layout,), [sent], (d_table,), offset, hit, remote_block_sizes=[bp])[0]
    small, ratio = min(bp, bd), max(bp, bd) // min(bp, bd)
    covered = []
    for (src, dst), phase in zip(pairs, pairs.phases):
        assert 0 <= phase < ratio
        # The sub-block's first token, on each side: its block's start plus the phase's offset
        # on the larger side.
        p_token = (src - 100) * bp + (phase * small if bp > bd else 0)
        d_token = (dst - 1000) * bd + (phase * small if bd > bp else 0)
        assert p_token == d_token, (src, dst, phase)
        covered.append(d_token)
    first = max(hit, max(0, offset - window + 1) if window else 0) // small * small
    assert covered == list(range(first, cdiv(offset, small) * small, small))


@pytest.mark.parametrize("bp, bd", [(24, 16), (16, 24), (0, 16)])
def test_block_sizes_without_an_integral_ratio_cannot_be_paired(bp, bd):
    with pytest.raises(PairingError, match="not an integral ratio"):
        pair_block_lists((GroupLayout(ATTENTION, bd),), [[1, 2, 3]], ([1, 2, 3, 4],), 40, 0, remote_block_sizes=[bp])


def test_sub_block_pairs_refuse_a_block_list_of_the_wrong_length():
    """P's list must be exactly the blocks its own size needs (a tampered pd_block_sizes)."""
    with pytest.raises(PairingError, match="P sent 3 blocks of 32 tokens, offset 40 needs 2"):
        pair_block_lists((GroupLayout(ATTENTION, 16),), [[1, 2, 3]], ([1, 2, 3, 4],), 40, 0, remote_block_sizes=[32])


def test_mamba_groups_ignore_the_block_sizes():
    layouts = (GroupLayout(ATTENTION, 16), GroupLayout(MAMBA, 16))
    pairs = pair_block_lists(layouts, [[5], [9]], ([1, 2], [4]), 20, 0, remote_block_sizes=[32, 0])
    assert list(pairs[0]) == [(5, 1), (5, 2)] and pairs[0].phases == [0, 1]
    assert list(pairs[1]) == [(9, 4)] and pairs[1].phases is None


def test_block_pairs_with_phases_keep_them_through_pickling_and_equality():
    pairs = BlockPairs([5, 5], [1, 2], [0, 1])
    assert pickle.loads(pickle.dumps(pairs)) == pairs
    assert pairs != BlockPairs([5, 5], [1, 2], [1, 0])
    assert "phases=[0, 1]" in repr(pairs)
