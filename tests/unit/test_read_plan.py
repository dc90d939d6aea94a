"""Pure tests of ``read_plan.plan_engine``: which P bytes feed which D bytes, per P rank of one P
engine, at equal TP (the page maps reconciled), at unequal TP (the shard plan), at unequal
block sizes (the phase re-cut), for a P rank this D rank reads nothing from, and which peers
share one prepared local list. Checked on the byte ranges each peer's ``Planner`` moves
(``merged_ranges``); over real NIXL: tests/nixl/test_transport.py, test_tp_transfer.py,
test_block_size_transfer.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core import block_phases, shards
from pd_connector.core.block_phases import INTERLEAVED, PhasePlan
from pd_connector.core.descriptors import DescriptorError
from pd_connector.core.pairing import ATTENTION, BlockPairs
from pd_connector.core.protocol import LayerRegion
from pd_connector.core.read_plan import Planner, plan_engine, plan_peer

POSTS = dict(threads=1, copies_in_post=True)  # one thread: runs are never cut, ranges stay whole
NO_RECUT = PhasePlan.of((), (), ())
HEAD_BYTES = 64
NUM_BLOCKS = 8


def attention_layers(tp: int, rank: int, base: int, heads: int = 4, *, packed: bool = False) -> list[LayerRegion]:
    """Two attention layers of this rank's heads: layer-major (each layer its own run of
    blocks) or packed (both layers' pages side by side in each block)."""
    segments = shards.attention_segments(heads, tp, rank, HEAD_BYTES)
    page = segments[0].count * HEAD_BYTES
    if packed:
        return [LayerRegion(f"attn.{i}", 0, base + i * page, 2 * page, page, NUM_BLOCKS, segments=segments) for i in range(2)]
    return [
        LayerRegion(f"attn.{i}", 0, base + i * NUM_BLOCKS * page, page, page, NUM_BLOCKS, segments=segments)
        for i in range(2)
    ]


def state_layer(spec: int, base: int, conv_kernel: int = 4, dim: int = 8) -> list[LayerRegion]:
    """A GDN layer's conv state (``spec`` speculative scratch rows, SD orientation) and SSM
    state, in group 1 (as test_state_regions.py builds them)."""
    rows = conv_kernel - 1 + spec
    conv = LayerRegion("gdn.0#0", 1, base, 1 << 12, rows * dim * 2, NUM_BLOCKS, rows=rows, scratch_rows=spec)
    ssm = LayerRegion("gdn.0#1", 1, base + conv.page_bytes, 1 << 12, 256, NUM_BLOCKS, rows=4, scratch_rows=spec)
    return [conv, ssm]


def byte_map(planner: Planner, pairs) -> dict[int, int]:
    """D address -> P address of every byte a READ of ``pairs`` moves (each D byte once)."""
    out: dict[int, int] = {}
    for local, remote, nbytes in zip(*planner.merged_ranges(*planner.indices(pairs))):
        for k in range(int(nbytes)):
            assert int(local) + k not in out, "two descriptors write one D byte"
            out[int(local) + k] = int(remote) + k
    return out


# --- equal TP ---------------------------------------------------------------------------------


def test_equal_tp_reads_the_whole_page_map_and_the_state_rows_both_sides_hold():
    """P with 2 speculative tokens, D with 1: the conv state's leading state rows only, each
    from where P keeps it to where D keeps it; the SSM state whole, at its own offset on each
    side; no shard, no phases."""
    d, p = state_layer(1, base=0x10000), state_layer(2, base=0x90000)
    plans = plan_engine(d, {0: p}, (0,), True, NO_RECUT, (), (), **POSTS)
    assert list(plans) == [0]
    plan = plans[0]
    assert not plan.planner.shard and plan.planner.phases is None
    got = byte_map(plan.planner, [[], [(4, 1)]])  # P's slot 4 -> D's slot 1
    state_rows = 3 * 8 * 2
    want = {d[0].addr + 1 * 4096 + k: p[0].addr + 4 * 4096 + k for k in range(state_rows)}
    want |= {d[1].addr + 1 * 4096 + k: p[1].addr + 4 * 4096 + k for k in range(256)}
    assert got == want
    assert plan_peer(d, p, **POSTS).local_key == plan.local_key


def test_equal_tp_moves_packed_spans_only_where_both_sides_pack():
    d = attention_layers(1, 0, 0x10000, packed=True)
    both = plan_peer(d, attention_layers(1, 0, 0x90000, packed=True), **POSTS)
    one = plan_peer(d, attention_layers(1, 0, 0x90000), **POSTS)
    unpacked = plan_peer(d, attention_layers(1, 0, 0x90000, packed=True), packed=False, **POSTS)
    assert [len(p.local_rows.rows) for p in (both, one, unpacked)] == [1, 2, 2]
    # The same bytes whatever the descriptors.
    pairs = [[(3, 5), (4, 6)]]
    assert byte_map(both.planner, pairs) == byte_map(unpacked.planner, pairs)


def test_equal_tp_refuses_page_maps_that_do_not_match():
    d = attention_layers(1, 0, 0x10000)
    with pytest.raises(DescriptorError, match="layer count differs"):
        plan_engine(d, {0: d[:1]}, (0,), True, NO_RECUT, (), (), **POSTS)


# --- unequal TP -------------------------------------------------------------------------------


def test_p_tp2_d_tp1_reads_each_half_of_d_s_heads_from_the_rank_that_holds_it():
    d = attention_layers(1, 0, 0x10000)
    p = {r: attention_layers(2, r, 0x100000 * (r + 1)) for r in (0, 1)}
    plans = plan_engine(d, p, (0, 1), False, NO_RECUT, (), (), **POSTS)
    assert set(plans) == {0, 1} and all(plan.planner.shard for plan in plans.values())
    half = 2 * HEAD_BYTES
    for r, plan in plans.items():
        want = {
            d[i].addr + 5 * d[i].block_stride + r * half + k: p[r][i].addr + 3 * p[r][i].block_stride + k
            for i in range(2)
            for k in range(half)
        }
        assert byte_map(plan.planner, [[(3, 5)]]) == want


def test_p_tp1_d_tp2_reads_d_rank_1_s_heads_from_the_second_half_of_p_s_page():
    d = attention_layers(2, 1, 0x10000)
    p = attention_layers(1, 0, 0x90000)
    plans = plan_engine(d, {0: p}, shards.peer_ranks(1, 2, 1), False, NO_RECUT, (), (), **POSTS)
    half = 2 * HEAD_BYTES
    want = {
        d[i].addr + 5 * d[i].block_stride + k: p[i].addr + 3 * p[i].block_stride + half + k
        for i in range(2)
        for k in range(half)
    }
    assert byte_map(plans[0].planner, [[(3, 5)]]) == want


def test_a_p_rank_holding_only_what_another_rank_sends_is_planned_none():
    """A replicated page (MLA's latent) is read whole from the first paired P rank; the other
    P rank of the pair sends nothing (D releases it instead of reading)."""
    latent = shards.replicated_segments(512)
    d = [LayerRegion("mla", 0, 0x10000, 512, 512, NUM_BLOCKS, segments=latent)]
    p = {r: [LayerRegion("mla", 0, 0x100000 * (r + 1), 512, 512, NUM_BLOCKS, segments=latent)] for r in (0, 1)}
    plans = plan_engine(d, p, (0, 1), False, NO_RECUT, (), (), **POSTS)
    assert plans[1] is None
    assert len(byte_map(plans[0].planner, [[(3, 5)]])) == 512


def tp_pair_and_heads():
    pairs = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]
    return st.tuples(st.sampled_from(pairs), st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=60, deadline=None)
