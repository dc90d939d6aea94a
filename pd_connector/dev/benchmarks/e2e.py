"""End to end on vLLM CPU: pd_connector vs vLLM's NixlConnector, same model, same prompts.

Two P/D deployments run side by side (four vLLM CPU servers, the most the 2-core box is meant
to hold): P and D with ``PDConnector`` behind ``pd-connector proxy``, and P and D with vLLM's
``NixlConnector`` (``"kv_buffer_device":"cpu"``, per-instance
``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``) behind the same proxy: it sends P vLLM's toy-proxy fields
and forwards P's ``kv_transfer_params`` to D opaquely, which is all NixlConnector needs. Same
model, flags and placement on both (``dev/rig/placement.cpu_binds`` for the four: unpinned,
one OpenMP thread each, on a 2-core box; vLLM's NixlConnector pins its own worker thread).
Every prompt (a new one per round and length, so no prefix cache ever hits) goes to both
deployments, one request at a time, alternating which goes first (A B, B A, ...) so drift on
the shared box hits both alike. With ``--isolate`` (the default) the deployment not serving is
stopped (SIGSTOP on its process groups) for the request, so neither system's idle spinning or
trouble (a NixlConnector handshake retrying for seconds) lands in the other's figures.

Per request, measured by this client through the proxy (streaming ``/v1/completions``):
  TTFT   send -> first streamed chunk carrying a generated token
  total  send -> ``[DONE]``
Handoff overhead per deployment, from the servers' own Prometheus series over the measured
requests (warm-up excluded): D's mean TTFT (``vllm:time_to_first_token_seconds``, arrival on
D -> first token: queueing, the KV/state load, recomputing the tail, sampling) minus D's mean
inter-token latency (one decode step ~ recomputing the one-token tail), i.e. what "P done ->
D's first token" costs beyond D's recompute; and the connector's own transfer time
(``vllm:pd_transfer_seconds`` / ``vllm:nixl_xfer_time_seconds``).

With ``--prefix-caching``: the tiny Qwen3-Next GDN hybrid (bf16, the only dtype its CPU kernels
run; ``--enable-prefix-caching``, i.e. Mamba align mode; max_model_len 2048) on all four servers,
at lengths around the Mamba block B that vLLM picks (read from D's ``vllm:cache_config_info``
after start-up: B-1, B, B+1, 2B-1, 2B+1, 3B+1 and two off the grid, unless ``--lengths``). Per
measured request, D's ``vllm:prompt_tokens_by_source`` (local_compute, external_kv_transfer,
local_cache_hit) is read before and after the request and the deltas are kept in its record; a
second table gives, per length, the median tokens D computed itself and loaded from P for both
connectors, and the share of the prompt D computed.

  pd-connector bench e2e --quick     # one hybrid, 3 lengths x 3 rounds (5-9 min on 2 loaded cores)
  pd-connector bench e2e             # tiny Nemotron-H hybrid and llama, 5 lengths x 8 rounds
  pd-connector bench e2e --prefix-caching --rounds 2   # Qwen3-Next, prefix caching, 8 lengths (~10 min)

Start it under ``flock /tmp/pd-e2e.lock`` on a shared box (it starts vLLM servers). The
deployments and the streaming client live in ``e2e_servers``, figures and tables in ``e2e_report``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pd_connector.dev.benchmarks import report
from pd_connector.dev.benchmarks.e2e_report import (
    SYSTEMS,
    TOKEN_SOURCES,
    handoff_figures,
    handoff_table,
    latency_table,
    plot,
    prefix_caching_lengths,
    prefix_caching_rows,
    prefix_caching_table,
    summarize,
    token_deltas,
)
from pd_connector.dev.benchmarks.e2e_servers import Deployment, send
from pd_connector.dev.rig.placement import cpu_binds
from pd_connector.urls import OPENER

# --prefix-caching: the one hybrid whose CPU kernels run Mamba align mode (Mamba2's SSD kernel
# crashes in it, docs/testing.md); its GDN runs only in bf16 on vLLM CPU.
PREFIX_CACHING_MODEL = "qwen3_next_mtp"
PREFIX_CACHING_ARGS = ["--enable-prefix-caching"]
PREFIX_CACHING_DTYPE = "bfloat16"
PREFIX_CACHING_MAX_MODEL_LEN = 2048


# Prometheus series read before and after the measured requests (sum and count of each).
SERIES = {
    "decode": [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:pd_transfer_seconds",
        "vllm:pd_claim_seconds",
        "vllm:pd_read_seconds",
        "vllm:nixl_xfer_time_seconds",
    ],
    "prefill": ["vllm:e2e_request_latency_seconds", "vllm:pd_claim_held_seconds"],
}


PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"


def prompt_tokens(server) -> dict[str, float | None]:
    """D's cumulative prompt tokens per source (None: the series is not exported)."""
    return {source: server.metric(PROMPT_TOKENS, {"source": source}) for source in TOKEN_SOURCES}


