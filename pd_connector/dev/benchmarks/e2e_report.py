"""Figures, tables and plot of the end-to-end benchmark (``pd_connector.dev.benchmarks.e2e``):
handoff figures from the servers' Prometheus snapshots, per-length latency summaries, the two
tables and the PNG; in the prefix-caching case, the lengths around the Mamba block and D's
prompt tokens by source per request. Pure apart from ``plot`` (matplotlib through
``report.pyplot``)."""

from __future__ import annotations

import statistics
from typing import Any

from pd_connector.dev.benchmarks import report

SYSTEMS = ("pd", "nixl")
LABEL = {"pd": "pd_connector", "nixl": "NixlConnector"}
# D's ``vllm:prompt_tokens_by_source`` labels (vLLM's metrics/stats.py PromptTokenStats): what D
# computed itself, what it loaded through the connector, what its own prefix cache served.
TOKEN_SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")


def mean_delta(before: dict, after: dict, key: str) -> float | None:
    s0, s1 = before.get(f"{key}_sum"), after.get(f"{key}_sum")
    n = _count_delta(before, after, key)
    if s0 is None or s1 is None or n is None or n <= 0:
        return None
    return (s1 - s0) / n


def handoff_figures(before: dict, after: dict, system: str) -> dict[str, float | None]:
    d_ttft = mean_delta(before, after, "decode:vllm:time_to_first_token_seconds")
    d_itl = mean_delta(before, after, "decode:vllm:inter_token_latency_seconds")
    transfer_key = "vllm:pd_transfer_seconds" if system == "pd" else "vllm:nixl_xfer_time_seconds"
    # NixlConnector's series is the READ alone; ours splits claim + READ and the READ alone.
    read_key = "vllm:pd_read_seconds" if system == "pd" else "vllm:nixl_xfer_time_seconds"
    return {
        "d_ttft_ms": _ms(d_ttft),
        "d_itl_ms": _ms(d_itl),
        "handoff_overhead_ms": _ms(d_ttft - d_itl) if d_ttft is not None and d_itl is not None else None,
        "transfer_ms": _ms(mean_delta(before, after, f"decode:{transfer_key}")),
        "read_ms": _ms(mean_delta(before, after, f"decode:{read_key}")),
        # NixlConnector has no claim: its D reads what the params name, unconfirmed.
        "claim_ms": _ms(mean_delta(before, after, "decode:vllm:pd_claim_seconds")) if system == "pd" else None,
        # Of which P held claims that overtook their lease (mean over the held ones only).
        "p_held_ms": _ms(mean_delta(before, after, "prefill:vllm:pd_claim_held_seconds")) if system == "pd" else None,
        "p_held_count": _count_delta(before, after, "prefill:vllm:pd_claim_held_seconds"),
        "d_queue_ms": _ms(mean_delta(before, after, "decode:vllm:request_queue_time_seconds")),
        "d_prefill_ms": _ms(mean_delta(before, after, "decode:vllm:request_prefill_time_seconds")),
        "p_e2e_ms": _ms(mean_delta(before, after, "prefill:vllm:e2e_request_latency_seconds")),
    }


def _held(h: dict) -> str:
    n = h.get("p_held_count")
    if not n:
        return "-" if n is None else "none"  # None: the series is not there (NixlConnector)
    return f"{h['p_held_ms']:.1f} ({n:.0f})"


def _count_delta(before: dict, after: dict, key: str) -> float | None:
    c0, c1 = before.get(f"{key}_count"), after.get(f"{key}_count")
    return None if c0 is None or c1 is None else c1 - c0


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(runs: list[dict], lengths: list[int]) -> list[dict]:
    rows = []
    for run in runs:
        for n in [*lengths, "all"]:
            row: dict[str, Any] = {"model": run["model"], "prompt_len": n}
            for s in SYSTEMS:
                recs = [r for r in run["records"] if r["system"] == s and (n == "all" or r["prompt_len"] == n)]
                for metric in ("ttft_s", "total_s"):
                    xs = [r[metric] for r in recs]
                    row[f"{s}_{metric}_median"] = statistics.median(xs)
                    row[f"{s}_{metric}_p90"] = quantile(xs, 0.9)
                row[f"{s}_n"] = len(recs)
            row["ttft_ratio"] = row["pd_ttft_s_median"] / row["nixl_ttft_s_median"]
            row["total_ratio"] = row["pd_total_s_median"] / row["nixl_total_s_median"]
            recs = [r for r in run["records"] if r["system"] == "pd" and (n == "all" or r["prompt_len"] == n)]
            row["same_text"] = f"{sum(r['same_text'] for r in recs)}/{len(recs)}"
            rows.append(row)
    return rows


def latency_table(rows: list[dict]) -> str:
    headers = ["model", "prompt", "TTFT pd med/p90 ms", "TTFT nixl med/p90 ms", "TTFT pd/nixl",
               "total pd med/p90 ms", "total nixl med/p90 ms", "total pd/nixl", "same text"]  # fmt: skip

    def mp(r, s, m):
        return f"{r[f'{s}_{m}_median'] * 1e3:.0f} / {r[f'{s}_{m}_p90'] * 1e3:.0f}"

    body = [
        [r["model"], r["prompt_len"], mp(r, "pd", "ttft_s"), mp(r, "nixl", "ttft_s"), f"{r['ttft_ratio']:.2f}",
         mp(r, "pd", "total_s"), mp(r, "nixl", "total_s"), f"{r['total_ratio']:.2f}", r["same_text"]]  # fmt: skip
        for r in rows
    ]
    return report.format_table(headers, body)


