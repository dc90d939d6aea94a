"""SideChannelServer / side_channel.call over real loopback ZMQ sockets (no NIXL needed).

Misbehaving peers are played by raw pyzmq REQ/DEALER sockets sending hand-made frames.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import msgspec
import pytest
import zmq

from pd_connector.transport import side_channel
from pd_connector.core.compat import compat_differences
from pd_connector.core.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Ack,
    EngineCompat,
    GroupDesc,
    Hello,
    LayerRegion,
    Reject,
    Release,
    Welcome,
    decode_message,
    encode_message,
)
from pd_connector.transport.side_channel import SideChannelError, SideChannelServer

HOST = "127.0.0.1"
COMPAT = EngineCompat(
    model="tiny-hybrid",
    dtype="torch.bfloat16",
    kv_cache_dtype="auto",
    groups=[
        GroupDesc("attention", 16, 4096, ["attn.0", "attn.1"]),
        GroupDesc("mamba", 64, 3072, ["mamba.0", "mamba.1"]),
    ],
    conv_state_layout="DS",
    tensor_parallel_size=1,
    device="cpu",
)
WELCOME = Welcome(
    engine_id="engine-p",
    agent_name="pd-agent-p",
    agent_metadata=bytes(range(256)) * 2,  # opaque to the side channel
    regions=[
        LayerRegion("attn.0", 0, 0x7F0000000000, 8704, 4096, 40),
        LayerRegion("attn.1", 0, 0x7F0000001000, 8704, 4096, 40),
        LayerRegion("mamba.0", 1, 0x7F0000000000, 8704, 3072, 40),
        LayerRegion("mamba.1", 1, 0x7F0000001000, 8704, 3072, 40),
    ],
    compat=COMPAT,
)


class PrefillHandler:
    """What the worker's P handler does, minus NIXL: compat check, Welcome, Release -> Ack.
    ``explode_on`` makes it raise for one request id (a handler bug)."""

    def __init__(self):
        self.released: list[str] = []
        self.explode_on: str | None = None
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self, message):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if isinstance(message, Hello):
            diffs = compat_differences(COMPAT, message.compat)
            if diffs:
                return Reject(reason="incompatible: " + "; ".join(diffs))
            return WELCOME
        if isinstance(message, Release):
            if self.explode_on in message.request_ids:
                raise KeyError(f"boom {self.explode_on}")
            self.released.extend(message.request_ids)
            return Ack()
        return Reject(reason=f"unexpected message {type(message).__name__}")


@pytest.fixture
def handler():
    return PrefillHandler()


@pytest.fixture
def server(free_port, handler):
    srv = SideChannelServer(HOST, free_port, handler)
    yield srv
    srv.close()


@pytest.fixture
def raw():
    """raw(port, body, timeout_s) -> reply bytes, or None on timeout (one REQ socket per
    call, own context)."""
    ctx = zmq.Context()

    def send(port: int, body: bytes, timeout_s: float = 2.0) -> bytes | None:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{HOST}:{port}")
            sock.send(body)
            return sock.recv() if sock.poll(int(timeout_s * 1000)) else None
        finally:
            sock.close()

    yield send
    ctx.term()


def assert_serving(port: int, handler: PrefillHandler, request_id: str = "after") -> None:
    reply = side_channel.call(HOST, port, Release(request_ids=[request_id]), 5.0)
    assert reply == Ack()
    assert handler.released[-1] == request_id


def reject_reason(body: bytes | None) -> str:
    assert body is not None, "no reply (the server dropped the frame)"
    reply = decode_message(body)
    assert isinstance(reply, Reject), reply
    return reply.reason


# --- happy path -----------------------------------------------------------------------------


def test_hello_gets_welcome(server, handler):
    port = server.address[1]
    reply = side_channel.call(HOST, port, Hello(engine_id="engine-d", compat=COMPAT), 5.0)
    assert reply == WELCOME
    assert isinstance(reply.agent_metadata, bytes)
    assert handler.threads == {"pd-side-channel"}  # served on the listener thread


def test_release_round_trip_and_incompatible_hello(server, handler):
    port = server.address[1]
    assert side_channel.call(HOST, port, Release(request_ids=["r1", "r2"]), 5.0) == Ack()
    assert handler.released == ["r1", "r2"]
    other = msgspec.structs.replace(COMPAT, kv_cache_dtype="fp8")
    reply = side_channel.call(HOST, port, Hello(engine_id="engine-d", compat=other), 5.0)
    assert isinstance(reply, Reject)
    assert "kv_cache_dtype: local 'auto', remote 'fp8'" in reply.reason


def test_many_sequential_calls(server, handler):
    port = server.address[1]
    for i in range(20):
        assert side_channel.call(HOST, port, Release(request_ids=[f"r{i}"]), 5.0) == Ack()
    assert handler.released == [f"r{i}" for i in range(20)]


def test_concurrent_callers_each_get_their_own_reply(server, handler):
    port = server.address[1]
    results: dict[int, object] = {}

    def one(i):
        results[i] = side_channel.call(HOST, port, Release(request_ids=[f"c{i}"]), 5.0)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {i: Ack() for i in range(8)}
    assert sorted(handler.released) == sorted(f"c{i}" for i in range(8))


# --- misbehaving peers ----------------------------------------------------------------------


def test_garbage_frame_gets_reject_then_server_keeps_serving(server, handler, raw):
    port = server.address[1]
    reason = reject_reason(raw(port, b"this is not msgpack \xc1\xff"))
    assert reason.startswith("side-channel frame:"), reason
    # A valid envelope around a body that is no known message.
    body = msgspec.msgpack.encode([PROTOCOL_VERSION, msgspec.msgpack.encode({"type": "nope"})])
    reason = reject_reason(raw(port, body))
    assert reason.startswith("side-channel message:") and "nope" in reason, reason
    assert server.rejected == {"malformed": 2}
    assert handler.calls == 0  # never reached the handler
    assert_serving(port, handler)


def test_wrong_protocol_version_gets_reject_naming_both_versions(server, handler, raw):
    port = server.address[1]
    hello = msgspec.msgpack.encode(Hello(engine_id="engine-d", compat=COMPAT))
    frame = msgspec.msgpack.encode([PROTOCOL_VERSION + 1, hello])
    reason = reject_reason(raw(port, frame))
    want = f"protocol {PROTOCOL_VERSION + 1}, this instance {PROTOCOL_VERSION}"
    assert reason == f"peer speaks pd_connector {want}"
    assert handler.calls == 0
    assert server.rejected == {"version_mismatch": 1}
    assert_serving(port, handler)


def test_oversized_frame_does_not_stop_the_server(server, handler, raw):
    """A frame beyond even the socket's headroom is dropped by libzmq (no reply, memory
    bounded), and the server keeps serving."""
    from pd_connector.transport.side_channel import _SOCKET_LIMIT

    port = server.address[1]
    t0 = time.monotonic()
    assert raw(port, b"\x00" * (_SOCKET_LIMIT + 1), timeout_s=0.5) is None
    assert time.monotonic() - t0 < 5
    assert handler.calls == 0
    assert_serving(port, handler)
    # A frame of exactly the limit is still read and refused by the decoder.
    assert reject_reason(raw(port, b"\x00" * MAX_MESSAGE_BYTES)).startswith("side-channel frame")


def test_oversized_frame_gets_reject_saying_it_is_too_big(server, raw):
    port = server.address[1]
    reason = reject_reason(raw(port, b"\x00" * (MAX_MESSAGE_BYTES + 1), timeout_s=5.0))
    assert "exceeds" in reason and str(MAX_MESSAGE_BYTES) in reason


def test_frame_without_req_envelope_is_ignored(server, handler):
    """A DEALER frame without the empty delimiter is not a REQ envelope: dropped silently."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{HOST}:{server.address[1]}")
        sock.send(encode_message(Release(request_ids=["dealer"])))
        assert not sock.poll(300)
    finally:
        sock.close()
        ctx.term()
    assert "dealer" not in handler.released
    assert_serving(server.address[1], handler)


