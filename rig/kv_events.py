"""vLLM's KV events (``--kv-events-config``, ZMQ publisher) as a test reads them.

A server started with ``kv_events_args(port)`` publishes every prefix-cache change as a
``KVEventBatch`` (vllm/distributed/kv_events.py): multipart (topic, sequence number, msgpack).
``KvEvents`` binds the endpoint, subscribes and collects them on a thread of its own; ``stored()`` gives the blocks
announced as stored since a mark, as (KV-cache group, block hash) pairs, which is what a
cache-aware router (llm-d's precise prefix scorer, Dynamo's KV router) indexes.

Block hashes agree across instances only when every instance hashes alike: the same
``--prefix-caching-hash-algo``, block sizes and, for a non-cryptographic hash, the same
``PYTHONHASHSEED`` (vLLM's ``init_none_hash``); ``HASH_ENV`` is what the tests set.
"""

from __future__ import annotations

import json
import threading
import time

import msgspec
import zmq

HASH_ENV = {"PYTHONHASHSEED": "0"}


def kv_events_args(port: int) -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    return ["--kv-events-config", json.dumps(config)]


class KvEvents:
    """``with KvEvents(port) as events:`` subscribe to one server's events."""

    def __init__(self, port: int):
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # vLLM's publisher connects to an endpoint that names a host and binds only a wildcard
        # (ZmqEventPublisher._is_bind_endpoint): the collector binds, on loopback.
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._events: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            batch = self._decoder.decode(payload)
            with self._lock:
                self._events.extend(batch.events)

    def mark(self) -> int:
        with self._lock:
            return len(self._events)

    def stored(self, since: int, settle_s: float = 1.5) -> set[tuple[int | None, object]]:
        """(group_idx, block hash) of every BlockStored since ``mark()`` returned ``since``, after
        ``settle_s`` (events leave with the engine step's output, then the publisher's queue)."""
        from vllm.distributed.kv_events import BlockStored

        time.sleep(settle_s)
        with self._lock:
            events = self._events[since:]
        return {(e.group_idx, h) for e in events if isinstance(e, BlockStored) for h in e.block_hashes}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

    def __enter__(self) -> "KvEvents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def by_group(stored: set[tuple[int | None, object]]) -> dict[int | None, int]:
    """How many blocks per group: the readable summary of a difference."""
    out: dict[int | None, int] = {}
    for group, _ in stored:
        out[group] = out.get(group, 0) + 1
    return out


STACK_ROLES = ("baseline", "prefill", "decode")


def publish_from_stack(config) -> dict[str, int]:
    """Make a ``stack.StackConfig``'s baseline, P and D publish their KV events, each to a port of
    its own, hashing alike (``HASH_ENV``): edits ``config`` in place and returns role -> port,
    where a ``KvEvents`` collector binds. Same servers, two more flags each: no extra start."""
    from rig.ports import free_port

    ports = {role: free_port() for role in STACK_ROLES}
    config.baseline_args = [*config.baseline_args, *kv_events_args(ports["baseline"])]
    config.prefill_args = [*config.prefill_args, *kv_events_args(ports["prefill"])]
    config.decode_args = [*config.decode_args, *kv_events_args(ports["decode"])]
    config.baseline_env = {**HASH_ENV, **config.baseline_env}
    config.prefill_env = {**HASH_ENV, **config.prefill_env}
    config.decode_env = {**HASH_ENV, **config.decode_env}
    return ports
