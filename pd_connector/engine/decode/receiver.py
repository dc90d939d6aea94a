"""D's load pipeline on one TP rank: per request, one *leg* per P rank it pairs with
(``shards.peer_ranks``), each a small state machine (``Stage``): connect -> claim -> READ (or
release) -> done, its whole state in the leg.

- connect: once per P engine, every paired rank's side channel in one background call; with
  different TP sizes the shard plan (``shards.shard_regions``) says which bytes each P rank
  sends. A failed connect fails every request waiting on it; later requests retry.
- claim: each P rank confirms offset and block ids against its lease and extends it (background
  thread); a refused claim fails the request before any byte is read.
- READ: one prepared NIXL transfer per leg (engine thread), planned by the engine's
  ``read_plan.Planner`` and sliced where the post itself copies (``ChunkedRead``); the
  notification on its last post tells that P rank this reader is done. A P rank this rank reads nothing from (replicated units) is released instead.
- optional digest check of the recurrent state (equal TP only).
- the hold: a READ counts only if it completed while P still held the lease, as far as P's
  grant and its answers to the extensions confirmed (``core/read_hold.py``); P frees a lease
  at its deadline even under a READ, so one that outlived it fails (``lease_lost``).

Lease keep-alive is not kept here: D's scheduler extends every handoff it depends on, from
acceptance until this pipeline reports the load ended (``SchedulerSide._due_extensions``); the
worker only forwards those extensions (``extend``).

A request ends when all its legs have: ``finished``, or ``failed`` if any leg failed (the
scheduler recomputes). A failed request's legs that have not read yet release their P rank at
once; a leg already reading runs to its end first, so nothing writes into D's blocks once vLLM
hears the outcome. All NIXL calls stay on the engine thread; the background threads only speak
ZMQ (``transport/lease_client.py``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pd_connector.core import block_phases, read_hold, shards
from pd_connector.core.settings import ConnectorSettings
from pd_connector.core.protocol import EngineCompat, ReadDone, encode_read_done
from pd_connector.engine.metadata import ExtendTask, RecvTask, ReleaseTask
from pd_connector.engine.metrics import Recorder
from pd_connector.engine.decode.prefill_peers import ConnectedEngine, PrefillPeers
from pd_connector.engine.decode.read_in_flight import ReadInFlight
from pd_connector.transport.nixl import FAILED, PENDING, ChunkedRead, NixlTransport
from pd_connector.transport.lease_client import ClaimRequest, LeaseClient
from pd_connector.transport.side_channel import prefer_thread

logger = logging.getLogger("vllm.pd_connector")

MiB = 1 << 20
# A post or poll of a READ that holds D's engine thread longer than this is reported
# (``nixl_call_slow``): far above a slice's copy or a poll, so only a stall is reported.
SLOW_NIXL_CALL_S = 1.0
# Threads making side-channel calls (handshakes, claims, releases, extensions).
_SIDE_CHANNEL_THREADS = 4


def read_pairs(task: RecvTask) -> list:
    """The pairs one READ moves: the offset's, then the prompt checkpoints' in each group."""
    extra = task.checkpoint_pairs
    if not extra or not any(extra):
        return task.pairs
    # A group without checkpoints keeps its pairs as they are (attention pairs may carry phases).
    return [list(main) + list(more) if len(more) else main for main, more in zip(task.pairs, extra)]


class Stage(enum.Enum):
    """Where one leg is: waiting for its P engine's handshake, waiting for P's answer to its
    claim, reading, or over (the leg has left its load)."""

    CONNECT = "connect"
    CLAIM = "claim"
    READ = "read"


@dataclass
class _Leg:
    """One D request's transfer from one P rank: connect -> claim -> READ -> done."""

    rank: int
    stage: Stage = Stage.CONNECT
    claim: Future | None = None  # CLAIM: P's answer
    claim_sent: float = 0.0
    read: ReadInFlight | None = None  # READ: the transfer in flight


@dataclass
class _Load:
    """One D request: its legs that have not ended, by P rank."""

    task: RecvTask
    legs: dict[int, _Leg]
    reader: str
    readers: int
    error: tuple[str, str] | None = None  # (why, kind) of the first failed leg
    started: float = field(default_factory=time.monotonic)


