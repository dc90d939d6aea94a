"""P-side lease bookkeeping for handed-off blocks (pure state machine over ids and times).

A finished request's blocks stay allocated on P only while its lease runs. Before reading, D
*claims* the lease with the offset and block ids it is about to act on; P grants only an exact
match of what it recorded, and extends the lease, so rewritten parameters or a late D never read
freed (possibly reused) memory. D's completion (a NIXL notification after its READ, or a
release) ends the lease; so does the deadline. Either way the id is reported to vLLM as
``finished_sending`` exactly once, which is when vLLM frees the blocks.

A completion can overtake its grant: D may release as soon as the router forwards P's params,
while the grant reaches P's worker with the next engine step. Such early completions are
remembered (bounded by time) and settle the grant on arrival.

With tensor parallelism each P rank keeps its own table (every rank receives the same grants),
and several D ranks may read one P rank's shard: a lease then ends only when each of its
``readers`` has completed (READ notification or release, one per reader, idempotent), or when
D's scheduler releases it whole (no reader), or at its deadline.
"""

from __future__ import annotations

from typing import NamedTuple

# How long an early completion or an expiry is remembered, to answer late messages precisely.
MEMORY_TTL = 300.0

GRANTED, UNKNOWN, EXPIRED, MISMATCH = "granted", "unknown", "expired", "mismatch"

# The most often D asks a P to extend leases, however short a lease P grants (a tiny grant must
# not make every engine step send one).
MIN_EXTEND_INTERVAL_S = 0.1


def extension_interval(lease_seconds: float) -> float:
    """How often D asks P to extend the leases D still depends on (requests queued for
    admission, or still loading): every third of the lease, so two extensions can go missing before
    it runs out, and at most every ``MIN_EXTEND_INTERVAL_S``. P extends by its own
    lease_seconds, so D passes the shortest lease it knows."""
    return max(lease_seconds / 3, MIN_EXTEND_INTERVAL_S)


class Lease(NamedTuple):
    deadline: float
    offset: int
    block_ids: tuple[tuple[int, ...], ...]
    readers: int = 1  # completions this rank waits for (the largest count a reader announced)
    done: frozenset[str] = frozenset()  # readers that completed


class _Early(NamedTuple):
    """Completions that arrived before the grant."""

    seen: float
    readers: int
    done: frozenset[str]
    whole: bool  # a release without a reader: the lease ends on arrival


def _frozen(block_ids) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in block_ids)


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._early: dict[str, _Early] = {}
        self._expired: dict[str, float] = {}
        self._finished: list[str] = []
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def holds(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, deadline: float, offset: int = 0, block_ids=()) -> None:
        early = self._early.pop(request_id, None)
        lease = Lease(deadline, offset, _frozen(block_ids))
        if early is not None:
            if early.whole or len(early.done) >= early.readers:
                self._finished.append(request_id)
                return
            lease = lease._replace(readers=early.readers, done=early.done)
        self._leases[request_id] = lease

    def claim(
        self, request_id: str, offset: int, block_ids, now: float, extend_to: float, readers: int = 1
    ) -> tuple[str, str]:
        """(outcome, explanation) for D's claim; on GRANTED the deadline becomes at least
        ``extend_to`` and the lease waits for at least ``readers`` completions."""
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id in self._expired:
                return EXPIRED, f"the lease of {request_id} expired; its blocks were freed"
            return UNKNOWN, f"no lease for request {request_id} on this prefill instance"
        if lease.deadline <= now:
            return EXPIRED, f"the lease of {request_id} has expired"
        claimed = _frozen(block_ids)
        if offset != lease.offset or claimed != lease.block_ids:
            return MISMATCH, (
                f"claim for {request_id} (offset {offset}, blocks {list(map(list, claimed))}) "
                f"does not match the lease (offset {lease.offset}, blocks "
                f"{list(map(list, lease.block_ids))}): parameters altered in transit"
            )
        self._leases[request_id] = lease._replace(
            deadline=max(lease.deadline, extend_to), readers=max(lease.readers, readers)
        )
        return GRANTED, ""

    def extend(self, request_id: str, now: float, extend_to: float) -> bool:
        """Keep a live lease at least until ``extend_to`` (D still waits to read it)."""
        lease = self._leases.get(request_id)
        if lease is None or lease.deadline <= now:
            return False
        self._leases[request_id] = lease._replace(deadline=max(lease.deadline, extend_to))
        return True

    def complete(self, request_id: str, now: float, reader: str = "", readers: int = 1) -> bool:
        """``reader`` (one of ``readers``) is done with ``request_id``; no reader: every
        reader is (D's scheduler released it). True when this ended the lease; False while
        other readers are still due, or if no lease is known (yet, or any more)."""
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id not in self._expired:
                early = self._early.get(request_id) or _Early(now, 1, frozenset(), False)
                self._early[request_id] = _Early(
                    early.seen,
                    max(early.readers, readers),
                    early.done | {reader} if reader else early.done,
                    early.whole or not reader,
                )
            return False
        if reader:
            lease = lease._replace(readers=max(lease.readers, readers), done=lease.done | {reader})
            if len(lease.done) < lease.readers:
                self._leases[request_id] = lease
                return False
        del self._leases[request_id]
        self._finished.append(request_id)
        return True

    def expire(self, now: float) -> list[str]:
        """Leases past their deadline; each is finished (its blocks freed) exactly once.
        Scans every entry: deadlines are not in grant order once leases are extended
        (the bug of vllm#58222)."""
        expired = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        for rid in expired:
            del self._leases[rid]
            self._expired[rid] = now
        self._finished.extend(expired)
        self.expired_total += len(expired)
        for rid in [rid for rid, early in self._early.items() if now - early.seen > MEMORY_TTL]:
            del self._early[rid]
        for rid in [rid for rid, seen in self._expired.items() if now - seen > MEMORY_TTL]:
            del self._expired[rid]
        return expired

    def take_finished(self) -> set[str]:
        finished, self._finished = set(self._finished), []
        return finished
