"""pyzmq side channel: P serves handshakes and release notices; D asks.

One ROUTER socket on P, served by one daemon thread that never touches NIXL (the handler
callbacks only read prepared bytes or enqueue ids). D asks through a ``Client``: REQ sockets
kept open per peer across calls (a new socket per call would add a TCP connect and a ZMTP
greeting to every claim), each call
with a timeout, so a dead P costs D a timeout, never a hang.

A handler that cannot answer yet returns a ``Deferred``: the thread parks the request (ROUTER
replies need not be in order) and keeps serving everyone else; it asks the ``Deferred`` again
whenever ``kick()`` is called (P's engine thread, after granting leases) and sends its timeout
reply at the deadline. So D's claim that overtook its lease is granted the moment the lease
lands, instead of at D's next retry.

The threads every message passes through (the serving thread and libzmq's I/O threads, on both
sides) run at the lowest real-time priority where the host allows it: see ``prefer_thread``.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pd_connector.core.protocol import (
    MAX_MESSAGE_BYTES,
    Message,
    ProtocolError,
    Reject,
    decode_message,
    encode_message,
)

logger = logging.getLogger("vllm.pd_connector")


@dataclass
class Deferred:
    """A reply not ready yet: ``poll()`` returns it, or None while it is not; at ``deadline``
    (``time.monotonic()``) the server sends ``on_timeout()`` instead. A server that cannot park
    it (``MAX_PARKED``) answers ``unparked`` at once, or ``on_timeout()`` when that is None: a
    handler that measures how long a request was held must not see a hold that never was."""

    poll: Callable[[], Message | None]
    deadline: float
    on_timeout: Callable[[], Message]
    unparked: Message | None = None


Handler = Callable[[Message], "Message | Deferred"]
# Parked requests are also re-polled this often, in case a kick() was missed.
_PARKED_POLL_S = 0.05
# A serving thread that comes back from its poll this much later than asked, or spends this
# long on one answer, is logged: a peer's call waited that long (tests/e2e saw D's claims go
# unanswered for 20 s on a loaded host; the log says on which side the time went).
STALL_WARN_S = 5.0
# How long a new context's libzmq threads get to name themselves (they are found by name).
_ZMQ_THREADS_NAMED_S = 1.0
# More parked requests than this (a flood, or a peer asking about ids P never leased) get their
# timeout answer at once: parking is an optimisation, never a place to pile up memory.
MAX_PARKED = 4096


class SideChannelError(RuntimeError):
    pass


def prefer_thread(tid: int = 0) -> bool:
    """Run thread ``tid`` (0: the calling one) under SCHED_RR at the lowest real-time priority,
    where the host allows it (root, CAP_SYS_NICE or RLIMIT_RTPRIO); False, and nothing changed,
    where not. Why: a message waits on libzmq's I/O thread and the serving thread of each side,
    and with more runnable threads than cores those waited 0.1-0.7 s per message for a core
    (docs/operations.md, "The side channel's own threads"), while vLLM's stepping engines spin on
    sched_yield (``SpinCondition``, vllm/distributed/device_communicators/shm_broadcast.py),
    which yields nothing to other processes' scheduling groups. These threads block in poll and
    work microseconds per message: a real-time class takes no core from anyone."""
    try:
        policy = os.SCHED_RR
        os.sched_setscheduler(tid, policy, os.sched_param(os.sched_get_priority_min(policy)))
    except (AttributeError, OSError):  # not Linux, or not permitted: stay a normal thread
        return False
    return True


def _zmq_threads() -> set[int]:
    """This process's libzmq background threads (I/O and reaper), by their names."""
    out = set()
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/"):
                    out.add(int(tid))
        except OSError:
            pass  # the thread ended meanwhile
    return out


