"""The TP shard mapping (core/shards.py): every byte of every D rank's page is written exactly
once, from the P rank and offset that hold the same unit, for random layer shapes and TP pairs.

Each rank's pages are built the way vLLM 0.32 shards them (per-rank shapes from
MambaStateShapeCalculator / QKVParallelLinear rules) and labelled byte by byte with the global
unit they hold; D's pages are filled by copying the planned pieces out of the P ranks' pages.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core import shards
from pd_connector.core.protocol import LayerRegion

TPS = (1, 2, 4, 8)


def tp_pairs():
    return st.sampled_from([(p, d) for p in TPS for d in TPS if p % d == 0 or d % p == 0])


def replication_ok(total: int, tp: int) -> bool:
    return total % tp == 0 or tp % total == 0


class Layer:
    """One layer's regions on one rank: (name, segments, page_bytes)."""

    def __init__(self, regions):
        self.regions = regions


def attention_layer(k: int, head_bytes: int, tp: int, rank: int):
    per_rank = max(1, k // tp)
    segs = shards.attention_segments(k, tp, rank, head_bytes)
    return [("attn", segs, per_rank * head_bytes, 0)]


def mamba2_layer(h, hd, s, g, kernel, scratch, elems, dim_first, tp, rank):
    gp = g if g % tp == 0 else tp  # vLLM's extra_groups_for_head_shards: G == 1 is replicated
    conv_loc = (h * hd + 2 * gp * s) // tp
    rows = kernel - 1 + scratch
    conv = (conv_loc, rows) if dim_first else (rows, conv_loc)
    ssm = (h // tp, hd, s)
    out = []
    for state, shape in ((0, conv), (1, ssm)):
        segs = shards.recurrent_segments(
            shards.MAMBA2, state, conv, ssm, elems, dim_first, scratch, tp, rank, groups_replicated=g % tp != 0
        )
        size = 1
        for x in shape:
            size *= x
        out.append((f"m#{state}", segs, size * elems[state], scratch))
    return out


def gdn_layer(hk, hv, dk, dv, kernel, scratch, elems, dim_first, tp, rank):
    conv_loc = (2 * hk * dk + hv * dv) // tp
    rows = kernel - 1 + scratch
    conv = (conv_loc, rows) if dim_first else (rows, conv_loc)
    rec = (hv // tp, dv, dk)
    out = []
    for state, shape in ((0, conv), (1, rec)):
        segs = shards.recurrent_segments(shards.GDN, state, conv, rec, elems, dim_first, scratch, tp, rank)
        size = 1
        for x in shape:
            size *= x
        out.append((f"g#{state}", segs, size * elems[state], scratch))
    return out


def regions_of(layer_fn, tp: int, rank: int) -> list[LayerRegion]:
    return [
        LayerRegion(name, 0, 0, 1 << 20, page, 1, scratch_rows=scratch, segments=segs)
        for name, segs, page, scratch in layer_fn(tp, rank)
    ]


def labels(region: LayerRegion) -> list:
    """The global (unit, index, byte) each byte of the page holds (None outside segments)."""
    page: list = [None] * region.page_bytes
    for seg in region.segments:
        for i in range(seg.count):
            for b in range(seg.unit_bytes):
                at = seg.offset + i * seg.unit_bytes + b
                assert page[at] is None, "segments of one page overlap"
                page[at] = (seg.unit, seg.first + i, b)
    return page


def check_pair(layer_fn, p: int, d: int, tamper=None) -> None:
    """Plan every D rank against its P ranks and copy: each D segment byte written once with
    the label D expects; nothing outside segments written."""
    p_regions = {r: regions_of(layer_fn, p, r) for r in range(p)}
    for j in range(d):
        mine = regions_of(layer_fn, d, j)
        ranks = shards.peer_ranks(p, d, j)
        plans = shards.shard_regions(mine, {r: p_regions[r] for r in ranks}, ranks)
        if tamper is not None:
            plans = tamper(plans)
        written = {r.name: [0] * r.page_bytes for r in mine}
        got = {r.name: [None] * r.page_bytes for r in mine}
        source_labels = {r: {reg.name: labels(reg) for reg in p_regions[r]} for r in ranks}
        for rank, (local, remote) in plans.items():
            assert len(local) == len(remote)
            for lo, re_ in zip(local, remote):
                base = lo.name.rpartition("@")[0]
                assert re_.name == lo.name and lo.page_bytes == re_.page_bytes
                for b in range(lo.page_bytes):
                    written[base][lo.addr + b] += 1
                    src = source_labels[rank][base]
                    got[base][lo.addr + b] = src[re_.addr + b] if re_.addr + b < len(src) else "past the page"
        for region in mine:
            want = labels(region)
            for b, label in enumerate(want):
                assert written[region.name][b] == (0 if label is None else 1), (region.name, b, p, d, j)
                assert got[region.name][b] == label, (region.name, b, p, d, j)


@settings(max_examples=150, deadline=None)
@given(tp_pairs(), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 6))
def test_attention_heads_land_once_from_the_rank_that_holds_them(pair, k, head_bytes):
    p, d = pair
    if not (replication_ok(k, p) and replication_ok(k, d)):
        return
    check_pair(lambda tp, r: attention_layer(k, head_bytes, tp, r), p, d)


@settings(max_examples=150, deadline=None)
@given(
    tp_pairs(),
    st.sampled_from([8, 16]),  # heads (divisible by every TP)
    st.integers(1, 3),  # head dim
    st.integers(1, 3),  # state size
    st.sampled_from([1, 2, 4, 8]),  # n_groups
    st.integers(2, 4),  # conv kernel
    st.integers(0, 2),
    st.integers(0, 2),  # scratch rows on P, on D
    st.sampled_from([(1, 1), (2, 2), (2, 4), (4, 4)]),
    st.booleans(),
)
def test_mamba2_states_land_once_including_replicated_groups(pair, h, hd, s, g, kernel, sp, sd, elems, dim_first):
    p, d = pair
    if any(g % tp and g != 1 for tp in (p, d)):
        return  # vLLM refuses the model itself (MambaMixer2: n_groups must divide TP or be 1)

    def layer(tp, r):
        return mamba2_layer(h, hd, s, g, kernel, sp if tp == p else sd, elems, dim_first, tp, r)

    if p == d:
        sd = sp  # equal TP never comes here with other scratch rows (descriptors.reconcile_regions)
    if dim_first and sp != sd:
        with pytest.raises(shards.ShardError, match="unit is"):
            check_pair(layer, p, d)
        return
    check_pair(layer, p, d)


@settings(max_examples=100, deadline=None)
@given(
    tp_pairs(),
    st.sampled_from([8, 16]),
    st.sampled_from([8, 16]),
    st.integers(1, 2),
    st.integers(1, 2),
    st.integers(2, 4),
    st.integers(0, 1),
    st.sampled_from([(2, 2), (2, 4)]),
    st.booleans(),
)
def test_gdn_states_land_once(pair, hk, hv, dk, dv, kernel, scratch, elems, dim_first):
    p, d = pair
    check_pair(lambda tp, r: gdn_layer(hk, hv, dk, dv, kernel, scratch, elems, dim_first, tp, r), p, d)


def layout_layer(layout, rows, tails, scratch, elems, dim_first, tp, rank):
    """A layer of any ``StateLayout`` (Mamba1, short conv, KDA: vLLM's rules in
    engine/from_vllm/recurrent_layouts.py), its per-rank shapes as vLLM's shape functions give."""
    channels = sum(p.total if p.replicated else p.total // tp for p in layout.conv)
    conv = (channels, rows + scratch) if dim_first else (rows + scratch, channels)
    shapes = [conv] + [(layout.units // tp, *tail) for tail in tails]
    out = []
    for state, shape in enumerate(shapes):
        segs = shards.state_segments(layout, state, shape, elems[state], dim_first, scratch, tp, rank)
        size = 1
        for x in shape:
            size *= x
        out.append((f"s#{state}", segs, size * elems[state], scratch if state == 0 else 0))
    return out


def family_layouts(units, dim):
    part = shards.ConvPart
    return {
        "mamba1": (shards.StateLayout((part("x", units * dim),), "ssm_channel", units * dim), [(3,)]),
        "short_conv": (shards.StateLayout((part("channel", units * dim),), "channel", units * dim), []),
        "kda": (shards.StateLayout(tuple(part(a, units * dim) for a in "qkv"), "head", units), [(dim, dim)]),
    }


@settings(max_examples=150, deadline=None)
@given(
    tp_pairs(),
    st.sampled_from(["mamba1", "short_conv", "kda"]),
    st.sampled_from([8, 16]),  # heads (KDA), channel groups (Mamba1, short conv): divide every TP
    st.integers(1, 3),  # head dim / channels per group
    st.integers(1, 3),  # conv rows (kernel - 1)
    st.integers(0, 2),  # scratch rows (short conv, KDA under speculative decoding; Mamba1 has none)
    st.sampled_from([(2, 4), (2, 2), (4, 4)]),
    st.booleans(),
)
def test_mamba1_short_conv_and_kda_states_land_once(pair, family, units, dim, rows, scratch, elems, dim_first):
    p, d = pair
    layout, tails = family_layouts(units, dim)[family]
    scratch = 0 if family == "mamba1" else scratch
    check_pair(lambda tp, r: layout_layer(layout, rows, tails, scratch, elems, dim_first, tp, r), p, d)


def test_a_state_shape_that_is_not_the_ranks_share_is_refused():
    """The shape comes from vLLM's spec; one that does not hold exactly this rank's channels or
    heads (another layer's rule, another TP size) is refused, not read as if it did."""
    layout, _ = family_layouts(8, 2)["kda"]
    with pytest.raises(shards.ShardError, match="does not hold this rank's channels"):
        shards.state_segments(layout, 0, (3, 8 * 2 * 3 // 4 + 1), 2, False, 0, 4, 1)
    with pytest.raises(shards.ShardError, match="not this rank's share of 8 heads"):
        shards.state_segments(layout, 1, (3, 2, 2), 4, False, 0, 4, 1)
    assert shards.state_segments(layout, 1, (2, 2, 2), 4, False, 0, 4, 1)  # control: 8 / 4 heads


def test_worked_example_nemotron_n_groups_1_reads_b_and_c_whole():
    """n_groups 1 at TP 2 replicates the group: D at TP 1 takes B and C from one P rank whole,
    x and the SSM heads from both (the case NixlConnector's 3-read gets wrong)."""
    layer = lambda tp, r: mamba2_layer(8, 2, 4, 1, 4, 0, (2, 2), True, tp, r)  # noqa: E731
    p_regions = {r: regions_of(layer, 2, r) for r in range(2)}
    plans = shards.shard_regions(regions_of(layer, 1, 0), p_regions, (0, 1))
    conv_from = {rank: [x.page_bytes for x in local if x.name.startswith("m#0")] for rank, (local, _) in plans.items()}
    # rank 0: its x half, then B and C (contiguous on both sides: one piece); rank 1: its x half.
    x_half, group = 8 * 2 // 2 * 3 * 2, 4 * 3 * 2
    assert conv_from == {0: [x_half, 2 * group], 1: [x_half]} or conv_from == {0: [x_half + 2 * group], 1: [x_half]}


@pytest.mark.parametrize(
    "p, d, rank, want",
    [(1, 1, 0, (0,)), (2, 1, 0, (0, 1)), (1, 2, 1, (0,)), (4, 2, 1, (2, 3)), (2, 8, 5, (1,)), (8, 2, 0, (0, 1, 2, 3))],
)
def test_peer_ranks(p, d, rank, want):
    assert shards.peer_ranks(p, d, rank) == want


@pytest.mark.parametrize("p, d", [(2, 3), (3, 2), (4, 6), (0, 1)])
def test_a_tp_pair_that_does_not_divide_is_refused_naming_both_sizes(p, d):
    with pytest.raises(shards.ShardError, match=f"prefill TP {p} and decode TP {d}"):
        shards.peer_ranks(p, d, 0)


def test_a_head_count_that_does_not_divide_is_refused_naming_the_quantity():
    with pytest.raises(shards.ShardError, match="KV heads: 6 do not divide over TP 4"):
        shards.attention_segments(6, 4, 0, 8)


def test_a_layer_without_segments_is_refused_for_another_tp():
    bare = [LayerRegion("x", 0, 0, 64, 64, 1)]
    with pytest.raises(shards.ShardError, match="not described per TP shard"):
        shards.shard_regions(bare, {0: bare, 1: bare}, (0, 1))


def shift_remote(plans, by: int):
    """A plan that reads every piece ``by`` bytes further into P's page."""
    return {
        rank: (local, tuple(r.__class__(**{**{f: getattr(r, f) for f in r.__struct_fields__}, "addr": r.addr + by}) for r in remote))
        for rank, (local, remote) in plans.items()
    }


def swap_ranks(plans):
    """A plan that reads rank 0's pieces from rank 1 and back."""
    (a, pa), (b, pb) = plans.items()
    return {a: (pa[0], pb[1]), b: (pb[0], pa[1])} if len(pa[0]) == len(pb[0]) else {a: pb, b: pa}


@pytest.mark.parametrize("tamper", [lambda plans: shift_remote(plans, 2), swap_ranks], ids=["one_head_off", "ranks_swapped"])
def test_a_wrong_plan_is_caught_by_the_byte_check(tamper):
    """Negative controls: the byte check fails when a read is one head off or two ranks'
    shards are swapped."""
    layer = lambda tp, r: attention_layer(4, 2, tp, r)  # noqa: E731
    check_pair(layer, 2, 1)
    with pytest.raises(AssertionError):
        check_pair(layer, 2, 1, tamper)


# --- attention pages as vLLM views them (padding, kernel blocks), replicated pages ------------


def attention_page(k: int, tp: int, tokens: int, kv_bytes: int, pad_per_head: int = 0, kernel_blocks: int = 1):
    """A plain K/V page of a rank, as ``engine/from_vllm/shard_layout`` reads it off vLLM's view."""
    heads = max(1, k // tp)
    per_kernel = tokens // kernel_blocks
    kernel_stride = heads * per_kernel * kv_bytes
    return shards.AttentionPage(
        page_bytes=kernel_blocks * kernel_stride + heads * pad_per_head,
        kernel_blocks=kernel_blocks,
        kernel_stride=kernel_stride,
        slots=heads,
        slot_stride=per_kernel * kv_bytes,
        tokens=per_kernel,
        token_stride=kv_bytes,
        content_bytes=kv_bytes,
        kv_heads=heads,
        block_size=tokens,
        kv_bytes=kv_bytes,
    )


@settings(max_examples=150, deadline=None)
@given(tp_pairs(), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4]), st.integers(0, 9), st.sampled_from([1, 2, 4]))
def test_padded_and_kernel_split_pages_place_heads_and_never_write_padding(pair, k, token_bytes, pad, kernel_blocks):
    """Heads land once from the rank that holds them; the padding after them (labelled None by
    the segments) is never written, at any TP pair."""
    p, d = pair
    if not (replication_ok(k, p) and replication_ok(k, d)):
        return

    def layer(tp, r):
        page = attention_page(k, tp, 4, token_bytes, pad, kernel_blocks)
        return [("attn", shards.attention_page_segments(page, k, tp, r), page.page_bytes, 0)]

    check_pair(layer, p, d)


VALID = attention_page(4, 1, 4, 8, pad_per_head=16)


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("slots", 8, "8 head slots for 4 KV heads"),
        ("content_bytes", 4, "4 B per head and token, 8 B of K and V"),
        ("tokens", 2, "1 x 2 tokens viewed in a 4-token page"),
        ("token_stride", 32, "a head is not one run"),  # token-major (LBNHC)
        ("slot_stride", 8, "a head is not one run"),
        ("page_bytes", 100, "past the 100 B page"),
    ],
)
def test_an_attention_page_the_code_cannot_place_is_refused_with_its_reason(field, value, reason):
    assert shards.attention_page_segments(VALID, 4, 2, 1) == (shards.Segment("kv_head", 2, 2, 0, 32),)  # control
    with pytest.raises(shards.ShardError, match=reason):
        shards.attention_page_segments(VALID._replace(**{field: value}), 4, 2, 1)


def test_overlapping_kernel_blocks_are_refused():
    page = attention_page(4, 1, 4, 8, kernel_blocks=2)
    assert len(shards.attention_page_segments(page, 4, 1, 0)) == 2
    with pytest.raises(shards.ShardError, match="overlap"):
        shards.attention_page_segments(page._replace(kernel_stride=page.kernel_stride - 1), 4, 1, 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), min_size=1, max_size=4), st.sampled_from([1, 2, 4, 8]))
def test_a_layers_head_count_is_the_one_candidate_that_gives_its_per_rank_heads(candidates, tp):
    for per_rank in range(1, 17):
        fits = {t for t in candidates if max(1, t // tp) == per_rank and (t % tp == 0 or tp % t == 0)}
        if len(fits) == 1:
            assert shards.layer_kv_heads(per_rank, tp, candidates) == fits.pop()
        else:
            with pytest.raises(shards.ShardError, match=f"{per_rank} KV head"):
                shards.layer_kv_heads(per_rank, tp, candidates)


@settings(max_examples=60, deadline=None)
@given(tp_pairs(), st.integers(1, 64), st.integers(0, 8))
def test_a_replicated_page_is_read_whole_from_the_first_paired_p_rank(pair, nbytes, pad):
    p, d = pair
    layer = lambda tp, r: [("mla", shards.replicated_segments(nbytes), nbytes + pad, 0)]  # noqa: E731
    check_pair(layer, p, d)
    for j in range(d):
        ranks = shards.peer_ranks(p, d, j)
        plans = shards.shard_regions(regions_of(layer, d, j), {r: regions_of(layer, p, r) for r in ranks}, ranks)
        assert [len(plans[r][0]) for r in ranks] == [1] + [0] * (len(ranks) - 1)


def test_the_refusal_names_the_layer_and_the_reason_from_either_side():
    described = LayerRegion("attn", 0, 0, 64, 64, 1, segments=shards.attention_segments(2, 1, 0, 32))
    refused = LayerRegion("attn", 0, 0, 64, 64, 1, reason="num_head_slots 4 for 2 KV heads")
    with pytest.raises(shards.ShardError, match="attn: this layer's layout is not described per TP shard: num_head_slots 4"):
        shards.shard_regions([refused], {0: [described]}, (0,))
    mine = LayerRegion("attn", 0, 0, 64, 32, 1, segments=shards.attention_segments(2, 2, 1, 32))
    with pytest.raises(shards.ShardError, match="no prefill rank holds kv_head unit 1 .*; prefill rank 0: num_head_slots 4"):
        shards.shard_regions([mine], {0: [refused]}, (0,))
