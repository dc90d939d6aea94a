"""Pure tests of pd_connector.core.block_phases: cutting attention pages of different block
sizes into phases, and which pages and pairs are refused (byte-level checks over real NIXL:
tests/nixl/test_block_size_transfer.py; through vLLM's own pages and kernel:
tests/vllm/test_block_size_layout.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pd_connector.core import block_phases, shards
from pd_connector.core.block_phases import (
    INTERLEAVED,
    K_COLUMNS_V_ROWS,
    BlockSizeError,
    PhasePlan,
    paired_for_other_sizes,
    route_pairs,
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


@pytest.mark.parametrize("layout", ["", "CPU_ATTN:amx", "FLASHINFER", "k_columns_v_rows/0", "k_columns_v_rows/x"])
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
