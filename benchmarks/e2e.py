"""End to end on vLLM CPU: pd_connector with zero replay and with replay, vLLM's NixlConnector,
and aggregated serving; same model, same prompts, ratios from the same run.

Two P/D deployments run side by side (four vLLM CPU servers, the most the 2-core box is meant
to hold): P and D with ``PDConnector``, and P and D with vLLM's ``NixlConnector``
(``"kv_buffer_device":"cpu"``, per-instance ``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``). Four systems
are measured on them:

  zero replay   the pd_connector pair behind ``pd-connector proxy`` (default ``--resume
                first-token``): P computes the whole prompt and samples the first token, which
                the client gets at once; D loads all N tokens and computes one (that token)
  replay        the same pair behind a second proxy with ``--resume replay``: P computes N - 1
                tokens, D loads them, recomputes the last prompt token and samples the first
  NixlConnector its pair behind a proxy with ``--resume replay`` (vLLM's toy-proxy flow: it
                sends P the toy proxy's fields and forwards P's ``kv_transfer_params`` to D
                opaquely, which is all NixlConnector needs; it has no zero replay)
  aggregated    the same request straight to the pd_connector pair's P without
                ``kv_transfer_params``: a kv_producer serves it as an aggregated server does

Same model, flags and placement for all four servers (``rig/placement.cpu_binds``:
unpinned, one OpenMP thread each, on a 2-core box; vLLM's NixlConnector pins its own worker
thread). Every prompt (a new one per round and length, so no prefix cache ever hits; with prefix
caching on, each system's request also carries its own ``cache_salt``, as the three pd_connector
systems share P and D) goes to every system, one request at a time: the two deployments alternate
which goes first (A B, B A, ...) and the pd_connector deployment's three systems rotate
(``e2e_report.request_order``), so drift on the shared box hits all alike. With ``--isolate``
(the default) the deployment not serving is stopped (SIGSTOP on its process groups, its proxies
with its servers) for the request, so neither deployment's idle spinning or trouble (a
NixlConnector handshake retrying for seconds) lands in the other's figures.

Per request, measured by this client (streaming ``/v1/completions``, through the system's proxy
or straight to P):
  TTFT     send -> the first generated token's chunk
  token 2  send -> the second token's (with zero replay: D's first token)
  ITL      (last token's arrival - first's) / (tokens - 1); tokens counted from each chunk's
           ``token_ids`` (``return_token_ids``): on a loaded box vLLM merges tokens into one chunk
  total    send -> ``[DONE]``
with whether the output is aggregated serving's: its token ids (``same_ids``; else
``diverged_at``, the first differing token's index) and its text (``same_text``). Around each
request this client reads the serving deployment's P and D ``/metrics`` (sum and count of
``SERIES``, and ``vllm:prompt_tokens_by_source`` of both), kept as per-request deltas in its
record: D's loaded and computed prompt tokens, P's computed ones and P's prefill time per
request, and the handoff figures (D's TTFT, queue, inter-token latency,
``vllm:pd_transfer/claim/read_seconds`` or ``vllm:nixl_xfer_time_seconds``, bytes read) per
system, which a snapshot around the whole run could not separate for systems sharing a
deployment. The handoff accounting splits "P done ->
D's first token" as the client sees it (D's first token's arrival - P's e2e latency) into the
proxy's hops (outside D) and D's TTFT: the transfer (claim, the wait for D's engine step, READ)
and the rest (intake, one forward, output).

With ``--prefix-caching``: the tiny Qwen3-Next GDN hybrid (bf16, the only dtype its CPU kernels
run; ``--enable-prefix-caching``, i.e. Mamba align mode; max_model_len 2048) on all four servers,
at lengths around the Mamba block B that vLLM picks (read from D's ``vllm:cache_config_info``
after start-up: B-1, B, B+1, 2B-1, 2B+1, 3B+1 and two off the grid, unless ``--lengths``).

  python -m benchmarks e2e --quick     # one hybrid, 3 lengths x 3 rounds (~10 min on 2 loaded cores)
  python -m benchmarks e2e             # tiny Nemotron-H hybrid and llama, 5 lengths x 8 rounds
  python -m benchmarks e2e --models nemotron_h --lengths 16 64 400 900 --rounds 8 --max-tokens 16
  python -m benchmarks e2e --prefix-caching --rounds 2   # Qwen3-Next, prefix caching, 8 lengths

Start it under ``flock /tmp/pd-e2e.lock`` on a shared box (it starts vLLM servers). The
deployments and the streaming client live in ``e2e_servers``, figures and tables in ``e2e_report``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.e2e_report import (
    CONNECTOR,
    DEPLOYMENT,
    HANDOFF_SYSTEMS,
    LABEL,
    SYSTEMS,
    accounting_rows,
    accounting_table,
    first_difference,
    handoff_from_records,
    handoff_table,
    latency_tables,
    plot,
    prefill_rows,
    prefill_table,
    prefix_caching_lengths,
    request_order,
    summarize,
    token_deltas,
    token_rows,
    token_table,
)
from benchmarks.e2e_servers import Deployment, send
from rig.placement import cpu_binds
from pd_connector.urls import OPENER

# --prefix-caching: the one hybrid whose CPU kernels run Mamba align mode (Mamba2's SSD kernel
# crashes in it, docs/testing.md); its GDN runs only in bf16 on vLLM CPU.
PREFIX_CACHING_MODEL = "qwen3_next_mtp"
PREFIX_CACHING_ARGS = ["--enable-prefix-caching"]
PREFIX_CACHING_DTYPE = "bfloat16"
PREFIX_CACHING_MAX_MODEL_LEN = 2048

# The proxies in front of each deployment, by system: pd_connector's P and D get the default
# (zero replay) proxy and a replay one; NixlConnector's, which has no zero replay, the standard
# flow. Aggregated serving is the pd_connector deployment's P itself.
PROXIES = {
    "pd": {"pd": [], "replay": ["--resume", "replay"]},
    "nixl": {"nixl": ["--resume", "replay"]},
}
URL_NAME = {"pd": "pd", "replay": "replay", "nixl": "nixl", "agg": "prefill"}
# The second accounting table's quantile: on a shared box a few requests wait seconds for a core
# and move the medians; the lower quartile shows what the handoff costs when it does not.
QUIET_QUANTILE = 0.25


# Prometheus series read around every measured request (sum and count of each), and before and
# after the run with their buckets (the JSON only).
SERIES = {
    "decode": [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:pd_transfer_seconds",
        "vllm:pd_claim_seconds",
        "vllm:pd_read_seconds",
        "vllm:pd_transfer_bytes",
        "vllm:nixl_xfer_time_seconds",
    ],
    "prefill": [
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:pd_claim_held_seconds",
    ],
}


PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_SOURCE = re.compile(r'(?:^|,)source="([^"]*)"')


def read_server(server, role: str) -> dict[str, Any]:
    """One ``/metrics`` read of a server in one pass: ``series`` = sum and count of ``SERIES[role]``
    as ``<role>:<name>_sum|count`` (summed over label sets), ``tokens`` = its cumulative prompt
    tokens per source (a series or source not exported is absent)."""
    with OPENER.open(server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode("utf-8", "replace")
    wanted = {f"{name}_{part}": f"{role}:{name}_{part}" for name in SERIES[role] for part in ("sum", "count")}
    series: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not (m := _SAMPLE.match(line)):
            continue
        name, value = m.group(1), float(m.group(3))
        if name in wanted:
            series[wanted[name]] = series.get(wanted[name], 0.0) + value
        elif name == PROMPT_TOKENS and (src := _SOURCE.search(m.group(2) or "")):
            tokens[src.group(1)] = tokens.get(src.group(1), 0.0) + value
    return {"series": series, "tokens": tokens}


def read_request(dep: Deployment, system: str) -> dict[str, dict]:
    """The serving deployment's P, and D unless ``system`` is aggregated serving (P alone)."""
    out = {"prefill": read_server(dep.prefill, "prefill")}
    if system != "agg":
        out["decode"] = read_server(dep.decode, "decode")
    return out


