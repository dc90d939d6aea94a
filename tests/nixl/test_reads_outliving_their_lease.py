"""A READ that outlives its lease: P frees the blocks at the deadline even under the READ (its
hold stays bounded), another request reuses them, and D must fail the load (vLLM recomputes)
instead of decoding on the other request's KV. Real NIXL (UCX over DRAM), the production
LeaseServer (P's lease table and side channel) and Receiver (D), sliced READs.

Two ways a READ outlives its lease: D's engine paused between two slices (no extension is sent
and no slice posted), and the link down under the READ (the slice in flight does not complete
and D's extensions are not delivered). Each is run with D's guard (``core/read_hold.py``) and,
as a negative control, without it: then D reports the load finished with the wrong bytes.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pd_connector.core import read_hold
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import Welcome
from pd_connector.engine.metadata import ExtendTask, RecvTask, SendLease
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.prefill.lease_server import LeaseServer
from pd_connector.transport.nixl import PENDING
from rig import devices

from test_chunked_read import COMPAT, load_one
from test_transport import MAMBA_LAYERS, ATTN_LAYERS, TIMEOUT_S, expected_after, make_engine

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(devices.on_cuda(), reason="needs a READ in several slices, which only DRAM without worker "
                       "threads makes (over VRAM the post is asynchronous: one slice), and writes P's pages in place"),
]

# Long enough for a claim on a loaded box, short enough to wait out.
LEASE_S = 2.0
PAIRS = [[(1, 3), (7, 9), (4, 5)], [(3, 11)]]  # (P block, D block) per group


def reuse_p_blocks(p) -> None:
    """Another request's prefill writes P's freed blocks."""
    for group, names in enumerate((ATTN_LAYERS, MAMBA_LAYERS)):
        for p_block, _ in PAIRS[group]:
            for name in names:
                page = p.page(name, p_block)
                page[:] = 255 - page


def outlive_the_lease(way: str, port: int) -> tuple[set[str], dict[str, str], bool, LeaseServer, Receiver]:
    """Run one handoff whose READ outlives its lease; return (D finished, D failed, D's bytes
    equal P's original ones, the LeaseServer, the Receiver)."""
    p = make_engine("layer_major_dense", 40, seed=11)
    d = make_engine("layer_major_dense", 56, seed=None)
    settings = ConnectorSettings(
        side_channel_host="127.0.0.1", side_channel_port=port, lease_seconds=LEASE_S, claim_deadline_seconds=LEASE_S
    )
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    sender = LeaseServer(settings, "p", COMPAT, welcome, None, threading.Event())
    receiver = Receiver(d.transport, settings, "d", COMPAT, None)
    receiver._chunk_bytes = 8192  # 4 KiB pages: several slices per READ
    want, _ = expected_after(d, p, PAIRS)
    blocks = [[s for s, _ in g] for g in PAIRS]
    try:
        # A first handoff connects D to P, so the short lease below times the READ, not a
        # handshake on a loaded box.
        sender.grant({"P-r0": SendLease(time.monotonic() + TIMEOUT_S, 15, blocks)})
        load_one(receiver, RecvTask(LeaseRef("p", "127.0.0.1", port, "P-r0"), PAIRS, 16, 15, blocks))
        d.mem[:] = 0
        sender.grant({"P-r1": SendLease(time.monotonic() + LEASE_S, 15, blocks)})
        receiver.add("r1", RecvTask(LeaseRef("p", "127.0.0.1", port, "P-r1"), PAIRS, 16, 15, blocks))
        deadline = time.monotonic() + TIMEOUT_S
        while not receiver.reads():  # connect, claim, first slice
            receiver.advance()
            assert time.monotonic() < deadline and not receiver.failed, receiver.failed
            time.sleep(0.002)
        read = receiver.reads()[0]
        freed: set[str] = set()
        if way == "d_paused":
            # D's engine thread stops: no slice posted, no extension sent, while P frees.
            while "P-r1" not in freed:
                freed |= sender.blocks_to_free(p.transport.take_notifications())
                assert time.monotonic() < deadline
                time.sleep(0.01)
        else:
            # The link is down: the slice in flight does not complete and D's extensions are
            # not delivered; D keeps stepping and asking.
            real_state = d.transport.state
            d.transport.state = lambda handle: PENDING
            receiver._calls.extend = lambda *call: None
            while "P-r1" not in freed:
                receiver.advance()
                receiver.extend(ExtendTask("127.0.0.1", port, 1, ["P-r1"]))
                freed |= sender.blocks_to_free(p.transport.take_notifications())
                assert time.monotonic() < deadline
                time.sleep(0.01)
            d.transport.state = real_state
        assert read.xfer.next < read.xfer.slices, "test bug: every slice was posted before P freed"
        reuse_p_blocks(p)
        finished: set[str] = set()
        failed: dict[str, str] = {}
        while not finished and not failed:
            receiver.advance()
            failed = dict(receiver.failed)
            finished = receiver.take_results()[0]
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return finished, failed, bool(np.array_equal(d.mem, want)), sender, receiver
    finally:
        receiver.close()
        sender.close()
        d.transport.close()
        p.transport.close()


def check_refused(way: str, port: int) -> None:
    finished, failed, _, sender, receiver = outlive_the_lease(way, port)
    assert not finished, "D decoded on blocks P had freed and reused"
    assert "after the end of the lease P confirmed" in failed["r1"]
    assert receiver.recorder.totals["load_failed:lease_lost"] == 1
    assert sender.recorder.totals["lease_expired_while_reading"] == 1


@pytest.mark.parametrize("way", ["d_paused", "link_down"])
def test_a_read_that_outlives_its_lease_fails_instead_of_loading_reused_blocks(way, free_port):
    check_refused(way, free_port)


@pytest.mark.parametrize("way", ["d_paused", "link_down"])
def test_without_the_hold_check_the_outliving_read_loads_another_requests_bytes(way, free_port, monkeypatch):
    """Negative control: with D's guard switched off the same READ is reported loaded, and
    D's pages then hold bytes of the request that reused P's blocks."""
    monkeypatch.setattr(read_hold, "read_was_held", lambda hold, completed_at: True)
    finished, failed, same_bytes, _, _ = outlive_the_lease(way, free_port)
    assert finished == {"r1"} and not failed and not same_bytes


def test_extensions_p_confirms_keep_a_long_read_trusted(free_port):
    """The hold moves with every extension P confirms: a READ in flight for several leases,
    kept alive by D's extensions, loads (and P never expires it)."""
    # Longer than LEASE_S: the margin a confirmed extension leaves must cover a stall of a
    # loaded CI box between two extensions (CI once saw none confirmed within a 2 s lease).
    lease_s = 3.0
    p = make_engine("layer_major_dense", 40, seed=12)
    d = make_engine("layer_major_dense", 56, seed=None)
    settings = ConnectorSettings(
        side_channel_host="127.0.0.1", side_channel_port=free_port, lease_seconds=lease_s,
        claim_deadline_seconds=lease_s,
    )
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    sender = LeaseServer(settings, "p", COMPAT, welcome, None, threading.Event())
    receiver = Receiver(d.transport, settings, "d", COMPAT, None)
    # Several slices: P's completion notification rides on the last one, which is posted only
    # once the first is seen done. A one-slice READ would notify P at once while slow_state
    # still says pending: P ends the lease on it (rightly) and D, seeing the READ done seconds
    # later, fails it (CI saw that, as "no extension confirmed").
    receiver._chunk_bytes = 8192
    want, _ = expected_after(d, p, PAIRS)
    blocks = [[s for s, _ in g] for g in PAIRS]
    real_state = d.transport.state
    first_poll: list[float] = []

    def slow_state(handle):
        first_poll.append(time.monotonic())
        return PENDING if first_poll[-1] < first_poll[0] + 2.5 * lease_s else real_state(handle)

    answers: list[tuple[float, dict[str, float] | None]] = []  # for the failure message
    real_extend = receiver._calls.extend

    def recorded_extend(*call):
        reply = real_extend(*call)
        answers.append((time.monotonic(), None if reply is None else dict(reply.held)))
        return reply

    receiver._calls.extend = recorded_extend
    try:
        # A first handoff connects D to P: the leases below time the READ, not a handshake.
        sender.grant({"P-r0": SendLease(time.monotonic() + TIMEOUT_S, 15, blocks)})
        load_one(receiver, RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r0"), PAIRS, 16, 15, blocks))
        d.mem[:] = 0
        sender.grant({"P-r1": SendLease(time.monotonic() + lease_s, 15, blocks)})
        receiver.add("r1", RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r1"), PAIRS, 16, 15, blocks))
        d.transport.state = slow_state
        deadline = time.monotonic() + TIMEOUT_S
        freed: set[str] = set()
        finished: set[str] = set()
        last_extend = 0.0
        while not finished:
            receiver.advance()
            if time.monotonic() - last_extend > lease_s / 4:
                receiver.extend(ExtendTask("127.0.0.1", free_port, 1, ["P-r1"]))
                last_extend = time.monotonic()
            finished, failed = receiver.take_results()
            if receiver.reads():
                read = receiver.reads()[0]
                assert read.xfer.slices > 1, "test bug: a one-slice READ notifies P at once"
            start = first_poll[0] if first_poll else 0.0
            assert not failed, (failed, [(round(t - start, 2), held) for t, held in answers],
                                dict(sender.recorder.totals))
            freed |= sender.blocks_to_free(p.transport.take_notifications())
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert np.array_equal(d.mem, want)
        assert sender.recorder.totals["lease_expired"] == 0
    finally:
        receiver.close()
        sender.close()
        d.transport.close()
        p.transport.close()
