"""Attention blocks of different sizes on P and D, read over real NIXL (UCX over DRAM).

Each rank's attention pages are laid out as vLLM's head-major page view (``[kernel block,
head, token, content]``, heads sharded by TP) and P's bytes are a function of the *global* KV
head and the *token position in the prompt*, so D's pages after the handoff must hold, byte for
byte, that function for every token D loaded (the tokens of the sub-blocks it paired), and be
untouched everywhere else, whatever the two block sizes, kernel blocks and TP sizes. The
negative control moves every pair one phase off and must fail the comparison.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pd_connector.core import block_phases, pairing, read_plan, shards
from pd_connector.core.pairing import ATTENTION, SLIDING_WINDOW, GroupLayout
from rig.attention_pages import LAYERS, AttentionRank
from pd_connector.transport.nixl import DONE, PENDING, ChunkedRead

pytestmark = pytest.mark.nixl

TOKEN_BYTES = 8  # one token's K and V of one head
CPU_VEC = block_phases.token_layout_name(block_phases.K_COLUMNS_V_ROWS, TOKEN_BYTES // 2)  # 1-byte elements
LAYOUTS = [block_phases.INTERLEAVED, CPU_VEC]
NUM_BLOCKS = 24


def read(d: AttentionRank, key: str, planner: read_plan.Planner, pairs: list) -> None:
    xfer = ChunkedRead(d.transport, key, planner.plan(pairs, 0), b"")
    deadline = time.monotonic() + 20
    while (state := xfer.advance()) == PENDING:
        assert time.monotonic() < deadline, "READ did not finish"
        time.sleep(0.0005)
    assert state == DONE


def handoff(
    p: int, d: int, bp: int, bd: int, offset: int, hit: int, *, kernels=(1, 1), window=0, off_by_one_phase=False,
    token_layout=block_phases.INTERLEAVED, pages_as=None,
):
    """Read a prompt's first ``offset`` tokens from P (TP ``p``, blocks of ``bp``) into D rank 0
    and 1.. (TP ``d``, blocks of ``bd``) past D's own hit of ``hit`` tokens; assert the bytes."""
    kind = SLIDING_WINDOW if window else ATTENTION
    rng = np.random.default_rng(bp * 1000 + bd + offset)
    p_ranks = [
        AttentionRank(p, r, bp, kernels=kernels[0], pad=16, seed=10 + r, token_layout=token_layout) for r in range(p)
    ]
    for rank in p_ranks:
        rank.memory_layout = pages_as or token_layout
    p_table = [int(x) for x in rng.permutation(np.arange(1, NUM_BLOCKS))[: pairing.cdiv(offset, bp)]]
    for rank in p_ranks:
        rank.fill(p_table)
    remote_layout = GroupLayout(kind, bp, sliding_window=window)
    sent = pairing.select_source_blocks((remote_layout,), ([*p_table],), offset)[0]
    local_layout = GroupLayout(kind, bd, sliding_window=window)
    plan = block_phases.PhasePlan.of([bp], [bd], [kind])
    try:
        for j in range(d):
            dr = AttentionRank(d, j, bd, kernels=kernels[1], token_layout=token_layout)
            dr.memory_layout = pages_as or token_layout
            before = dr.mem().copy()
            d_table = [int(x) for x in rng.permutation(np.arange(1, NUM_BLOCKS))[: pairing.cdiv(offset, bd) + 1]]
            pairs = pairing.pair_block_lists((local_layout,), [sent], (d_table,), offset, hit, remote_block_sizes=[bp])
            if off_by_one_phase:
                g = pairs[0]
                pairs = [pairing.BlockPairs(g.remote, g.local, [(x + 1) % plan.ratio[0] for x in g.phases])]
            order = shards.peer_ranks(p, d, j)
            peers = read_plan.plan_engine(
                dr.regions, {r: p_ranks[r].regions for r in order}, order, p == d, plan, [bd], [bp],
                threads=dr.transport.threads, copies_in_post=dr.transport.copies_in_post,
            )
            for r, peer in peers.items():
                if peer is None:
                    continue  # every head of this D rank comes from another P rank
                key = f"p#{r}"
                src = p_ranks[r].transport
                dr.transport.add_peer(key, src.agent_metadata, peer, agent_name=src.name)
                read(dr, key, peer.planner, pairs)
            want = before.copy()
            first = max(0, offset - window + 1) if window else 0
            for u in range(max(hit, first) // min(bp, bd), pairing.cdiv(offset, min(bp, bd))):
                s = min(bp, bd)
                block_id, t0 = d_table[u * s // bd], u * s % bd
                for layer in range(len(LAYERS)):
                    dr.write_tokens(want, layer, block_id, u * s - t0, slice(t0, t0 + s))
            got = dr.mem()
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, f"D rank {j}: {bad.size} bytes differ, first at {bad[:4].tolist()}"
            dr.close()
    finally:
        for rank in p_ranks:
            rank.close()


@pytest.mark.parametrize(
    "bp, bd",
    [(32, 16), (64, 16), (16, 32), (16, 64), (48, 16), (16, 48)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("offset, hit", [(100, 0), (95, 0), (129, 64), (47, 0)])
@pytest.mark.parametrize("token_layout", LAYOUTS)
def test_every_byte_of_d_pages_holds_ps_tokens_across_block_sizes(bp, bd, offset, hit, token_layout):
    handoff(1, 1, bp, bd, offset, hit // bd * bd, token_layout=token_layout)


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("bp, bd", [(32, 16), (16, 64)])
def test_block_sizes_and_tp_sizes_differ_together(p, d, bp, bd):
    handoff(p, d, bp, bd, 77, 0)


@pytest.mark.parametrize("bp, bd, kernels", [(64, 16, (2, 1)), (16, 64, (1, 4)), (32, 64, (2, 2))])
def test_kernel_blocks_on_either_side(bp, bd, kernels):
    """vLLM splits a block into kernel blocks (a run of tokens per head in each): a phase may
    span kernel blocks or lie inside one."""
    handoff(1, 2, bp, bd, 90, 0, kernels=kernels)


@pytest.mark.parametrize("bp, bd", [(32, 16), (16, 32)])
def test_sliding_window_reads_only_the_window_on_each_side(bp, bd):
    handoff(1, 1, bp, bd, 150, 0, window=40)


@pytest.mark.parametrize("bp, bd", [(32, 16), (16, 64)])
def test_negative_control_pairs_one_phase_off_do_not_match(bp, bd):
    with pytest.raises(AssertionError, match="bytes differ"):
        handoff(1, 1, bp, bd, 100, 0, off_by_one_phase=True)


def test_negative_control_a_cpu_page_read_as_interleaved_does_not_match():
    """vLLM CPU's page planned as if a token's K and V sat together: the bytes must differ."""
    with pytest.raises(AssertionError, match="bytes differ"):
        handoff(1, 1, 32, 16, 100, 0, token_layout=block_phases.INTERLEAVED, pages_as=CPU_VEC)
