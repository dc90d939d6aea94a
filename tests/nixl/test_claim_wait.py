"""P answers a claim that overtook its lease the moment the lease lands (Claim.wait_ms), over a
real side channel, with P's own claim handler (engine/prefill/lease_server.py); no NIXL transfer needed."""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest

from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.protocol import (
    Ack,
    Claim,
    EngineCompat,
    Granted,
    Pending,
    ReadDone,
    Reject,
    Release,
    Welcome,
    encode_read_done,
)
from pd_connector.engine.prefill import lease_server as sender_mod
from pd_connector.engine.metadata import SendLease
from pd_connector.engine.prefill.lease_server import LeaseServer
from pd_connector.transport import side_channel

HOST = "127.0.0.1"
BLOCKS = [[3, 4], [9]]


COMPAT = EngineCompat("m", "float32", "auto", [], "", 1, "cpu")


@pytest.fixture
def served(free_port):
    """P's sender (lease table and side-channel answers) on a real side channel at ``free_port``."""
    welcome = Welcome("p", "agent", b"", [], COMPAT)
    settings = ConnectorSettings(side_channel_host=HOST, side_channel_port=free_port)
    s = LeaseServer(settings, "p", COMPAT, welcome, None, threading.Event())
    yield s
    s.close()


def grant(s: LeaseServer, request_id: str, offset: int = 31) -> None:
    """What P's engine thread does one step after the request finished."""
    s.grant({request_id: SendLease(deadline=time.monotonic() + 30, replay_offset=offset, block_ids=BLOCKS)})


def claim(request_id: str, wait_ms: int, offset: int = 31) -> Claim:
    return Claim(engine_id="d", request_id=request_id, replay_offset=offset, block_ids=BLOCKS, wait_ms=wait_ms)


def test_claim_that_overtook_its_lease_is_granted_when_the_lease_lands(served, free_port, monkeypatch):
    # Only the grant's kick can answer within the test: the periodic re-poll and P's cap on the
    # wait are both pushed past it.
    monkeypatch.setattr(side_channel, "_PARKED_POLL_S", 60.0)
    monkeypatch.setattr(sender_mod, "MAX_CLAIM_PARK_MS", 60_000)
    out: dict = {}
    caller = threading.Thread(target=lambda: out.update(r=side_channel.call(HOST, free_port, claim("r1", 30_000), 40)))
    caller.start()
    time.sleep(0.3)
    assert "r" not in out, "P must hold the answer, not say Pending or Reject"
    grant(served, "r1")
    caller.join(10)
    assert isinstance(out.get("r"), Granted)
    # vllm:pd_claim_held_seconds: P held it from its arrival (a little after the caller
    # started) until the grant (after the 0.3 s above).
    (held,) = served.recorder.interval.data["claim_held_seconds"]
    assert 0.2 < held < 10


def test_claim_without_wait_is_answered_pending_at_once_as_before(served, free_port):
    """A D that predates wait_ms (0): P answers Pending at once and D polls."""
    assert isinstance(side_channel.call(HOST, free_port, claim("r2", 0), 5), Pending)
    grant(served, "r2")
    assert isinstance(side_channel.call(HOST, free_port, claim("r2", 0), 5), Granted)


def test_parked_claim_runs_out_as_pending_and_a_mismatch_is_still_refused(served, free_port):
    reply = side_channel.call(HOST, free_port, claim("r3", 200), 5)
    assert isinstance(reply, Pending) and "no lease for request r3" in reply.reason
    (held,) = served.recorder.interval.data["claim_held_seconds"]  # the hold that ran out counts too
    assert held >= 0.19
    grant(served, "r3", offset=31)
    reply = side_channel.call(HOST, free_port, claim("r3", 200, offset=30), 5)
    assert isinstance(reply, Reject) and "does not match the lease" in reply.reason


def test_claim_beyond_max_parked_is_pending_at_once_and_records_no_hold(served, free_port, monkeypatch):
    """P past MAX_PARKED (a flood) cannot hold the claim: Pending at once, D asks again, and
    vllm:pd_claim_held_seconds gets no sample (it used to record a ~0 s hold that never was)."""
    monkeypatch.setattr(side_channel, "MAX_PARKED", 0)
    started = time.monotonic()
    reply = side_channel.call(HOST, free_port, claim("r4", 30_000), 5)
    assert isinstance(reply, Pending) and "no lease for request r4" in reply.reason
    assert time.monotonic() - started < 5  # not held for the 30 s D offered
    assert served.recorder.interval.data["claim_held_seconds"] == []


def test_claim_whose_prompt_fingerprint_was_rewritten_is_refused_by_p(served, free_port):
    """A router that rewrote pd_prompt_fingerprint in D's params to match D's prompt passes D's own
    check; P compares the claimed fingerprint with the one it computed."""
    served.grant({"r5": SendLease(time.monotonic() + 30, 31, BLOCKS, fingerprint="1:aa")})
    base = Claim(engine_id="d", request_id="r5", replay_offset=31, block_ids=BLOCKS, reader="d#0/x")
    reply = side_channel.call(HOST, free_port, msgspec.structs.replace(base, fingerprint="1:bb"), 5)
    assert isinstance(reply, Reject) and "prompt fingerprint 1:bb" in reply.reason
    assert served.recorder.interval.data["events"]["claim_refused:prompt_mismatch"] == 1
    assert isinstance(side_channel.call(HOST, free_port, msgspec.structs.replace(base, fingerprint="1:aa"), 5), Granted)


def test_n_readers_of_one_handoff_keep_the_blocks_until_the_last_is_done(served, free_port):
    """n = 2 on D: two D requests read one lease announced for two; the first one's READ
    notification must not free the blocks, and a late claim after the end is refused at once."""
    served.grant({"r6": SendLease(time.monotonic() + 30, 31, BLOCKS, requests=2)})
    for reader in ("d#0/0_c", "d#0/1_c"):
        c = Claim(engine_id="d", request_id="r6", replay_offset=31, block_ids=BLOCKS, reader=reader)
        assert isinstance(side_channel.call(HOST, free_port, c, 5), Granted)
    assert served.blocks_to_free([encode_read_done(ReadDone("r6", "d#0/0_c"))]) == set()
    assert served.held() == 1
    assert served.blocks_to_free([encode_read_done(ReadDone("r6", "d#0/1_c"))]) == {"r6"}
    late = Claim(engine_id="d", request_id="r6", replay_offset=31, block_ids=BLOCKS, reader="d#0/2_c")
    started = time.monotonic()
    reply = side_channel.call(HOST, free_port, msgspec.structs.replace(late, wait_ms=1000), 5)
    assert isinstance(reply, Reject) and "already ended" in reply.reason
    assert time.monotonic() - started < 0.5, "a definite answer, not a held or pending claim"


def test_release_reason_reaches_p_log(served, free_port, caplog):
    caplog.set_level(logging.INFO, logger="vllm.pd_connector")
    grant(served, "r7")
    release = Release(request_ids=["r7"], reason="refused (prompt_mismatch): another prompt", reader="d#0/x")
    assert isinstance(side_channel.call(HOST, free_port, release, 5), Ack)
    assert "decode d#0/x released r7: refused (prompt_mismatch): another prompt" in caplog.text
    assert served.blocks_to_free([]) == {"r7"}
