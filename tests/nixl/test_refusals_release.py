"""Every handoff D refuses after P answered is released on P with the reason (P then frees the
blocks at once, not at the lease's end); a P that does not answer cannot be told, and frees
at its claim deadline (core/leases.py). Real side channels, P's own LeaseServer; no NIXL transfer."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import EngineCompat, Welcome
from pd_connector.engine.metadata import RecvTask, SendLease
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.engine.prefill.lease_server import LeaseServer

HOST = "127.0.0.1"
COMPAT = EngineCompat("m", "float32", "auto", [], "", 1, "cpu")


@pytest.fixture
def p(free_port):
    settings = ConnectorSettings(side_channel_host=HOST, side_channel_port=free_port, lease_seconds=600)
    s = LeaseServer(settings, "p", COMPAT, Welcome("p", "agent", b"", [], COMPAT), None, threading.Event())
    yield s
    s.close()


def receiver(compat=COMPAT) -> Receiver:
    settings = ConnectorSettings(handshake_timeout_seconds=1)
    return Receiver(SimpleNamespace(regions=[]), settings, "d", compat, None)


def load_until_failed(r: Receiver, rid: str, task: RecvTask, timeout: float = 10) -> None:
    r.add(rid, task)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r.advance()
        _, failed = r.take_results()
        if rid in failed:
            return
        time.sleep(0.01)
    raise AssertionError(f"{rid} did not fail")


def task(port: int, engine: str, request_id: str) -> RecvTask:
    return RecvTask(LeaseRef(engine, HOST, port, request_id), [[(1, 1)]], 16, 15, [[1]])


def wait_freed(p: LeaseServer, rid: str, timeout: float = 5) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        freed = p.blocks_to_free([])
        if freed:
            return freed
        time.sleep(0.02)
    return set()


@pytest.mark.parametrize("case", ["wrong_engine_id", "incompatible_engine"])
def test_a_handshake_p_answered_but_d_refuses_releases_p_with_the_reason(p, free_port, case, caplog):
    """A rewritten remote_engine_id (or a P whose model differs) used to fail the load without a
    word to P, whose blocks then stayed for lease_seconds."""
    caplog.set_level("INFO", logger="vllm.pd_connector")
    p.grant({"r1": SendLease(time.monotonic() + 600, 15, [[1]])})
    if case == "wrong_engine_id":
        r, engine = receiver(), "not-an-engine"
    else:
        r, engine = receiver(EngineCompat("other-model", "float32", "auto", [], "", 1, "cpu")), "p"
    try:
        load_until_failed(r, "d1", task(free_port, engine, "r1"))
        assert wait_freed(p, "r1") == {"r1"}
    finally:
        r.close()
    assert "decode d#0/d1 released r1: decode load failed: handshake failed" in caplog.text


def test_an_unanswered_handshake_is_not_released_and_p_frees_at_the_claim_deadline(p, new_free_port):
    """The params point D at an address where no P answers: D cannot tell P anything; P's lease,
    granted for the claim deadline only, frees the blocks then (not after lease_seconds)."""
    p.grant({"r2": SendLease(time.monotonic() + 4.0, 15, [[1]])})  # as the scheduler grants it
    r = receiver()
    try:
        load_until_failed(r, "d2", task(new_free_port(), "p", "r2"))
    finally:
        r.close()
    assert p.blocks_to_free([]) == set() and p.held() == 1
    assert wait_freed(p, "r2", timeout=10) == {"r2"}
    assert p.recorder.interval.data["events"]["lease_expired"] == 1
