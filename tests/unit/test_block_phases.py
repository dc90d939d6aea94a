"""Pure tests of pd_connector.core.block_phases: cutting attention pages of different block
sizes into phases, and which pages and pairs are refused (byte-level checks over real NIXL:
tests/nixl/test_block_size_transfer.py; through vLLM's own pages and kernel:
tests/vllm/test_block_size_layout.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_connector.core import block_phases, shards
from pd_connector.core.block_phases import (
    AMX_VNNI,
    INTERLEAVED,
    K_COLUMNS_V_ROWS,
    BlockSizeError,
    PhasePlan,
    paired_for_other_sizes,
    phase_regions,
    route_pairs,
    token_granule,
    token_layout_name,
    token_parts,
    token_segments,
    window,
)
from pd_connector.core.pairing import BlockPairs
from pd_connector.core.protocol import LayerRegion

CPU_VEC = token_layout_name(K_COLUMNS_V_ROWS, 4)


def region(block: int, token_layout: str = INTERLEAVED, kernels: int = 1, heads: int = 2, token_bytes: int = 16):
    per = block // kernels
    head = per * token_bytes
    segments = shards.attention_segments(heads, 1, 0, head, kernels, heads * head)
    return LayerRegion("attn", 0, 1 << 20, kernels * heads * head, kernels * heads * head, 8, segments=segments,
                       token_layout=token_layout)  # fmt: skip


def test_interleaved_tokens_are_one_run_per_head():
    assert token_parts(INTERLEAVED, 32, 16) == [(0, 16)]


def test_cpu_vec_tokens_are_one_run_per_k_column_and_one_v_run():
    """K column-major [d, N], then V row-major [N, d] (4 dims of 2 bytes: 16 B per token)."""
    assert token_parts(token_layout_name(K_COLUMNS_V_ROWS, 4), 32, 16) == [(0, 2), (64, 2), (128, 2), (192, 2), (256, 8)]


def test_cpu_amx_tokens_are_one_k_run_and_one_v_run_per_16_dims():
    """32 bf16 dims (128 B per token), 32 tokens: K is 32 * 64 B; V one run per 16 dims after it."""
    assert token_parts(token_layout_name(AMX_VNNI, 32), 32, 128) == [(0, 64), (2048, 32), (3072, 32)]
    assert token_parts(token_layout_name(AMX_VNNI, 32), 32, 64) == [(0, 32), (1024, 16), (1536, 16)]  # fp8
    assert token_granule(token_layout_name(AMX_VNNI, 32)) == 16
    assert token_granule(INTERLEAVED) == token_granule(CPU_VEC) == 1


@pytest.mark.parametrize("layout", [
    "", "CPU_ATTN:amx", "FLASHINFER", "k_columns_v_rows/0", "k_columns_v_rows/x", "amx_vnni/0", "amx_vnni/24", "amx_vnni",
])  # fmt: skip
def test_opaque_layouts_are_not_cut(layout):
    assert token_parts(layout, 32, 16) is None
    with pytest.raises(BlockSizeError, match="not known for its attention backend"):
        token_segments(region(32, layout), 32)


def test_a_replicated_latent_page_is_refused_by_name():
    latent = LayerRegion("mla", 0, 0, 512, 512, 8, segments=shards.replicated_segments(512), token_layout=INTERLEAVED)
    with pytest.raises(BlockSizeError, match=r"not described per KV head and token \(units \['replicated'\]\)"):
        token_segments(latent, 32)


@pytest.mark.parametrize("layout", [INTERLEAVED, CPU_VEC])
@pytest.mark.parametrize("kernels", [1, 2, 4])
def test_token_segments_cover_each_byte_of_each_head_once(layout, kernels):
    r = region(32, layout, kernels)
    covered = np.zeros(r.page_bytes, dtype=int)
    for seg in token_segments(r, 32):
        covered[seg.offset : seg.offset + seg.count * seg.unit_bytes] += 1
    heads_bytes = 2 * (32 // kernels) * 16
    for k in range(kernels):
        assert (covered[k * heads_bytes : (k + 1) * heads_bytes] == 1).all()


def test_window_keeps_a_phases_tokens_renumbered_from_zero():
    segs = token_segments(region(64, INTERLEAVED, kernels=2, heads=1), 64)  # tokens 0-31, 32-63
    assert [(s.first, s.count, s.offset) for s in window(segs, 16, 32)] == [(0, 16, 256), (16, 16, 512)]


def test_phase_plan_numbers_phase_groups_after_the_real_ones():
    plan = PhasePlan.of([0, 64, 16, 32], [0, 16, 64, 32], ["mamba", "attention", "sliding_window", "attention"])
    assert plan.ratio == {1: 4, 2: 4}
    assert plan.groups == {(1, 0): 1, (1, 1): 4, (1, 2): 5, (1, 3): 6, (2, 0): 2, (2, 1): 7, (2, 2): 8, (2, 3): 9}
    assert plan.num_groups == 10


@pytest.mark.parametrize("p, d, kind", [(48, 32, "attention"), (0, 32, "attention"), (32, 64, "mamba")])
def test_phase_plan_refuses_what_cannot_be_cut(p, d, kind):
    with pytest.raises(BlockSizeError, match="cannot be re-cut"):
        PhasePlan.of([p], [d], [kind])


def test_route_pairs_sends_each_pair_to_its_phase_group():
    plan = PhasePlan.of([0, 32], [0, 16], ["mamba", "attention"])
    routed = route_pairs([[(9, 4)], BlockPairs([5, 5, 6], [1, 2, 3], [0, 1, 0])], plan)
    assert routed[0] == [(9, 4)]
    assert routed[1].tolist() == [[5, 1], [6, 3]] and routed[2].tolist() == [[5, 2]]


def test_route_pairs_refuses_pairs_cut_for_other_block_sizes():
    plan = PhasePlan.of([32], [16], ["attention"])
    with pytest.raises(BlockSizeError, match="paired as whole blocks"):
        route_pairs([[(5, 1)]], plan)
    with pytest.raises(BlockSizeError, match="phase 2 of 2"):
        route_pairs([BlockPairs([5], [1], [2])], plan)
    with pytest.raises(BlockSizeError, match="paired as sub-blocks"):
        route_pairs([BlockPairs([5], [1], [0])], PhasePlan.of([16], [16], ["attention"]))


def test_pairs_cut_for_the_params_sizes_are_read_only_from_a_p_showing_them():
    assert paired_for_other_sizes(None, (0, 16)) == ""
    assert paired_for_other_sizes((0, 16), (0, 16)) == ""
    assert "paired for prefill block sizes [0, 32]" in paired_for_other_sizes((0, 32), (0, 16))


def test_token_layouts_of_p_and_d_must_be_the_same_to_cut():
    plan = PhasePlan.of([32], [16], ["attention"])
    with pytest.raises(shards.ShardError, match="another attention backend or CPU ISA"):
        block_phases.peer_regions([region(16, CPU_VEC)], {0: [region(32, INTERLEAVED)]}, [0], True, plan, [16], [32])


def amx_kernel_offsets(tokens: int, head_dim: int, elem: int) -> np.ndarray:
    """Byte offset in one KV head's run of (token, K|V, dim, byte), as vLLM 0.32's AMX
    reshape_and_cache writes it (read off the kernel: tests/vllm/test_block_size_layout.py;
    csrc/cpu/cpu_attn_amx.hpp): K [N/16][d/2][16][2], then V [d/16][N/2][16][2], in elements."""
    t = np.arange(tokens)[:, None, None, None]
    i = np.arange(head_dim)[None, None, :, None]
    b = np.arange(elem)[None, None, None, :]
    k = (t // 16) * 16 * head_dim + (i // 2) * 32 + (t % 16) * 2 + i % 2
    v = tokens * head_dim + (i // 16) * tokens * 16 + (t // 2) * 32 + (i % 16) * 2 + t % 2
    kv = np.where(np.arange(2)[None, :, None, None] == 0, k, v)
    return kv * elem + b


def amx_page(block: int, heads: int, head_dim: int, elem: int, kernels: int, first_token: int) -> np.ndarray:
    """A page whose every byte names what it holds: (token of the prompt, K|V, head, dim, byte)."""
    per = block // kernels
    head_bytes = per * 2 * head_dim * elem
    page = np.full(kernels * heads * head_bytes, -1, dtype=np.int64)
    offsets = amx_kernel_offsets(per, head_dim, elem)
    t, kv, i, b = np.meshgrid(np.arange(per), np.arange(2), np.arange(head_dim), np.arange(elem), indexing="ij")
    for kernel in range(kernels):
        for h in range(heads):
            token = first_token + kernel * per + t
            label = (((token * 2 + kv) * heads + h) * head_dim + i) * elem + b
            page[kernel * heads * head_bytes + h * head_bytes + offsets] = label
    return page


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 3),
    ratio=st.integers(1, 4),
    head_dim=st.sampled_from([16, 32, 64, 128]),
    elem=st.sampled_from([1, 2]),
    heads=st.integers(1, 3),
    kernels=st.sampled_from([1, 2]),
    p_larger=st.booleans(),
)
def test_amx_phases_move_exactly_the_bytes_the_kernel_writes_for_their_tokens(
    groups, ratio, head_dim, elem, heads, kernels, p_larger
):
    """Phase j of a larger AMX page, copied run by run into a smaller page, is byte for byte the
    page the kernel writes for tokens [j*s, (j+1)*s) (every byte once, none from another token)."""
    small, layout = 16 * groups * kernels, token_layout_name(AMX_VNNI, head_dim)
    large = small * ratio
    token_bytes = 2 * head_dim * elem
    regions = {size: region(size, layout, kernels, heads, token_bytes) for size in {small, large}}
    sizes = (large, small) if p_larger else (small, large)
    plan = PhasePlan.of([sizes[0]], [sizes[1]], ["attention"])
    if ratio == 1:
        assert not plan.ratio
        return
    big_page = amx_page(large, heads, head_dim, elem, kernels, 0)
    big, little = (phase_regions([regions[size]], plan, [size], [small]) for size in (large, small))
    for j in range(ratio):
        assert big[j].name == little[j].name == f"attn~{j}" and big[j].group == little[j].group
        # Matched as the shard plan matches them: by unit (head, part) and token, here per pack.
        src, dst = (packs(r.segments) for r in (big[j], little[j]))
        assert src.keys() == dst.keys()
        got = np.full(regions[small].page_bytes, -1, dtype=np.int64)
        for key, (at, n) in dst.items():
            assert src[key][1] == n
            got[at : at + n] = big_page[src[key][0] : src[key][0] + n]
        np.testing.assert_array_equal(got, amx_page(small, heads, head_dim, elem, kernels, j * small))


def packs(segments) -> dict[tuple[str, int], tuple[int, int]]:
    """(unit, first token) of each 16-token pack of token segments -> (byte offset, bytes)."""
    out = {}
    for seg in segments:
        assert seg.first % 16 == 0 and seg.count % 16 == 0
        for t in range(seg.first, seg.first + seg.count, 16):
            out[(seg.unit, t)] = (seg.offset + (t - seg.first) * seg.unit_bytes, 16 * seg.unit_bytes)
    return out


@pytest.mark.parametrize("small, large, kernels, what", [(8, 32, 1, "blocks of 8"), (32, 64, 4, "kernel blocks of 8")])
def test_amx_pages_are_not_cut_inside_a_pack_of_16_tokens(small, large, kernels, what):
    """An AMX page cut where 16 tokens are packed together: refused by name, on either side."""
    layout = token_layout_name(AMX_VNNI, 16)
    plan = PhasePlan.of([large], [small], ["attention"])
    mine, theirs = region(small, layout, kernels, token_bytes=64), region(large, layout, kernels, token_bytes=64)
    with pytest.raises(BlockSizeError, match=f"token layout 'amx_vnni/16' packs 16 tokens together, {what} tokens"):
        block_phases.peer_regions([mine], {0: [theirs]}, [0], True, plan, [small], [large])


def test_amx_sub_blocks_must_be_whole_packs_of_16_tokens():
    """The larger side's page alone (16-token packs whole) is refused for sub-blocks of 8."""
    plan = PhasePlan.of([32], [8], ["attention"])
    with pytest.raises(BlockSizeError, match="packs 16 tokens together, sub-blocks of 8 tokens would split them"):
        phase_regions([region(32, token_layout_name(AMX_VNNI, 16), token_bytes=64)], plan, [32], [8])
    # The same sizes, vec's layout: no packs, so cut.
    assert len(phase_regions([region(32, token_layout_name(K_COLUMNS_V_ROWS, 16), token_bytes=64)], plan, [32], [8])) == 4


def test_amx_and_vec_pages_are_not_cut_into_each_other():
    plan = PhasePlan.of([64], [32], ["attention"])
    amx, vec = token_layout_name(AMX_VNNI, 16), token_layout_name(K_COLUMNS_V_ROWS, 16)
    with pytest.raises(shards.ShardError, match="another attention backend or CPU ISA"):
        block_phases.peer_regions(
            [region(32, vec, token_bytes=64)], {0: [region(64, amx, token_bytes=64)]}, [0], True, plan, [32], [64]
        )
