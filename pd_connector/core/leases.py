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


def _frozen(block_ids) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in group) for group in block_ids)


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._early: dict[str, float] = {}
        self._expired: dict[str, float] = {}
        self._finished: list[str] = []
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._leases)

    def holds(self, request_id: str) -> bool:
        return request_id in self._leases

    def grant(self, request_id: str, deadline: float, offset: int = 0, block_ids=()) -> None:
        if request_id in self._early:
            del self._early[request_id]
            self._finished.append(request_id)
            return
        self._leases[request_id] = Lease(deadline, offset, _frozen(block_ids))

    def claim(
        self, request_id: str, offset: int, block_ids, now: float, extend_to: float
    ) -> tuple[str, str]:
        """(outcome, explanation) for D's claim; on GRANTED the deadline becomes at least
        ``extend_to``."""
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
        self._leases[request_id] = lease._replace(deadline=max(lease.deadline, extend_to))
        return GRANTED, ""

    def extend(self, request_id: str, now: float, extend_to: float) -> bool:
        """Keep a live lease at least until ``extend_to`` (D still waits to read it)."""
        lease = self._leases.get(request_id)
        if lease is None or lease.deadline <= now:
            return False
        self._leases[request_id] = lease._replace(deadline=max(lease.deadline, extend_to))
        return True

    def complete(self, request_id: str, now: float) -> bool:
        """D is done with ``request_id``. False if no lease is known (yet, or any more)."""
        if self._leases.pop(request_id, None) is not None:
            self._finished.append(request_id)
            return True
        if request_id not in self._expired:
            self._early[request_id] = now
        return False

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
        for memory in (self._early, self._expired):
            for rid in [rid for rid, seen in memory.items() if now - seen > MEMORY_TTL]:
                del memory[rid]
        return expired

    def take_finished(self) -> set[str]:
        finished, self._finished = set(self._finished), []
        return finished