def request_counted(system: str, before: dict, after: dict, n: int) -> bool:
    """Whether the servers' counters hold the request: vLLM's API server records a step's stats
    after handing its outputs on (metrics/loggers.py), so the stream can end first. Waits for
    P's e2e count and its prompt tokens (N - 1 with replay), and on D for its e2e count, the
    connector's transfer and the N tokens of its prompt; a series not exported is not waited for."""

    def grew(role: str, key: str) -> bool:
        b, a = before[role]["series"].get(key), after[role]["series"].get(key)
        return b is None or a is None or a - b >= 1

    def tokens(role: str, at_least: int) -> bool:
        b, a = before[role]["tokens"], after[role]["tokens"]
        return not a or sum(a.get(k, 0.0) - b.get(k, 0.0) for k in a) >= at_least

    done = grew("prefill", "prefill:vllm:e2e_request_latency_seconds_count") and tokens("prefill", n - 1)
    if system != "agg":
        transfer = "vllm:pd_transfer_seconds" if CONNECTOR[system] == "pd" else "vllm:nixl_xfer_time_seconds"
        done = (done and grew("decode", "decode:vllm:e2e_request_latency_seconds_count")
                and grew("decode", f"decode:{transfer}_count") and tokens("decode", n))  # fmt: skip
    return done