@given(tp_pair_and_heads(), st.booleans())
def test_every_d_byte_is_read_once_from_a_paired_p_rank_that_holds_its_head(case, packed):
    (p, d), heads = case
    for j in range(d):
        mine = attention_layers(d, j, 0x10000, heads, packed=packed)
        order = shards.peer_ranks(p, d, j)
        theirs = {r: attention_layers(p, r, 0x1000000 * (r + 1), heads, packed=packed) for r in order}
        plans = plan_engine(mine, theirs, order, p == d, NO_RECUT, (), (), **POSTS)
        assert set(plans) == set(order)
        source: dict[int, tuple[int, int]] = {}  # D byte -> (P rank, P byte)
        for r, plan in plans.items():
            if plan is None:
                continue
            moved = byte_map(plan.planner, [[(3, 5)]])
            assert moved, f"P rank {r} is planned but sends nothing"
            assert not source.keys() & moved.keys(), "a D byte read from two P ranks"
            source |= {at: (r, src) for at, src in moved.items()}
        d_first, _ = shards.sharded(heads, d, j, "KV heads")
        want_bytes = set()
        for i, region in enumerate(mine):
            page = region.addr + 5 * region.block_stride
            for offset in range(region.page_bytes):
                want_bytes.add(page + offset)
                r, src = source[page + offset]
                head = d_first + offset // HEAD_BYTES
                p_first, p_count = shards.sharded(heads, p, r, "KV heads")
                assert p_first <= head < p_first + p_count
                p_region = theirs[r][i]
                p_offset = (head - p_first) * HEAD_BYTES + offset % HEAD_BYTES
                assert src == p_region.addr + 3 * p_region.block_stride + p_offset
        assert set(source) == want_bytes


