"""P-side lease bookkeeping for handed-off blocks (pure state machine over ids and times).

A finished request's blocks stay allocated on P only while its lease runs. Before reading, D
*claims* the lease with the offset, block ids and prompt fingerprint it is about to act on; P
grants only an exact match of what it recorded, and extends the lease, so rewritten parameters,
another prompt or a late D never read freed (possibly reused) memory. D's completion (a NIXL
notification after its READ, or a release) ends the lease; so does the deadline. Either way the
id is reported to vLLM as ``finished_sending`` exactly once, which is when vLLM frees the blocks.

A lease starts short (P's ``claim_deadline_seconds``: the time D needs to claim it) and becomes
``lease_seconds`` long when D claims or extends it, so a handoff no D ever claims (an
unreachable P address in the params, a client gone between P and D) is freed within the claim
deadline, not the full lease.

A completion can overtake its grant: D may release as soon as the router forwards P's params,
while the grant reaches P's worker with the next engine step. Such early completions are
remembered (bounded by time) and count as soon as the grant arrives.

Verbs (docs/architecture.md, "Glossary"): P *grants* a lease, D *claims* and *extends* it; a
reader *completes* (READ notification or release); the lease *ends* when every reader has
completed, or *expires* at its deadline; P then *frees* its blocks.

Readers: with tensor parallelism each P rank keeps its own table (every rank receives the same
grants), and several D ranks may read one P rank's shard (``readers`` per D request); with
``n > 1`` sampling several D requests read one handoff (``requests``). A lease ends when
``requests * readers`` distinct readers have completed (READ notification or release, idempotent)
and every reader P granted a claim to has completed: blocks are never freed under a granted
READ. D's scheduler may release a lease whole (no reader): no claim is granted after that, and
it ends once the granted readers are done. A late claim on a lease that ended is refused at
once (``ENDED``), not left pending.

The deadline is the one exception, on purpose: a lease ends at its deadline even under a
granted READ, and no claim or extension moves it past ``max_hold`` after the grant, so P's hold
is bounded whatever the link or D does (a claim past that cap is refused as ``EXPIRED``). D
trusts a READ only if it completed inside the hold P confirmed (``read_hold.py``); one that
outlived the lease fails and is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

# How long an early completion, an expiry or an ended lease is remembered, to answer late
# messages precisely.
MEMORY_TTL = 300.0

GRANTED, UNKNOWN, EXPIRED, MISMATCH = "granted", "unknown", "expired", "mismatch"
# The claimed prompt fingerprint is not the lease's; the lease ended (completed or released).
PROMPT_MISMATCH, ENDED = "prompt_mismatch", "ended"

# The most often D asks a P to extend leases, however short a lease P grants (a tiny grant must
# not make every engine step send one).
MIN_EXTEND_INTERVAL_S = 0.1


def extension_interval(lease_seconds: float) -> float:
    """How often D asks P to extend the leases D still depends on (requests queued for
    admission, or still loading): every third of the lease, so two extensions can go missing before
    it runs out, and at most every ``MIN_EXTEND_INTERVAL_S``. D passes the shortest lease it
    knows P to keep (``pd_lease_seconds`` in the params before a claim, ``Granted.lease_seconds``
    after it)."""
    return max(lease_seconds / 3, MIN_EXTEND_INTERVAL_S)


def initial_lease(claim_deadline_seconds: float, lease_seconds: float) -> float:
    """How long P keeps a new handoff before D claims or extends it."""
    return min(claim_deadline_seconds, lease_seconds)


class Lease(NamedTuple):
    deadline: float
    replay_offset: int
    block_ids: tuple[tuple[int, ...], ...]
    fingerprint: str = ""
    requests: int = 1  # D requests that read this handoff (the client's n)
    readers: int = 1  # completions per D request on this rank (the largest count announced)
    claimed: frozenset[str] = frozenset()  # readers granted a claim
    done: frozenset[str] = frozenset()  # readers that completed
    released_whole: bool = False  # released whole by D's scheduler: no new claims
    cap: float = float("inf")  # no claim or extension keeps the lease past this
    # Prompt checkpoints below the offset leased with it: (position, block ids per group).
    checkpoints: frozenset[tuple[int, tuple[tuple[int, ...], ...]]] = frozenset()

    def reading(self) -> bool:
        """A granted reader has not completed: its READ may be in flight."""
        return not self.claimed <= self.done

    def ends(self) -> bool:
        """Every reader due has completed (or D released it whole) and none is reading."""
        return not self.reading() and (self.released_whole or len(self.done) >= self.requests * self.readers)


class _Early(NamedTuple):
    """Completions that arrived before the grant."""

    seen: float
    readers: int
    done: frozenset[str]
    whole: bool  # a release without a reader: the lease ends on arrival


def _frozen(block_ids) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in block_ids)


def _frozen_checkpoints(checkpoints) -> frozenset[tuple[int, tuple[tuple[int, ...], ...]]]:
    """``protocol.CheckpointBlocks`` (or anything with ``position`` and ``block_ids``) as set items."""
    return frozenset((int(c.position), _frozen(c.block_ids)) for c in checkpoints)


class LeaseTable:
    def __init__(self, claim_seconds: float = float("inf"), max_hold: float = float("inf")) -> None:
        # How long readers still due may take to claim once every granted reader is done.
        self.claim_seconds = claim_seconds
        # The longest a lease lives after its grant, however often D claims or extends it.
        self.max_hold = max_hold
        self._leases: dict[str, Lease] = {}
        self._early: dict[str, _Early] = {}
        self._expired: dict[str, float] = {}
        self._ended: dict[str, float] = {}  # in ending order: forgotten from the front
        self._to_free: list[str] = []
        self.expired_total = 0
        # Leases that reached their deadline with a granted READ not reported done.
        self.expired_reading_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def holds(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(
        self,
        request_id: str,
        deadline: float,
        replay_offset: int = 0,
        block_ids: Sequence[Sequence[int]] = (),
        fingerprint: str = "",
        requests: int = 1,
        now: float | None = None,
        checkpoints: Sequence = (),
    ) -> None:
        """Lease ``request_id``'s blocks until ``deadline``, for ``requests`` D requests, and at
        most ``max_hold`` past ``now`` (the grant's time; default: the deadline's own bound);
        ``checkpoints``: the prompt checkpoints leased with them (``protocol.CheckpointBlocks``)."""
        cap = (deadline if now is None else now) + self.max_hold
        lease = Lease(
            deadline, replay_offset, _frozen(block_ids), fingerprint, max(1, requests), cap=cap,
            checkpoints=_frozen_checkpoints(checkpoints),
        )
        early = self._early.pop(request_id, None)
        if early is not None:
            lease = lease._replace(readers=early.readers, done=early.done, released_whole=early.whole)
            if lease.ends():
                self._end(request_id, early.seen)
                return
        self._leases[request_id] = lease

    def claim(
        self,
        request_id: str,
        replay_offset: int,
        block_ids,
        now: float,
        extend_to: float,
        readers: int = 1,
        reader: str = "",
        fingerprint: str | None = None,
        checkpoints: Sequence = (),
    ) -> tuple[str, str]:
        """(outcome, explanation) for D's claim; on GRANTED the deadline becomes at least
        ``extend_to``, ``reader`` counts as reading until it completes, and the lease waits for
        at least ``readers`` completions per D request. ``fingerprint`` None: not compared.
        ``checkpoints``: the prompt checkpoints D reads too, each one this lease holds."""
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id in self._expired:
                return EXPIRED, f"the lease of {request_id} expired; its blocks were freed"
            if request_id in self._ended:
                return ENDED, f"the lease of {request_id} already ended (read or released); its blocks were freed"
            return UNKNOWN, f"no lease for request {request_id} on this prefill instance"
        if lease.deadline <= now:
            return EXPIRED, f"the lease of {request_id} has expired"
        if lease.cap <= now:
            # A grant now would confirm a 0 s hold: D would READ, fail it as lease_lost and
            # recompute. Any positive hold is granted: no floor fits every READ size and link, and a
            # READ outliving a short hold is failed by D's check (read_hold) as a refusal would be.
            return EXPIRED, (
                f"the lease of {request_id} reached P's hold cap ({self.max_hold:g} s after its grant, "
                "max_hold_seconds): no claim is granted past it"
            )
        claimed = _frozen(block_ids)
        if replay_offset != lease.replay_offset or claimed != lease.block_ids:
            return MISMATCH, (
                f"claim for {request_id} (offset {replay_offset}, blocks {list(map(list, claimed))}) "
                f"does not match the lease (offset {lease.replay_offset}, blocks "
                f"{list(map(list, lease.block_ids))}): parameters altered in transit"
            )
        stray = _frozen_checkpoints(checkpoints) - lease.checkpoints
        if stray:
            return MISMATCH, (
                f"claim for {request_id} reads checkpoints {sorted(stray)} this instance did not lease "
                f"with it ({sorted(lease.checkpoints)}): parameters altered in transit"
            )
        if fingerprint is not None and fingerprint != lease.fingerprint:
            return PROMPT_MISMATCH, (
                f"claim for {request_id}: the decode request's prompt fingerprint {fingerprint or '(none)'} "
                f"is not the one of the {replay_offset} tokens this instance computed ({lease.fingerprint}): "
                "another prompt, or parameters altered in transit"
            )
        if reader in lease.done or (lease.released_whole and reader not in lease.claimed):
            return ENDED, f"{reader or 'the decode instance'} already released or read {request_id}"
        self._leases[request_id] = lease._replace(
            deadline=min(max(lease.deadline, extend_to), lease.cap),
            readers=max(lease.readers, readers),
            claimed=lease.claimed | {reader} if reader else lease.claimed,
        )
        return GRANTED, ""

    def extend(self, request_id: str, now: float, extend_to: float) -> bool:
        """Keep a live lease at least until ``extend_to`` (D still waits to read it)."""
        lease = self._leases.get(request_id)
        if lease is None or lease.deadline <= now:
            return False
        self._leases[request_id] = lease._replace(deadline=min(max(lease.deadline, extend_to), lease.cap))
        return True

    def held_seconds(self, request_id: str, now: float) -> float:
        """How long from ``now`` the lease of ``request_id`` is still held (0: not held)."""
        lease = self._leases.get(request_id)
        return max(0.0, lease.deadline - now) if lease is not None else 0.0

    def complete(self, request_id: str, now: float, reader: str = "", readers: int = 1) -> bool:
        """``reader`` (one of ``readers`` per D request) is done with ``request_id``; no reader:
        D's scheduler released it whole. True when this ended the lease; False while readers
        are still due, or if no lease is known (yet, or any more)."""
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id not in self._expired and request_id not in self._ended:
                early = self._early.get(request_id) or _Early(now, 1, frozenset(), False)
                # Remembered from the latest completion: a repeat is fresh evidence.
                self._early[request_id] = _Early(
                    now,
                    max(early.readers, readers),
                    early.done | {reader} if reader else early.done,
                    early.whole or not reader,
                )
            return False
        if reader:
            lease = lease._replace(readers=max(lease.readers, readers), done=lease.done | {reader})
        else:
            lease = lease._replace(released_whole=True)
        if lease.ends():
            del self._leases[request_id]
            self._end(request_id, now)
            return True
        if not lease.reading():
            # Nobody reads now; the readers still due get the time a claim needs, not the
            # rest of a lease extended for a reader that is done.
            lease = lease._replace(deadline=min(lease.deadline, now + self.claim_seconds))
        self._leases[request_id] = lease
        return False

    def _end(self, request_id: str, now: float) -> None:
        self._to_free.append(request_id)
        self._ended.pop(request_id, None)
        self._ended[request_id] = now

    def expire(self, now: float) -> list[str]:
        """Leases past their deadline; each is freed exactly once.
        Scans every entry: deadlines are not in grant order once leases are extended
        (the bug of vllm#58222)."""
        expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in expired:
            self.expired_reading_total += self._leases[rid].reading()
            del self._leases[rid]
            self._expired[rid] = now
        self._to_free.extend(expired)
        self.expired_total += len(expired)
        for rid in [rid for rid, early in self._early.items() if now - early.seen > MEMORY_TTL]:
            del self._early[rid]
        for rid in [rid for rid, seen in self._expired.items() if now - seen > MEMORY_TTL]:
            del self._expired[rid]
        old = []
        for rid, seen in self._ended.items():  # oldest first: stop at the first one kept
            if now - seen <= MEMORY_TTL:
                break
            old.append(rid)
        for rid in old:
            del self._ended[rid]
        return expired

    def take_to_free(self) -> set[str]:
        """The leases that ended or expired since the last call: their blocks P frees now."""
        to_free, self._to_free = set(self._to_free), []
        return to_free