def read_request_after(dep: Deployment, system: str, before: dict, n: int, timeout_s: float = 5.0) -> tuple[dict, bool]:
    """``read_request`` once the request is in the counters (``request_counted``), or whatever
    is there after ``timeout_s`` (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = read_request(dep, system)
        if request_counted(system, before, after, n):
            return after, True
        if time.monotonic() > deadline:
            return after, False
        time.sleep(0.05)


def request_deltas(before: dict, after: dict) -> dict[str, Any]:
    """Record fields from two ``read_request`` readings: ``metrics`` (every series' sum and count
    delta) and the prompt tokens per source of D (``d_<source>``) and P (``p_<source>``)."""
    metrics: dict[str, float] = {}
    out: dict[str, Any] = {"metrics": metrics}
    for role, prefix in (("prefill", "p"), ("decode", "d")):
        if role not in after:
            continue
        b, a = before[role], after[role]
        metrics.update({k: a["series"][k] - b["series"][k] for k in a["series"] if k in b["series"]})
        out.update(token_deltas(b["tokens"], a["tokens"], prefix))
    return out


def snapshot(dep: Deployment) -> dict[str, float | None]:
    from rig.prometheus import parse_metric, parse_metric_labels

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


def measure(deps: dict[str, Deployment], system: str, prompt: list[int], args, errors: list[dict],
            salt: str | None) -> dict[str, Any]:  # fmt: skip
    """One measured request of ``system``: its deployment resumed (the other paused with
    ``--isolate``), the counters read, the gap slept, the request timed, the counters read
    again. The record's fields: the client's timings and text, the metric deltas, whether the
    request was sent twice (``retried``) and whether the counters held it in time."""
    dep = deps[DEPLOYMENT[system]]
    if args.isolate:
        for name, d in deps.items():
            (d.resume if name == DEPLOYMENT[system] else d.pause)()
    before = read_request(dep, system)
    # vLLM CPU workers spin (sched_yield) for ~1 s after their last step (shm_broadcast.py
    # SpinCondition): let the previous request's go quiet first, so each request runs on a box
    # no other system is still burning.
    time.sleep(args.gap_s)
    failed_before = len(errors)
    out = send(dep.urls[URL_NAME[system]], prompt, args.max_tokens, errors, system, salt)
    after, counted = read_request_after(dep, system, before, len(prompt))
    # Sent twice: the deltas cover both sends (the token and accounting tables leave it out).
    return {**out, **request_deltas(before, after), "retried": len(errors) > failed_before, "counted": counted}


def prefix_caching_on(dep: Deployment) -> bool:
    return str(dep.decode.cache_config().get("enable_prefix_caching", "")).lower() == "true"


# Long: one deployment's life: start, warm-up, the measured rounds, the snapshots, the stop.
def run_model(kind: str, args, log_root: Path) -> dict[str, Any]:
    from rig.cpu_matrix import CPU_MODELS, random_prompt
    from rig.servers import start_many
    from rig.tiny_models import build_model

    model = str(build_model(kind, Path(args.model_root)))
    log_dir = log_root / kind
    log_dir.mkdir(parents=True, exist_ok=True)
    placement = cpu_binds(2 * len(PROXIES))  # all four servers run at once
    if args.prefix_caching:
        server_args, dtype = PREFIX_CACHING_ARGS, PREFIX_CACHING_DTYPE
    else:
        server_args, dtype = list(CPU_MODELS[kind]), "float32"
    deps = {
        d: Deployment(d, model, server_args, log_dir, args.max_model_len, placement[2 * i : 2 * i + 2], dtype)
        for i, d in enumerate(PROXIES)
    }
    lengths, block_sizes = args.lengths, {}
    t0 = time.monotonic()
    try:
        start_many([srv for d in deps.values() for srv in (d.prefill, d.decode)], timeout=900)
        for name, d in deps.items():
            d.start_proxies(PROXIES[name])
        started = time.monotonic() - t0
        print(f"[{kind}] 4 servers and 3 proxies up in {started:.0f} s (logs {log_dir})", flush=True)
        if args.prefix_caching:
            block_sizes = {d: int(deps[d].decode.cache_config()["block_size"]) for d in deps}
            lengths = lengths or prefix_caching_lengths(block_sizes["pd"])
            print(f"[{kind}] D's block size (Mamba align block) {block_sizes}; lengths {lengths}", flush=True)
            if max(lengths) + args.max_tokens > args.max_model_len:
                raise RuntimeError(f"the longest prompt {max(lengths)} plus {args.max_tokens} tokens does not "
                                   f"fit max_model_len {args.max_model_len}")  # fmt: skip
        salted = prefix_caching_on(deps["pd"])
        # Warm-up, not timed: handshakes (NIXL agents, side channels), first-use paths. A failure
        # here is kept in the JSON (e.g. NixlConnector's first handshake timing out on a loaded
        # box fails that request under its kv_load_failure_policy=fail) and the request is sent
        # once more, as in the measured rounds.
        warmup_errors: list[dict] = []
        for i, n in enumerate((max(lengths), min(lengths))):
            for s in SYSTEMS:
                salt = f"warm-{s}-{i}" if salted else None
                send(deps[DEPLOYMENT[s]].urls[URL_NAME[s]], random_prompt(n, seed=10_000 + i), args.max_tokens,
                     warmup_errors, s, salt)  # fmt: skip
        before = {d: snapshot(deps[d]) for d in deps}
        records: list[dict] = []
        errors: list[dict] = []
        for rnd in range(args.rounds):
            for i, n in enumerate(lengths):
                prompt = random_prompt(n, seed=rnd * 1000 + i)
                order = request_order(rnd + i)
                recs = {}
                for s in order:
                    salt = f"{s}-{rnd}-{i}" if salted else None
                    out = measure(deps, s, prompt, args, errors, salt)
                    recs[s] = {"model": kind, "system": s, "round": rnd, "prompt_len": n, "first": s == order[0],
                               "position": order.index(s), **out}  # fmt: skip
                for s in order:
                    diverged = None if s == "agg" else first_difference(recs[s], recs["agg"])
                    recs[s].update(same_ids=None if s == "agg" else diverged is None, diverged_at=diverged,
                                   same_text=None if s == "agg" else recs[s]["text"] == recs["agg"]["text"])  # fmt: skip
                    records.append(recs[s])
            line = "  ".join(
                f"{s} {statistics.median(r['ttft_s'] for r in records if r['system'] == s and r['round'] == rnd) * 1e3:.0f} ms"
                for s in SYSTEMS
            )
            print(f"[{kind}] round {rnd + 1}/{args.rounds}: median TTFT {line}", flush=True)
        for d in deps.values():
            d.resume()
        after = {d: snapshot(deps[d]) for d in deps}
    finally:
        for d in deps.values():
            d.close()
    return {
        "model": kind,
        "lengths": lengths,
        "block_size": block_sizes or None,
        "cache_salt": salted,
        "startup_s": started,
        "records": records,
        "handoff": {s: handoff_from_records(records, s) for s in HANDOFF_SYSTEMS},
        "errors": errors,
        "warmup_errors": warmup_errors,
        "metrics_before": before,
        "metrics_after": after,
    }


def parse_args(argv):
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks e2e", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=".artifacts/bench/", help="folder for e2e.json / e2e.png and the server logs")
    ap.add_argument("--quick", action="store_true", help="nemotron_h only, lengths 64 400 900, 3 rounds, 8 tokens")
    ap.add_argument("--models", nargs="+", choices=["nemotron_h", "llama", "granite_hybrid"])
    ap.add_argument("--lengths", type=int, nargs="+",
                    help="prompt lengths in tokens (default 64 128 256 512 900; with --prefix-caching B-1, B, B+1, "
                         "B+B//4+5, 2B-B//3, 2B-1, 2B+1, 3B+1 for D's Mamba block B)")
    ap.add_argument("--rounds", type=int, help="prompts per length, each sent to every system (default 8)")
    ap.add_argument("--max-tokens", type=int, help="tokens generated per request (default 16; --quick 8)")
    ap.add_argument("--max-model-len", type=int,
                    help=f"default 1024; {PREFIX_CACHING_MAX_MODEL_LEN} with --prefix-caching")
    ap.add_argument("--prefix-caching", action="store_true",
                    help=f"{PREFIX_CACHING_MODEL} (bf16) with --enable-prefix-caching on all four servers, lengths "
                         "around D's Mamba block B (unless --lengths); every request carries its own cache_salt")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="SIGSTOP the other deployment (servers and proxies) while one serves a request "
                         "(default on: on a small box each deployment's idle processes and failures otherwise "
                         "slow the other's requests; --no-isolate runs both side by side; the systems of one "
                         "deployment are never paused against each other)")
    ap.add_argument("--gap-s", type=float, default=1.5,
                    help="pause before each request (default 1.5: past vLLM CPU's 1 s post-step spin)")
    ap.add_argument("--model-root", default=os.environ.get("PD_TEST_MODEL_ROOT", ".artifacts/models"))
    ap.add_argument("--from-json", metavar="PATH",
                    help="print the tables again from a run's e2e.json (starts nothing, writes nothing)")
    args = ap.parse_args(argv)
    if args.from_json:
        return args
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


# Long: the report: every table, printed with its legend.
def print_report(args, runs: list[dict]) -> dict[str, Any]:
    """Print every table over ``runs`` with its legend; returns the rows and tables for the JSON."""
    lengths = args.lengths or runs[0]["lengths"]  # --prefix-caching: one model, lengths from its block
    rows = summarize(runs, lengths)
    records = [r for run in runs for r in run["records"]]
    title = (f"P/D end to end on vLLM CPU: zero replay, replay, NixlConnector, aggregated; "
             f"{args.rounds} prompts per length, {args.max_tokens} tokens")  # fmt: skip
    lat, hand = latency_tables(rows), handoff_table(runs)
    acc_rows, tok_rows, pre_rows = accounting_rows(records, lengths), token_rows(records, lengths), prefill_rows(records, lengths)
    quiet_rows = accounting_rows(records, lengths, QUIET_QUANTILE)
    acc, quiet, tok, pre = accounting_table(acc_rows), accounting_table(quiet_rows), token_table(tok_rows), prefill_table(pre_rows)
    print(f"\n== {title} ==\nmedian / p90 over the measured requests (warm-up excluded), ms; zero = pd_connector "
          "zero replay (default proxy), replay = the same P/D behind a --resume replay proxy, nixl = NixlConnector, "
          "agg = the same request straight to the pd_connector P (aggregated); x/agg and zero/replay = ratios of "
          "medians\n")  # fmt: skip
    print("time to first token (send -> first token's chunk)\n" + lat["ttft"])
    print("\ninter-token latency ((last token's arrival - first's) / (tokens - 1)); token 2 at = send -> second "
          "token (median)\n" + lat["itl"])  # fmt: skip
    print("\ntotal (send -> [DONE]); same ids / same text = outputs whose token ids / text equal aggregated "
          "serving's\n" + lat["total"])  # fmt: skip
    print("\nhandoff, from the servers' metrics (means of per-request deltas): overhead = D TTFT - D inter-token "
          "latency (P done -> D's first\ntoken, less one decode step); transfer = the connector's own figure "
          "(pd_connector: claim -> READ done; NixlConnector: its READ); claim = D's\nclaim round trip; P held = "
          "claims P held for their lease (count); READ = the READ alone; KiB read = vllm:pd_transfer_bytes\n")  # fmt: skip
    print(hand)
    print("\nwhere P done -> D's first token goes (medians per request, ms): D's 1st at client = when D's first "
          "token reached the\nclient (zero replay: the second token; replay, nixl: the first); P done -> D's 1st = "
          "that - P's e2e (vllm:e2e_request_latency on P);\noutside D = that - D TTFT (the proxy's hops); D TTFT "
          "(arrival on D -> D's first token) = transfer (claim + step wait + READ; step wait =\nthe wait for D's "
          "engine step) + D rest (intake, one forward, output); D queue and D prefill = vLLM's intervals on D\n")  # fmt: skip
    print(acc)
    print(f"\nthe same, lower quartile (p{QUIET_QUANTILE * 100:.0f}) of each figure on its own: the quieter requests "
          "on a shared box\n")  # fmt: skip
    print(quiet)
    print("\nprompt tokens per request, medians, from vllm:prompt_tokens_by_source deltas: D prompt = all of D's "
          "sources (zero replay:\nN + 1, P's prompt plus its first token), loaded from P = external_kv_transfer, "
          "D computed = local_compute, D cache hit =\nlocal_cache_hit, share = D computed / N; P computed = P's "
          "local_compute (replay: P stops at N - 1)\n")  # fmt: skip
    print(tok)
    print("\nP's prefill per request (vllm:request_prefill_time_seconds on P, median ms) and the tokens it computed; "
          "zero replay's P\ncomputes the whole prompt, replay's stops at N - 1 (no extra stop: P samples one token "
          "in both)\n")  # fmt: skip
    print(pre)
    for run in runs:
        print_exceptions(run)
    return {"title": title, "summary": rows, "latency_tables": lat, "handoff_table": hand, "accounting_rows": acc_rows,
            "accounting_table": acc, "quiet_accounting_rows": quiet_rows, "quiet_accounting_table": quiet,
            "token_rows": tok_rows, "token_table": tok, "prefill_rows": pre_rows, "prefill_table": pre}  # fmt: skip


def print_exceptions(run: dict) -> None:
    """Requests sent twice, outputs other than aggregated serving's, counters that lagged."""
    if run["errors"]:
        print(f"\n{run['model']}: {len(run['errors'])} request(s) failed once and were sent again: "
              + "; ".join(f"{e['system']} n={e['prompt_len']}: {e['error']}" for e in run["errors"]))
    diverged = [r for r in run["records"] if r.get("diverged_at") is not None]
    if diverged:
        print(f"\n{run['model']}: {len(diverged)} output(s) differ from aggregated serving's: "
              + ", ".join(f"{LABEL[r['system']]} n={r['prompt_len']} round {r['round']} from token {r['diverged_at']}"
                          for r in diverged))  # fmt: skip
    text_only = [r for r in run["records"] if r.get("same_ids") and r.get("same_text") is False]
    if text_only:
        print(f"\n{run['model']}: {len(text_only)} output(s) with aggregated serving's token ids but another text: "
              + ", ".join(f"{LABEL[r['system']]} n={r['prompt_len']} round {r['round']}" for r in text_only))
    late = [r for r in run["records"] if not r.get("counted", True)]
    if late:
        print(f"\n{run['model']}: {len(late)} request(s) not complete in the servers' counters 5 s after the "
              "stream ended: " + ", ".join(f"{LABEL[r['system']]} n={r['prompt_len']}" for r in late))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        for key in ("lengths", "rounds", "max_tokens"):
            setattr(args, key, data["args"][key])
        print_report(args, data["runs"])
        return 0
    t_start = time.monotonic()
    print(f"bench e2e: models {args.models}, lengths {args.lengths}, {args.rounds} rounds, {args.max_tokens} tokens, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    log_root = Path(args.out) / "e2e-logs"
    runs = [run_model(kind, args, log_root) for kind in args.models]
    tables = print_report(args, runs)
    title, rows = tables.pop("title"), tables["summary"]
    paths = report.write(
        args.out,
        "e2e",
        {"benchmark": "e2e", "environment": report.environment(), "args": vars(args), "runs": runs, **tables,
         "wall_s": time.monotonic() - t_start},  # fmt: skip
        lambda path: plot(rows, path, title),
    )
    print(f"\nwrote {', '.join(paths)} ({time.monotonic() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