# --- unequal block sizes ----------------------------------------------------------------------


def attention_page(block: int, base: int, heads: int = 2, token_bytes: int = 16) -> list[LayerRegion]:
    """One attention layer, ``block`` tokens per block, head-major, tokens interleaved."""
    head = block * token_bytes
    segments = shards.attention_segments(heads, 1, 0, head)
    return [LayerRegion("attn", 0, base, heads * head, heads * head, NUM_BLOCKS, segments=segments,
                        token_layout=INTERLEAVED)]  # fmt: skip


def test_p_blocks_twice_d_s_move_each_phase_into_a_whole_d_block():
    """P block 3 holds 32 tokens; its phase 1 (tokens 16..31 of each head) fills D block 5."""
    d, p = attention_page(16, 0x10000), attention_page(32, 0x90000)
    phases = PhasePlan.of([32], [16], [ATTENTION])
    plan = plan_engine(d, {0: p}, (0,), True, phases, [16], [32], **POSTS)[0]
    assert plan.planner.phases is phases and plan.planner.shard
    got = byte_map(plan.planner, [BlockPairs([3], [5], [1])])
    d_page, p_page = d[0].addr + 5 * d[0].block_stride, p[0].addr + 3 * p[0].block_stride
    want = {d_page + h * 256 + k: p_page + h * 512 + 256 + k for h in range(2) for k in range(256)}
    assert got == want
    with pytest.raises(block_phases.BlockSizeError, match="paired as whole blocks"):
        plan.planner.indices([[(3, 5)]])


def test_equal_block_sizes_plan_no_phases():
    d, p = attention_page(16, 0x10000), attention_page(16, 0x90000)
    plan = plan_engine(d, {0: p}, (0,), True, PhasePlan.of([16], [16], [ATTENTION]), [16], [16], **POSTS)[0]
    assert plan.planner.phases is None and not plan.planner.shard


# --- shared local lists -----------------------------------------------------------------------


def test_peers_with_the_same_packing_and_local_page_map_share_one_local_list():
    d = attention_layers(1, 0, 0x10000, packed=True)
    p1 = plan_peer(d, attention_layers(1, 0, 0x90000, packed=True), **POSTS)
    p2 = plan_peer(d, attention_layers(1, 0, 0x190000, packed=True), **POSTS)
    layer_major = plan_peer(d, attention_layers(1, 0, 0x290000), **POSTS)
    assert p1.local_key == p2.local_key and hash(p1.local_key) == hash(p2.local_key)
    assert layer_major.local_key != p1.local_key  # P packs nothing: D's list is per layer


def test_peers_with_other_speculative_counts_get_their_own_local_list():
    d = state_layer(1, base=0x10000)
    same = plan_peer(d, state_layer(1, base=0x90000), **POSTS)
    wider = plan_peer(d, state_layer(2, base=0x90000), **POSTS)
    assert same.local_key != wider.local_key
    assert plan_peer(d, state_layer(3, base=0x190000), **POSTS).local_key == wider.local_key


def test_the_shards_of_two_p_ranks_have_their_own_local_lists():
    d = attention_layers(1, 0, 0x10000)
    p = {r: attention_layers(2, r, 0x100000 * (r + 1)) for r in (0, 1)}
    plans = plan_engine(d, p, (0, 1), False, NO_RECUT, (), (), **POSTS)
    assert plans[0].local_key != plans[1].local_key
    again = plan_engine(d, {r: attention_layers(2, r, 0x900000 * (r + 1)) for r in (0, 1)}, (0, 1), False,
                        NO_RECUT, (), (), **POSTS)  # fmt: skip
    assert [again[r].local_key for r in (0, 1)] == [plans[r].local_key for r in (0, 1)]


def test_the_planner_gets_the_transport_s_posting_facts():
    d = attention_layers(1, 0, 0x10000)
    plan = plan_peer(d, attention_layers(1, 0, 0x90000), threads=4, copies_in_post=False)
    assert (plan.planner.threads, plan.planner.copies_in_post) == (4, False)
