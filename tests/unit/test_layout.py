"""Pure tests of pd_connector.layout: descriptor arithmetic (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.layout import (
    LayoutError,
    check_matching,
    count_runs,
    descriptor_indices,
    group_regions,
    region_offsets,
    strided_descriptors,
)
from pd_connector.protocol import LayerRegion

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
    with pytest.raises(LayoutError):
        plan(local, remote, pairs)


def test_block_id_valid_for_one_layer_but_not_another_raises():
    local = [LayerRegion("a", 0, 0, 8, 8, 10), LayerRegion("b", 0, 0, 8, 8, 4)]
    with pytest.raises(LayoutError):
        plan(local, local, [[(1, 5)]])
    with pytest.raises(LayoutError):
        plan(local, local, [[(5, 1)]])


def test_pairs_for_group_without_layers_raise():
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(LayoutError):
        plan(local, local, [[], [(1, 1)]])


@pytest.mark.parametrize("bad", [2**63, 2**70, -(2**63) - 1])
def test_descriptor_indices_block_id_beyond_int64_raises_layout_error(bad):
    """Regression: np.array(..., dtype=int64) raised OverflowError, not LayoutError."""
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(LayoutError):
        plan(local, local, [[(bad, 1)]])
    with pytest.raises(LayoutError):
        plan(local, local, [[(1, bad)]])


@pytest.mark.parametrize("pairs", [[[(1,)]], [[(1, 2, 3)]], [[("a", 1)]], [[None]]])
def test_descriptor_indices_malformed_pairs_raise_layout_error(pairs):
    local = [LayerRegion("a", 0, 0, 8, 8, 10)]
    with pytest.raises(LayoutError):
        plan(local, local, pairs)


# --- count_runs -------------------------------------------------------------------------------


def naive_runs(local, remote):
    runs = 0
    for i in range(len(local)):
        if i == 0 or local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1:
            runs += 1
    return runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-50, 50), st.integers(-50, 50)), max_size=40))
def test_count_runs_equals_naive(pairs):
    local = np.array([a for a, _ in pairs], dtype=np.int32)
    remote = np.array([b for _, b in pairs], dtype=np.int32)
    assert count_runs(local, remote) == naive_runs(local.tolist(), remote.tolist())


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 10)), max_size=10))
def test_count_runs_of_consecutive_blocks(segments):
    """Runs built from consecutive segments on both sides merge to at most one per segment."""
    local, remote, base = [], [], 0
    for start, length in segments:
        local.extend(range(base + start, base + start + length))
        remote.extend(range(base * 2 + start, base * 2 + start + length))
        base += start + length + 1  # a gap after every segment
    got = count_runs(np.array(local, dtype=np.int32), np.array(remote, dtype=np.int32))
    assert got == len(segments)


def test_count_runs_examples():
    assert count_runs(np.zeros(0, np.int32), np.zeros(0, np.int32)) == 0
    assert count_runs(np.array([5]), np.array([9])) == 1
    assert count_runs(np.array([1, 2, 3]), np.array([7, 8, 9])) == 1
    assert count_runs(np.array([1, 2, 3]), np.array([7, 9, 10])) == 2  # breaks on remote
    assert count_runs(np.array([1, 3, 4]), np.array([7, 8, 9])) == 2  # breaks on local
    assert count_runs(np.array([3, 2, 1]), np.array([3, 2, 1])) == 3


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
    with pytest.raises(LayoutError, match="layer count"):
        check_matching(a, a[:1])
    for bad in (
        LayerRegion("lX", 1, 0, 8, 4, 10),  # name
        LayerRegion("l1", 0, 0, 8, 4, 10),  # group
        LayerRegion("l1", 1, 0, 8, 8, 10),  # page size
    ):
        with pytest.raises(LayoutError, match="layer mismatch"):
            check_matching(a, [a[0], bad])
