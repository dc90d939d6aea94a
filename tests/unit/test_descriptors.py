"""Pure tests of pd_connector.core.descriptors: descriptor arithmetic (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core.descriptors import (
    DescriptorError,
    check_matching,
    common_packing,
    count_runs,
    descriptor_indices,
    descriptor_rows,
    group_regions,
    merged_ranges,
    packed_layer_order,
    plan_indices,
    region_offsets,
    strided_descriptors,
)
from pd_connector.core.protocol import LayerRegion
from pd_connector.core.read_plan import chunk_bounds, cut_long_runs, thread_slices

SETTINGS = settings(max_examples=120, deadline=None)


@st.composite
def page_maps(draw):
    """Matching local/remote region lists (same layers, groups and page sizes; block counts and
    addresses differ per side), plus per-group pairs within both sides' bounds."""
    n_groups = draw(st.integers(1, 4))
    n_layers = draw(st.integers(1, 10))
    groups = [draw(st.integers(0, n_groups - 1)) for _ in range(n_layers)]
    local, remote = [], []
    for i, g in enumerate(groups):
        page = draw(st.integers(1, 4096))
        local.append(
            LayerRegion(f"l{i}", g, draw(st.integers(0, 2**40)), page, page, draw(st.integers(1, 40)))
        )
        remote.append(
            LayerRegion(f"l{i}", g, draw(st.integers(0, 2**40)), page * 2, page, draw(st.integers(1, 40)))
        )
    pairs = []
    for g in range(n_groups):
        idx = [i for i, gg in enumerate(groups) if gg == g]
        if not idx:
            pairs.append([])
            continue
        max_src = min(remote[i].num_blocks for i in idx)
        max_dst = min(local[i].num_blocks for i in idx)
        pairs.append(
            draw(
                st.lists(
                    st.tuples(st.integers(0, max_src - 1), st.integers(0, max_dst - 1)), max_size=8
                )
            )
        )
    return local, remote, pairs


def plan(local, remote, pairs):
    return descriptor_indices(
        pairs,
        group_regions(local),
        region_offsets(local),
        region_offsets(remote),
        np.array([r.num_blocks for r in local], dtype=np.int64),
        np.array([r.num_blocks for r in remote], dtype=np.int64),
    )


def naive_plan(local, remote, pairs):
    loff, roff, acc = [], [], 0
    for r in local:
        loff.append(acc)
        acc += r.num_blocks
    acc = 0
    for r in remote:
        roff.append(acc)
        acc += r.num_blocks
    out_l, out_r = [], []
    for g, group_pairs in enumerate(pairs):
        for i, r in enumerate(local):  # layer-major within a group, in region order
            if r.group != g:
                continue
            for src, dst in group_pairs:
                out_l.append(loff[i] + dst)
                out_r.append(roff[i] + src)
    return out_l, out_r


@SETTINGS
@given(page_maps())
def test_descriptor_indices_equal_naive_double_loop(maps):
    local, remote, pairs = maps
    li, ri = plan(local, remote, pairs)
    nl, nr = naive_plan(local, remote, pairs)
    assert li.tolist() == nl and ri.tolist() == nr
    assert li.dtype == np.int32 and ri.dtype == np.int32
    assert len(li) == len(ri)
    # Every index addresses a descriptor of the prepared lists.
    assert all(0 <= x < sum(r.num_blocks for r in local) for x in nl)
    assert all(0 <= x < sum(r.num_blocks for r in remote) for x in nr)


def test_descriptor_indices_no_pairs_is_empty():
    local = [LayerRegion("a", 0, 0, 8, 8, 4)]
    li, ri = plan(local, local, [[]])
    assert li.size == 0 and ri.size == 0
    li, ri = plan(local, local, [])
    assert li.size == 0 and ri.size == 0