class Receiver:
    def __init__(
        self,
        transport: NixlTransport,
        settings: ConnectorSettings,
        engine_id: str,
        compat: EngineCompat,
        state_digest: Callable[[list[list[int]]], bytes] | None,
        wake: threading.Event | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.transport = transport
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._state_digest = state_digest
        self.recorder = Recorder()
        self._chunk_bytes = settings.nixl_read_chunk_mib * MiB
        # Side-channel calls only (never NIXL): a few threads so one slow peer or a claim that
        # waits for its grant does not hold up the others.
        # They run at a real-time priority where permitted, as P's side channel does (prefer_thread).
        self._executor = ThreadPoolExecutor(
            max_workers=_SIDE_CHANNEL_THREADS, thread_name_prefix="pd-side-channel", initializer=prefer_thread
        )
        # At most one socket in use per thread: keep that many open per P, no more.
        self._calls = LeaseClient(settings, engine_id, compat, max_idle_per_peer=_SIDE_CHANNEL_THREADS)
        # Set when a handshake or claim reply arrives, so an idle engine step waiting on it
        # (WorkerSide.get_transfer_results) resumes at once.
        self._wake = wake
        self._peers = PrefillPeers(
            transport, self._calls, self._submit, tp_rank, tp_size, self.recorder, settings.prefill_engine_idle_seconds
        )
        # Every transfer's state lives in its leg; loads in arrival order (oldest posts first).
        self._loads: dict[str, _Load] = {}
        # At most one slice posted per advance() where the post copies (DRAM without worker
        # threads), oldest request first; otherwise every READ posts at once.
        self._post_budget = 1
        # Extensions in flight: (answer, sent, P host, P base port, P rank).
        self._extensions: list[tuple[Future, float, str, int, int]] = []
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}

    # -- inputs from the scheduler -----------------------------------------------------------

    def add(self, request_id: str, task: RecvTask) -> None:
        p = task.lease.tp_size
        try:
            ranks = shards.peer_ranks(p, self.tp_size, self.tp_rank)
        except shards.ShardError as exc:
            self._refuse(request_id, task, str(exc), "tp_mismatch")
            return
        if task.pairs is None:
            self._refuse(request_id, task, "P's blocks could not be paired with this instance's", "pairing")
            return
        self._loads[request_id] = _Load(
            task,
            {rank: _Leg(rank) for rank in ranks},
            reader=self._reader(request_id),
            readers=shards.readers_per_rank(p, self.tp_size),
        )
        self._peers.connect(task.lease)

    def _reader(self, request_id: str) -> str:
        """This rank reading for D request ``request_id``: one of the readers P's lease counts."""
        return f"{self.engine_id}#{self.tp_rank}/{request_id}"

    def release_all(self, task: ReleaseTask) -> None:
        """D's scheduler will not load this handoff: every P rank may free it (each D rank sends
        it to the P ranks it pairs with, so every P rank hears it), as the reader of
        ``task.request_id`` (its n > 1 siblings keep the lease), or whole without one."""
        reader, readers = "", 1
        try:
            ranks = shards.peer_ranks(task.lease.tp_size, self.tp_size, self.tp_rank)
            if task.request_id:
                reader = self._reader(task.request_id)
                readers = shards.readers_per_rank(task.lease.tp_size, self.tp_size)
        except shards.ShardError:
            ranks = range(task.lease.tp_size) if self.tp_rank == 0 else ()
        for rank in ranks:
            self._executor.submit(self._calls.release, task.lease, rank, task.reason, reader, readers)

    def extend(self, task: ExtendTask) -> None:
        """Extend on the P ranks this rank pairs with (each D rank covers its own), except the
        requests whose leg to that rank is connecting or claiming: the claim is the lease check
        and extends the lease when granted, and an extension behind an unanswered claim would
        hold a side-channel thread until it times out."""
        try:
            ranks = shards.peer_ranks(task.tp_size, self.tp_size, self.tp_rank)
        except shards.ShardError:
            return
        unclaimed = {
            (load.task.lease.request_id, leg.rank)
            for load in self._loads.values()
            for leg in load.legs.values()
            if leg.stage is not Stage.READ
        }
        for rank in ranks:
            ids = [rid for rid in task.request_ids if (rid, rank) not in unclaimed]
            if ids:
                sent = time.monotonic()  # before submitting: P may answer before submit returns
                future = self._executor.submit(self._calls.extend, task.host, task.port + rank, ids)
                self._extensions.append((future, sent, task.host, task.port, rank))

    # -- progress ---------------------------------------------------------------------------

    def advance(self) -> None:
        """Move every leg as far along as it can go now; never blocks. Extension answers are
        taken first, so a READ that completes in this call is judged on the newest hold."""
        self._peers.finish_connects()
        self._peers.forget_idle(lambda: {load.task.lease.engine_id for load in self._loads.values()})
        self._take_extension_answers()
        self._post_budget = 1
        connecting = False
        for request_id, load in list(self._loads.items()):
            for leg in list(load.legs.values()):
                self._step(request_id, load, leg)
                connecting = connecting or leg.stage is Stage.CONNECT and leg.rank in load.legs
        if not connecting:
            self._peers.forget_errors()

    def take_results(self) -> tuple[set[str], set[str]]:
        finished, failed = self.finished, set(self.failed)
        self.finished, self.failed = set(), {}
        return finished, failed

    def pending(self) -> int:
        return len(self._loads)

    def reads(self) -> list[ReadInFlight]:
        """The READs in flight, oldest request first."""
        return [leg.read for load in self._loads.values() for leg in load.legs.values() if leg.read is not None]

    def reads_in_nixl(self) -> list[float | None]:
        """Per READ in flight, how long its posted slice has been in NIXL's hands, or None when
        it has a slice to post now: how long an idle step may wait (``idle_wait.idle_step_wait``)."""
        now = time.monotonic()
        return [read.xfer.in_nixl_for(now) for read in self.reads()]

    def _submit(self, fn, *args) -> Future:
        future = self._executor.submit(fn, *args)
        if self._wake is not None:
            future.add_done_callback(lambda _: self._wake.set())
        return future

    # -- one leg ------------------------------------------------------------------------------

    def _step(self, request_id: str, load: _Load, leg: _Leg) -> None:
        """Move one leg on: a leg whose claim is granted posts its first slice in the same call."""
        if leg.stage is Stage.CONNECT:
            self._connect(request_id, load, leg)
        elif leg.stage is Stage.CLAIM and leg.claim.done():
            self._granted(request_id, load, leg)
        if leg.stage is Stage.READ:
            self._poll(request_id, load, leg)

    def _connect(self, request_id: str, load: _Load, leg: _Leg) -> None:
        """CONNECT: claim once the engine is connected; end the leg if its engine was refused or
        another leg of the request failed."""
        key = load.task.lease.engine_id
        error = self._peers.errors.get(key)
        if load.error is not None:
            self._end_leg(request_id, load, leg, release=True)
        elif error is not None:
            # A P that answered (refused, or its shards cannot pair) is told to release; one
            # that never answered cannot hear it (it frees at its claim deadline).
            self._end_leg(request_id, load, leg, error, release=error[1] != "handshake")
        elif key in self._peers.engines:
            mismatch = block_phases.paired_for_other_sizes(load.task.remote_block_sizes, self._peers.engines[key].block_sizes)
            if mismatch:
                self._end_leg(request_id, load, leg, (mismatch, "block_size"), release=True)
                return
            task = load.task
            request = ClaimRequest(
                task.lease,
                leg.rank,
                task.replay_offset,
                task.remote_block_ids or [],
                load.reader,
                load.readers,
                task.fingerprint,
                task.checkpoints,
            )
            # Stamped before submitting: the claim may be answered before submit returns.
            leg.claim_sent = time.monotonic()
            leg.claim, leg.stage = self._submit(self._calls.claim, request), Stage.CLAIM
        else:
            self._peers.connect(load.task.lease)  # a no-op unless dropped (restarted P)

    def _granted(self, request_id: str, load: _Load, leg: _Leg) -> None:
        """CLAIM answered: READ, or connect again when P restarted since we connected."""
        future, sent = leg.claim, leg.claim_sent
        leg.claim = None
        try:
            granted, answered = future.result()
        except Exception as exc:
            self._end_leg(request_id, load, leg, (str(exc), "claim"), release=True)
            return
        self.recorder.observe("claim_seconds", answered - sent)
        key = load.task.lease.engine_id
        engine = self._peers.engines.get(key)
        if engine is None or (granted.agent_name and granted.agent_name != engine.agents.get(leg.rank)):
            # P restarted under the same engine id since we connected: connect again, then
            # claim again (idempotent: same reader).
            logger.info("pd_connector: prefill engine %s restarted; connecting again", key)
            self._peers.drop(key)
            leg.stage = Stage.CONNECT
            return
        if load.error is not None:
            self._end_leg(request_id, load, leg, release=True)
            return
        hold = read_hold.held_until(sent, granted.lease_seconds)
        self._start_read(request_id, load, leg, engine, granted.state_digest, hold)

    def _start_read(self, request_id: str, load: _Load, leg: _Leg, engine: ConnectedEngine, digest: bytes, hold: float) -> None:
        peer = engine.sources.get(leg.rank)
        if peer is None:
            self._end_leg(request_id, load, leg, release=True, reason="nothing to read from this rank")
            return
        try:
            plan = engine.planners[peer].plan(read_pairs(load.task), self._chunk_bytes)
            if plan.empty:
                # Nothing D lacks (NIXL refuses an empty READ): done; P may free now.
                self._end_leg(request_id, load, leg, release=True, reason="nothing to read")
                return
            done = ReadDone(load.task.lease.request_id, load.reader, load.readers)
            xfer = ChunkedRead(self.transport, peer, plan, encode_read_done(done))
        except Exception as exc:
            self._end_leg(request_id, load, leg, (str(exc), "post"), release=True)  # nothing will be read
            return
        if load.task.lease.tp_size != self.tp_size:
            digest = b""  # P's pages hold another shard than ours
        leg.read = ReadInFlight(xfer, load.task.lease, leg.rank, time.monotonic(), plan.runs, digest, plan.nbytes, hold)
        leg.stage = Stage.READ

    def _take_extension_answers(self) -> None:
        """Move each READ's hold forward by the extensions P confirmed. A request P left out
        is no longer held there: its hold stays where it was, so the READ counts only if it
        completes before that (P may also have ended it on this READ's own notification)."""
        still = []
        for entry in self._extensions:
            future, sent, host, port, rank = entry
            if not future.done():
                still.append(entry)
                continue
            reply = None if future.exception() is not None else future.result()
            if reply is None:
                continue
            for read in self.reads():
                read.confirm_hold(host, port, rank, sent, reply.held)
        self._extensions = still

    def _poll(self, request_id: str, load: _Load, leg: _Leg) -> None:
        """READ: poll the slice in flight, post the next one, and judge the READ once done."""
        read = leg.read
        may_post = not (self.transport.copies_in_post and self._chunk_bytes) or self._post_budget > 0
        posted = read.xfer.next
        called = time.monotonic()
        state = read.xfer.advance(may_post)
        now = time.monotonic()
        self._post_budget -= read.xfer.next - posted
        if now - called > SLOW_NIXL_CALL_S:
            read.report_slow_call(request_id, now - called, self.recorder, self.settings.nixl_num_threads)
        if state == PENDING:
            if not read.warned and now - read.read_started > self.settings.read_warn_seconds:
                read.warned = True
                read.report_slow_read(request_id, now - read.read_started, self.recorder, self.settings.nixl_num_threads)
            return
        leg.read = None
        own_blocks = [[d for _, d in g] for g in load.task.pairs]
        self.read_ended(load.task)
        if state == FAILED:
            # No completion notification will come: release.
            self._end_leg(request_id, load, leg, (read.xfer.error, read.xfer.error_kind), release=True)
            return
        if not read_hold.read_was_held(read.hold, now):
            why = (
                f"the READ completed {now - read.hold:.1f} s after the end of the lease P "
                "confirmed: P may have freed and reused those blocks"
            )
            self._end_leg(request_id, load, leg, (why, "lease_lost"))
            return
        if read.digest and self._state_digest is not None and self._state_digest(own_blocks) != read.digest:
            self._end_leg(request_id, load, leg, ("the recurrent state read differs from P's digest", "digest"))
            return
        self.recorder.observe("read_seconds", now - read.read_started)
        self.recorder.observe("transfer_bytes", read.nbytes)
        self.recorder.observe("descriptors", read.descriptors)
        self._end_leg(request_id, load, leg)

    def read_ended(self, task: RecvTask) -> None:
        """A READ into ``task``'s blocks (``read_pairs``) ended, before its outcome is checked:
        nothing to do here; a connector subclass may look at (or alter) what landed."""

    def _end_leg(
        self, request_id: str, load: _Load, leg: _Leg, error: tuple[str, str] | None = None,
        release: bool = False, reason: str = "",
    ) -> None:
        """One leg is over (READ done, failed or never to start); the request ends with its
        last leg. ``release``: tell that P rank this reader is done without a notification."""
        if error is not None and load.error is None:
            load.error = error
        if release:
            why = reason or (f"decode load failed: {load.error[0]}" if load.error else "not read")
            self._executor.submit(
                self._calls.release, load.task.lease, leg.rank, why, load.reader, load.readers
            )
        del load.legs[leg.rank]
        if load.legs:
            return
        del self._loads[request_id]
        if load.error is not None:
            self._fail(request_id, *load.error)
            return
        self.finished.add(request_id)
        now = time.monotonic()
        self.recorder.observe("transfer_seconds", now - load.started)
        logger.debug("pd_connector: %s loaded in %.2f ms", request_id, (now - load.started) * 1e3)

    def _refuse(self, request_id: str, task: RecvTask, why: str, kind: str) -> None:
        """Fail a request before any leg started, and let every P rank free it."""
        self._fail(request_id, why, kind)
        self.release_all(ReleaseTask(task.lease, f"decode refused the load ({kind}): {why}"))

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
        for read in self.reads():
            read.xfer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._calls.close()
