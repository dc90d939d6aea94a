"""Timing instruments of the scheduler-side benchmark (``benchmarks.scheduler``).

``instrument`` wraps every ``SchedulerSide`` method and every ``PDConnector`` hook vLLM's
Scheduler calls with a ``Timers`` entry (thread CPU time and wall time per call); ``Driver``
times vLLM's own entry points around them; ``summarize`` turns one run into µs per request,
timer bias (``calibrate``) subtracted.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from collections import defaultdict

# SchedulerSide methods vLLM reaches through the PDConnector facade.
HALF_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
# PDConnector methods that only forward to SchedulerSide (timed there, not twice).
DELEGATING = {*HALF_METHODS, "request_finished_all_groups"}
# KVConnectorBase_V1 scheduler-side methods vLLM 0.32's Scheduler calls (vllm/v1/core/sched/
# scheduler.py); the base-class defaults count too: they run on every step.
BASE_SCHEDULER_HOOKS = {
    "update_connector_output",
    "get_finished_count",
    "take_events",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "has_connector_metadata",
    "get_loaded_kv_cache_group_ids",
    "has_pending_block_frees",
    "has_pending_push_work",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
}
NOT_PER_STEP = {"build_kv_connector_stats", "build_prom_metrics", "get_required_kvcache_layout"}
# Labels of parts timed inside our hooks (reported, never added to the totals).
NESTED = "nested:"
FINGERPRINT = NESTED + "prompt fingerprint"


class Timers:
    """Per label: calls, wall ns (perf_counter) and CPU ns of this thread (thread_time: what
    the hook costs the scheduler's thread, unaffected by other processes preempting it on a
    shared box). The CPU figure is the one reported; both are in the JSON."""

    def __init__(self) -> None:
        self.wall: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        # > 0 while one of our hooks runs: a garbage collection starting then is charged to us.
        self.depth = 0
        # Collections during the run (see gc_accounting): CPU ns and count, in ours / in vLLM.
        self.gc_cpu: dict[str, int] = defaultdict(int)
        self.gc_runs: dict[str, int] = defaultdict(int)
        self._originals: list[tuple[object, str, object]] = []

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        self._originals.append((obj, name, fn))
        wall, cpu, calls = self.wall, self.cpu, self.calls
        wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

        @functools.wraps(fn)
        def timed(*a, **kw):
            self.depth += 1
            w0, c0 = wall_clock(), cpu_clock()
            try:
                return fn(*a, **kw)
            finally:
                c1, w1 = cpu_clock(), wall_clock()
                self.depth -= 1
                cpu[label] += c1 - c0
                wall[label] += w1 - w0
                calls[label] += 1

        setattr(obj, name, timed)  # instance attribute: shadows the bound method

    def restore(self) -> None:
        """Undo every wrap (a module function wrapped for one run must not stay wrapped)."""
        for obj, name, fn in reversed(self._originals):
            setattr(obj, name, fn)
        self._originals = []


def calibrate(n: int = 100_000) -> dict[str, float]:
    """What the timer reports for an empty method (``cpu``/``wall`` bias, subtracted from every
    hook call) and the whole wrapper's extra wall time (``wrapper``: the part outside the timed
    region lands in vLLM's figure and is subtracted there). Best of 5."""

    class Dummy:
        def f(self):
            return None

    best = {"cpu": float("inf"), "wall": float("inf"), "wrapper": float("inf")}
    for _ in range(5):
        plain, wrapped, timers = Dummy(), Dummy(), Timers()
        timers.wrap(wrapped, "f", "x")
        t0 = time.perf_counter_ns()
        for _ in range(n):
            plain.f()
        t1 = time.perf_counter_ns()
        for _ in range(n):
            wrapped.f()
        t2 = time.perf_counter_ns()
        best["cpu"] = min(best["cpu"], timers.cpu["x"] / n)
        best["wall"] = min(best["wall"], timers.wall["x"] / n)
        best["wrapper"] = min(best["wrapper"], ((t2 - t1) - (t1 - t0)) / n)
    return best


def instrument(scheduler, timers: Timers) -> None:
    connector = scheduler.connector
    half = connector._scheduler
    for name in HALF_METHODS:
        timers.wrap(half, name, f"SchedulerSide.{name}")
    cls = type(connector)
    for name in dir(cls):
        if name.startswith("_") or name in DELEGATING or name in NOT_PER_STEP:
            continue
        attr = getattr(cls, name, None)
        if not callable(attr) or isinstance(vars(cls).get(name), (classmethod, staticmethod)):
            continue
        if name in vars(cls) or name in BASE_SCHEDULER_HOOKS:
            timers.wrap(connector, name, f"PDConnector.{name}")
    from pd_connector.engine.from_vllm import identity

    # Inside on_new_request on both halves: P over the tokens it prefills, D over its prompt[:R].
    timers.wrap(identity, "prompt_fingerprint", FINGERPRINT)