def handoff_table(runs: list[dict]) -> str:
    headers = ["model", "connector", "handoff overhead ms", "transfer ms", "claim ms", "P held (n) ms", "READ ms",
               "D TTFT ms", "D ITL ms", "D queue ms", "P e2e ms"]

    def f(x):
        return "-" if x is None else f"{x:.1f}"

    body = []
    for run in runs:
        for s in SYSTEMS:
            h = run["handoff"][s]
            body.append([run["model"], LABEL[s], f(h["handoff_overhead_ms"]), f(h["transfer_ms"]), f(h.get("claim_ms")),
                         _held(h),
                         f(h.get("read_ms")),
                         f(h["d_ttft_ms"]),
                         f(h["d_itl_ms"]), f(h["d_queue_ms"]), f(h["p_e2e_ms"])])  # fmt: skip
    return report.format_table(headers, body)


def prefix_caching_lengths(block: int) -> list[int]:
    """Prompt lengths around vLLM's Mamba block ``block`` (the align-mode checkpoint grid), two
    of them off the grid, ascending."""
    b = block
    return sorted({b - 1, b, b + 1, 2 * b - 1, 2 * b + 1, 3 * b + 1, b + b // 4 + 5, 2 * b - b // 3})


def token_deltas(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    """D's prompt tokens per source over one request, as record fields ``d_<source>``; None
    where a source is missing from either reading."""
    out: dict[str, float | None] = {}
    for source in TOKEN_SOURCES:
        t0, t1 = before.get(source), after.get(source)
        out[f"d_{source}"] = None if t0 is None or t1 is None else t1 - t0
    return out


def prefix_caching_rows(records: list[dict], lengths: list[int]) -> list[dict]:
    """Per model and prompt length, per system: the median over the measured requests of D's
    computed tokens, the tokens it loaded from P, its own prefix-cache hits, and the share of the
    prompt D computed (``None`` where no request of that system carries the figures). A request
    sent twice (``retried``) is left out: its deltas count both sends."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        for n in lengths:
            row: dict[str, Any] = {"model": model, "prompt_len": n}
            for s in SYSTEMS:
                recs = [r for r in records if r["model"] == model and r["system"] == s and r["prompt_len"] == n
                        and r.get("d_local_compute") is not None and not r.get("retried")]  # fmt: skip
                row[f"{s}_n"] = len(recs)
                for source, key in (("local_compute", "computed"), ("external_kv_transfer", "loaded"),
                                    ("local_cache_hit", "cache_hit")):  # fmt: skip
                    xs = [r[f"d_{source}"] for r in recs if r.get(f"d_{source}") is not None]
                    row[f"{s}_{key}"] = statistics.median(xs) if xs else None
                row[f"{s}_computed_share"] = statistics.median(r["d_local_compute"] / n for r in recs) if recs else None
            rows.append(row)
    return rows


def prefix_caching_table(rows: list[dict]) -> str:
    headers = ["model", "prompt", "D computed pd", "D computed nixl", "loaded from P pd", "loaded from P nixl",
               "D computed share pd", "D computed share nixl", "D cache hit pd/nixl", "requests pd/nixl"]  # fmt: skip

    def f(x):
        return "-" if x is None else f"{x:.0f}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    body = [
        [r["model"], r["prompt_len"], f(r["pd_computed"]), f(r["nixl_computed"]), f(r["pd_loaded"]),
         f(r["nixl_loaded"]), pct(r["pd_computed_share"]), pct(r["nixl_computed_share"]),
         f"{f(r['pd_cache_hit'])}/{f(r['nixl_cache_hit'])}", f"{r['pd_n']}/{r['nixl_n']}"]  # fmt: skip
        for r in rows
    ]
    return report.format_table(headers, body)


def plot(rows: list[dict], path: str, title: str) -> bool:
    plt = report.pyplot()
    if plt is None:
        return False
    import numpy as np

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
    for ax_row, model in zip(axes, models):
        mrows = [r for r in rows if r["model"] == model and r["prompt_len"] != "all"]
        xs = np.arange(len(mrows))
        for ax, metric, name in zip(ax_row, ("ttft_s", "total_s"), ("TTFT", "total latency")):
            for i, s in enumerate(SYSTEMS):
                med = np.array([r[f"{s}_{metric}_median"] for r in mrows]) * 1e3
                p90 = np.array([r[f"{s}_{metric}_p90"] for r in mrows]) * 1e3
                ax.bar(xs + (i - 0.5) * 0.38, med, 0.38, yerr=[np.zeros_like(med), p90 - med], capsize=3,
                       label=f"{LABEL[s]} (median, p90 whisker)", color=f"C{i}")  # fmt: skip
            ax.set_xticks(xs, [str(r["prompt_len"]) for r in mrows])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("ms")
            ratio = next(r for r in rows if r["model"] == model and r["prompt_len"] == "all")[
                "ttft_ratio" if metric == "ttft_s" else "total_ratio"
            ]
            ax.set_title(f"{model}: {name} through the proxy (pd/nixl median {ratio:.2f})", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
