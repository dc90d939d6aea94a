"""Tensor-parallel handoffs in one process, with real NIXL agents (UCX over DRAM), real side
channels and the production LeaseServer (one per P rank) and Receiver (one per D rank).

Every rank's pages are laid out the way vLLM shards them (segments from core/shards.py) and
filled with bytes that are a function of the *global* unit (KV head, conv channel of a row,
SSM head) and the block: D's pages after the handoff must equal that function for the units D
holds, byte for byte, and stay untouched everywhere else; every P rank must free the request
once each of its readers is done.
"""

from __future__ import annotations

import re
import threading
import time

import msgspec
import numpy as np
import pytest

from pd_connector.core import ranks, shards
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import Welcome
from rig.ports import free_ports
from pd_connector.engine.metadata import RecvTask, SendLease
from pd_connector.engine.decode.receiver import Receiver
from rig.tp_layouts import KDA, MAMBA1, SHORT_CONV, Model, compat
from pd_connector.engine.prefill.lease_server import LeaseServer

pytestmark = pytest.mark.nixl

TIMEOUT_S = 20.0


def run_handoff(
    model: Model, p: int, d: int, port: int, requests: dict[str, dict[int, list[tuple[int, int]]]], tamper=None,
    dp_index: int = 0,
):
    """Fill every P rank's source blocks, serve them with one LeaseServer per rank, load them on
    every D rank with a Receiver; return (D ranks, {rank: finished requests} per P rank).
    ``dp_index``: P is that DP rank of a DP group (engine ``p_dp<k>``, ports from
    ``port + k * p``); DP rank 0's TP ranks listen below it meanwhile, holding no lease."""
    p_ranks = [model.rank(p, r, seed=100 + r) for r in range(p)]
    engine = f"p_dp{dp_index}" if dp_index else "p"
    d_ranks = [model.rank(d, j, seed=None) for j in range(d)]
    settings = ConnectorSettings(side_channel_host="127.0.0.1", side_channel_port=port, lease_seconds=30)
    senders, receivers, decoys = [], [], []
    try:
        for r, rank in enumerate(p_ranks):
            rank.fill({g: [src for req in requests.values() for src, _ in req.get(g, [])] for g in (0, 1)})
            welcome = Welcome(engine, rank.transport.name, rank.transport.agent_metadata, rank.regions, compat(p), r, p)
            senders.append(LeaseServer(settings, engine, compat(p), welcome, None, threading.Event(), dp_index=dp_index))
        decoys += [
            LeaseServer(settings, "p_dp0", compat(p), Welcome("p_dp0", "decoy", b"", [], compat(p), r, p), None, threading.Event())
            for r in range(p)
            if dp_index
        ]
        before = [rank.mem().copy() for rank in d_ranks]
        for sender in senders:
            sender.grant(
                {
                    rid: SendLease(time.monotonic() + 30, 15, [[s for s, _ in req.get(g, [])] for g in (0, 1)])
                    for rid, req in requests.items()
                }
            )
        for j, rank in enumerate(d_ranks):
            receivers.append(Receiver(rank.transport, settings, "d", compat(d), None, tp_rank=j, tp_size=d))
        if tamper is not None:
            tamper(receivers)
        for rid, req in requests.items():
            task = RecvTask(
                LeaseRef(engine, "127.0.0.1", ranks.engine_base_port(port, dp_index, p), rid, p),
                [req.get(0, []), req.get(1, [])],
                16,
                15,
                [[s for s, _ in req.get(g, [])] for g in (0, 1)],
            )
            for receiver in receivers:
                receiver.add(f"D-{rid}", task)
        finished = [set() for _ in receivers]
        freed = [set() for _ in senders]
        failures: dict[int, object] = {}  # D rank -> what failed; a failed rank is not advanced again
        deadline = time.monotonic() + TIMEOUT_S
        while any(len(f) < len(requests) for f in finished) or any(len(f) < len(requests) for f in freed):
            assert time.monotonic() < deadline, f"handoff incomplete: D {finished}, P {freed}, failed {failures}"
            for j, receiver in enumerate(receivers):
                if j in failures:
                    continue
                receiver.advance()
                done, failed = receiver.take_results()
                if failed:
                    failures[j] = receiver.failed or failed
                finished[j] |= done
            # Once one rank failed, wait only until every other one failed or finished, so the
            # failure names all failing ranks whatever order their handshakes land in.
            if failures and all(j in failures or len(f) == len(requests) for j, f in enumerate(finished)):
                raise AssertionError(f"D ranks {sorted(failures)} failed: {failures}")
            for r, sender in enumerate(senders):
                freed[r] |= sender.blocks_to_free(p_ranks[r].transport.take_notifications())
            time.sleep(0.002)
        for j, rank in enumerate(d_ranks):
            want = rank.expected({g: [pr for req in requests.values() for pr in req.get(g, [])] for g in (0, 1)}, before[j])
            got = rank.mem()
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                pytest.fail(f"D rank {j} of {d} (P TP {p}): {bad.size} bytes differ, first at {bad[0]}")
        return freed
    finally:
        for receiver in receivers:
            receiver.close()
        for sender in senders + decoys:
            sender.close()
        for rank in p_ranks + d_ranks:
            rank.close()