def _started_context(kind: int) -> tuple[zmq.Context, zmq.Socket]:
    """A context of our own and its first socket (libzmq starts the context's I/O threads and
    its reaper with its first socket), those threads raised with ``prefer_thread``. libzmq's own
    ZMQ_THREAD_SCHED_POLICY aborts the process where the policy is not permitted, hence this.
    A libzmq thread names itself once it first runs (``thread_t``): wait for that, briefly."""
    before = _zmq_threads()
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    started, deadline = set(), time.monotonic() + _ZMQ_THREADS_NAMED_S
    while len(started) < ctx.get(zmq.IO_THREADS) + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
        started = _zmq_threads() - before
    for tid in started:
        prefer_thread(tid)
    return ctx, sock


_SOCKET_LIMIT = MAX_MESSAGE_BYTES + (1 << 20)


def bind_error_message(host: str, port: int, exc: zmq.ZMQError) -> str:
    """What to change when P's side channel cannot bind ``host:port`` (start-up refusal)."""
    where = f"pd_connector: cannot bind the side channel to {host}:{port} ({exc.strerror})"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{where}: another process (a second prefill instance on this host?) holds the port. "
            "Set side_channel_port in kv_connector_extra_config (or PD_CONNECTOR_SIDE_CHANNEL_PORT)"
            " to a free port, one per prefill instance"
        )
    if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV):
        # libzmq reads a bind host that is not an IP address as a network interface name, hence
        # ENODEV for host names.
        return (
            f"{where}: {host!r} is not an IP address of this machine. Set side_channel_host in "
            "kv_connector_extra_config (or PD_CONNECTOR_SIDE_CHANNEL_HOST) to one of this "
            "machine's IP addresses that the decode instances can reach (it is advertised to "
            "them as remote_host)"
        )
    return f"{where}: check side_channel_host and side_channel_port in kv_connector_extra_config"


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _timeout_reply(deferred: Deferred) -> Message:
    try:
        return deferred.on_timeout()
    except Exception as exc:
        logger.exception("pd_connector: side-channel deferred reply failed")
        return Reject(reason=f"internal error: {exc}")


