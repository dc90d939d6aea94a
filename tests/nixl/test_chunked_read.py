"""The connector's READ path beyond one prepared transfer: the descriptor count it reports is
NIXL's own merged count, slices (``ChunkedRead``) move the same bytes with one notification,
and the Receiver posts at most one slice per ``advance()`` over DRAM. Real NIXL, UCX over DRAM.
"""

from __future__ import annotations

import dataclasses

import time
from concurrent.futures import Future
from contextlib import contextmanager

import pytest

from pd_connector.transport import side_channel
from pd_connector.core.settings import ConnectorSettings
from pd_connector.engine.metadata import ExtendTask, RecvTask
from pd_connector.core.params import LeaseRef
from pd_connector.core.protocol import (
    Ack,
    Claim,
    EngineCompat,
    Extended,
    Granted,
    Hello,
    ReadDone,
    Reject,
    Release,
    Welcome,
    encode_read_done,
)
from pd_connector.engine.decode.receiver import Receiver
from pd_connector.transport.nixl import DONE, FAILED, PENDING, ChunkedRead
from rig import devices

from test_transport import (
    ATTN,
    MAMBA,
    P_BLOCKS,
    TIMEOUT_S,
    assert_bytes,
    collect_notifications,
    expected_after,
    make_engine,
)

pytestmark = pytest.mark.nixl

CASES = {
    "scattered": [[(7, 2), (1, 9), (4, 5), (30, 44)], [(3, 11)]],
    "contiguous": [[(1, 3), (2, 4), (3, 5), (4, 6), (5, 7)], [(11, 15)]],
    "two_runs": [[(1, 3), (2, 4), (20, 30), (21, 31), (22, 32)], []],
}


def read_done(rid: str) -> bytes:
    """The notification D's rank 0 ("d#0") sends P when it has read request ``rid``."""
    return encode_read_done(ReadDone(f"P-{rid}", f"d#0/{rid}", 1))


def load_one(receiver: Receiver, task: RecvTask, pause_s: float = 0.01) -> None:
    """Add one request ("r1") and step the receiver until it finished; failing it fails the test."""
    receiver.add("r1", task)
    deadline = time.monotonic() + TIMEOUT_S
    finished: set[str] = set()
    while not finished:
        receiver.advance()
        finished, failed = receiver.take_results()
        assert not failed and time.monotonic() < deadline
        time.sleep(pause_s)


@contextmanager
def peered_pairs(seed: int, **transport_kw):
    """``get(kind, num_blocks=None) -> (P, D)``, made once per (kind, size) with these transport
    settings: D's agent records NIXL's per-transfer telemetry and is peered with P as "p"; every
    call zeroes D and drains P's notifications. Closes them all on exit."""
    made = {}

    def get(kind, num_blocks=None):
        if (kind, num_blocks) not in made:
            p = make_engine(kind, num_blocks or P_BLOCKS, seed=seed, **transport_kw)
            d = make_engine(kind, num_blocks or 56, seed=None, capture_telemetry=True, **transport_kw)
            d.add_peer("p", p.transport.agent_metadata, p.regions)
            made[kind, num_blocks] = (p, d)
        p, d = made[kind, num_blocks]
        devices.zero(d.buf)
        p.transport.take_notifications()
        return p, d

    try:
        yield get
    finally:
        for p, d in made.values():
            d.transport.close()
            p.transport.close()


@pytest.fixture(scope="module")
def engines():
    """kind -> (P, D with a telemetry-capturing agent, peered with P as "p")."""
    with peered_pairs(seed=77) as get:
        yield get


def read_merged_count(d, li, ri, notif: bytes) -> int:
    """Post one READ, wait for it, and return NIXL's own merged descriptor count."""
    handle = d.transport.read("p", li, ri, notif)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while (state := d.transport.state(handle)) == PENDING:
            assert time.monotonic() < deadline
            time.sleep(0.0005)
        assert state == DONE
        return d.transport.merged_descriptors(handle)
    finally:
        d.transport.discard(handle)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["block_major_padded", "layer_major_dense"])
def test_reported_descriptor_count_is_nixls_merged_count(engines, kind, case):
    p, d = engines(kind)
    pairs = CASES[case]
    li, ri = d.planners["p"].indices(pairs)
    assert read_merged_count(d, li, ri, b"n") == d.planners["p"].count_runs(li, ri)
    want, _ = expected_after(d, p, pairs)
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 1) == {b"n": 1}


