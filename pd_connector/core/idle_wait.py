"""How long an engine step that scheduled nothing waits, instead of returning at once.

vLLM steps again at once while P holds a lease or D waits for a load
(``Scheduler.has_requests`` in vllm/v1/core/sched/scheduler.py), even when a step schedules
nothing: without a wait the engine core and the worker spin for the whole lease, a core's worth
of CPU taken from whatever else runs on a CPU host. The worker (``WorkerSide``) waits, bounded by
``idle_step_wait_ms``, as long as this says; side-channel news ends the wait early.

A READ in flight is no exception once its slices are in NIXL's hands: NIXL's progress thread
(and, where they run, its worker threads or the peer's) move it, not D's polls, which used to
come every step for the READ's whole duration. Such a step waits a fraction of the time the
slice has already been in flight: a READ that completes in microseconds is polled as often as
before, one that lasts seconds every ``idle_step_wait_ms``. What this cannot remove is vLLM's
own cost of stepping (docs/operations.md, "CPU hosts"): with the worker in a process of its own,
the side that waits spins on ``sched_yield`` (``SpinCondition``,
vllm/distributed/device_communicators/shm_broadcast.py).
"""

from __future__ import annotations

from collections.abc import Sequence

# A step waits at most this fraction of the time the youngest slice in flight has waited so far,
# so its completion is noticed at most that fraction late (a READ's time grows by at most ~1/8).
READ_WAIT_FRACTION = 0.125


def should_wait_for_news(idle_step: bool, wait_s: float, leases_held: int, loads_pending: bool) -> bool:
    """With no READ in flight (a step with one waits as ``idle_step_wait`` says): True iff the
    step scheduled nothing (``idle_step``), waiting is configured (``wait_s`` > 0), and there is
    connector work that news can advance: P holds leases (``leases_held``) or D has loads
    pending (``loads_pending``). With neither, vLLM would not be stepping on the connector's
    behalf, so there is nothing to wait for."""
    if not idle_step or wait_s <= 0:
        return False
    return leases_held > 0 or loads_pending


def idle_step_wait(
    idle_step: bool, wait_s: float, leases_held: int, loads_pending: bool, reads: Sequence[float | None] = ()
) -> float:
    """Seconds this step waits (0: none). ``reads``: per READ in flight, how long its posted
    slice has been in NIXL's hands, or None when it has a slice to post now (D's engine thread
    posts slices, ``ChunkedRead.advance``: waiting would only delay the copy). With every READ
    in NIXL's hands the wait is ``READ_WAIT_FRACTION`` of the shortest such time, at most
    ``wait_s``; without READs, ``wait_s`` when ``should_wait_for_news`` says so."""
    if not idle_step or wait_s <= 0:
        return 0.0
    if reads:
        if any(waited is None for waited in reads):
            return 0.0
        return min(wait_s, READ_WAIT_FRACTION * max(0.0, min(reads)))
    return wait_s if should_wait_for_news(idle_step, wait_s, leases_held, loads_pending) else 0.0


def idle_wait_seconds(idle_step_wait_ms: float, dp_lockstep: bool) -> float:
    """The bound on an idle step's wait. None when the engine's DP ranks step in lockstep (a
    MoE model under data parallelism, vLLM's DPEngineCoreProc): every rank's step, a dummy batch
    included, joins the same collectives, so a rank that waited for news would hold up the
    forward pass of every other rank."""
    return 0.0 if dp_lockstep else idle_step_wait_ms / 1000.0