def test_handler_that_raises_gets_reject_and_listener_survives(server, handler):
    port = server.address[1]
    handler.explode_on = "bad"
    reply = side_channel.call(HOST, port, Release(request_ids=["bad"]), 5.0)
    assert isinstance(reply, Reject)
    assert reply.reason.startswith("internal error:") and "boom bad" in reply.reason
    assert_serving(port, handler)


def test_handler_reply_that_cannot_be_encoded_does_not_kill_the_listener(free_port):
    replies = iter([Reject(reason=object()), Ack()])  # type: ignore[arg-type]
    srv = SideChannelServer(HOST, free_port, lambda message: next(replies))
    try:
        with contextlib.suppress(SideChannelError):
            side_channel.call(HOST, free_port, Release(request_ids=["x"]), 0.5)
        assert side_channel.call(HOST, free_port, Release(request_ids=["y"]), 0.5) == Ack()
    finally:
        srv.close()


def test_a_slow_answer_is_logged_and_counted_as_a_stall(free_port, monkeypatch, caplog):
    """D's claims went unanswered for 20 s on a loaded host with nothing in P's log; P's serving
    thread now says when it was held up, and how (here: one slow answer)."""
    monkeypatch.setattr(side_channel, "STALL_WARN_S", 0.2)

    def slow(message):
        time.sleep(0.3)
        return Ack()

    srv = SideChannelServer(HOST, free_port, slow)
    try:
        with caplog.at_level("WARNING", logger="vllm.pd_connector"):
            assert side_channel.call(HOST, free_port, Release(request_ids=["x"]), 5.0) == Ack()
            deadline = time.monotonic() + 2  # noted after the reply went out
            while srv.stalls == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert srv.stalls == 1
        assert "spent" in caplog.text and "answering one message" in caplog.text
    finally:
        srv.close()