def test_block_outer_packed_contiguous_attention_is_one_descriptor_per_block_not_per_layer(engines):
    """block_major_padded: both attention layers of a block are one span (slots are padded, so
    consecutive blocks do not merge): 5 blocks -> 5 descriptors, not 10."""
    p, d = engines("block_major_padded")
    pairs = [CASES["contiguous"][0], []]
    li, ri = d.planners["p"].indices(pairs)
    assert li.size == 5 and d.planners["p"].count_runs(li, ri) == 5


@pytest.mark.parametrize("chunk_bytes", [1, 4096 * 3, 1 << 30])
def test_sliced_read_moves_the_same_bytes_and_notifies_once_after_the_last_slice(engines, chunk_bytes):
    p, d = engines("layer_major_dense")
    pairs = CASES["scattered"]
    plan = d.planners["p"].plan(pairs, chunk_bytes)
    bounds = plan.bounds
    xfer = ChunkedRead(d.transport, "p", plan, b"req")
    notified_early = False
    deadline = time.monotonic() + TIMEOUT_S
    while (state := xfer.advance()) == PENDING:
        if xfer.next < xfer.slices and p.transport.take_notifications():
            notified_early = True
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert state == DONE
    assert not notified_early, "P was notified before the last slice was posted"
    want, _ = expected_after(d, p, pairs)
    assert_bytes(d, want)
    assert collect_notifications(p.transport, 1) == {b"req": 1}
    assert xfer.slices == (1 if chunk_bytes >= 1 << 30 else len(bounds))


def test_a_slice_nixl_refuses_fails_the_read_without_notifying(engines):
    p, d = engines("layer_major_dense")
    plan = d.planners["p"].plan(CASES["scattered"], 0)
    bounds = [(0, 2), (2, 2), (2, plan.local_idx.size)]  # an empty slice: NIXL refuses zero descriptors
    xfer = ChunkedRead(d.transport, "p", dataclasses.replace(plan, bounds=bounds), b"never")
    deadline = time.monotonic() + TIMEOUT_S
    while (state := xfer.advance()) == PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    assert state == FAILED and xfer.error_kind == "post"
    assert collect_notifications(p.transport, 0) == {}


COMPAT = EngineCompat(
    model="tiny", dtype="torch.bfloat16", kv_cache_dtype="auto", groups=[],
    conv_state_layout="", tensor_parallel_size=1, device="cpu",
)


def granting_side_channel(p, port: int, engine_id: str = "p") -> side_channel.SideChannelServer:
    """P's side channel as a Receiver needs it: it welcomes D (as ``engine_id``), grants every
    claim and acknowledges every release."""
    welcome = Welcome(engine_id, p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)

    def serve(message):
        if isinstance(message, Hello):
            return welcome
        if isinstance(message, Claim):
            return Granted(lease_seconds=30.0)
        if isinstance(message, Release):
            return Ack()
        return Reject(reason="unexpected")

    return side_channel.SideChannelServer("127.0.0.1", port, serve)


@pytest.mark.skipif(devices.on_cuda(), reason="over VRAM the post copies nothing, so the Receiver does not bound "
                    "posts per advance (receiver.py, may_post)")
