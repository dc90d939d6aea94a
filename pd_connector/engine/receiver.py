"""D's load pipeline, one request at a time through: handshake -> claim -> READ -> done.

- handshake: once per P engine (side channel, background thread, cached); a failed one fails
  every request waiting on it and is retried by later requests.
- claim: P confirms the offset and block ids match its lease and extends it (background
  thread); refused claims fail the request *before* any byte is read.
- READ: one prepared NIXL transfer (engine thread). Where the post itself copies (DRAM without
  UCX worker threads) it goes out in slices of at most ``nixl_read_chunk_mib``, one per
  ``advance()`` call, so a big READ never holds the engine thread for more than a slice's copy;
  elsewhere (worker threads, VRAM) in one post. The notification rides on the last slice and
  tells P to free.
- optional digest check of the recurrent state after the READ.

Outcomes are per request: ``finished`` or ``failed`` (the scheduler recomputes failed ones).
All NIXL calls stay on the engine thread; the background threads only speak ZMQ (the calls to
P live in ``prefill_calls.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pd_connector.core.config import ConnectorSettings
from pd_connector.core.leases import extension_interval
from pd_connector.engine.metadata import ExtendTask, ReleaseTask, RecvTask, extend_tasks
from pd_connector.engine.metrics import Recorder
from pd_connector.transport.prefill_calls import PrefillCalls
from pd_connector.core.protocol import EngineCompat
from pd_connector.transport.nixl import FAILED, PENDING, ChunkedRead, NixlTransport

logger = logging.getLogger("vllm.pd_connector")


MiB = 1 << 20
# A post or poll of a READ that holds D's engine thread longer than this is reported
# (``nixl_call_slow``): a post copies a 32 MiB slice in ~10 ms, a poll takes microseconds.
SLOW_NIXL_CALL_S = 1.0
# Threads making side-channel calls (handshakes, claims, releases, extensions).
_SIDE_CHANNEL_THREADS = 4


@dataclass
class _Read:
    xfer: ChunkedRead
    task: RecvTask
    started: float  # claim sent
    read_started: float  # first slice about to be posted
    descriptors: int
    digest: bytes
    nbytes: int
    warned: bool = False  # read_slow reported


def _release_of(task: RecvTask) -> ReleaseTask:
    return ReleaseTask(task.remote_engine_id, task.remote_host, task.remote_port, task.remote_request_id)


class Receiver:
    def __init__(
        self,
        transport: NixlTransport,
        settings: ConnectorSettings,
        engine_id: str,
        compat: EngineCompat,
        state_digest: Callable[[list[list[int]]], bytes] | None,
        corrupt_state: Callable[[list[list[int]]], None] | None = None,
        wake: threading.Event | None = None,
    ):
        self.transport = transport
        self.settings = settings
        self._state_digest = state_digest
        self._corrupt_state = corrupt_state
        self.recorder = Recorder()
        # Only where the post itself copies (transport.copies_in_post) is a READ sliced by size;
        # NixlTransport.read_slices decides.
        self._chunk_bytes = settings.nixl_read_chunk_mib * MiB
        self._group_page_bytes: dict[int, int] = {}
        for region in transport.regions:
            self._group_page_bytes[region.group] = self._group_page_bytes.get(region.group, 0) + region.page_bytes
        # Side-channel calls only (never NIXL): a few threads so one slow peer or a claim that
        # waits for its grant does not hold up the others.
        self._executor = ThreadPoolExecutor(max_workers=_SIDE_CHANNEL_THREADS, thread_name_prefix="pd-side-channel")
        # At most one socket in use per thread: keep that many open per P, no more.
        self._calls = PrefillCalls(settings, engine_id, compat, max_idle_per_peer=_SIDE_CHANNEL_THREADS)
        # Set when a handshake or claim reply arrives, so an idle engine step waiting on it
        # (WorkerHalf.get_transfer_results) resumes at once.
        self._wake = wake
        self._handshakes: dict[str, Future] = {}
        self._peer_errors: dict[str, str] = {}
        self._waiting: dict[str, RecvTask] = {}
        self._claims: dict[str, tuple[RecvTask, Future, float]] = {}
        self._reads: dict[str, _Read] = {}
        self._last_extend = time.monotonic()
        # The shortest lease a P has granted: P extends by its own lease_seconds, which can be
        # shorter than this instance's, so the extension cadence follows the shorter one.
        self._shortest_lease = settings.lease_seconds
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}

    # -- inputs from the scheduler -----------------------------------------------------------

    def add(self, request_id: str, task: RecvTask) -> None:
        if task.pairs is None:
            self._fail(request_id, "P's blocks could not be paired with this instance's", "pairing")
            return
        self._waiting[request_id] = task
        key = task.remote_engine_id
        if not self.transport.has_peer(key) and key not in self._handshakes:
            self._handshakes[key] = self._submit(self._calls.handshake, task)

    def release(self, task: ReleaseTask) -> None:
        self._executor.submit(self._calls.release, task)

    def extend(self, task: ExtendTask) -> None:
        self._executor.submit(self._calls.extend, task)

    # -- progress ---------------------------------------------------------------------------

    def advance(self) -> None:
        """Move every request as far along as it can go now; never blocks."""
        self._connect_peers()
        self._start_claims()
        self._start_reads()
        self._poll_reads()
        self._extend_in_flight()

    def _extend_in_flight(self) -> None:
        """Every ``leases.extension_interval`` of the shortest lease granted, ask each P to
        extend the leases of this instance's READs in flight. The claim extends a lease once; a
        READ that outlives it would otherwise copy blocks P has freed and reused (a stalled READ
        cannot be cancelled, see ``_report_slow_read``).

        Only granted claims: before the grant the claim itself is the lease check (P refuses an
        expired lease and D recomputes) and extends it when granting, and the address it goes to
        has not answered yet. Regression: extending requests whose claim or handshake was still
        in flight sent extensions to an unreachable side channel too, each holding one of the
        few side-channel threads for ``handshake_timeout_seconds``. The scheduler extends the
        requests still waiting for admission (``SchedulerHalf._due_extensions``)."""
        now = time.monotonic()
        if now - self._last_extend < extension_interval(self._shortest_lease):
            return
        self._last_extend = now
        tasks = (read.task for read in self._reads.values())
        for extension in extend_tasks((t.remote_host, t.remote_port, t.remote_request_id) for t in tasks):
            self.extend(extension)

    def take_results(self) -> tuple[set[str], set[str]]:
        finished, failed = self.finished, set(self.failed)
        self.finished, self.failed = set(), {}
        return finished, failed

    def pending(self) -> int:
        return len(self._waiting) + len(self._claims) + len(self._reads)

    def reading(self) -> bool:
        """A READ is in flight: the engine thread must keep polling (and posting slices)."""
        return bool(self._reads)

    def _submit(self, fn, task: RecvTask) -> Future:
        future = self._executor.submit(fn, task)
        if self._wake is not None:
            future.add_done_callback(lambda _: self._wake.set())
        return future

    # -- stages -----------------------------------------------------------------------------

    def _connect_peers(self) -> None:
        for key, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[key]
            try:
                welcome, seconds = future.result()
                self.transport.add_peer(
                    key, welcome.agent_metadata, welcome.regions, agent_name=welcome.agent_name
                )
                # Connect now, while this request's claim is in flight, not in its first READ.
                self.transport.connect(key)
                self.recorder.observe("handshake_seconds", seconds)
                self._peer_errors.pop(key, None)
                logger.info("pd_connector: connected to prefill engine %s", key)
            except Exception as exc:
                self._peer_errors[key] = str(exc)
                logger.warning("pd_connector: handshake with prefill engine %s failed: %s", key, exc)

    def _start_claims(self) -> None:
        for request_id, task in list(self._waiting.items()):
            key = task.remote_engine_id
            if key in self._peer_errors:
                del self._waiting[request_id]
                self._fail(request_id, f"handshake failed: {self._peer_errors[key]}", "handshake")
            elif self.transport.has_peer(key):
                del self._waiting[request_id]
                # Stamped before submitting: the claim may be answered before submit returns.
                sent = time.monotonic()
                self._claims[request_id] = (task, self._submit(self._calls.claim, task), sent)
        if self._peer_errors and not self._waiting and not self._handshakes:
            # A later request retries a peer that failed (it may have restarted).
            self._peer_errors.clear()

    def _start_reads(self) -> None:
        for request_id, (task, future, started) in list(self._claims.items()):
            if not future.done():
                continue
            del self._claims[request_id]
            try:
                granted, answered = future.result()
            except Exception as exc:
                self._fail(request_id, str(exc), "claim")
                continue
            self.recorder.observe("claim_seconds", answered - started)
            if granted.lease_seconds > 0:
                self._shortest_lease = min(self._shortest_lease, granted.lease_seconds)
            try:
                local_idx, remote_idx = self.transport.plan(task.remote_engine_id, task.pairs)
                if local_idx.size == 0:
                    # Nothing D lacks (NIXL refuses an empty READ): done; P may free now.
                    self.release(_release_of(task))
                    self.finished.add(request_id)
                    continue
                key = task.remote_engine_id
                bounds = self.transport.read_slices(key, local_idx, remote_idx, self._chunk_bytes)
                xfer = ChunkedRead(self.transport, key, local_idx, remote_idx, task.remote_request_id.encode(), bounds)
                runs = self.transport.count_runs(key, local_idx, remote_idx)
            except Exception as exc:
                self._fail(request_id, str(exc), "post")
                self.release(_release_of(task))  # nothing will be read: P may free now
                continue
            nbytes = sum(len(pairs) * self._group_page_bytes.get(g, 0) for g, pairs in enumerate(task.pairs))
            self._reads[request_id] = _Read(xfer, task, started, time.monotonic(), runs, granted.state_digest, nbytes)

    def _poll_reads(self) -> None:
        # At most one slice posted per call where the post copies (DRAM without worker
        # threads), oldest request first; otherwise every READ posts at once.
        budget = 1
        for request_id, read in list(self._reads.items()):
            may_post = not (self.transport.copies_in_post and self._chunk_bytes) or budget > 0
            posted = read.xfer.next
            called = time.monotonic()
            state = read.xfer.advance(may_post)
            now = time.monotonic()
            budget -= read.xfer.next - posted
            if now - called > SLOW_NIXL_CALL_S:
                self._report_slow_call(request_id, read, now - called)
            if state == PENDING:
                if not read.warned and now - read.read_started > self.settings.read_warn_seconds:
                    read.warned = True
                    self._report_slow_read(request_id, read, now - read.read_started)
                continue
            del self._reads[request_id]
            if read.task.corrupt_state and self._corrupt_state is not None:
                self._corrupt_state([[d for _, d in g] for g in read.task.pairs])
            if state == FAILED:
                self._fail(request_id, read.xfer.error, read.xfer.error_kind)
                self.release(_release_of(read.task))  # no completion notification will come
            elif read.digest and self._state_digest is not None and (
                self._state_digest([[d for _, d in g] for g in read.task.pairs]) != read.digest
            ):
                self._fail(request_id, "the recurrent state read differs from P's digest", "digest")
            else:
                self.finished.add(request_id)
                now = time.monotonic()
                self.recorder.observe("transfer_seconds", now - read.started)
                self.recorder.observe("read_seconds", now - read.read_started)
                self.recorder.observe("transfer_bytes", read.nbytes)
                self.recorder.observe("descriptors", read.descriptors)
                logger.debug(
                    "pd_connector: %s: %d descriptors in %.2f ms",
                    request_id,
                    read.descriptors,
                    (now - read.started) * 1e3,
                )

    def _report_slow_call(self, request_id: str, read: _Read, seconds: float) -> None:
        # The engine thread itself was held: every request on this instance waited.
        self.recorder.count("nixl_call_slow")
        logger.warning(
            "pd_connector: a NIXL call for %s (READ from %s, slice %d of %d) held the engine "
            "thread for %.2f s (nixl_num_threads=%d; see docs/operations.md, \"Slow READs\")",
            request_id,
            read.task.remote_engine_id,
            read.xfer.next,
            read.xfer.slices,
            seconds,
            self.settings.nixl_num_threads,
        )

    def _report_slow_read(self, request_id: str, read: _Read, seconds: float) -> None:
        self.recorder.count("read_slow")
        logger.warning(
            "pd_connector: READ for %s from %s still in flight after %.1f s (%d descriptors, "
            "%d of %d slices posted, nixl_num_threads=%d); still waiting, a posted READ cannot "
            "be cancelled safely (see docs/operations.md, \"Slow READs\")",
            request_id,
            read.task.remote_engine_id,
            seconds,
            read.descriptors,
            read.xfer.next,
            read.xfer.slices,
            self.settings.nixl_num_threads,
        )

    def _fail(self, request_id: str, why: str, kind: str) -> None:
        self.recorder.count(f"load_failed:{kind}")
        logger.warning(
            "pd_connector: loading KV for %s failed (%s); load_failure_policy=%s",
            request_id,
            why,
            self.settings.load_failure_policy,
        )
        self.failed[request_id] = why

    def close(self) -> None:
        for read in self._reads.values():
            read.xfer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._calls.close()
