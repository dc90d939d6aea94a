"""D's connections to P engines end: vLLM gives every P start a fresh engine id, and D dropped a
peer only when the same id restarted, so every P restart or scale-out left a loaded remote
agent, a prepared descriptor list and side-channel sockets on every D rank for the life of D.
Real NIXL (UCX over DRAM, loopback) and real ZMQ, in process."""

from __future__ import annotations

import time

import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.engine.metadata import RecvTask
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.transport import side_channel

from test_chunked_read import COMPAT, granting_side_channel, load_one
from test_transport import P_BLOCKS, TIMEOUT_S, assert_bytes, expected_after, make_engine

pytestmark = pytest.mark.nixl

KIND = "layer_major_dense"
PAIRS = [[(1, 3), (7, 9)], [(3, 11)]]
IDLE_S = 0.5
RESTARTS = 10


def serve_as(p, engine_id: str, port: int) -> side_channel.SideChannelServer:
    """P's side channel under ``engine_id``: welcomes D, grants every claim, acks releases."""
    return granting_side_channel(p, port, engine_id)


def advance_until(receiver: Receiver, done, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        receiver.advance()
        assert time.monotonic() < deadline, f"D still holds prefill engines {sorted(receiver._peers.engines)}"
        time.sleep(0.02)


def test_p_restarted_ten_times_with_fresh_engine_ids_leaves_d_holding_no_old_engine(new_free_port):
    d = make_engine(KIND, 56, seed=None)
    settings = ConnectorSettings(nixl_read_chunk_mib=0, prefill_engine_idle_seconds=IDLE_S)
    receiver = Receiver(d.transport, settings, "d", COMPAT, None)
    agent = d.transport._agent
    gone: list[str] = []
    try:
        for i in range(RESTARTS):
            port = new_free_port()
            p = make_engine(KIND, P_BLOCKS, seed=100 + i)
            server = serve_as(p, f"p-start-{i}", port)
            try:
                d.mem[:] = 0
                want, _ = expected_after(d, p, PAIRS)
                prefill = LeaseRef(f"p-start-{i}", "127.0.0.1", port, "P-r1")
                load_one(receiver, RecvTask(prefill, PAIRS, 16, 15, [[1]]))
                assert_bytes(d, want)
                assert agent.check_remote_metadata(p.transport.name)
            finally:
                server.close()
                gone.append(p.transport.name)
                p.transport.close()  # this P is gone; the next start has a fresh engine id
        assert len(receiver._peers.engines) <= RESTARTS
        # After the idle time, one more step forgets every engine no load uses.
        time.sleep(IDLE_S)
        advance_until(receiver, lambda: len(receiver._peers.engines) <= 1)
        advance_until(receiver, lambda: not receiver._peers.engines)
        assert not any(agent.check_remote_metadata(name) for name in gone), "remote agents removed"
        assert not receiver.transport._peers, "descriptor lists released"
        assert receiver._calls.idle_sockets() == 0, "side-channel sockets closed"
        assert receiver.recorder.gauges["prefill_engines_connected", 0] == 0
    finally:
        receiver.close()
        d.transport.close()


def test_an_engine_a_load_still_uses_is_never_forgotten(free_port):
    """Negative control: idle time counts only while no load uses the engine; the engine a READ
    is waiting on stays, and it is forgotten once idle."""
    d = make_engine(KIND, 56, seed=None)
    p = make_engine(KIND, P_BLOCKS, seed=7)
    settings = ConnectorSettings(nixl_read_chunk_mib=0, prefill_engine_idle_seconds=IDLE_S)
    receiver = Receiver(d.transport, settings, "d", COMPAT, None)
    server = serve_as(p, "p-busy", free_port)
    try:
        load_one(receiver, RecvTask(LeaseRef("p-busy", "127.0.0.1", free_port, "P-r1"), PAIRS, 16, 15, [[1]]))
        engines = receiver._peers
        engine = engines.engines["p-busy"]
        assert receiver.recorder.gauges["prefill_engines_connected", 0] == 1
        # A load in progress keeps it, however long since it was last asked for.
        engines._next_sweep = 0.0
        engines.forget_idle(lambda: {"p-busy"}, now=engine.last_used + 10 * IDLE_S)
        assert "p-busy" in engines.engines
        later = engine.last_used + IDLE_S / 2
        engines._next_sweep = 0.0
        engines.forget_idle(set, now=later)
        assert "p-busy" in engines.engines, "not idle long enough"
        engines._next_sweep = 0.0
        engines.forget_idle(set, now=engine.last_used + IDLE_S)
        assert not engines.engines and not d.transport._peers
        assert receiver.recorder.gauges["prefill_engines_connected", 0] == 0
        # A P that is forgotten and comes back is connected again.
        d.mem[:] = 0
        want, _ = expected_after(d, p, PAIRS)
        load_one(receiver, RecvTask(LeaseRef("p-busy", "127.0.0.1", free_port, "P-r2"), PAIRS, 16, 15, [[1]]))
        assert "p-busy" in engines.engines
        assert_bytes(d, want)
    finally:
        receiver.close()
        server.close()
        p.transport.close()
        d.transport.close()