@pytest.mark.parametrize("answered", ["in_background", "before_submit_returns"])
def test_receiver_posts_one_slice_per_advance_and_finishes_every_request(engines, free_port, answered):
    """Two requests of several slices each: each Receiver.advance() posts at most one slice in
    total, both finish with the right bytes, and P gets exactly one notification each.

    ``before_submit_returns``: side-channel calls run inline, as a fast P on an idle thread can
    answer before ``submit`` returns: the claim and transfer times must still be measured from
    the moment the claim was sent (a claim stamped after submit once timed negative in CI)."""
    p, d = engines("layer_major_dense")
    d.transport.remove_peer("p")
    server = granting_side_channel(p, free_port)
    # 4 KiB pages: 8 KiB slices = two descriptors each.
    settings = ConnectorSettings(nixl_read_chunk_mib=0)
    receiver = Receiver(d.transport, settings, "d", COMPAT, None)
    receiver._chunk_bytes = 8192
    if answered == "before_submit_returns":

        def run_inline(fn, *args):
            future = Future()
            future.set_result(fn(*args))
            return future

        receiver._submit = run_inline
    try:
        reqs = {
            "r1": [[(1, 3), (7, 9), (4, 5)], [(3, 11)]],
            "r2": [[(10, 20), (11, 21)], [(12, 22)]],
        }
        for rid, pairs in reqs.items():
            receiver.add(rid, RecvTask(LeaseRef("p", "127.0.0.1", free_port, f"P-{rid}"), pairs, 16, 15, [[1]]))
        finished: set[str] = set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(finished) < 2:
            reads = receiver.reads()  # kept, so their ids stay theirs
            before = sum(r.xfer.next for r in reads)
            seen = {id(r) for r in reads}
            receiver.advance()
            after = sum(r.xfer.next for r in receiver.reads() if id(r) in seen)
            started = sum(r.xfer.next for r in receiver.reads() if id(r) not in seen)
            done, failed = receiver.take_results()
            assert not failed
            finished |= done
            # Slices posted this call by requests still reading (finished ones posted none:
            # their last slice was posted by an earlier call).
            assert after - before + started <= 1
            assert time.monotonic() < deadline
            time.sleep(0.001)
        union = [[pr for pairs in reqs.values() for pr in pairs[g]] for g in (ATTN, MAMBA)]
        want, _ = expected_after(d, p, union)
        assert_bytes(d, want)
        assert collect_notifications(p.transport, 2) == {read_done("r1"): 1, read_done("r2"): 1}
        # vllm:pd_transfer_seconds (claim -> done), vllm:pd_claim_seconds (claim -> grant) and
        # vllm:pd_read_seconds (READ alone), one sample per request; claim and READ are
        # disjoint parts of the transfer.
        data = receiver.recorder.interval.data
        assert len(data["transfer_seconds"]) == len(data["read_seconds"]) == len(data["claim_seconds"]) == 2
        # READ and transfer are recorded together, request by request: the READ is the later
        # part of its own transfer.
        assert all(0 <= r <= t for r, t in zip(data["read_seconds"], data["transfer_seconds"]))
        assert min(data["claim_seconds"]) >= 0
        # Claims are recorded when their READ starts, possibly in another order: summed.
        assert sum(data["claim_seconds"]) + sum(data["read_seconds"]) <= sum(data["transfer_seconds"])
    finally:
        receiver.close()
        server.close()
        if not d.transport.has_peer("p"):
            d.add_peer("p", p.transport.agent_metadata, p.regions)


