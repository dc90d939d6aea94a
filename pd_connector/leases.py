"""P-side lease bookkeeping for handed-off blocks (pure state machine over ids and times).

A finished request's blocks stay allocated on P only while its lease runs. D's completion (a
NIXL notification after its READ, or a side-channel release) ends the lease; so does the
deadline. Either way the id is reported to vLLM as ``finished_sending`` exactly once, which is
when vLLM frees the blocks.

A completion can overtake its grant: D may read as soon as the router forwards P's params,
while the grant reaches P's worker with the next engine step's metadata. Such early
completions are remembered (bounded by time) and settle the grant on arrival.
"""

from __future__ import annotations

EARLY_COMPLETION_TTL = 300.0


class LeaseTable:
    def __init__(self) -> None:
        self._deadlines: dict[str, float] = {}
        self._early: dict[str, float] = {}
        self._finished: list[str] = []
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._deadlines)

    def holds(self, request_id: str) -> bool:
        return request_id in self._deadlines

    def grant(self, request_id: str, deadline: float) -> None:
        if request_id in self._early:
            del self._early[request_id]
            self._finished.append(request_id)
            return
        self._deadlines[request_id] = deadline

    def complete(self, request_id: str, now: float) -> bool:
        """D is done with ``request_id``. False if no lease is known (yet, or any more)."""
        if self._deadlines.pop(request_id, None) is not None:
            self._finished.append(request_id)
            return True
        self._early[request_id] = now
        return False

    def expire(self, now: float) -> list[str]:
        """Leases past their deadline; each is finished (its blocks freed) exactly once.
        Scans every entry: deadlines are not in grant order once leases differ (vllm#58222)."""
        expired = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
        for rid in expired:
            del self._deadlines[rid]
        self._finished.extend(expired)
        self.expired_total += len(expired)
        stale = [rid for rid, seen in self._early.items() if now - seen > EARLY_COMPLETION_TTL]
        for rid in stale:
            del self._early[rid]
        return expired

    def take_finished(self) -> set[str]:
        finished, self._finished = set(self._finished), []
        return finished
