"""Whether an engine step that scheduled nothing should wait for side-channel news.

vLLM steps again at once while P holds a lease or D waits for a load
(``Scheduler.has_requests`` in vllm/v1/core/sched/scheduler.py), even when a step schedules
nothing: without a wait the engine core and the worker spin for the whole lease, a core's worth
of CPU taken from whatever else runs on a CPU host. The worker (``WorkerSide``) waits, bounded by
``idle_step_wait_ms``, only when this says so; side-channel news ends the wait early.
"""

from __future__ import annotations


def should_wait_for_news(idle_step: bool, wait_s: float, reading: bool, leases_held: int, loads_pending: bool) -> bool:
    """True iff the step scheduled nothing (``idle_step``), waiting is configured (``wait_s`` >
    0), no READ is in flight (``reading``: its slices are posted and polled step by step, so a
    wait would only delay it), and there is connector work that news can advance: P holds
    leases (``leases_held``) or D has loads pending (``loads_pending``). With neither, vLLM
    would not be stepping on the connector's behalf, so there is nothing to wait for."""
    if not idle_step or wait_s <= 0 or reading:
        return False
    return leases_held > 0 or loads_pending


def idle_wait_seconds(idle_step_wait_ms: float, dp_lockstep: bool) -> float:
    """The bound on an idle step's wait. None when the engine's DP ranks step in lockstep (a
    MoE model under data parallelism, vLLM's DPEngineCoreProc): every rank's step, a dummy batch
    included, joins the same collectives, so a rank that waited for news would hold up the
    forward pass of every other rank."""
    return 0.0 if dp_lockstep else idle_step_wait_ms / 1000.0