def test_descriptor_indices_example_layer_major():
    local = [LayerRegion("a", 0, 0, 8, 8, 10), LayerRegion("m", 1, 0, 8, 8, 5), LayerRegion("b", 0, 0, 8, 8, 10)]
    remote = [LayerRegion("a", 0, 0, 8, 8, 20), LayerRegion("m", 1, 0, 8, 8, 6), LayerRegion("b", 0, 0, 8, 8, 20)]
    li, ri = plan(local, remote, [[(3, 1), (4, 2)], [(5, 4)]])
    # Offsets: local a=0, m=10, b=15; remote a=0, m=20, b=26. Group 0 layer-major (a, then b),
    # then group 1 (m).
    assert li.tolist() == [1, 2, 16, 17, 14]
    assert ri.tolist() == [3, 4, 29, 30, 25]


@SETTINGS
@given(page_maps(), st.data())
def test_out_of_range_block_ids_raise_layout_error(maps, data):
    local, remote, pairs = maps
    groups_with_layers = sorted({r.group for r in local})
    g = data.draw(st.sampled_from(groups_with_layers), label="group")
    idx = [i for i, r in enumerate(local) if r.group == g]
    side = data.draw(st.sampled_from(["src", "dst"]), label="side")
    regions = remote if side == "src" else local
    bad = data.draw(
        st.one_of(
            st.integers(-(2**62), -1),
            # Too large for at least one layer of the group (not necessarily all).
            st.integers(min(regions[i].num_blocks for i in idx), 2**62),
        ),
        label="bad id",
    )
    pair = (bad, 0) if side == "src" else (0, bad)
    pairs = [list(p) for p in pairs]
    pairs[g] = pairs[g] + [pair]
    with pytest.raises(DescriptorError):
        plan(local, remote, pairs)


def test_block_id_valid_for_one_layer_but_not_another_raises():
    local = [LayerRegion("a", 0, 0, 8, 8, 10), LayerRegion("b", 0, 0, 8, 8, 4)]
    with pytest.raises(DescriptorError):
        plan(local, local, [[(1, 5)]])
    with pytest.raises(DescriptorError):
        plan(local, local, [[(5, 1)]])


def test_pairs_for_group_without_layers_raise():
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(DescriptorError):
        plan(local, local, [[], [(1, 1)]])


@pytest.mark.parametrize("bad", [2**63, 2**70, -(2**63) - 1])
def test_descriptor_indices_block_id_beyond_int64_raises_layout_error(bad):
    """Regression: np.array(..., dtype=int64) raised OverflowError, not DescriptorError."""
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(DescriptorError):
        plan(local, local, [[(bad, 1)]])
    with pytest.raises(DescriptorError):
        plan(local, local, [[(1, bad)]])


@pytest.mark.parametrize("pairs", [[[(1,)]], [[(1, 2, 3)]], [[("a", 1)]], [[None]]])
def test_descriptor_indices_malformed_pairs_raise_layout_error(pairs):
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(DescriptorError):
        plan(local, local, pairs)


# --- region_offsets, group_regions, strided_descriptors, check_matching ------------------------

regions = st.builds(
    LayerRegion,
    name=st.text(max_size=4),
    group=st.integers(0, 3),
    addr=st.integers(0, 2**48),
    block_stride=st.integers(1, 2**20),
    page_bytes=st.integers(1, 2**20),
    num_blocks=st.integers(0, 10**6),
)


@SETTINGS
@given(st.lists(regions, max_size=12), st.integers(0, 7))
def test_region_offsets_group_regions_and_strided_rows(rs, device):
    # region_offsets: prefix sums of num_blocks.
    expected, acc = [], 0
    for r in rs:
        expected.append(acc)
        acc += r.num_blocks
    assert region_offsets(rs).tolist() == expected
    # group_regions: a partition of the region indices, in region order per group.
    by_group = group_regions(rs)
    assert sorted(i for ix in by_group.values() for i in ix.tolist()) == list(range(len(rs)))
    for g, ix in by_group.items():
        assert ix.tolist() == [i for i, r in enumerate(rs) if r.group == g]
    # strided_descriptors: one (addr, len, device, stride, count) row per region.
    rows = strided_descriptors(rs, device)
    assert rows.shape == (len(rs), 5)
    for row, r in zip(rows.tolist(), rs):
        assert row == [r.addr, r.page_bytes, device, r.block_stride, r.num_blocks]


