"""side_channel.Client: D's pooled REQ sockets, over real loopback ZMQ (no NIXL needed).

The pool must be invisible except in cost: every answer goes to the question that asked it,
a socket whose call failed is never reused, and nothing outlives the bounds or close().
"""

from __future__ import annotations

import threading
import time

import pytest

from pd_connector.transport import side_channel
from pd_connector.core.protocol import Ack, Reject, Release
from pd_connector.transport.side_channel import Client, SideChannelError, SideChannelServer

HOST = "127.0.0.1"


def echo(message):
    """Answers a Release with its own first request id, so a misrouted answer shows."""
    return Reject(reason=message.request_ids[0])


def ask(client: Client, port: int, request_id: str, timeout_s: float = 5.0) -> str:
    reply = client.call(HOST, port, Release(request_ids=[request_id]), timeout_s)
    assert isinstance(reply, Reject), reply
    return reply.reason


@pytest.fixture
def counted_sockets(monkeypatch):
    """How many sockets the client opened."""
    opened = []
    real = side_channel._req_socket

    def counting(host, port):
        opened.append((host, port))
        return real(host, port)

    monkeypatch.setattr(side_channel, "_req_socket", counting)
    return opened


@pytest.fixture
def echo_server(free_port):
    srv = SideChannelServer(HOST, free_port, echo)
    yield srv
    srv.close()


def test_client_reuses_one_socket_for_sequential_calls(echo_server, counted_sockets):
    port = echo_server.address[1]
    client = Client()
    try:
        assert [ask(client, port, f"r{i}") for i in range(5)] == [f"r{i}" for i in range(5)]
        assert len(counted_sockets) == 1
        assert client.idle_sockets() == 1
    finally:
        client.close()
    assert client.idle_sockets() == 0


def test_client_never_reads_a_late_reply_as_the_next_answer(free_port, counted_sockets):
    """The first question's answer comes after the caller gave up: the next question must get
    its own answer on a new socket, not that late one from the pooled socket."""
    first = threading.Event()

    def slow_once(message):
        if not first.is_set():
            first.set()
            time.sleep(0.6)
        return echo(message)

    srv = SideChannelServer(HOST, free_port, slow_once)
    client = Client()
    try:
        with pytest.raises(SideChannelError, match="no answer"):
            ask(client, free_port, "slow", timeout_s=0.2)
        assert client.idle_sockets() == 0  # the timed-out socket was closed, not pooled
        time.sleep(0.6)  # the late answer to "slow" is sent meanwhile
        assert ask(client, free_port, "next") == "next"
        assert len(counted_sockets) == 2
    finally:
        client.close()
        srv.close()


def test_concurrent_callers_each_get_their_own_answer_and_the_pool_stays_bounded(echo_server):
    port = echo_server.address[1]
    client = Client(max_idle_per_peer=3)
    answers: dict[str, str] = {}

    def caller(n: int) -> None:
        for i in range(10):
            rid = f"t{n}-{i}"
            answers[rid] = ask(client, port, rid)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(answers) == 60
        assert all(question == answer for question, answer in answers.items())
        assert 1 <= client.idle_sockets() <= 3
    finally:
        client.close()


def test_client_keeps_sockets_for_at_most_max_peers(counted_sockets, new_free_port):
    servers = [SideChannelServer(HOST, new_free_port(), echo) for _ in range(3)]
    ports = [srv.address[1] for srv in servers]
    client = Client(max_peers=2)
    try:
        for port in ports:
            assert ask(client, port, str(port)) == str(port)
        assert client.idle_sockets() == 2  # the least recently used peer's socket was closed
        assert ask(client, ports[0], "again") == "again"  # and is opened again on demand
        assert len(counted_sockets) == 4
    finally:
        client.close()
        for srv in servers:
            srv.close()


def test_closed_client_refuses_calls_and_keeps_no_socket(echo_server):
    port = echo_server.address[1]
    client = Client()
    assert ask(client, port, "x") == "x"
    client.close()
    assert client.idle_sockets() == 0
    with pytest.raises(SideChannelError, match="closed"):
        ask(client, port, "y")


def test_client_reaches_a_restarted_server_on_the_same_port(free_port):
    """A P restarted on its port: the pooled socket reconnects (ZMQ) and the next call is
    answered by the new server."""
    client = Client()
    srv = SideChannelServer(HOST, free_port, lambda m: Ack())
    try:
        assert client.call(HOST, free_port, Release(request_ids=["a"]), 5.0) == Ack()
    finally:
        srv.close()
    again = SideChannelServer(HOST, free_port, echo)
    try:
        assert ask(client, free_port, "b") == "b"
    finally:
        again.close()
        client.close()


def test_malformed_peer_address_is_a_side_channel_error():
    """A host libzmq cannot parse fails the call like any unreachable P (the caller fails that
    request and recomputes), not with a raw ZMQError that release/extend would not catch."""
    client = Client()
    with pytest.raises(SideChannelError, match="cannot connect to bad host!:5555"):
        client.call("bad host!", 5555, Release(request_ids=["x"]), 0.3)
    assert client.idle_sockets() == 0
    client.close()


def test_one_shot_call_to_a_malformed_address_is_a_side_channel_error():
    with pytest.raises(SideChannelError, match="cannot connect"):
        side_channel.call("bad host!", 5555, Release(request_ids=["x"]), 0.3)
