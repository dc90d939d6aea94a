#!/usr/bin/env python
"""Scheduler-side cost of pd_connector: microseconds per request in our hooks vs vLLM's own.

vLLM's real in-process ``Scheduler`` (``tests/vllm/harness.py``: no engine, no worker, no
GPU) runs ``--requests`` concurrent requests (all added before the first step) of
``--prompt-len`` tokens end to end:

  P (kv_producer)  add all requests with ``do_remote_decode`` -> prefill in chunks -> each
                   finishes after its prefill (request_finished leases the blocks) -> the
                   worker's ``finished_sending`` is fed back one step later, freeing the blocks.
  D (kv_consumer)  add all requests with the kv_transfer_params the P run really returned ->
                   admission parks them in WAITING_FOR_REMOTE_KVS (get_num_new_matched_tokens,
                   update_state_after_alloc) -> ``finished_recving`` one step later -> recompute
                   the tail and decode ``--max-tokens`` tokens -> finish.

Every ``SchedulerHalf`` method (our logic) and every ``PDConnector`` method vLLM calls that
does not delegate to it is wrapped with a ``perf_counter_ns`` timer. vLLM's own cost is the
wall time of ``add_request`` + ``schedule`` + ``update_from_output`` minus the time inside our
hooks, measured in the same run. Timer overhead (calibrated) is subtracted from the hooks.
Both attention-only and hybrid (attention + Mamba groups) configurations.

  .venv/bin/python scripts/bench_scheduler.py            # 1,000 requests, ~1k tokens
  .venv/bin/python scripts/bench_scheduler.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

HALF_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
)
# PDConnector methods that simply forward to SchedulerHalf (timed there, not here).
DELEGATING = {
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "request_finished_all_groups",
}


class Timers:
    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)
        ns, calls = self.ns, self.calls
        clock = time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                ns[label] += clock() - t0
                calls[label] += 1

        setattr(obj, name, timed)  # instance attribute: shadows the bound method


def calibrate_overhead(n: int = 200_000) -> float:
    """ns a timer wrapper adds per call (an empty method, wrapped vs not)."""

    class Dummy:
        def f(self):
            return None

    d, w = Dummy(), Dummy()
    t = Timers()
    t.wrap(w, "f", "x")
    best_plain = best_wrapped = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            d.f()
        best_plain = min(best_plain, time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            w.f()
        best_wrapped = min(best_wrapped, time.perf_counter_ns() - t0)
    return max(0.0, (best_wrapped - best_plain) / n)


def instrument(scheduler, timers: Timers) -> None:
    connector = scheduler.connector
    half = connector._scheduler
    for name in HALF_METHODS:
        timers.wrap(half, name, f"SchedulerHalf.{name}")
    # Facade methods vLLM calls that do not go through SchedulerHalf (base-class defaults
    # included: they run on every step and are part of what a connector costs).
    for name in dir(type(connector)):
        if name.startswith("_") or name in DELEGATING:
            continue
        attr = getattr(type(connector), name, None)
        if not callable(attr) or isinstance(attr, (classmethod, staticmethod)):
            continue
        if name in ("build_kv_connector_stats", "build_prom_metrics", "get_required_kvcache_layout"):
            continue
        if name in vars(type(connector)) or name in _BASE_SCHEDULER_HOOKS:
            timers.wrap(connector, name, f"PDConnector.{name}")


# KVConnectorBase_V1 scheduler-side methods vLLM 0.32's Scheduler may call on every step.
_BASE_SCHEDULER_HOOKS = {
    "update_connector_output",
    "get_finished_count",
    "take_events",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "has_connector_metadata",
    "get_loaded_kv_cache_group_ids",
}


class Driver:
    """Runs one scheduler to completion, timing vLLM's entry points."""

    def __init__(self, scheduler, timers: Timers):
        self.s = scheduler
        self.t = timers
        self.vllm_ns = defaultdict(int)
        self.steps = 0
        self.max_running = 0
        self.max_waiting_kv = 0

    def add(self, req) -> None:
        t0 = time.perf_counter_ns()
        self.s.add_request(req)
        self.vllm_ns["add_request"] += time.perf_counter_ns() - t0

    def step(self, kv_output=None):
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.perf_counter_ns()
        out = self.s.schedule()
        t1 = time.perf_counter_ns()
        self.max_running = max(self.max_running, len(self.s.running))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.s.requests[rid]
            # schedule() has already advanced num_computed_tokens by the scheduled tokens
            # (Scheduler._update_after_schedule), so a chunk that completes the prompt leaves
            # it equal to num_tokens. (harness.run_step adds the scheduled tokens a second
            # time, which samples after a partial chunk once prompts get chunked.)
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([7] if done else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        t2 = time.perf_counter_ns()
        engine_outputs = self.s.update_from_output(out, mro)
        t3 = time.perf_counter_ns()
        self.vllm_ns["schedule"] += t1 - t0
        self.vllm_ns["update_from_output"] += t3 - t2
        self.steps += 1
        return out, engine_outputs


def finished(engine_outputs) -> dict:
    found = {}
    for eco in engine_outputs.values():
        for o in eco.outputs:
            if o.finish_reason is not None:
                found[o.request_id] = o.kv_transfer_params
    return found


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Distinct prompts (no accidental prefix sharing), token ids inside the tiny vocab.
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


def patch_harness(harness, max_num_seqs: int, max_model_len: int) -> None:
    """The harness fixes max_num_seqs=16 and max_model_len=1024; 1,000 concurrent requests
    need more running slots. Override those two fields only, at construction."""
    real_sched, real_model = harness.SchedulerConfig, harness.ModelConfig

    def scheduler_config(**kw):
        kw["max_num_seqs"] = max_num_seqs
        kw["max_model_len"] = max_model_len
        return real_sched(**kw)

    def model_config(**kw):
        kw["max_model_len"] = max_model_len
        return real_model(**kw)

    harness.SchedulerConfig = scheduler_config
    harness.ModelConfig = model_config


def run_p(harness, model_dir, groups, prompts, args):
    timers = Timers()
    s = harness.make_scheduler(
        model_dir,
        "kv_producer",
        groups=groups,
        max_num_batched_tokens=args.batch_tokens,
        num_blocks=args.num_blocks,
    )
    instrument(s, timers)
    d = Driver(s, timers)
    reqs = [harness.make_request(p, {"do_remote_decode": True}, max_tokens=args.max_tokens) for p in prompts]
    gc.collect()
    t0 = time.perf_counter_ns()
    for r in reqs:
        d.add(r)
    params: dict[str, dict] = {}
    to_free: set[str] = set()
    from vllm.v1.outputs import KVConnectorOutput

    while len(params) < len(reqs) or to_free:
        kv = KVConnectorOutput(finished_sending=set(to_free)) if to_free else None
        to_free = set()
        _, outs = d.step(kv)
        done = finished(outs)
        params.update(done)
        # The worker reports D done reading one step after the lease went out.
        to_free |= {rid for rid, p in done.items() if p and p.get("do_remote_prefill")}
        if d.steps > 20 * len(reqs) + 100:
            raise RuntimeError("P run did not converge")
    wall = time.perf_counter_ns() - t0
    ordered = [params[r.request_id] for r in reqs]
    bad = [(p, len(pr)) for p, pr in zip(ordered, prompts) if not p or p.get("replay_offset") != len(pr) - 1]
    assert not bad, f"unexpected P results, e.g. {bad[:2]}"
    return summarize("P", groups, timers, d, wall, len(reqs)), ordered


def run_d(harness, model_dir, groups, prompts, p_params, args):
    timers = Timers()
    s = harness.make_scheduler(
        model_dir,
        "kv_consumer",
        groups=groups,
        max_num_batched_tokens=args.batch_tokens,
        num_blocks=args.num_blocks,
    )
    instrument(s, timers)
    d = Driver(s, timers)
    reqs = [harness.make_request(p, dict(pp), max_tokens=args.max_tokens) for p, pp in zip(prompts, p_params)]
    gc.collect()
    from vllm.v1.outputs import KVConnectorOutput

    t0 = time.perf_counter_ns()
    for r in reqs:
        d.add(r)
    done_ids: set[str] = set()
    loading: set[str] = set()
    loaded_total = 0
    while len(done_ids) < len(reqs):
        kv = KVConnectorOutput(finished_recving=set(loading)) if loading else None
        loaded_total += len(loading)
        loading = set()
        out, outs = d.step(kv)
        meta = out.kv_connector_metadata
        loading |= set(meta.to_recv)  # the worker "finishes" each load one step later
        d.max_waiting_kv = max(d.max_waiting_kv, len(meta.to_recv))
        done_ids |= set(finished(outs))
        if d.steps > 20 * len(reqs) + 100:
            raise RuntimeError("D run did not converge")
    wall = time.perf_counter_ns() - t0
    stats = s.connector._scheduler.stats
    assert loaded_total == len(reqs), f"{loaded_total} of {len(reqs)} requests loaded from P ({dict(stats)})"
    return summarize("D", groups, timers, d, wall, len(reqs))


def summarize(role, groups, timers: Timers, d: Driver, wall_ns: int, n: int) -> dict:
    overhead = OVERHEAD_NS
    hooks = {}
    for label in sorted(timers.ns):
        calls = timers.calls[label]
        net = max(0, timers.ns[label] - calls * overhead)
        hooks[label] = {"calls": calls, "us_per_request": net / n / 1e3, "us_per_call": net / max(1, calls) / 1e3}
    ours_ns = sum(max(0, timers.ns[k] - timers.calls[k] * overhead) for k in timers.ns)
    gross_ours = sum(timers.ns.values())
    vllm_total = sum(d.vllm_ns.values())
    vllm_own = vllm_total - gross_ours  # hooks run inside vLLM's entry points
    return {
        "role": role,
        "groups": list(groups),
        "requests": n,
        "steps": d.steps,
        "max_running": d.max_running,
        "hooks": hooks,
        "connector_us_per_request": ours_ns / n / 1e3,
        "vllm_us_per_request": vllm_own / n / 1e3,
        "vllm_breakdown_us_per_request": {k: v / n / 1e3 for k, v in d.vllm_ns.items()},
        "connector_share": ours_ns / max(1, vllm_own + ours_ns),
        "wall_s": wall_ns / 1e9,
    }


OVERHEAD_NS = 0.0


def fastest(runs: list[dict]) -> dict:
    """Per hook, and for vLLM's own time, the fastest of the repeated runs (noise on a shared
    box only ever adds time); the per-run figures stay in ``runs``."""
    out = dict(runs[0])
    out["hooks"] = {}
    for label in {h for r in runs for h in r["hooks"]}:
        out["hooks"][label] = min((r["hooks"][label] for r in runs if label in r["hooks"]), key=lambda h: h["us_per_request"])
    out["connector_us_per_request"] = sum(h["us_per_request"] for h in out["hooks"].values())
    out["vllm_us_per_request"] = min(r["vllm_us_per_request"] for r in runs)
    out["vllm_breakdown_us_per_request"] = min(runs, key=lambda r: r["vllm_us_per_request"])["vllm_breakdown_us_per_request"]
    out["connector_share"] = out["connector_us_per_request"] / (out["connector_us_per_request"] + out["vllm_us_per_request"])
    out["wall_s"] = min(r["wall_s"] for r in runs)
    out["runs"] = [{k: v for k, v in r.items() if k != "runs"} for r in runs]
    return out


def col_name(r: dict) -> str:
    name = f"{r['role']} {'attention' if r['groups'] == ['attention'] else 'attn+mamba'}"
    return name + (" (WARN)" if r.get("log_level") == "WARNING" else "")


def print_tables(results: list[dict]) -> str:
    cols = [col_name(r) for r in results]
    labels = sorted({h for r in results for h in r["hooks"]}, key=lambda h: (not h.startswith("SchedulerHalf"), h))
    w = 21
    lines = [f"{'us per request':<46}" + "".join(f"{c:>{w}}" for c in cols), "-" * (46 + w * len(cols))]
    for label in labels:
        cells = []
        for r in results:
            h = r["hooks"].get(label)
            cells.append(f"{h['us_per_request']:>9.2f} ({h['calls']:>6})" if h else "-")
        lines.append(f"{label:<46}" + "".join(f"{c:>{w}}" for c in cells))
    lines.append("-" * (46 + w * len(cols)))
    lines.append(f"{'connector total (our hooks)':<46}" + "".join(f"{r['connector_us_per_request']:>{w}.2f}" for r in results))
    lines.append(f"{'vLLM scheduler own (baseline)':<46}" + "".join(f"{r['vllm_us_per_request']:>{w}.2f}" for r in results))
    for part in ("add_request", "schedule", "update_from_output"):
        lines.append(
            f"{'  vLLM ' + part + ' (incl. hooks)':<46}"
            + "".join(f"{r['vllm_breakdown_us_per_request'].get(part, 0):>{w}.2f}" for r in results)
        )
    lines.append(f"{'connector share of scheduler time':<46}" + "".join(f"{r['connector_share'] * 100:>{w - 1}.1f}%" for r in results))
    lines.append(f"{'requests / steps / max running':<46}" + "".join(f"{str(r['requests']) + '/' + str(r['steps']) + '/' + str(r['max_running']):>{w}}" for r in results))
    lines.append(f"{'wall s':<46}" + "".join(f"{r['wall_s']:>{w}.2f}" for r in results))
    text = "\n".join(lines)
    print(text)
    return text


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    import numpy as np

    cols = [col_name(r).replace(" (", "\n(") for r in results]
    labels = sorted(
        h for h in {h for r in results for h in r["hooks"]}
        if max(rr["hooks"].get(h, {}).get("us_per_request", 0) for rr in results) > 0.05
    )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    xs = np.arange(len(results))
    bottom = np.zeros(len(results))
    for i, label in enumerate(labels):
        vals = np.array([r["hooks"].get(label, {}).get("us_per_request", 0) for r in results])
        ax1.bar(xs, vals, 0.6, bottom=bottom, label=label.split(".")[-1], color=f"C{i % 10}")
        bottom += vals
    ax1.set_xticks(xs, cols, fontsize=7)
    ax1.set_ylabel("µs per request")
    ax1.set_title("pd_connector hooks (stacked)", fontsize=10)
    ax1.legend(fontsize=7)
    ax2.bar(xs - 0.2, [r["connector_us_per_request"] for r in results], 0.4, label="pd_connector hooks", color="C0")
    ax2.bar(xs + 0.2, [r["vllm_us_per_request"] for r in results], 0.4, label="vLLM scheduler own", color="0.4")
    ax2.set_yscale("log")
    ax2.set_xticks(xs, cols, fontsize=7)
    ax2.set_ylabel("µs per request (log)")
    ax2.set_title(f"ours vs vLLM, {results[0]['requests']} concurrent requests", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    global OVERHEAD_NS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".artifacts/bench/")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="recorded only: the Scheduler does no device work (KV buffer device stays 'cpu')")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens D decodes per request")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--configs", nargs="+", default=["attention", "hybrid"], choices=["attention", "hybrid"])
    ap.add_argument("--model-root", default=os.environ.get("PD_TEST_MODEL_ROOT", str(ROOT / ".artifacts" / "models")))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, help="runs per configuration; per hook the fastest is kept (default 2)")
    ap.add_argument(
        "--log-level",
        default="INFO",
        help="level of vLLM's and our loggers during the runs; records go to /dev/null, so their "
        "formatting is counted as in a server at vLLM's default INFO level (default INFO)",
    )
    ap.add_argument(
        "--no-quiet-rerun",
        dest="quiet_rerun",
        action="store_false",
        help="skip the extra D run at log level WARNING (which isolates the cost of our INFO lines)",
    )
    args = ap.parse_args(argv)
    args.requests = args.requests or (200 if args.quick else 1000)
    args.repeat = args.repeat or (1 if args.quick else 2)
    blocks_per_req = -(-(args.prompt_len + args.max_tokens) // 16) + 4
    args.num_blocks = args.requests * blocks_per_req + 64
    max_model_len = max(1024, args.prompt_len + args.max_tokens + 16)

    t_start = time.monotonic()
    print(f"bench_scheduler: {args.requests} requests x {args.prompt_len} tokens, load {os.getloadavg()[0]:.1f}; importing vLLM...", flush=True)
    import logging

    import harness  # tests/vllm/harness.py
    from pd_connector.testing.tiny_models import build_model

    devnull = open(os.devnull, "w")
    sink = logging.StreamHandler(devnull)
    sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.getLogger("vllm").handlers = [sink]
    logging.getLogger("vllm.pd_connector").handlers = []

    def set_level(level: str) -> None:
        for name in ("vllm", "vllm.pd_connector"):
            logging.getLogger(name).setLevel(getattr(logging, level.upper()))

    set_level(args.log_level)
    patch_harness(harness, max_num_seqs=args.requests + 16, max_model_len=max_model_len)
    model_dir = str(build_model("llama", Path(args.model_root)))
    OVERHEAD_NS = calibrate_overhead()
    print(f"vLLM imported in {time.monotonic() - t_start:.0f} s; timer overhead {OVERHEAD_NS:.0f} ns/call (subtracted)", flush=True)

    prompts = make_prompts(args.requests, args.prompt_len, args.seed)
    results = []
    for cfg in args.configs:
        groups = ("attention",) if cfg == "attention" else ("attention", "mamba")
        p_runs, d_runs = [], []
        for rep in range(args.repeat):
            p_res, p_params = run_p(harness, model_dir, groups, prompts, args)
            p_runs.append(p_res)
            print(f"  P {cfg} #{rep + 1}: {p_res['connector_us_per_request']:.1f} us/request in our hooks, "
                  f"{p_res['vllm_us_per_request']:.1f} in vLLM ({p_res['wall_s']:.1f} s)", flush=True)
            d_res = run_d(harness, model_dir, groups, prompts, p_params, args)
            d_runs.append(d_res)
            print(f"  D {cfg} #{rep + 1}: {d_res['connector_us_per_request']:.1f} us/request in our hooks, "
                  f"{d_res['vllm_us_per_request']:.1f} in vLLM ({d_res['wall_s']:.1f} s)", flush=True)
            gc.collect()
        results.append(fastest(p_runs))
        results.append(fastest(d_runs))
        if args.quiet_rerun and args.log_level.upper() != "WARNING":
            # The same D workload with per-request INFO records off: what logging costs.
            set_level("WARNING")
            quiet = []
            for rep in range(args.repeat):
                quiet.append(run_d(harness, model_dir, groups, prompts, p_params, args))
                quiet[-1]["log_level"] = "WARNING"
                gc.collect()
            set_level(args.log_level)
            results.append(fastest(quiet))
            print(f"  D {cfg} at WARNING: {results[-1]['connector_us_per_request']:.1f} us/request in our hooks", flush=True)

    print(f"\n== scheduler-side cost, {args.requests} concurrent requests, ~{args.prompt_len}-token prompts ==")
    print("per hook: us per request (calls), fastest of --repeat runs; vLLM own = add_request + schedule +")
    print(f"update_from_output minus our hooks; logging at {args.log_level} into /dev/null\n")
    table = print_tables(results)
    os.makedirs(args.out, exist_ok=True)
    report = {
        "environment": {
            "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
            "timer_overhead_ns": OVERHEAD_NS,
            "argv": sys.argv,
            "device": args.device,
        },
        "args": vars(args),
        "results": results,
        "table": table,
        "wall_s": time.monotonic() - t_start,
    }
    jp, pp = os.path.join(args.out, "bench_scheduler.json"), os.path.join(args.out, "bench_scheduler.png")
    with open(jp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    try:
        plot(results, pp)
    except Exception as exc:
        print(f"plot failed: {exc}")
    print(f"\nwrote {jp} and {pp} ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