def prompt_tokens_after(server, before: dict[str, float | None], n: int, timeout_s: float = 5.0) -> dict:
    """D's counters once the request's n prompt tokens are in them: vLLM's API server counts
    them when the engine's step stats arrive (metrics/loggers.py), not when the stream ends.
    After ``timeout_s`` whatever is there is returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = prompt_tokens(server)
        counted = sum(v for v in token_deltas(before, after).values() if v is not None)
        if counted >= n or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def snapshot(dep: Deployment) -> dict[str, float | None]:
    from pd_connector.dev.rig.prometheus import parse_metric, parse_metric_labels

    out: dict[str, float | None] = {}
    for role, names in SERIES.items():
        server = getattr(dep, role)
        with OPENER.open(server.base_url + "/metrics", timeout=10) as resp:
            text = resp.read().decode("utf-8", "replace")
        for name in names:
            for part in ("sum", "count"):
                out[f"{role}:{name}_{part}"] = parse_metric(text, f"{name}_{part}")
            # Cumulative bucket counts too (the JSON only): a mean cannot tell one slow
            # request from many.
            for labels in parse_metric_labels(text, f"{name}_bucket"):
                le = labels.get("le")
                out[f"{role}:{name}_bucket:{le}"] = parse_metric(text, f"{name}_bucket", {"le": le})
    return out


def run_model(kind: str, args, log_root: Path) -> dict[str, Any]:
    from pd_connector.dev.rig.cpu_matrix import CPU_MODELS, random_prompt
    from pd_connector.dev.rig.servers import start_many
    from pd_connector.dev.rig.tiny_models import build_model

    model = str(build_model(kind, Path(args.model_root)))
    log_dir = log_root / kind
    log_dir.mkdir(parents=True, exist_ok=True)
    placement = cpu_binds(2 * len(SYSTEMS))  # all four run at once
    if args.prefix_caching:
        server_args, dtype = PREFIX_CACHING_ARGS, PREFIX_CACHING_DTYPE
    else:
        server_args, dtype = list(CPU_MODELS[kind]), "float32"
    deps = {
        s: Deployment(s, model, server_args, log_dir, args.max_model_len, placement[2 * i : 2 * i + 2], dtype)
        for i, s in enumerate(SYSTEMS)
    }
    lengths, block_sizes = args.lengths, {}
    t0 = time.monotonic()
    try:
        start_many([srv for d in deps.values() for srv in (d.prefill, d.decode)], timeout=900)
        for d in deps.values():
            d.start_proxy()
        started = time.monotonic() - t0
        print(f"[{kind}] 4 servers and 2 proxies up in {started:.0f} s (logs {log_dir})", flush=True)
        if args.prefix_caching:
            block_sizes = {s: int(deps[s].decode.cache_config()["block_size"]) for s in SYSTEMS}
            lengths = lengths or prefix_caching_lengths(block_sizes["pd"])
            print(f"[{kind}] D's block size (Mamba align block) {block_sizes}; lengths {lengths}", flush=True)
            if max(lengths) + args.max_tokens > args.max_model_len:
                raise RuntimeError(f"the longest prompt {max(lengths)} plus {args.max_tokens} tokens does not "
                                   f"fit max_model_len {args.max_model_len}")  # fmt: skip
        # Warm-up, not timed: handshakes (NIXL agents, side channels), first-use paths. A failure
        # here is kept in the JSON (e.g. NixlConnector's first handshake timing out on a loaded
        # box fails that request under its kv_load_failure_policy=fail) and the request is sent
        # once more, as in the measured rounds.
        warmup_errors: list[dict] = []
        for i, n in enumerate((max(lengths), min(lengths))):
            for s in SYSTEMS:
                send(deps[s].proxy_url, random_prompt(n, seed=10_000 + i), args.max_tokens, warmup_errors, s)
        before = {s: snapshot(deps[s]) for s in SYSTEMS}
        records: list[dict] = []
        errors: list[dict] = []
        for rnd in range(args.rounds):
            for i, n in enumerate(lengths):
                prompt = random_prompt(n, seed=rnd * 1000 + i)
                order = SYSTEMS if (rnd + i) % 2 == 0 else SYSTEMS[::-1]
                outs = {}
                for s in order:
                    if args.isolate:
                        for other in SYSTEMS:
                            (deps[other].resume if other == s else deps[other].pause)()
                    # vLLM CPU workers spin (sched_yield) for ~1 s after their last step
                    # (shm_broadcast.py SpinCondition): let the other deployment's go quiet first,
                    # so each request runs on a box the other system is not still burning.
                    time.sleep(args.gap_s)
                    tokens_before = prompt_tokens(deps[s].decode) if args.prefix_caching else None
                    failed_before = len(errors)
                    outs[s] = send(deps[s].proxy_url, prompt, args.max_tokens, errors, s)
                    records.append({"model": kind, "system": s, "round": rnd, "prompt_len": n,
                                    "first": s == order[0], **{k: v for k, v in outs[s].items() if k != "text"}})  # fmt: skip
                    if tokens_before is not None:
                        tokens_after = prompt_tokens_after(deps[s].decode, tokens_before, n)
                        records[-1].update(token_deltas(tokens_before, tokens_after))
                        # Sent twice: the deltas cover both sends (prefix_caching_rows leaves it out).
                        records[-1]["retried"] = len(errors) > failed_before
                records[-1]["same_text"] = records[-2]["same_text"] = outs["pd"]["text"] == outs["nixl"]["text"]
            line = "  ".join(
                f"{s} {statistics.median(r['ttft_s'] for r in records if r['system'] == s and r['round'] == rnd) * 1e3:.0f} ms"
                for s in SYSTEMS
            )
            print(f"[{kind}] round {rnd + 1}/{args.rounds}: median TTFT {line}", flush=True)
        for d in deps.values():
            d.resume()
        after = {s: snapshot(deps[s]) for s in SYSTEMS}
    finally:
        for d in deps.values():
            d.close()
    return {
        "model": kind,
        "lengths": lengths,
        "block_size": block_sizes or None,
        "startup_s": started,
        "records": records,
        "handoff": {s: handoff_figures(before[s], after[s], s) for s in SYSTEMS},
        "errors": errors,
        "warmup_errors": warmup_errors,
        "metrics_before": before,
        "metrics_after": after,
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="pd-connector bench e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=".artifacts/bench/", help="folder for e2e.json / e2e.png and the server logs")
    ap.add_argument("--quick", action="store_true", help="nemotron_h only, lengths 64 400 900, 3 rounds, 8 tokens")
    ap.add_argument("--models", nargs="+", choices=["nemotron_h", "llama", "granite_hybrid"])
    ap.add_argument("--lengths", type=int, nargs="+",
                    help="prompt lengths in tokens (default 64 128 256 512 900; with --prefix-caching B-1, B, B+1, "
                         "B+B//4+5, 2B-B//3, 2B-1, 2B+1, 3B+1 for D's Mamba block B)")
    ap.add_argument("--rounds", type=int, help="prompts per length, each sent to both deployments (default 8)")
    ap.add_argument("--max-tokens", type=int, help="tokens generated per request (default 16; --quick 8)")
    ap.add_argument("--max-model-len", type=int,
                    help=f"default 1024; {PREFIX_CACHING_MAX_MODEL_LEN} with --prefix-caching")
    ap.add_argument("--prefix-caching", action="store_true",
                    help=f"{PREFIX_CACHING_MODEL} (bf16) with --enable-prefix-caching on all four servers, lengths "
                         "around D's Mamba block B (unless --lengths), and D's prompt tokens by source per "
                         "request (a second table)")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="SIGSTOP the other deployment while one serves a request (default on: on a "
                         "small box each system's idle processes and failures otherwise slow the other's "
                         "requests; --no-isolate runs both side by side)")
    ap.add_argument("--gap-s", type=float, default=1.5,
                    help="pause before each request (default 1.5: past vLLM CPU's 1 s post-step spin)")
    ap.add_argument("--model-root", default=os.environ.get("PD_TEST_MODEL_ROOT", ".artifacts/models"))
    args = ap.parse_args(argv)
    if args.prefix_caching:
        if args.models:
            ap.error(f"--prefix-caching runs {PREFIX_CACHING_MODEL} only; drop --models")
        args.models = [PREFIX_CACHING_MODEL]
        # Lengths (unless given) come from D's Mamba block, known once the servers are up.
        args.max_model_len = args.max_model_len or PREFIX_CACHING_MAX_MODEL_LEN
    else:
        args.models = args.models or (["nemotron_h"] if args.quick else ["nemotron_h", "llama"])
        args.lengths = args.lengths or ([64, 400, 900] if args.quick else [64, 128, 256, 512, 900])
        args.max_model_len = args.max_model_len or 1024
    args.rounds = args.rounds or (3 if args.quick else 8)
    args.max_tokens = args.max_tokens or (8 if args.quick else 16)
    if args.lengths and max(args.lengths) + args.max_tokens > args.max_model_len:
        ap.error("the longest prompt plus --max-tokens must fit --max-model-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    print(f"bench e2e: models {args.models}, lengths {args.lengths}, {args.rounds} rounds, {args.max_tokens} tokens, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    log_root = Path(args.out) / "e2e-logs"
    runs = [run_model(kind, args, log_root) for kind in args.models]
    lengths = args.lengths or runs[0]["lengths"]  # --prefix-caching: one model, lengths from its block
    rows = summarize(runs, lengths)
    title = (f"P/D end to end on vLLM CPU through pd-connector proxy: pd_connector vs NixlConnector, "
             f"{args.rounds} prompts per length, {args.max_tokens} tokens")  # fmt: skip
    lat, hand = latency_table(rows), handoff_table(runs)
    print(f"\n== {title} ==\nmedian / p90 over the measured requests (warm-up excluded); ratio = pd median / nixl median\n")
    print(lat)
    print("\nhandoff, from the servers' metrics (means): overhead = D TTFT - D inter-token latency (P done -> D's first")
    print("token, less D's one-token recompute); transfer = the connector's own figure (pd_connector: claim ->")
    print("READ done; NixlConnector: its READ); claim = D's claim round trip; P held = claims P held for their")
    print("lease (count); READ = the READ alone\n")
    print(hand)
    tokens_rows, tokens = [], None
    if args.prefix_caching:
        tokens_rows = prefix_caching_rows([r for run in runs for r in run["records"]], lengths)
        tokens = prefix_caching_table(tokens_rows)
        print(f"\nprefix caching (D's Mamba block {runs[0]['block_size']}): D's prompt tokens per request, "
              "median over the measured\nrequests, from D's vllm:prompt_tokens_by_source: computed = local_compute, "
              "loaded from P =\nexternal_kv_transfer, cache hit = local_cache_hit; share = computed / prompt\n")
        print(tokens)
    for run in runs:
        if run["errors"]:
            print(f"\n{run['model']}: {len(run['errors'])} request(s) failed once and were sent again: "
                  + "; ".join(f"{e['system']} n={e['prompt_len']}: {e['error']}" for e in run["errors"]))
    paths = report.write(
        args.out,
        "e2e",
        {
            "benchmark": "e2e",
            "environment": report.environment(),
            "args": vars(args),
            "summary": rows,
            "runs": runs,
            "latency_table": lat,
            "handoff_table": hand,
            "prefix_caching_rows": tokens_rows,
            "prefix_caching_table": tokens,
            "wall_s": time.monotonic() - t_start,
        },
        lambda path: plot(rows, path, title),
    )
    print(f"\nwrote {', '.join(paths)} ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
