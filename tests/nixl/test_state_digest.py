"""The optional recurrent-state digest (``engine/state_digest.py``, ``verify_state_digest``) over real
NIXL READs, with its buffers on the test device (``PD_TEST_DEVICE``; CUDA tensors on a GPU):
P's SHA-256 of the state pages it sends equals D's of the pages it received (between engines
of different speculative widths too: only the conv state has speculative rows); D's page views
alias the registered memory, so the rig's state corruption (rig/fault_receiver.py) lands in it
and changes the digest; and through the production LeaseServer and the rig's Receiver subclass (the
production one, flipping a marked task's state as it lands) a handoff whose state D corrupted
fails the load, one that D left alone loads.
"""

from __future__ import annotations

import threading
import time

import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import Welcome
from rig import devices, nixl_peers
from rig.fault_receiver import StateCorruptingReceiver, corrupted, flip_pages
from pd_connector.engine.state_digest import StateDigester
from pd_connector.engine.metadata import RecvTask, SendLease
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.prefill.lease_server import LeaseServer

from test_chunked_read import COMPAT
from test_state_repairing import LAYERS as GDN_LAYERS, _engine as gdn_engine
from test_transport import (
    ATTN, MAMBA, MAMBA_LAYERS, TIMEOUT_S, assert_bytes, expected_after, make_engine, read_and_wait,
)

pytestmark = pytest.mark.nixl

PAIRS = [[(1, 3), (7, 9)], [(3, 11), (5, 2)]]  # (P block, D block) per group


def digester(engine) -> StateDigester:
    """Page views of ``engine``'s registered allocation, as the worker builds them from vLLM's
    per-layer views (``make_engine``'s kv_caches)."""
    pl = engine.placement
    kv_caches = {name: engine.buf[pl.page_offset(name, 0) :] for t in pl.tensors for name in t.layers}
    return StateDigester(kv_caches, engine.regions)


def blocks(pairs, side: int) -> list[list[int]]:
    return [[pair[side] for pair in group] for group in pairs]


@pytest.fixture
def pair():
    p = make_engine("layer_major_dense", 40, seed=21)
    d = make_engine("layer_major_dense", 56, seed=None)
    d.add_peer("engine-p", p.transport.agent_metadata, p.regions)
    yield p, d
    d.transport.close()
    p.transport.close()


def test_d_digest_of_the_state_it_read_is_p_digest_and_a_flipped_page_changes_it(pair):
    p, d = pair
    p_dig, d_dig = digester(p), digester(d)
    sent = p_dig.digest(blocks(PAIRS, 0), [MAMBA])
    assert d_dig.digest(blocks(PAIRS, 1), [MAMBA]) != sent, "negative control: D before the READ"
    read_and_wait(d, PAIRS, b"digest")
    want, _ = expected_after(d, p, PAIRS)
    assert_bytes(d, want)
    assert d_dig.digest(blocks(PAIRS, 1), [MAMBA]) == sent
    # Attention pages are not hashed: changing one leaves the state digest alone.
    next(d_dig.pages(blocks(PAIRS, 1), [ATTN])).bitwise_xor_(0xFF)
    assert d_dig.digest(blocks(PAIRS, 1), [MAMBA]) == sent
    # The rig's flip, through the same views, lands in D's registered memory.
    before = d.mem.copy()
    flip_pages(lambda b: d_dig.pages(b, [MAMBA]), blocks(PAIRS, 1))
    devices.sync()
    assert (d.mem != before).sum() == len(PAIRS[MAMBA]) * len(MAMBA_LAYERS) * d.placement.page[MAMBA]
    assert d_dig.digest(blocks(PAIRS, 1), [MAMBA]) != sent


def gdn_digester(engine) -> StateDigester:
    """Page views of test_state_repairing's engine: one layer after the other in its buffer."""
    layer_bytes = engine.buf.numel() // len(GDN_LAYERS)
    return StateDigester({n: engine.buf[i * layer_bytes :] for i, n in enumerate(GDN_LAYERS)}, engine.regions)