class SideChannelServer:
    """Serves ``handler(message) -> reply`` on ``host:port`` in a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler, secret: bytes = b""):
        self._handler = handler
        self._secret = secret
        self._ctx, self._sock = _started_context(zmq.ROUTER)
        # libzmq drops a peer whose frame exceeds MAXMSGSIZE without a word; leave headroom so
        # our decoder sees the frame and answers "oversized" instead (still bounded memory).
        self._sock.setsockopt(zmq.MAXMSGSIZE, _SOCKET_LIMIT)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        try:
            self._sock.bind(_endpoint(host, port))
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            raise SideChannelError(bind_error_message(host, port, exc)) from None
        self.address = (host, port)
        # Refused messages by ProtocolError kind (malformed, oversized, unauthenticated, ...).
        self.rejected: dict[str, int] = {}
        # Times the serving thread was held up past STALL_WARN_S (P counts side_channel_stalled).
        self.stalls = 0
        # kick(): a byte on a pipe the serving thread polls next to the socket (thread-safe,
        # unlike a zmq socket shared with another thread).
        self._kick_r, self._kick_w = os.pipe()
        os.set_blocking(self._kick_r, False)
        os.set_blocking(self._kick_w, False)
        # Guards the pipe's write end against close(): a kick after close must not write into
        # whatever file reuses the descriptor number.
        self._kick_lock = threading.Lock()
        self._closed = False
        self._parked: list[tuple[bytes, Deferred]] = []
        self._stop = threading.Event()
        # Whether the serving thread runs at a real-time priority (prefer_thread): ``preferred()``.
        self._preferred = False
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-side-channel", daemon=True)
        self._thread.start()

    def preferred(self, timeout: float = 1.0) -> bool:
        """Whether the serving thread runs at a real-time priority (``prefer_thread``)."""
        return self._started.wait(timeout) and self._preferred

    def _run(self) -> None:
        self._preferred = prefer_thread()
        self._started.set()
        self._serve()

    def kick(self) -> None:
        """Re-poll parked requests now (any thread)."""
        with self._kick_lock:
            if self._closed:
                return
            try:
                os.write(self._kick_w, b"k")
            except (BlockingIOError, OSError):
                pass  # pipe full: a kick is already pending

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._kick_r, zmq.POLLIN)
        while not self._stop.is_set():
            timeout_ms = 200
            if self._parked:
                until = min(d.deadline for _, d in self._parked) - time.monotonic()
                timeout_ms = max(0, min(int(until * 1000) + 1, int(_PARKED_POLL_S * 1000)))
            asked = time.monotonic()
            events = dict(poller.poll(timeout_ms))
            late = time.monotonic() - asked - timeout_ms / 1000
            self._note_stall(late, "came back", "late from its poll (the GIL or the CPU was held elsewhere in this process)")
            if self._kick_r in events:
                try:
                    while os.read(self._kick_r, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            if self._sock in events:
                started = time.monotonic()
                self._receive()
                self._note_stall(time.monotonic() - started, "spent", "answering one message")
            if self._parked:
                self._resolve_parked()

    def _note_stall(self, seconds: float, did: str, where: str) -> None:
        if seconds >= STALL_WARN_S:
            logger.warning(
                "pd_connector: the side-channel thread on %s:%d %s %.1f s %s; peers' calls waited that long",
                *self.address, did, seconds, where,
            )
            self.stalls += 1  # after the line: a reader that sees the count finds the line too

    def _receive(self) -> None:
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if len(frames) < 3:
            return  # not a REQ envelope (identity, empty delimiter, body)
        identity, body = frames[0], frames[-1]
        try:
            reply = self._handler(decode_message(body, self._secret))
        except ProtocolError as exc:
            self.rejected[exc.kind] = self.rejected.get(exc.kind, 0) + 1
            logger.warning("pd_connector: side channel refused a message: %s", exc)
            reply = Reject(reason=str(exc))
        except Exception as exc:  # a handler bug must not kill the listener
            logger.exception("pd_connector: side-channel handler failed")
            reply = Reject(reason=f"internal error: {exc}")
        if isinstance(reply, Deferred):
            if len(self._parked) < MAX_PARKED:
                self._parked.append((identity, reply))
                return
            reply = reply.unparked if reply.unparked is not None else _timeout_reply(reply)
        self._send(identity, reply)

    def _resolve_parked(self) -> None:
        now, still = time.monotonic(), []
        for identity, deferred in self._parked:
            try:
                reply = deferred.poll()
            except Exception as exc:
                logger.exception("pd_connector: side-channel deferred reply failed")
                reply = Reject(reason=f"internal error: {exc}")
            if reply is None and now >= deferred.deadline:
                reply = _timeout_reply(deferred)
            if reply is None:
                still.append((identity, deferred))
            else:
                self._send(identity, reply)
        self._parked = still

    def _send(self, identity: bytes, reply: Message) -> None:
        try:
            frame = encode_message(reply, self._secret)
        except Exception as exc:  # an unencodable reply must not kill the listener either
            logger.exception("pd_connector: cannot encode a side-channel reply")
            frame = encode_message(Reject(reason=f"internal error: {exc}"), self._secret)
        try:
            self._sock.send_multipart([identity, b"", frame])
        except zmq.ZMQError as exc:
            logger.warning("pd_connector: side-channel reply failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self.kick()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()
        with self._kick_lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._kick_r, self._kick_w):
                os.close(fd)


_client_context: zmq.Context | None = None
_client_context_lock = threading.Lock()


def _client_socket() -> zmq.Socket:
    """A REQ socket on the context D's calls share, made once with its I/O thread preferred
    (``_started_context``): a reply is moved off the wire by that thread before the caller's
    poll times out, so a starved one reads as P not answering."""
    global _client_context
    with _client_context_lock:
        if _client_context is None:
            _client_context, first = _started_context(zmq.REQ)
            return first
    return _client_context.socket(zmq.REQ)


def _req_socket(host: str, port: int) -> zmq.Socket:
    sock = _client_socket()
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _SOCKET_LIMIT)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(_endpoint(host, port))
    except zmq.ZMQError as exc:  # a malformed address (names resolve later, in the background)
        sock.close()
        raise SideChannelError(f"cannot connect to {host}:{port}: {exc.strerror}") from None
    return sock


def _round_trip(sock: zmq.Socket, host: str, port: int, message: Message, timeout_s: float, secret: bytes) -> Message:
    sock.send(encode_message(message, secret))
    if not sock.poll(int(timeout_s * 1000)):
        raise SideChannelError(f"no answer from {host}:{port} within {timeout_s:.1f} s")
    try:
        return decode_message(sock.recv(), secret)
    except ProtocolError as exc:
        raise SideChannelError(f"bad reply from {host}:{port}: {exc}") from None


def call(host: str, port: int, message: Message, timeout_s: float, secret: bytes = b"") -> Message:
    """One request/response round trip on a socket of its own (tools and tests; D's receiver
    uses a ``Client``); raises SideChannelError on timeout or bad reply."""
    sock = _req_socket(host, port)
    try:
        return _round_trip(sock, host, port, message, timeout_s, secret)
    finally:
        sock.close()


class Client:
    """Round trips to P's side channels over REQ sockets kept open between calls.

    A pool, not a socket per thread: a socket is checked out for one round trip (at most one
    thread uses it at a time; the pool's lock is the memory barrier libzmq asks for when a
    socket changes threads) and checked back in only after a clean reply. A socket whose call
    timed out or failed is closed, never reused: a REQ socket still waiting for its reply cannot
    send, and a late reply must never be read as the answer to the next question. Bounded: at
    most ``max_idle_per_peer`` idle sockets per peer and ``max_peers`` peers (least recently
    used closed first), so a fleet of P instances that came and went leaves nothing behind."""

    def __init__(self, max_peers: int = 64, max_idle_per_peer: int = 4):
        self._max_peers = max_peers
        self._max_idle = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: OrderedDict[tuple[str, int], list[zmq.Socket]] = OrderedDict()
        self._closed = False

    def call(self, host: str, port: int, message: Message, timeout_s: float, secret: bytes = b"") -> Message:
        """Like ``call``; raises SideChannelError on timeout or bad reply."""
        peer = (host, port)
        with self._lock:
            if self._closed:
                raise SideChannelError("side-channel client closed")
            idle = self._idle.get(peer)
            sock = idle.pop() if idle else None
        if sock is None:
            sock = _req_socket(host, port)
        try:
            reply = _round_trip(sock, host, port, message, timeout_s, secret)
        except BaseException:
            sock.close()
            raise
        self._check_in(peer, sock)
        return reply

    def _check_in(self, peer: tuple[str, int], sock: zmq.Socket) -> None:
        evicted: list[zmq.Socket] = []
        with self._lock:
            idle = None if self._closed else self._idle.setdefault(peer, [])
            if idle is None or len(idle) >= self._max_idle:
                evicted.append(sock)
            else:
                idle.append(sock)
                self._idle.move_to_end(peer)
            while len(self._idle) > self._max_peers:
                evicted.extend(self._idle.popitem(last=False)[1])
        for old in evicted:
            old.close()

    def forget(self, peers) -> None:
        """Close the idle sockets to these ``(host, port)`` peers (a P engine D forgot)."""
        with self._lock:
            closing = [sock for peer in peers for sock in self._idle.pop(peer, ())]
        for sock in closing:
            sock.close()

    def idle_sockets(self) -> int:
        with self._lock:
            return sum(len(socks) for socks in self._idle.values())

    def close(self) -> None:
        """Close the idle sockets; one in use is closed by its caller when its call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, OrderedDict()
        for socks in idle.values():
            for sock in socks:
                sock.close()