def test_check_matching():
    a = [LayerRegion("l0", 0, 0, 8, 8, 10), LayerRegion("l1", 1, 0, 8, 4, 10)]
    check_matching(a, [LayerRegion("l0", 0, 99, 16, 8, 3), LayerRegion("l1", 1, 5, 4, 4, 1)])
    with pytest.raises(DescriptorError, match="layer count"):
        check_matching(a, a[:1])
    for bad in (
        LayerRegion("lX", 1, 0, 8, 4, 10),  # name
        LayerRegion("l1", 0, 0, 8, 4, 10),  # group
        LayerRegion("l1", 1, 0, 8, 8, 10),  # page size
    ):
        with pytest.raises(DescriptorError, match="layer mismatch"):
            check_matching(a, [a[0], bad])


# --- packing, runs, chunks ------------------------------------------------------------------


@st.composite
def vllm_like_maps(draw):
    """One side's page map as vLLM places it: per group a KVCacheTensor with ``layers`` layers,
    either layer-outer (layer_stride = num_blocks * block_stride) or block-outer (layer_stride =
    page, block_stride = layers * page + padding), optionally with the layers listed in a
    different order than their addresses. Returns (regions, num_blocks)."""
    num_blocks = draw(st.integers(1, 12))
    regions, base = [], draw(st.integers(0, 2**20)) * 64
    for group in range(draw(st.integers(1, 3))):
        layers = draw(st.integers(1, 4))
        page = draw(st.sampled_from([8, 16, 24]))
        block_outer = draw(st.booleans())
        pad = draw(st.sampled_from([0, 0, 8])) if block_outer else 0
        if block_outer:
            layer_stride, block_stride = page, layers * page + pad
        else:
            layer_stride, block_stride = num_blocks * page, page
        slots = draw(st.permutations(range(layers)))
        for i in range(layers):
            regions.append(
                LayerRegion(f"g{group}.l{i}", group, base + slots[i] * layer_stride, block_stride, page, num_blocks)
            )
        base += layers * num_blocks * page + num_blocks * pad + 64
    regions.sort(key=lambda r: (r.group, r.name))
    return regions, num_blocks


def page_bytes_of(regions, pairs, side):
    """Every (address, byte) a per-layer copy touches on one side: the reference."""
    out = set()
    for g, gp in enumerate(pairs):
        for r in (r for r in regions if r.group == g):
            for src, dst in gp:
                b = src if side == "remote" else dst
                start = r.addr + b * r.block_stride
                out.update(range(start, start + r.page_bytes))
    return out


def copy_map(local, remote, pairs, packed):
    """D byte -> P byte for the descriptors planned with ``packed``."""
    lrows, rrows = descriptor_rows(local, packed), descriptor_rows(remote, packed)
    li, ri = plan_indices(pairs, lrows, rrows)
    mapping = {}
    for a, b in zip(li.tolist(), ri.tolist()):
        lrow = lrows.row_of(np.array([a]))[0]
        rrow = rrows.row_of(np.array([b]))[0]
        la, rr = lrows.rows[lrow], rrows.rows[rrow]
        assert la.span_bytes == rr.span_bytes
        lstart = la.addr + (a - int(lrows.offsets[lrow])) * la.block_stride
        rstart = rr.addr + (b - int(rrows.offsets[rrow])) * rr.block_stride
        for k in range(la.span_bytes):
            assert lstart + k not in mapping, "two descriptors write one byte"
            mapping[lstart + k] = rstart + k
    return mapping, li, ri, lrows, rrows


