"""The threads a side-channel message passes through run at a real-time priority where the host
permits it (``side_channel.prefer_thread``): P's serving thread and its libzmq I/O threads, D's
client I/O thread and D's side-channel call threads. On a host with more runnable threads than
cores they waited 0.1-0.7 s for a core per message without it, 1-5 ms with it (measured with a
P/D pair under load; docs/failure-modes.md). Where it is not permitted nothing changes and the
side channel serves as before."""

from __future__ import annotations

import os
import threading

import pytest

from pd_connector.core.protocol import Ack, Extend, Extended
from pd_connector.transport import side_channel

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_RR"), reason="POSIX real-time scheduling is Linux-only here")


def permitted() -> bool:
    """Whether this process may make a thread real-time (root, CAP_SYS_NICE or RLIMIT_RTPRIO)."""
    out = []
    t = threading.Thread(target=lambda: out.append(side_channel.prefer_thread()))
    t.start()
    t.join()
    return out[0]


def policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


def expected() -> int:
    return os.SCHED_RR if permitted() else os.SCHED_OTHER


def test_p_serving_thread_and_its_zmq_threads_are_real_time_where_permitted(free_port):
    before = side_channel._zmq_threads()
    server = side_channel.SideChannelServer("127.0.0.1", free_port, lambda m: Extended(held={}))
    try:
        ours = side_channel._zmq_threads() - before
        assert ours, "the server's context started no libzmq thread"
        assert server.preferred() == permitted()
        assert policy(server._thread.native_id) == expected()
        assert {policy(tid) for tid in ours} == {expected()}
        # It serves either way.
        assert isinstance(side_channel.call("127.0.0.1", free_port, Extend(request_ids=[]), 5.0), Extended)
    finally:
        server.close()
    # The engine thread that started it is left as it was.
    assert policy(0) == os.SCHED_OTHER


def test_d_client_zmq_threads_are_real_time_where_permitted(free_port, monkeypatch):
    server = side_channel.SideChannelServer("127.0.0.1", free_port, lambda m: Ack())
    monkeypatch.setattr(side_channel, "_client_context", None)  # made anew by the first call
    before = side_channel._zmq_threads()
    client = side_channel.Client()
    try:
        assert isinstance(client.call("127.0.0.1", free_port, Extend(request_ids=[]), 5.0), Ack)
        ours = side_channel._zmq_threads() - before
        assert ours, "the client's context started no libzmq thread"
        assert {policy(tid) for tid in ours} == {expected()}
        assert policy(0) == os.SCHED_OTHER  # the calling thread is left as it was
    finally:
        client.close()
        side_channel._client_context.destroy(linger=0)
        server.close()


@pytest.mark.nixl
def test_d_side_channel_call_threads_are_real_time_where_permitted():
    from pd_connector.core.settings import ConnectorSettings
    from pd_connector.engine.decode.receiver import Receiver
    from test_chunked_read import COMPAT
    from test_transport import make_engine

    d = make_engine("layer_major_dense", 8, seed=None)
    receiver = Receiver(d.transport, ConnectorSettings(), "d", COMPAT, None)
    try:
        assert receiver._executor.submit(lambda: policy(0)).result(10) == expected()
    finally:
        receiver.close()
        d.transport.close()