def test_digest_matches_across_speculative_widths_after_the_read():
    """Regression: every state of a Mamba layer carried the engine's speculative row count, so
    the digest trimmed the SSM state too (rows = its heads) and P (2 speculative tokens) and D
    (1) hashed different parts of the same bytes. Only the conv state has speculative rows
    (``compat._state_regions``); the digest covers its state rows and the whole SSM state."""
    p, d = gdn_engine(2, seed=1), gdn_engine(1, seed=2)
    try:
        planner = nixl_peers.add_peer(
            d.transport, "p", p.transport.agent_metadata, p.regions, agent_name=p.transport.name
        )
        p_dig, d_dig = gdn_digester(p), gdn_digester(d)
        sent = p_dig.digest([[4]], [0])
        assert d_dig.digest([[1]], [0]) != sent
        li, ri = planner.indices([[(4, 1)]])
        handle = d.transport.read("p", li, ri, b"")
        deadline = time.monotonic() + TIMEOUT_S
        while d.transport.state(handle) != "DONE":
            assert time.monotonic() < deadline
            time.sleep(0.005)
        d.transport.discard(handle)
        assert d_dig.digest([[1]], [0]) == sent
    finally:
        d.transport.close()
        p.transport.close()


def handoff(p, d, port: int, corrupt: bool) -> tuple[set[str], dict[str, str], Receiver]:
    """One handoff through the production LeaseServer (P's digest in the grant) and Receiver (D's
    check; the rig's subclass), D corrupting what it read when ``corrupt`` (CORRUPT_STATE's
    path: rig/fault_connector.py marks the task, the receiver flips its state)."""
    p_dig, d_dig = digester(p), digester(d)
    settings = ConnectorSettings(side_channel_host="127.0.0.1", side_channel_port=port, verify_state_digest=True)
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    sender = LeaseServer(settings, "p", COMPAT, welcome, lambda b: p_dig.digest(b, [MAMBA]), threading.Event())
    receiver = StateCorruptingReceiver(d.transport, settings, "d", COMPAT, lambda b: d_dig.digest(b, [MAMBA]))
    receiver.state_pages = lambda b: d_dig.pages(b, [MAMBA])
    try:
        sender.grant({"P-r1": SendLease(time.monotonic() + 30, 15, blocks(PAIRS, 0))})
        task = RecvTask(LeaseRef("p", "127.0.0.1", port, "P-r1"), PAIRS, 16, 15, blocks(PAIRS, 0))
        task = corrupted(task) if corrupt else task
        receiver.add("r1", task)
        deadline = time.monotonic() + TIMEOUT_S
        finished: set[str] = set()
        failed: dict[str, str] = {}
        while not finished and not failed:
            receiver.advance()
            failed = dict(receiver.failed)
            finished = receiver.take_results()[0]
            sender.blocks_to_free(p.transport.take_notifications())
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return finished, failed, receiver
    finally:
        receiver.close()
        sender.close()


def test_a_handoff_with_the_digest_on_loads_the_state_p_sent(pair, free_port):
    p, d = pair
    d.transport.remove_peer("engine-p")
    finished, failed, _ = handoff(p, d, free_port, corrupt=False)
    assert finished == {"r1"} and not failed
    want, _ = expected_after(d, p, PAIRS)
    assert_bytes(d, want)


def test_a_handoff_whose_state_d_corrupted_fails_on_the_digest(pair, free_port):
    """Negative control of the one above: the same handoff, D's state pages flipped after the
    READ, is refused by the digest (vLLM then recomputes)."""
    p, d = pair
    d.transport.remove_peer("engine-p")
    finished, failed, receiver = handoff(p, d, free_port, corrupt=True)
    assert not finished and "differs from P's digest" in failed["r1"]
    assert receiver.recorder.totals["load_failed:digest"] == 1