@settings(max_examples=150, deadline=None)
@given(vllm_like_maps(), st.data())
def test_packed_descriptors_copy_exactly_the_bytes_of_per_layer_ones(maps, data):
    local, num_blocks = maps
    # P: the same layers and pages, its own addresses and block count (same layout kind).
    remote_blocks = data.draw(st.integers(num_blocks, num_blocks + 5), label="remote blocks")
    shift = data.draw(st.integers(1, 2**20), label="shift") * 64
    remote = [
        LayerRegion(r.name, r.group, r.addr + shift, r.block_stride, r.page_bytes, remote_blocks) for r in local
    ]
    groups = sorted({r.group for r in local})
    pairs = [
        data.draw(
            st.lists(st.tuples(st.integers(0, remote_blocks - 1), st.integers(0, num_blocks - 1)), max_size=5,
                     unique_by=lambda p: p[1]),
            label=f"pairs {g}",
        )
        for g in groups
    ]
    packed = common_packing(local, remote)
    assert packed == frozenset(packed_layer_order(local))
    per_layer, li0, ri0, l0, r0 = copy_map(local, remote, pairs, ())
    spans, li1, ri1, l1, r1 = copy_map(local, remote, pairs, packed)
    assert spans == per_layer  # the same D bytes, each from the same P byte
    assert set(per_layer) == page_bytes_of(local, pairs, "local")
    assert set(per_layer.values()) == page_bytes_of(remote, pairs, "remote")
    assert li1.size <= li0.size
    # NIXL's merged count: never more with packing, and equal to an independent count of
    # maximal runs of (same dense row, consecutive index) on both sides.
    assert count_runs(li1, ri1, l1, r1) <= count_runs(li0, ri0, l0, r0)
    for li, ri, lr, rr in ((li0, ri0, l0, r0), (li1, ri1, l1, r1)):
        runs = 0
        for k in range(li.size):
            joined = k > 0 and all(
                idx[k] == idx[k - 1] + 1
                and rows.row_of(idx[k : k + 1])[0] == rows.row_of(idx[k - 1 : k])[0]
                and rows.rows[rows.row_of(idx[k : k + 1])[0]].block_stride
                == rows.rows[rows.row_of(idx[k : k + 1])[0]].span_bytes
                for idx, rows in ((li, lr), (ri, rr))
            )
            runs += not joined
        assert count_runs(li, ri, lr, rr) == runs
        # The merged byte ranges: one per run, together the same byte-for-byte copy.
        la, ra, nb = merged_ranges(li, ri, lr, rr)
        assert la.size == ra.size == nb.size == runs
        assert {int(a) + k: int(b) + k for a, b, n in zip(la, ra, nb) for k in range(int(n))} == per_layer
        # Cut for worker threads: the same pairs in another order, the same copy, no merged run
        # above its share (1/pieces of the bytes, or min_bytes, or one descriptor that cannot be
        # cut), never fewer runs.
        threads = data.draw(st.integers(1, 4), label="threads")
        per_thread = data.draw(st.integers(1, 4), label="pieces per thread")
        min_bytes = data.draw(st.sampled_from([0, 16, 64]), label="min_bytes")
        ci, cr = cut_long_runs(li, ri, lr, rr, threads, per_thread, min_bytes)
        assert sorted(zip(ci.tolist(), cr.tolist())) == sorted(zip(li.tolist(), ri.tolist()))
        if threads == 1:
            assert ci.tolist() == li.tolist() and cr.tolist() == ri.tolist()
        la, ra, nb = merged_ranges(ci, cr, lr, rr)
        assert {int(a) + k: int(b) + k for a, b, n in zip(la, ra, nb) for k in range(int(n))} == per_layer
        assert count_runs(ci, cr, lr, rr) == nb.size >= runs
        if li.size and threads > 1:
            sizes = lr.nbytes_of(li)
            share = -(-int(sizes.sum()) // (threads * per_thread))
            assert nb.max() <= max(share, min_bytes, int(sizes.max()))
        # Posting slices through the threads: in order, every descriptor once; a first slice
        # of a multiple of ``threads`` runs, a second of fewer than ``threads``.
        bounds = thread_slices(ci, cr, lr, rr, threads)
        assert [i for a, b in bounds for i in range(a, b)] == list(range(ci.size))
        slice_runs = [count_runs(ci[a:b], cr[a:b], lr, rr) for a, b in bounds]
        assert sum(slice_runs) == nb.size
        if len(bounds) == 2:
            assert slice_runs[0] % threads == 0 and 0 < slice_runs[1] < threads
        else:
            assert not bounds or nb.size <= threads or nb.size % threads == 0


def test_block_outer_contiguous_blocks_are_one_descriptor_per_group():
    """4 layers x 8 blocks, block-outer and dense: a run of 5 blocks is ONE descriptor (it was
    20 before packing, and NIXL merged none of them: different rows)."""
    page, layers, nb = 16, 4, 8
    regs = [LayerRegion(f"l{i}", 0, 1000 + i * page, layers * page, page, nb) for i in range(layers)]
    pairs = [[(b, b + 1) for b in range(1, 6)]]
    unpacked = descriptor_rows(regs, ())
    li, ri = plan_indices(pairs, unpacked, unpacked)
    assert li.size == 20 and count_runs(li, ri, unpacked, unpacked) == 20
    packed = descriptor_rows(regs, common_packing(regs, regs))
    li, ri = plan_indices(pairs, packed, packed)
    assert li.size == 5 and count_runs(li, ri, packed, packed) == 1
    assert packed.strided(0).tolist() == [[1000, layers * page, 0, layers * page, nb]]


def test_layer_outer_runs_are_one_per_layer_and_block_run():
    page, nb = 16, 10
    regs = [LayerRegion(f"l{i}", 0, i * nb * page, page, page, nb) for i in range(3)]
    rows = descriptor_rows(regs, common_packing(regs, regs))
    assert len(rows.rows) == 3  # nothing to pack: layers are whole pools apart
    li, ri = plan_indices([[(1, 2), (2, 3), (3, 4), (7, 8)]], rows, rows)
    assert count_runs(li, ri, rows, rows) == 3 * 2
    # The last block of one layer and the first of the next are adjacent bytes, but two rows.
    li, ri = plan_indices([[(9, 9)]], rows, rows)
    assert count_runs(li, ri, rows, rows) == 3


def test_packing_needs_the_same_layer_order_on_both_sides():
    page, nb = 16, 4
    d = [LayerRegion(f"l{i}", 0, i * page, 2 * page, page, nb) for i in range(2)]
    p_swapped = [LayerRegion("l0", 0, page, 2 * page, page, nb), LayerRegion("l1", 0, 0, 2 * page, page, nb)]
    assert common_packing(d, d) == {0}
    assert common_packing(d, p_swapped) == frozenset()
    with pytest.raises(DescriptorError, match="not packed"):
        descriptor_rows([LayerRegion("a", 0, 0, 64, 16, 4), LayerRegion("b", 0, 32, 64, 16, 4)], {0})


def test_padded_mamba_pages_are_not_packed():
    """Mamba pages padded inside their layer slot (page < layer stride) leave gaps: not packed."""
    regs = [LayerRegion("m0", 1, 0, 8704, 3072, 4), LayerRegion("m1", 1, 4096, 8704, 3072, 4)]
    assert packed_layer_order(regs) == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=40), st.integers(0, 300))