REQUESTS = {
    "r1": {0: [(1, 3), (2, 4), (7, 9)], 1: [(5, 6)]},
    "r2": {0: [(10, 1)], 1: [(11, 2)]},
}
PAIRS = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize("p, d", PAIRS)
@pytest.mark.parametrize(
    "model",
    [
        Model(shards.MAMBA2, kv_heads=2, n_groups=1),
        Model(shards.MAMBA2, kv_heads=4, n_groups=2),
        Model(shards.GDN, kv_heads=1),
    ],
    ids=["mamba2_g1_kv2", "mamba2_g2_kv4", "gdn_kv1"],
)
def test_every_byte_of_every_d_rank_page_comes_from_the_p_rank_that_holds_it(model, p, d):
    if model.n_groups % max(p, d) and model.n_groups != 1:
        pytest.skip("vLLM refuses n_groups that neither divide TP nor equal 1")
    freed = run_handoff(model, p, d, free_ports(p), REQUESTS)
    assert all(f == set(REQUESTS) for f in freed), "every P rank frees each request once its readers are done"


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize(
    "model",
    [Model(MAMBA1, kv_heads=2), Model(SHORT_CONV, kv_heads=2), Model(KDA, kv_heads=1), Model(KDA, kv_heads=1, mla=True)],
    ids=["mamba1", "short_conv", "kda", "kda_with_mla"],
)
def test_mamba1_short_conv_and_kda_states_land_on_their_d_rank_over_nixl(model, p, d):
    """Issue #29, 2: the layouts of Jamba's Mamba1, LFM2's short convolution and Kimi Linear's
    KDA (derived and checked on vLLM's own layers in tests/vllm/test_state_shard_layout.py) over
    the production LeaseServer and Receiver; fewer pairs than above, the pairing code being the same.
    ``kda_with_mla``: Kimi Linear's pair, KDA next to MLA's replicated latent in one handoff."""
    freed = run_handoff(model, p, d, free_ports(p), REQUESTS)
    assert all(f == set(REQUESTS) for f in freed)


