"""Scheduler-side cost of pd_connector: microseconds per request in our hooks vs vLLM's own.

vLLM's real in-process ``Scheduler`` (``rig.scheduler_harness``: no engine,
no worker, no GPU) runs ``--requests`` concurrent requests (all added before the first step)
end to end, for each prompt length in ``--prompt-lens``:

  P (kv_producer)  add all requests with ``do_remote_decode`` -> prefill in chunks -> each
                   finishes after its prefill (request_finished leases the blocks) -> the
                   worker's ``finished_sending`` is fed back one step later, freeing the blocks.
  D (kv_consumer)  add all requests with the kv_transfer_params the P run really returned ->
                   admission parks them in WAITING_FOR_REMOTE_KVS (get_num_new_matched_tokens,
                   update_state_after_alloc) -> ``finished_recving`` one step later -> recompute
                   the tail and decode ``--max-tokens`` tokens -> finish.

Every ``SchedulerSide`` method (our logic) and every ``PDConnector`` method vLLM's Scheduler
calls that does not delegate to it is wrapped with a timer reading the thread's CPU clock (the
figure reported: what the hook costs the scheduler thread, immune to preemption on a shared
box) and the wall clock (in the JSON and the table's "wall" column); the timer's own bias,
calibrated on an empty method, is subtracted. vLLM's own cost is the CPU time of
``add_request`` + ``schedule`` + ``update_from_output`` minus the time inside our hooks, in the
same run (``scheduler_timing``; tables and plot: ``scheduler_report``). The heap is collected
and frozen before each timed run, as vLLM's server does after startup (``freeze_gc_heap``).
Configurations (``configs()``): ``attention`` (one attention group, 16-token blocks: the GPU
default); ``hybrid`` (attention + Mamba, laid out as vLLM lays out a Nemotron-H-8B-like model:
the attention block size raised until its page holds a Mamba state, one Mamba block per request
with prefix caching off); ``hybrid-b16`` (the same groups at 16-token blocks everywhere, a
stress case vLLM never builds for a hybrid: 256 blocks per group at 4k tokens). Each (configuration,
length) runs ``--repeat`` times; the run with the smallest connector total is reported (noise
on a shared box only adds time), every run is kept in the JSON. Loggers run at ``--log-level``
(vLLM's default INFO) into /dev/null, so a per-request log record is counted as a server pays it.

  python -m benchmarks scheduler                 # 1,000 requests, 128/1024/4096-token prompts
  python -m benchmarks scheduler --quick         # 200 requests, 1k-token prompts (~1 min)
  python -m benchmarks scheduler --profile       # + cProfile of one D run, our functions first
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import report
from benchmarks.scheduler_report import TARGET_US, best_run, plot, print_profile, table
from benchmarks.scheduler_timing import (
    Driver,
    Timers,
    calibrate,
    frozen_heap,
    gc_accounting,
    instrument,
    summarize,
)


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1_000_003 + length)
    # Distinct prompts (no accidental prefix sharing), token ids inside the tiny vocab.
    return [[rng.randrange(10, 500) for _ in range(length)] for _ in range(n)]


@dataclass(frozen=True)
class Config:
    name: str
    groups: tuple[str, ...]
    block_size: int
    mamba_block_size: int | None = None  # None: block_size; 0: max_model_len (one per request)


def _hybrid_block_size() -> int:
    """The attention block size vLLM gives a Nemotron-H-8B-like model (16-token kernel blocks
    raised until an attention page holds a Mamba2 state: ``transfer_shapes.hybrid_block_size``,
    cross-checked against vLLM by ``bench transfer --check-vllm``)."""
    from benchmarks.transfer_shapes import MODELS, hybrid_block_size

    return hybrid_block_size(MODELS["nemotron-h"], 16)


def configs() -> dict[str, Config]:
    return {
        "attention": Config("attention", ("attention",), 16),
        "hybrid": Config("hybrid", ("attention", "mamba"), _hybrid_block_size(), 0),
        "hybrid-b16": Config("hybrid-b16", ("attention", "mamba"), 16),
    }


def _scheduler(harness, model_dir, role, cfg: Config, length, args):
    blocks_per_req = -(-(length + args.max_tokens) // cfg.block_size) + 4
    max_model_len = max(1024, length + args.max_tokens + 16)
    return harness.make_scheduler(
        model_dir,
        role,
        groups=cfg.groups,
        block_size=cfg.block_size,
        mamba_block_size=max_model_len if cfg.mamba_block_size == 0 else cfg.mamba_block_size,
        max_num_batched_tokens=max(args.batch_tokens, length),
        num_blocks=args.requests * blocks_per_req + 64,
        max_num_seqs=args.requests + 16,
        max_model_len=max_model_len,
    )


def run_p(harness, model_dir, cfg: Config, prompts, args, cal: dict):
    from vllm.v1.outputs import KVConnectorOutput

    timers = Timers()
    s = _scheduler(harness, model_dir, "kv_producer", cfg, len(prompts[0]), args)
    instrument(s, timers)
    d = Driver(s)
    reqs = [
        harness.make_request(p, {"do_remote_decode": True}, max_tokens=args.max_tokens, block_size=s.hash_block_size)
        for p in prompts
    ]
    params: dict[str, dict] = {}
    with frozen_heap(), gc_accounting(timers):
        t0 = time.perf_counter_ns()
        for r in reqs:
            d.add(r)
        to_free: set[str] = set()
        while len(params) < len(reqs) or to_free:
            kv = KVConnectorOutput(finished_sending=to_free) if to_free else None
            _, outs = d.step(kv)
            done = harness.finished_params(outs)
            params.update(done)
            # P's worker reports D done reading one step after the lease went out.
            to_free = {rid for rid, p in done.items() if p and p.get("do_remote_prefill")}
            if d.steps > 20 * len(reqs) + 100:
                raise RuntimeError("P run did not converge")
        wall = time.perf_counter_ns() - t0
    ordered = [params[r.request_id] for r in reqs]
    bad = [(p, len(pr)) for p, pr in zip(ordered, prompts) if not p or p.get("replay_offset") != len(pr) - 1]
    assert not bad, f"unexpected P results, e.g. {bad[:2]}"
    assert not s.connector._scheduler.prefill.offsets, "P kept offsets of finished requests"
    return summarize(timers, d, wall, len(reqs), cal), ordered


def run_d(harness, model_dir, cfg: Config, prompts, p_params, args, cal: dict, profiler=None):
    from vllm.v1.outputs import KVConnectorOutput

    timers = Timers()
    s = _scheduler(harness, model_dir, "kv_consumer", cfg, len(prompts[0]), args)
    instrument(s, timers)
    d = Driver(s)
    reqs = [
        harness.make_request(p, dict(pp), max_tokens=args.max_tokens, block_size=s.hash_block_size)
        for p, pp in zip(prompts, p_params)
    ]
    done_ids: set[str] = set()
    loaded_total = 0
    with frozen_heap(), gc_accounting(timers):
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter_ns()
        for r in reqs:
            d.add(r)
        loading: set[str] = set()
        while len(done_ids) < len(reqs):
            kv = KVConnectorOutput(finished_recving=loading) if loading else None
            loaded_total += len(loading)
            out, outs = d.step(kv)
            loading = set(out.kv_connector_metadata.to_recv)  # the worker finishes each load a step later
            done_ids |= set(harness.finished_params(outs))
            if d.steps > 20 * len(reqs) + 100:
                raise RuntimeError("D run did not converge")
        wall = time.perf_counter_ns() - t0
        if profiler is not None:
            profiler.disable()
    half = s.connector._scheduler
    stats = dict(half.stats)
    # Every request was admitted through P's handoff (none refused, none recomputed locally).
    assert loaded_total == len(reqs) == stats.get("handoff_accepted"), f"{loaded_total} of {len(reqs)} loaded ({stats})"
    assert not half.decode._decisions, "D kept decisions of admitted requests"
    return summarize(timers, d, wall, len(reqs), cal)


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks scheduler", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=".artifacts/bench/", help="folder for scheduler.json / scheduler.png")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="recorded only: the Scheduler does no device work")
    ap.add_argument("--quick", action="store_true", help="200 requests, one prompt length, one run each")
    ap.add_argument("--requests", type=int, help="concurrent requests (default 1000; --quick 200)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", help="default 128 1024 4096 (--quick: 1024)")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens D decodes per request")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--configs", nargs="+", default=["attention", "hybrid", "hybrid-b16"],
                    choices=["attention", "hybrid", "hybrid-b16"], help="see the description (default: all)")
    ap.add_argument("--model-root", default=os.environ.get("PD_TEST_MODEL_ROOT", ".artifacts/models"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, help="runs per (configuration, length); default 3 (--quick 1)")
    ap.add_argument("--log-level", default="INFO", help="vLLM's and our loggers, into /dev/null (default INFO)")
    ap.add_argument("--profile", action="store_true", help="cProfile one extra D run per configuration (longest prompt)")
    args = ap.parse_args(argv)
    args.requests = args.requests or (200 if args.quick else 1000)
    args.prompt_lens = args.prompt_lens or ([1024] if args.quick else [128, 1024, 4096])
    args.repeat = args.repeat or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # Prompts longer than the tiny model's 2,048 positions: only the Scheduler runs, no model.
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    t_start = time.monotonic()
    print(f"bench scheduler: {args.requests} concurrent requests, prompts {args.prompt_lens}, load {os.getloadavg()[0]:.1f}; importing vLLM...", flush=True)
    from rig import scheduler_harness as harness
    from rig.tiny_models import build_model

    # Records are formatted and written as a server at this level would, then discarded.
    sink = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the run
    sink.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.getLogger("vllm").handlers = [sink]
    for name in ("vllm", "vllm.pd_connector"):
        logging.getLogger(name).setLevel(getattr(logging, args.log_level.upper()))

    model_dir = str(build_model("llama", Path(args.model_root)))
    cal = calibrate()
    print(f"ready in {time.monotonic() - t_start:.0f} s; timer bias {cal['cpu']:.0f} ns CPU / {cal['wall']:.0f} ns wall "
          f"per call (subtracted)", flush=True)

    results, profiles = [], {}
    for cfg in (configs()[name] for name in args.configs):
        for length in args.prompt_lens:
            prompts = make_prompts(args.requests, length, args.seed)
            p_runs, d_runs = [], []
            for _ in range(args.repeat):
                p_res, p_params = run_p(harness, model_dir, cfg, prompts, args, cal)
                p_runs.append(p_res)
                d_runs.append(run_d(harness, model_dir, cfg, prompts, p_params, args, cal))
                gc.collect()
            for role, runs in (("P", p_runs), ("D", d_runs)):
                results.append(best_run(runs, config=cfg.name, block_size=cfg.block_size, prompt_len=length, role=role))
                r = results[-1]
                print(f"  {cfg.name:<10} {length:>5} tok {role}: {r['connector_us_per_request']:6.1f} µs/request in our hooks, "
                      f"{r['vllm_us_per_request']:6.0f} in vLLM ({r['wall_s']:.2f} s)", flush=True)
            if args.profile and length == max(args.prompt_lens):
                profiler = cProfile.Profile()
                run_d(harness, model_dir, cfg, prompts, p_params, args, cal, profiler)
                print(f"\n-- cProfile, D {cfg.name} {length} tokens (whole run; our and logging functions) --")
                profiles[cfg.name] = print_profile(profiler)

    title = f"scheduler-side cost, {args.requests} concurrent requests, log level {args.log_level}"
    print(f"\n== {title} ==")
    print("ours = SchedulerSide + PDConnector hooks, CPU time of the scheduler thread (timer bias subtracted);")
    print("vLLM = add_request + schedule + update_from_output minus our hooks, same clock; wall = the same")
    print("hooks by wall clock (includes preemption by other processes); best of --repeat runs by our total\n")
    text = table(results)
    print(text)
    paths = report.write(
        args.out,
        "scheduler",
        {
            "benchmark": "scheduler",
            "environment": {**report.environment(), "timer_calibration_ns": cal, "device": args.device},
            "args": vars(args),
            "target_us_per_request": TARGET_US,
            "results": results,
            "profiles": profiles,
            "table": text,
            "wall_s": time.monotonic() - t_start,
        },
        lambda path: plot(results, path, title),
    )
    print(f"\nwrote {', '.join(paths)} ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