class Driver:
    """Runs one scheduler to completion, timing vLLM's entry points (wall and thread CPU)."""

    def __init__(self, scheduler):
        self.s = scheduler
        self.vllm_wall: dict[str, int] = defaultdict(int)
        self.vllm_cpu: dict[str, int] = defaultdict(int)
        self.steps = 0
        self.max_running = 0

    def _timed(self, part: str, fn, *a):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out = fn(*a)
        self.vllm_cpu[part] += time.thread_time_ns() - c0
        self.vllm_wall[part] += time.perf_counter_ns() - w0
        return out

    def add(self, req) -> None:
        self._timed("add_request", self.s.add_request, req)

    def step(self, kv_output=None):
        from vllm.v1.outputs import ModelRunnerOutput

        out = self._timed("schedule", self.s.schedule)
        self.max_running = max(self.max_running, len(self.s.running))
        req_ids = list(out.num_scheduled_tokens)
        reqs = self.s.requests
        # schedule() has already advanced num_computed_tokens by the scheduled chunk
        # (Scheduler._update_after_schedule): a request samples once its prompt is complete.
        sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in req_ids]
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        engine_outputs = self._timed("update_from_output", self.s.update_from_output, out, mro)
        self.steps += 1
        return out, engine_outputs


@contextlib.contextmanager
def frozen_heap():
    """What a vLLM server does after startup (vllm/utils/gc_utils.py freeze_gc_heap): collect,
    then freeze everything alive, here the scheduler and the pre-built requests, so that
    a collection scanning that heap is not charged to whichever hook happens to allocate."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


@contextlib.contextmanager
def gc_accounting(timers: Timers):
    """Charge each garbage collection of the run (``gc.callbacks``) to our hooks or to vLLM, by
    where it started. Collections are part of both figures already (they run inside whichever
    call allocated past the threshold); this says how much, so that a figure inflated by a
    collection it merely triggered shows as such (a few µs per request, gen 0/1
    only, with the heap frozen as a vLLM server freezes it)."""
    started = [0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time_ns()
            return
        where = "ours" if timers.depth else "vllm"
        timers.gc_cpu[where] += time.thread_time_ns() - started[0]
        timers.gc_runs[f"{where}_gen{info['generation']}"] += 1

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def summarize(timers: Timers, d: Driver, wall_ns: int, n: int, cal: dict) -> dict:
    timers.restore()
    hooks = {}
    for label in sorted(timers.calls):
        calls = timers.calls[label]
        cpu = max(0.0, timers.cpu[label] - calls * cal["cpu"])
        wall = max(0.0, timers.wall[label] - calls * cal["wall"])
        hooks[label] = {"calls": calls, "us_per_request": cpu / n / 1e3, "wall_us_per_request": wall / n / 1e3}
    top = [label for label in timers.calls if not label.startswith(NESTED)]
    calls = sum(timers.calls[label] for label in top)
    ours_cpu = sum(hooks[label]["us_per_request"] for label in top)
    ours_wall = sum(hooks[label]["wall_us_per_request"] for label in top)
    # Our hooks run inside vLLM's entry points: vLLM's own time is the rest, less the wrapper.
    spent_cpu = sum(timers.cpu[label] for label in top)
    spent_wall = sum(timers.wall[label] for label in top)
    vllm_cpu = (sum(d.vllm_cpu.values()) - spent_cpu - calls * (cal["wrapper"] - cal["wall"])) / n / 1e3
    vllm_wall = (sum(d.vllm_wall.values()) - spent_wall - calls * (cal["wrapper"] - cal["wall"])) / n / 1e3
    return {
        "requests": n,
        "steps": d.steps,
        "max_running": d.max_running,
        "hooks": hooks,
        "connector_us_per_request": ours_cpu,
        "connector_wall_us_per_request": ours_wall,
        "vllm_us_per_request": vllm_cpu,
        "vllm_wall_us_per_request": vllm_wall,
        "vllm_breakdown_us_per_request": {k: v / n / 1e3 for k, v in d.vllm_cpu.items()},
        "gc_us_per_request": {where: ns / n / 1e3 for where, ns in timers.gc_cpu.items()},
        "gc_collections": dict(timers.gc_runs),
        "wall_s": wall_ns / 1e9,
    }
