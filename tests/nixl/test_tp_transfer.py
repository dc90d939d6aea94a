"""Tensor-parallel handoffs in one process, with real NIXL agents (UCX over DRAM), real side
channels and the production Sender (one per P rank) and Receiver (one per D rank).

Every rank's pages are laid out the way vLLM shards them (segments from core/shards.py) and
filled with bytes that are a function of the *global* unit (KV head, conv channel of a row,
SSM head) and the block: D's pages after the handoff must equal that function for the units D
holds, byte for byte, and stay untouched everywhere else; every P rank must free the request
once each of its readers is done.
"""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from pd_connector.core import shards
from pd_connector.core.config import ConnectorSettings
from pd_connector.core.params import PrefillRef
from pd_connector.core.protocol import Welcome
from pd_connector.dev.testing.ports import free_ports
from pd_connector.engine.metadata import RecvTask, SendLease
from pd_connector.engine.receiver import Receiver
from pd_connector.dev.testing.tp_layouts import Model, compat
from pd_connector.engine.sender import Sender

pytestmark = pytest.mark.nixl

TIMEOUT_S = 20.0


def run_handoff(model: Model, p: int, d: int, port: int, requests: dict[str, dict[int, list[tuple[int, int]]]], tamper=None):
    """Fill every P rank's source blocks, serve them with one Sender per rank, load them on
    every D rank with a Receiver; return (D ranks, {rank: finished requests} per P rank)."""
    p_ranks = [model.rank(p, r, seed=100 + r) for r in range(p)]
    d_ranks = [model.rank(d, j, seed=None) for j in range(d)]
    settings = ConnectorSettings(side_channel_host="127.0.0.1", side_channel_port=port, lease_seconds=30)
    senders, receivers = [], []
    try:
        for r, rank in enumerate(p_ranks):
            rank.fill({g: [src for req in requests.values() for src, _ in req.get(g, [])] for g in (0, 1)})
            welcome = Welcome("p", rank.transport.name, rank.transport.agent_metadata, rank.regions, compat(p), r, p)
            senders.append(Sender(settings, "p", compat(p), welcome, None, threading.Event()))
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
                PrefillRef("p", "127.0.0.1", port, rid, p),
                [req.get(0, []), req.get(1, [])],
                16,
                15,
                [[s for s, _ in req.get(g, [])] for g in (0, 1)],
            )
            for receiver in receivers:
                receiver.add(f"D-{rid}", task)
        finished = [set() for _ in receivers]
        freed = [set() for _ in senders]
        deadline = time.monotonic() + TIMEOUT_S
        while any(len(f) < len(requests) for f in finished) or any(len(f) < len(requests) for f in freed):
            assert time.monotonic() < deadline, f"handoff incomplete: D {finished}, P {freed}"
            for j, receiver in enumerate(receivers):
                receiver.advance()
                done, failed = receiver.take_results()
                assert not failed, f"D rank {j} failed: {receiver.failed or failed}"
                finished[j] |= done
            for r, sender in enumerate(senders):
                freed[r] |= sender.collect(p_ranks[r].transport.take_notifications())
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
        for sender in senders:
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