def test_a_thread_held_past_its_poll_is_logged_as_a_stall(free_port, monkeypatch, caplog):
    """The serving thread comes back from a 200 ms idle poll while this thread holds the GIL
    in a pure-Python loop for a second: logged as late, not as a slow answer."""
    monkeypatch.setattr(side_channel, "STALL_WARN_S", 0.3)
    old = sys.getswitchinterval()
    srv = SideChannelServer(HOST, free_port, PrefillHandler())
    try:
        with caplog.at_level("WARNING", logger="vllm.pd_connector"):
            sys.setswitchinterval(5.0)  # this thread keeps the GIL for its whole loop
            try:
                end = time.monotonic() + 1.2
                while time.monotonic() < end:
                    pass
            finally:
                sys.setswitchinterval(old)
            deadline = time.monotonic() + 2
            while srv.stalls == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert srv.stalls >= 1
        assert "came back" in caplog.text
    finally:
        srv.close()


# --- set-up failures ------------------------------------------------------------------------


def test_second_server_on_same_port_names_the_port_and_the_fix(server, handler):
    port = server.address[1]
    with pytest.raises(SideChannelError) as info:
        SideChannelServer(HOST, port, handler)
    message = str(info.value)
    assert f"{HOST}:{port}" in message
    assert "side_channel_port" in message and "free port" in message
    assert_serving(port, handler)  # the first server is unaffected


def test_call_to_port_nobody_listens_on_times_out(free_port):
    timeout_s = 0.3
    t0 = time.monotonic()
    with pytest.raises(SideChannelError, match=rf"no answer from {HOST}:{free_port} within 0\.3 s"):
        side_channel.call(HOST, free_port, Hello(engine_id="engine-d", compat=COMPAT), timeout_s)
    elapsed = time.monotonic() - t0
    assert timeout_s * 0.9 <= elapsed < timeout_s + 1.0


def test_call_to_a_closed_server_times_out(free_port, handler):
    srv = SideChannelServer(HOST, free_port, handler)
    assert side_channel.call(HOST, free_port, Release(request_ids=["x"]), 5.0) == Ack()
    srv.close()
    with pytest.raises(SideChannelError, match="no answer"):
        side_channel.call(HOST, free_port, Release(request_ids=["y"]), 0.3)
    # The port is free again: a restarted P can bind it.
    again = SideChannelServer(HOST, free_port, handler)
    try:
        assert side_channel.call(HOST, free_port, Release(request_ids=["z"]), 5.0) == Ack()
    finally:
        again.close()
    assert handler.released == ["x", "z"]


def test_bad_reply_raises_side_channel_error(free_port):
    """A server that answers with garbage: call() raises SideChannelError, not a decode error."""
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(f"tcp://{HOST}:{free_port}")

    def answer():
        if rep.poll(5000):
            rep.recv()
            rep.send(b"\xc1 not msgpack")

    t = threading.Thread(target=answer)
    t.start()
    try:
        with pytest.raises(SideChannelError, match=rf"bad reply from {HOST}:{free_port}"):
            side_channel.call(HOST, free_port, Release(request_ids=["x"]), 5.0)
    finally:
        t.join(6)
        rep.close()
        ctx.term()


# --- shared secret (HMAC over the body) ----------------------------------------------------


def test_shared_secret_round_trip_and_refusals(free_port, handler, raw):
    secret = b"s3cret-shared-by-p-and-d"
    srv = SideChannelServer(HOST, free_port, handler, secret=secret)
    try:
        hello = Hello(engine_id="engine-d", compat=COMPAT)
        assert side_channel.call(HOST, free_port, hello, 5.0, secret=secret) == WELCOME

        # No MAC at all: refused before the body is decoded; the Reject says why.
        reason = reject_reason(raw(free_port, encode_message(Release(request_ids=["nomac"]))))
        assert "without a valid MAC" in reason and "shared_secret" in reason
        # Wrong secret: P refuses, and D cannot authenticate P's (signed) Reject either.
        with pytest.raises(SideChannelError, match="bad reply .*without a valid MAC"):
            side_channel.call(HOST, free_port, hello, 5.0, secret=b"other")
        # A body swapped under a valid MAC (tampering in transit).
        good = msgspec.msgpack.decode(encode_message(Release(request_ids=["ok"]), secret))
        forged = msgspec.msgpack.encode(
            [good[0], msgspec.msgpack.encode(Release(request_ids=["evil"])), good[2]]
        )
        assert "without a valid MAC" in reject_reason(raw(free_port, forged))
        assert handler.released == []  # nothing unauthenticated reached the handler
        assert srv.rejected == {"unauthenticated": 3}
        ok = side_channel.call(HOST, free_port, Release(request_ids=["ok"]), 5.0, secret=secret)
        assert ok == Ack()
        assert handler.released == ["ok"]
    finally:
        srv.close()