@pytest.mark.parametrize("p, d", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_padded_page_p_tp1_d_tp2_reads_each_d_rank_its_own_heads_over_nixl(p, d):
    """Regression (issue #25, 1): with a padded attention page (vLLM's page_size_padded) a head
    was taken as page_size_bytes // heads, so D rank 1 silently received half of head 1 and P's
    padding. The pages here are vLLM's own (spec, placement, views: rig/vllm_pages.py)
    and the oracle reads them through vLLM's view: each D rank must hold its heads byte for byte
    and its padding untouched."""
    pytest.importorskip("vllm.v1.kv_cache_interface")
    from rig.vllm_pages import Layers, plain_attention

    model = Layers(4, plain_attention(pad_per_head=32), nixl=True)
    freed = run_handoff(model, p, d, free_ports(p), {"r1": {0: REQUESTS["r1"][0]}, "r2": {0: REQUESTS["r2"][0]}})
    assert all(f == {"r1", "r2"} for f in freed)


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)])
def test_mla_latent_across_tp_is_read_from_one_p_rank_and_every_other_p_rank_released(p, d):
    """Issue #25, 7: MLA's latent (vLLM's max_tp_shards == 1: every rank holds it whole) is read
    from the first P rank each D rank pairs with; the P ranks it reads nothing from still free
    the request (the receiver's release), so every P rank's lease ends."""
    pytest.importorskip("vllm.v1.kv_cache_interface")
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from rig.vllm_pages import Layers

    def mla(tp, heads):  # as MLAAttention.get_kv_cache_spec builds it
        return MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=24, dtype=torch.bfloat16, max_tp_shards=1)

    freed = run_handoff(Layers(1, mla, replicated=True, nixl=True), p, d, free_ports(p), {"r1": {0: REQUESTS["r1"][0]}})
    assert all(f == {"r1"} for f in freed)


def test_head_slots_that_are_not_heads_refuse_the_pair_at_the_handshake_naming_layer_and_reason(caplog):
    """Issue #25, 2: a page of 2H slots (FlashInfer NVFP4: all K, then all V) is not sharded by
    head; D refuses the P engine at the handshake and the load fails with the layer and why."""
    pytest.importorskip("vllm.v1.kv_cache_interface")
    import dataclasses

    from rig.vllm_pages import LAYERS, Layers, plain_attention

    plain = plain_attention()

    def nvfp4(tp, heads):  # FlashInferBackend.customize_spec (flashinfer is absent on CPU)
        spec = plain(tp, heads)
        return dataclasses.replace(spec, num_head_slots=2 * heads, state_content_bytes=spec.head_size * 2)

    model = Layers(2, nvfp4, k_then_v_slots=True, nixl=True)
    with pytest.raises(AssertionError, match=re.escape("D ranks [0, 1] failed")):
        run_handoff(model, 1, 2, free_ports(1), {"r1": {0: REQUESTS["r1"][0]}})
    assert re.search(f"tensor-parallel layouts cannot be paired: {re.escape(LAYERS[0])}: .*num_head_slots 2 for 1 KV heads", caplog.text)


def test_swapped_rank_shards_are_caught_by_the_byte_comparison():
    """Negative control: P ranks 0 and 1 describing each other's shards (so D reads rank 1's
    bytes where rank 0's belong, and back) fails the byte comparison."""

    def swap(receivers):
        real = receivers[0]._peers._add_engine

        def add_engine(key, answers, prefill):
            (r0, w0, s0), (r1, w1, s1) = answers

            def with_segments_of(w, other):
                regions = [msgspec.structs.replace(a, segments=b.segments) for a, b in zip(w.regions, other.regions)]
                return msgspec.structs.replace(w, regions=regions)

            return real(key, [(r0, with_segments_of(w0, w1), s0), (r1, with_segments_of(w1, w0), s1)], prefill)

        receivers[0]._peers._add_engine = add_engine

    with pytest.raises(pytest.fail.Exception, match="bytes differ"):
        run_handoff(Model(shards.MAMBA2, kv_heads=2, n_groups=2), 2, 1, free_ports(2), {"r1": REQUESTS["r1"]}, swap)


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2)])
def test_d_reads_from_the_dp_rank_its_params_name_at_remote_port_plus_tp_rank(p, d):
    """P is DP rank 1 of a DP group (ports base + p .. base + 2p - 1), DP rank 0 listens on the
    ports below it: D's ranks reach exactly DP rank 1's TP ranks, byte for byte."""
    freed = run_handoff(Model(shards.MAMBA2, kv_heads=2, n_groups=1), p, d, free_ports(2 * p), REQUESTS, dp_index=1)
    assert all(f == set(REQUESTS) for f in freed)
