"""Pure tests of pd_connector.pairing: which of P's blocks feed which of D's blocks.

Block tables are generated the way vLLM 0.32 shapes them (reference sections 3.4, 3.5):
- attention: >= cdiv(R, B) unique non-null ids;
- sliding window: the same, with null (0) ids for blocks that lie wholly before the window;
- Mamba ``none`` mode: [state] + scratch slots; ``align`` mode: position-indexed
  [null or checkpoint..., state] + scratch slots.
No vLLM, NIXL, torch or sockets.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.pairing import (
    ATTENTION,
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    GroupLayout,
    PairingError,
    _tail,
    _window_blocks,
    cdiv,
    mamba_state_slot,
    pair_blocks,
    select_source_blocks,
)

SETTINGS = settings(max_examples=300, deadline=None)
FEWER = settings(max_examples=200, deadline=None)

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


def sw_skipped_blocks(layout: GroupLayout, processed_tokens: int) -> int:
    """vLLM's ``SlidingWindowManager.remove_skipped_blocks``: blocks [0, k) become null with
    k = (processed - window + 1) // B (``get_num_skipped_tokens``)."""
    return max(0, processed_tokens - layout.sliding_window + 1) // layout.block_size


@dataclass
class Table:
    ids: list[int]
    state: int | None = None  # Mamba: the slot holding the running state
    scratch: list[int] = field(default_factory=list)


def make_table(draw, ids: Ids, layout: GroupLayout, offset: int, nulls: int) -> Table:
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


def safe_p_nulls(layout: GroupLayout, offset: int) -> int:
    """Null blocks P's sliding-window table may hold without touching the tail that
    ``select_source_blocks`` ships (see the strict xfail below for the vLLM-exact count)."""
    n = cdiv(offset, layout.block_size)
    return max(0, min(n - _window_blocks(layout, offset), sw_skipped_blocks(layout, offset)))


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
            p_nulls = draw(st.integers(0, safe_p_nulls(g, offset)))
            # D allocated for `offset` computed tokens: vLLM nulls what the window skips.
            d_nulls = sw_skipped_blocks(g, offset)
        else:
            p_nulls = d_nulls = 0
        p_tables.append(make_table(draw, p_ids, g, offset, p_nulls))
        d_tables.append(make_table(draw, d_ids, g, offset, d_nulls))
    return Scenario(groups, offset, local_hit, p_tables, d_tables)


# --- helpers ----------------------------------------------------------------------------------


def test_tail_of_zero_is_empty():
    """Regression: ``lst[-0:]`` is the whole list; ``_tail(ids, 0)`` must be []."""
    assert _tail([1, 2, 3], 0) == []
    assert _tail([], 0) == []
    assert _tail([1, 2, 3], -1) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers()), st.data())
def test_tail_is_the_last_n(ids, data):
    n = data.draw(st.integers(0, len(ids)))
    got = _tail(ids, n)
    assert len(got) == n and got == ids[len(ids) - n :]


@pytest.mark.xfail(
    strict=True,
    reason="pairing._tail(ids, n) with n > len(ids) slices from a negative index and drops "
    "the head: _tail([1, 2, 3], 5) == [2, 3], not [1, 2, 3] (latent: current callers pass "
    "n <= len)",
)
def test_tail_longer_than_list_is_whole_list():
    assert _tail([1, 2, 3], 5) == [1, 2, 3]


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


def test_window_blocks_never_exceed_blocks_of_offset():
    for b, w, r in itertools.product(range(1, 20), range(1, 60), range(1, 120)):
        layout = GroupLayout(kind=SLIDING_WINDOW, block_size=b, sliding_window=w)
        k = _window_blocks(layout, r)
        n = cdiv(r, b)
        assert 1 <= k <= n
        if k < n:
            # The shipped tail covers every token the first recomputed token attends to.
            assert (n - k) * b <= r - w + 1


# --- select_source_blocks ---------------------------------------------------------------------


@SETTINGS
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
            assert blocks == table.ids[n - _window_blocks(layout, sc.offset) : n]
        else:
            assert blocks == [table.state]
    assert select_source_blocks(sc.layouts, sc.p_ids(), 0) == [[] for _ in sc.layouts]


def test_select_source_blocks_group_count_mismatch():
    layouts_ = (GroupLayout(ATTENTION, 16), GroupLayout(MAMBA, 16))
    with pytest.raises(PairingError):
        select_source_blocks(layouts_, ([1, 2],), 20)
    with pytest.raises(PairingError):
        select_source_blocks(layouts_, ([1, 2], [3], [4]), 20)


def test_select_source_blocks_too_short_table():
    with pytest.raises(PairingError):
        select_source_blocks((GroupLayout(ATTENTION, 16),), ([1],), 17)


@pytest.mark.parametrize("table", [[], [0], [0, 5], [0, 5, 6]])
def test_select_source_blocks_mamba_without_state_slot(table):
    layout = GroupLayout(MAMBA, 16, num_speculative_blocks=len(table) - 1 if table else 0)
    with pytest.raises(PairingError):
        select_source_blocks((layout,), (table,), 10)


def test_select_source_blocks_null_in_attention_prefix_raises():
    with pytest.raises(PairingError):
        select_source_blocks((GroupLayout(ATTENTION, 4),), ([3, 0, 5],), 9)