def test_chunk_bounds_cover_every_descriptor_once_within_the_limit(sizes, limit):
    nbytes = np.array(sizes, dtype=np.int64)
    bounds = chunk_bounds(nbytes, limit)
    flat = [i for a, b in bounds for i in range(a, b)]
    assert flat == list(range(len(sizes)))
    assert all(b > a for a, b in bounds)
    if limit <= 0:
        assert len(bounds) == (1 if sizes else 0)
    else:
        for a, b in bounds:
            assert b - a == 1 or int(nbytes[a:b].sum()) <= limit
            # Greedy: the next descriptor would not have fitted.
            if b < len(sizes):
                assert int(nbytes[a : b + 1].sum()) > limit


def test_long_attention_runs_before_short_state_pages_are_cut_so_a_split_by_count_is_even():
    """Contiguous blocks of a hybrid: 4 attention layers of 8-block runs (128 B each) listed
    before 6 one-page state descriptors (32 B): NIXL's thread pool would hand the first half of
    the descriptors -- all the attention bytes -- to one thread. Cut to about the median run,
    both halves carry the same bytes."""
    attn = [LayerRegion(f"a{i}", 0, i * 10 * 16, 16, 16, 10) for i in range(4)]
    state = [LayerRegion(f"s{i}", 1, 4096 + i * 10 * 32, 32, 32, 10) for i in range(6)]
    rows = descriptor_rows(attn + state, ())
    li, ri = plan_indices([[(b, b) for b in range(1, 9)], [(3, 3)]], rows, rows)
    assert count_runs(li, ri, rows, rows) == 4 + 6
    ci, cr = cut_long_runs(li, ri, rows, rows, threads=2, pieces_per_thread=8)
    _, _, sizes = merged_ranges(ci, cr, rows, rows)
    assert sizes.tolist() == [32] * 16 + [32] * 6  # each attention run cut in 4, last piece first
    assert sizes[: sizes.size // 2].sum() == sizes[sizes.size // 2 :].sum()
    # Pieces of one run are listed last first: NIXL cannot merge them back.
    assert ci[:8].tolist() == [li[6], li[7], li[4], li[5], li[2], li[3], li[0], li[1]]
    assert thread_slices(ci, cr, rows, rows, 2) == [(0, ci.size)]


def test_an_odd_run_count_gets_one_more_cut_where_a_run_can_take_it():
    """3 layers x one contiguous 4-block run, 2 threads: NIXL would cut 3 runs into chunks of
    one, the third queued behind the first thread's copy. One run is cut once more: 4 runs."""
    regs = [LayerRegion(f"l{i}", 0, i * 10 * 16, 16, 16, 10) for i in range(3)]
    rows = descriptor_rows(regs, ())
    li, ri = plan_indices([[(b, b) for b in range(1, 5)]], rows, rows)
    assert count_runs(li, ri, rows, rows) == 3
    ci, cr = cut_long_runs(li, ri, rows, rows, threads=2, pieces_per_thread=1, min_bytes=64)
    assert count_runs(ci, cr, rows, rows) == 4
    assert thread_slices(ci, cr, rows, rows, 2) == [(0, 12)]


def test_odd_single_descriptor_runs_post_the_last_run_in_a_second_slice():
    regs = [LayerRegion(f"l{i}", 0, i * 10 * 16, 16, 16, 10) for i in range(3)]
    rows = descriptor_rows(regs, ())
    li, ri = plan_indices([[(1, 7)]], rows, rows)  # one block: 3 runs of one descriptor
    ci, cr = cut_long_runs(li, ri, rows, rows, threads=2)
    assert ci.tolist() == li.tolist()
    assert thread_slices(ci, cr, rows, rows, 2) == [(0, 2), (2, 3)]
    assert thread_slices(ci, cr, rows, rows, 3) == [(0, 3)]  # one run per thread
    assert thread_slices(ci, cr, rows, rows, 4) == [(0, 3)]  # fewer runs than threads
    assert thread_slices(ci, cr, rows, rows, 1) == [(0, 3)]
    assert thread_slices(ci[:0], cr[:0], rows, rows, 2) == []