def test_a_side_channel_reply_wakes_an_idle_step(engines, free_port):
    """An idle engine step waits on the wake event (WorkerSide._wait_if_idle): the handshake
    reply and the claim grant must each set it, so the step resumes at once, not at its timeout."""
    import threading

    p, d = engines("layer_major_dense")
    d.transport.remove_peer("p")
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    server = side_channel.SideChannelServer(
        "127.0.0.1", free_port, lambda m: welcome if isinstance(m, Hello) else Granted(lease_seconds=30.0)
    )
    wake = threading.Event()
    receiver = Receiver(d.transport, ConnectorSettings(), "d", COMPAT, None, wake=wake)
    try:
        receiver.add("r1", RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r1"), [[(1, 3)], []], 16, 15, [[1]]))
        assert wake.wait(TIMEOUT_S), "the handshake reply did not wake the step"
        wake.clear()
        receiver.advance()  # connects and sends the claim
        assert d.transport.has_peer("p#0")
        assert wake.wait(TIMEOUT_S), "the claim grant did not wake the step"
        deadline = time.monotonic() + TIMEOUT_S
        finished: set[str] = set()
        while not finished and time.monotonic() < deadline:
            receiver.advance()
            finished, failed = receiver.take_results()
            assert not failed
        assert finished == {"r1"}
    finally:
        receiver.close()
        server.close()
        if not d.transport.has_peer("p"):
            d.add_peer("p", p.transport.agent_metadata, p.regions)


def test_a_stalled_read_and_a_slow_post_are_reported_once_and_the_read_still_finishes(
    engines, free_port, monkeypatch, caplog
):
    """Worker-thread READs were seen to hang for 2-105 s at the first READ from a new P, either
    inside the post (D's engine thread held) or posted and not completing (docs/operations.md,
    "Slow READs"). Neither can be cancelled safely, so D reports them, once each, and keeps
    polling: here the post is slowed and NIXL's state held at PENDING past read_warn_seconds,
    then released; the request must finish with the right bytes."""
    import pd_connector.engine.decode.receiver as receiver_mod

    p, d = engines("layer_major_dense")
    d.transport.remove_peer("p")
    server = granting_side_channel(p, free_port)
    receiver = Receiver(d.transport, ConnectorSettings(read_warn_seconds=0.2), "d", COMPAT, None)
    # Thresholds well above a poll's scheduling noise on a loaded 2-core CI box.
    monkeypatch.setattr(receiver_mod, "SLOW_NIXL_CALL_S", 0.3)
    real_read, real_state = d.transport.read, d.transport.state
    stalled_until = []

    def slow_read(*args):
        time.sleep(0.6)
        stalled_until.append(time.monotonic() + 0.5)
        return real_read(*args)

    def stalled_state(handle):
        return PENDING if time.monotonic() < stalled_until[-1] else real_state(handle)

    monkeypatch.setattr(d.transport, "read", slow_read)
    monkeypatch.setattr(d.transport, "state", stalled_state)
    pairs = [[(1, 3), (7, 9)], [(3, 11)]]
    try:
        with caplog.at_level("WARNING", logger="vllm.pd_connector"):
            load_one(receiver, RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r1"), pairs, 16, 15, [[1]]), pause_s=0.005)
        want, _ = expected_after(d, p, pairs)
        assert_bytes(d, want)
        totals = receiver.recorder.totals
        # Once per request for the READ; once per slow call (the post; a poll would add one).
        assert totals["read_slow"] == 1 and totals["nixl_call_slow"] >= 1
        messages = [r.getMessage() for r in caplog.records]
        assert sum("still in flight" in m and "r1" in m for m in messages) == 1
        assert any("held the engine thread" in m and "slice 1 of 1" in m for m in messages)
    finally:
        receiver.close()
        server.close()
        if not d.transport.has_peer("p"):
            d.add_peer("p", p.transport.agent_metadata, p.regions)


def test_extensions_wait_for_the_grant_and_never_go_to_an_unanswered_claim(engines, free_port, monkeypatch):
    """Regression (a flaky e2e count of "no answer from"): D extended requests whose claim was
    still in flight, so a claim to an unreachable side channel was followed by extensions to it,
    each holding a side-channel thread until it timed out. The claim is itself the lease check
    and extends the lease when P grants it: the worker forwards the scheduler's extensions
    (here every step, as a short lease would ask) only once the claim is granted, and keeps
    forwarding them while the READ runs."""
    p, d = engines("layer_major_dense")
    d.transport.remove_peer("p")
    welcome = Welcome("p", p.transport.name, p.transport.agent_metadata, list(p.regions), COMPAT)
    granted_at: list[float] = []

    def serve(message):
        if isinstance(message, Hello):
            return welcome
        if isinstance(message, Claim):
            time.sleep(0.6)
            granted_at.append(time.monotonic())
            return Granted(lease_seconds=0.3)
        return Ack()

    server = side_channel.SideChannelServer("127.0.0.1", free_port, serve)
    receiver = Receiver(d.transport, ConnectorSettings(lease_seconds=0.3), "d", COMPAT, None)
    extended: list[float] = []
    def extend(host, port, ids):
        extended.append(time.monotonic())
        return Extended(held={rid: 0.3 for rid in ids})

    monkeypatch.setattr(receiver._calls, "extend", extend)
    real_state = d.transport.state
    held: list[float] = []

    def state(handle):
        # Hold the READ 0.6 s after its first poll, so extensions have time to flow during it.
        held.append(time.monotonic())
        return PENDING if held[-1] < held[0] + 0.6 else real_state(handle)

    monkeypatch.setattr(d.transport, "state", state)
    task = RecvTask(LeaseRef("p", "127.0.0.1", free_port, "P-r1"), [[(1, 3)], [(3, 11)]], 16, 15, [[1]])
    try:
        receiver.add("r1", task)
        deadline = time.monotonic() + TIMEOUT_S
        finished: set[str] = set()
        while not finished:
            receiver.advance()
            receiver.extend(ExtendTask("127.0.0.1", free_port, 1, ["P-r1"]))
            finished, failed = receiver.take_results()
            assert not failed and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.1)  # extensions still queued on the side-channel threads run
        assert granted_at and not [at for at in extended if at < granted_at[0]]
        assert len(extended) >= 3  # ...and the READ itself is still kept alive
    finally:
        receiver.close()
        server.close()
        if not d.transport.has_peer("p"):
            d.add_peer("p", p.transport.agent_metadata, p.regions)