@pytest.mark.xfail(
    strict=True,
    reason="pairing.select_source_blocks ships the last cdiv(W,B)+1 blocks of a sliding-window "
    "group, but vLLM 0.32 (Scheduler._connector_finished -> remove_skipped_blocks) hands P's "
    "table over with blocks [0, (R-W+1)//B) already nulled; when the first shipped block lies "
    "wholly before the window it is such a null and select_source_blocks raises PairingError "
    "(uncaught in scheduler._finish_prefill). For W a multiple of B: R % B in {0, B-1}, "
    "R >= W+B-1; for other W about half of all R > W",
)
@pytest.mark.parametrize(
    "offset, block_size, window",
    [(96, 16, 32), (95, 16, 32), (64, 8, 16), (10, 1, 3), (8192, 16, 4096)],
)
def test_select_source_blocks_accepts_sliding_window_table_nulled_before_window(
    offset, block_size, window
):
    layout = GroupLayout(SLIDING_WINDOW, block_size, sliding_window=window)
    n = cdiv(offset, block_size)
    skipped = sw_skipped_blocks(layout, offset)  # what vLLM nulls at request_finished
    p_table = [NULL_BLOCK] * skipped + list(range(100, 100 + n - skipped))
    needed = p_table[skipped:n]  # blocks holding tokens the window of token R still reads
    sent = select_source_blocks((layout,), (p_table,), offset)
    assert NULL_BLOCK not in sent[0]
    assert set(needed) <= set(sent[0])
    d_table = [NULL_BLOCK] * skipped + list(range(500, 500 + n - skipped))
    pairs = pair_blocks((layout,), sent, (d_table,), offset, 0)
    assert sorted(pairs[0]) == [(p_table[i], d_table[i]) for i in range(skipped, n)]


# --- pair_blocks ------------------------------------------------------------------------------


def expected_pairs(sc: Scenario) -> list[list[tuple[int, int]]]:
    out = []
    for layout, p, d in zip(sc.layouts, sc.p, sc.d):
        if layout.kind == MAMBA:
            out.append([(p.state, d.state)])
            continue
        n = cdiv(sc.offset, layout.block_size)
        start = sc.local_hit // layout.block_size
        if layout.kind == SLIDING_WINDOW:
            start = max(start, n - _window_blocks(layout, sc.offset))
        out.append([(p.ids[i], d.ids[i]) for i in range(start, n) if d.ids[i] != NULL_BLOCK])
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
        positions = []
        for src, dst in group_pairs:
            i = d.ids.index(dst)
            # P block at token-block index i feeds D block at index i.
            assert p.ids.index(src) == i
            # Never a D block below the local hit, never past the offset.
            assert first_needed <= i < n
            positions.append(i)
        assert positions == sorted(positions)
        if layout.kind == ATTENTION:
            # Exactly the blocks D lacks: [local_hit / B, cdiv(R, B)).
            assert positions == list(range(first_needed, n))
        else:
            # Every block of D's the window reads (token R attends to [R - W + 1, R]) that D
            # did not already hit is written.
            needed_from = max(first_needed, max(0, sc.offset - layout.sliding_window + 1) // b)
            assert set(range(needed_from, n)) <= set(positions)
    assert len(written) == len(set(written)), "a D block is written twice"


@FEWER
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


def test_pair_blocks_sliding_window_skips_d_nulls():
    layout = GroupLayout(SLIDING_WINDOW, 4, sliding_window=6)
    # R = 22: n = 6, window tail = cdiv(6, 4) + 1 = 3 blocks (idx 3..5); token 22 reads 17..22.
    sent = select_source_blocks((layout,), ([1, 2, 3, 4, 5, 6],), 22)
    assert sent == [[4, 5, 6]]
    d = [0, 0, 0, 0, 70, 71]  # vLLM nulled blocks wholly before 17
    assert pair_blocks((layout,), sent, (d,), 22, 0) == [[(5, 70), (6, 71)]]


# --- mismatched or tampered inputs raise ------------------------------------------------------


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
        for i in range(len(remote[g])):
            shrunk = [list(x) for x in remote]
            del shrunk[g][i]
            yield f"group {g}: remote block {i} dropped", shrunk, local, sc.local_hit
        if layout.kind != MAMBA:
            n = cdiv(sc.offset, layout.block_size)
            short = [list(x) for x in local]
            short[g] = short[g][: n - 1]
            yield f"group {g}: D table one block short", remote, short, sc.local_hit
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


@pytest.mark.xfail(
    strict=True,
    reason="pairing.pair_blocks skips a null (0) D block in an *attention* group as if it "
    "were a sliding-window gap: the block is silently never written although D counts its "
    "tokens as loaded",
)
def test_pair_blocks_refuses_null_block_in_attention_table():
    layout = GroupLayout(ATTENTION, 4)
    with pytest.raises(PairingError):
        pair_blocks((layout,), [[1, 2, 3]], ([5, 0, 7],), 12, 0)


@pytest.mark.xfail(
    strict=True,
    reason="pairing.pair_blocks does not check P's ids: a null (0) remote block is paired "
    "and read (only protocol.decode_handoff_params rejects it upstream), contrary to the "
    "module invariant 'the null block is never shipped'",
)
@pytest.mark.parametrize(
    "layout, remote, local, offset",
    [
        (GroupLayout(ATTENTION, 4), [[1, 0, 3]], ([5, 6, 7],), 12),
        (GroupLayout(MAMBA, 16), [[0]], ([5],), 12),
    ],
    ids=["attention", "mamba"],
)
def test_pair_blocks_refuses_null_remote_block(layout, remote, local, offset):
    with pytest.raises(PairingError):
        pair_blocks((layout,), remote, local, offset, 0)