def test_client_with_secret_refuses_an_unsigned_server(server):
    with pytest.raises(SideChannelError, match="bad reply .*without a valid MAC"):
        side_channel.call(
            HOST, server.address[1], Hello(engine_id="engine-d", compat=COMPAT), 5.0, secret=b"k"
        )


def test_deferred_reply_is_sent_on_kick_while_other_peers_are_served(free_port, monkeypatch):
    """A claim that overtook its lease is parked, not answered Pending: the listener keeps
    serving other messages meanwhile, and answers it as soon as kick() says news arrived. The
    periodic re-poll is pushed past the test's timeouts, so only the kick can answer in time."""
    monkeypatch.setattr(side_channel, "_PARKED_POLL_S", 60.0)
    ready = threading.Event()

    def handler(message):
        if isinstance(message, Release) and message.request_ids == ["parked"]:
            return side_channel.Deferred(
                poll=lambda: Ack() if ready.is_set() else None,
                deadline=time.monotonic() + 30,
                on_timeout=lambda: Reject(reason="timed out"),
            )
        return Ack()

    srv = SideChannelServer(HOST, free_port, handler)
    try:
        out: dict = {}
        caller = threading.Thread(
            target=lambda: out.update(reply=side_channel.call(HOST, free_port, Release(request_ids=["parked"]), 20.0))
        )
        caller.start()
        time.sleep(0.2)
        assert "reply" not in out, "answered before the news"
        assert side_channel.call(HOST, free_port, Release(request_ids=["other"]), 2.0) == Ack()
        ready.set()
        srv.kick()
        caller.join(10)
        assert out.get("reply") == Ack()
    finally:
        srv.close()


def never_ready_server(port: int, deadline_s: float, answer: str) -> SideChannelServer:
    """Parks every message until ``deadline_s`` from its arrival, then answers Reject(answer)."""
    return SideChannelServer(
        HOST,
        port,
        lambda m: side_channel.Deferred(poll=lambda: None, deadline=time.monotonic() + deadline_s,
                                        on_timeout=lambda: Reject(reason=answer)),
    )


def test_deferred_reply_times_out_with_its_own_answer(free_port):
    srv = never_ready_server(free_port, 0.2, "still no lease")
    try:
        assert side_channel.call(HOST, free_port, Release(request_ids=["x"]), 5.0) == Reject(reason="still no lease")
    finally:
        srv.close()


def test_deferred_poll_that_raises_gets_reject_and_listener_survives(free_port):
    calls = iter([side_channel.Deferred(poll=lambda: 1 / 0, deadline=time.monotonic() + 5, on_timeout=Ack)])
    srv = SideChannelServer(HOST, free_port, lambda m: next(calls, Ack()))
    try:
        reply = side_channel.call(HOST, free_port, Release(request_ids=["x"]), 5.0)
        assert isinstance(reply, Reject) and "internal error" in reply.reason
        assert side_channel.call(HOST, free_port, Release(request_ids=["y"]), 5.0) == Ack()
    finally:
        srv.close()


def test_parking_is_bounded_beyond_max_parked_the_timeout_answer_comes_at_once(free_port, monkeypatch):
    monkeypatch.setattr(side_channel, "MAX_PARKED", 0)
    srv = never_ready_server(free_port, 30, "busy")
    try:
        assert side_channel.call(HOST, free_port, Release(request_ids=["x"]), 2.0) == Reject(reason="busy")
    finally:
        srv.close()


def test_kick_after_close_is_a_no_op(free_port, handler):
    """P's engine thread may grant a lease during shutdown: kick() must not write into a reused
    descriptor number."""
    srv = SideChannelServer(HOST, free_port, handler)
    srv.close()
    srv.kick()
    srv.close()  # idempotent enough for a second shutdown path


def test_a_deferred_reply_that_cannot_be_parked_gets_its_unparked_answer_not_its_timeout(free_port, monkeypatch):
    monkeypatch.setattr(side_channel, "MAX_PARKED", 0)
    timeouts: list[int] = []
    srv = SideChannelServer(
        HOST,
        free_port,
        lambda m: side_channel.Deferred(poll=lambda: None, deadline=time.monotonic() + 30,
                                        on_timeout=lambda: timeouts.append(1) or Reject(reason="held"),
                                        unparked=Reject(reason="not held")),
    )
    try:
        assert side_channel.call(HOST, free_port, Release(request_ids=["x"]), 2.0) == Reject(reason="not held")
        assert timeouts == []
    finally:
        srv.close()
