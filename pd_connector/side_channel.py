"""pyzmq side channel: P serves handshakes and release notices; D asks.

One ROUTER socket on P, served by one daemon thread that never touches NIXL (the handler
callbacks only read prepared bytes or enqueue ids). D uses a short-lived REQ socket per call
from its background thread, with a timeout, so a dead P costs D a timeout, never a hang.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable

import zmq

from pd_connector.protocol import (
    MAX_MESSAGE_BYTES,
    Message,
    ProtocolError,
    Reject,
    decode_message,
    encode_message,
)

logger = logging.getLogger("vllm.pd_connector")

Handler = Callable[[Message], Message]


class SideChannelError(RuntimeError):
    pass


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


class SideChannelServer:
    """Serves ``handler(message) -> reply`` on ``host:port`` in a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler, secret: bytes = b""):
        self._handler = handler
        self._secret = secret
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pd-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                continue  # not a REQ envelope (identity, empty delimiter, body)
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
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()


def call(host: str, port: int, message: Message, timeout_s: float, secret: bytes = b"") -> Message:
    """One request/response round trip; raises SideChannelError on timeout or bad reply."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _SOCKET_LIMIT)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(_endpoint(host, port))
        sock.send(encode_message(message, secret))
        if not sock.poll(int(timeout_s * 1000)):
            raise SideChannelError(f"no answer from {host}:{port} within {timeout_s:.1f} s")
        try:
            return decode_message(sock.recv(), secret)
        except ProtocolError as exc:
            raise SideChannelError(f"bad reply from {host}:{port}: {exc}") from None
    finally:
        sock.close()
