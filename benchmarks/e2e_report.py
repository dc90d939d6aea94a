"""Figures, tables and plot of the end-to-end benchmark (``benchmarks.e2e``):
the order of the systems per prompt, per-length latency summaries (TTFT, inter-token latency,
the second token, total) with ratios against aggregated serving, handoff figures from the
servers' Prometheus series (per-request deltas), where "P done -> D's first token" goes, D's and
P's prompt tokens by source per request, P's prefill time, and the PNG; in the prefix-caching
case, the lengths around the Mamba block. Pure apart from ``plot`` (matplotlib through
``report.pyplot``)."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import report

# The systems measured: pd_connector with zero replay (the default proxy), the same deployment
# behind a ``--resume replay`` proxy, vLLM's NixlConnector (its own deployment and proxy), and
# aggregated serving (a plain request to the pd_connector deployment's P: a kv_producer serves a
# request without kv_transfer_params as an aggregated server does).
SYSTEMS = ("pd", "replay", "nixl", "agg")
# The tables' order: the baseline first.
DISPLAY = ("agg", "pd", "replay", "nixl")
LABEL = {"pd": "zero replay", "replay": "replay", "nixl": "NixlConnector", "agg": "aggregated"}
SHORT = {"pd": "zero", "replay": "replay", "nixl": "nixl", "agg": "agg"}
# The deployment serving each system (systems sharing one pause and resume together).
DEPLOYMENT = {"pd": "pd", "replay": "pd", "agg": "pd", "nixl": "nixl"}
# Systems with a handoff, and the connector whose series they read.
HANDOFF_SYSTEMS = ("pd", "replay", "nixl")
CONNECTOR = {"pd": "pd", "replay": "pd", "nixl": "nixl"}
# The pd_connector deployment's systems, rotated per prompt (request_order).
_PD_ROTATION = ("pd", "replay", "agg")
# D's ``vllm:prompt_tokens_by_source`` labels (vLLM's metrics/stats.py PromptTokenStats): what D
# computed itself, what it loaded through the connector, what its own prefix cache served.
TOKEN_SOURCES = ("local_compute", "external_kv_transfer", "local_cache_hit")


def request_order(k: int) -> list[str]:
    """The order the systems serve prompt ``k`` (k = round + length index): the two deployments
    alternate which goes first (A B, B A, ...), and the pd_connector deployment's three systems
    rotate, so each is first after its deployment resumes a third of the time."""
    r = k % len(_PD_ROTATION)
    pd = list(_PD_ROTATION[r:] + _PD_ROTATION[:r])
    return [*pd, "nixl"] if k % 2 == 0 else ["nixl", *pd]


def first_difference(out: dict, reference: dict) -> int | None:
    """The index of the first token where ``out`` differs from ``reference`` (token ids when both
    have them, else characters of the text); None when they are the same."""
    a, b = out.get("token_ids"), reference.get("token_ids")
    if not a or not b:
        a, b = out.get("text", ""), reference.get("text", "")
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mean_delta(before: dict, after: dict, key: str) -> float | None:
    s0, s1 = before.get(f"{key}_sum"), after.get(f"{key}_sum")
    n = _count_delta(before, after, key)
    if s0 is None or s1 is None or n is None or n <= 0:
        return None
    return (s1 - s0) / n


def handoff_figures(before: dict, after: dict, system: str) -> dict[str, float | None]:
    """Means over the requests between two snapshots (or over summed per-request deltas
    against zeros: ``handoff_from_records``) of ``system``'s servers."""
    pd = CONNECTOR.get(system, system) == "pd"
    d_ttft = mean_delta(before, after, "decode:vllm:time_to_first_token_seconds")
    d_itl = mean_delta(before, after, "decode:vllm:inter_token_latency_seconds")
    transfer_key = "vllm:pd_transfer_seconds" if pd else "vllm:nixl_xfer_time_seconds"
    # NixlConnector's series is the READ alone; ours splits claim + READ and the READ alone.
    read_key = "vllm:pd_read_seconds" if pd else "vllm:nixl_xfer_time_seconds"
    return {
        "d_ttft_ms": _ms(d_ttft),
        "d_itl_ms": _ms(d_itl),
        "handoff_overhead_ms": _ms(d_ttft - d_itl) if d_ttft is not None and d_itl is not None else None,
        "transfer_ms": _ms(mean_delta(before, after, f"decode:{transfer_key}")),
        "read_ms": _ms(mean_delta(before, after, f"decode:{read_key}")),
        # NixlConnector has no claim: its D reads what the params name, unconfirmed.
        "claim_ms": _ms(mean_delta(before, after, "decode:vllm:pd_claim_seconds")) if pd else None,
        # Of which P held claims that overtook their lease (mean over the held ones only).
        "p_held_ms": _ms(mean_delta(before, after, "prefill:vllm:pd_claim_held_seconds")) if pd else None,
        "p_held_count": _count_delta(before, after, "prefill:vllm:pd_claim_held_seconds"),
        "d_queue_ms": _ms(mean_delta(before, after, "decode:vllm:request_queue_time_seconds")),
        "d_prefill_ms": _ms(mean_delta(before, after, "decode:vllm:request_prefill_time_seconds")),
        "p_e2e_ms": _ms(mean_delta(before, after, "prefill:vllm:e2e_request_latency_seconds")),
        "p_prefill_ms": _ms(mean_delta(before, after, "prefill:vllm:request_prefill_time_seconds")),
        "read_kib": _kib(mean_delta(before, after, "decode:vllm:pd_transfer_bytes")) if pd else None,
    }


def summed_metrics(records: list[dict]) -> dict[str, float]:
    """The records' per-request metric deltas (``metrics``), summed key by key (a key missing
    from a record counts nothing there)."""
    out: dict[str, float] = {}
    for r in records:
        for key, value in (r.get("metrics") or {}).items():
            if value is not None:
                out[key] = out.get(key, 0.0) + value
    return out


def handoff_from_records(records: list[dict], system: str) -> dict[str, float | None]:
    """``handoff_figures`` over ``system``'s measured requests, from their per-request deltas
    (systems sharing a deployment share its counters: a snapshot around the run would mix them)."""
    after = summed_metrics([r for r in records if r["system"] == system])
    return handoff_figures(dict.fromkeys(after, 0.0), after, system)


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


def _kib(x: float | None) -> float | None:
    return None if x is None else x / 1024


def _f1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _f0(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# Per request, client side: send -> first token chunk, the second one, [DONE]; inter-token latency.
METRICS = ("ttft_s", "token2_s", "itl_s", "total_s")


def summarize(runs: list[dict], lengths: list[int]) -> list[dict]:
    """Per model and prompt length (and ``all``): per system the median and p90 of each client
    metric over the measured requests, the ratios of medians against aggregated serving
    (``<s>_<metric>_vs_agg``) and of zero replay against replay (``pd_<metric>_vs_replay``), and
    how many outputs had the aggregated one's token ids and text (``<s>_same_ids``, ``<s>_same_text``)."""
    rows = []
    for run in runs:
        for n in [*lengths, "all"]:
            row: dict[str, Any] = {"model": run["model"], "prompt_len": n}
            for s in SYSTEMS:
                recs = [r for r in run["records"] if r["system"] == s and (n == "all" or r["prompt_len"] == n)]
                for metric in METRICS:
                    xs = [r[metric] for r in recs if r.get(metric) is not None]
                    row[f"{s}_{metric}_median"] = _median(xs)
                    row[f"{s}_{metric}_p90"] = quantile(xs, 0.9) if xs else None
                row[f"{s}_n"] = len(recs)
                for key in ("same_ids", "same_text"):
                    same = [r[key] for r in recs if r.get(key) is not None]
                    row[f"{s}_{key}"] = f"{sum(same)}/{len(same)}"
            for metric in METRICS:
                for s in SYSTEMS:
                    row[f"{s}_{metric}_vs_agg"] = _ratio(row, s, "agg", metric)
                row[f"pd_{metric}_vs_replay"] = _ratio(row, "pd", "replay", metric)
            rows.append(row)
    return rows


def _ratio(row: dict, num: str, den: str, metric: str) -> float | None:
    a, b = row.get(f"{num}_{metric}_median"), row.get(f"{den}_{metric}_median")
    return a / b if a is not None and b else None


def _mp(r: dict, s: str, metric: str) -> str:
    med, p90 = r[f"{s}_{metric}_median"], r[f"{s}_{metric}_p90"]
    return "-" if med is None else f"{med * 1e3:.0f} / {p90 * 1e3:.0f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def metric_table(rows: list[dict], metric: str, name: str, extra: tuple[str, ...] = ()) -> str:
    """Per model and length: ``metric``'s median / p90 (ms) for each system, each system's
    median against aggregated serving's, and zero replay's against replay's; ``extra`` adds
    the second token's median per system (``token2``) or the outputs whose token ids and text
    equal aggregated serving's (``same``)."""
    others = [s for s in DISPLAY if s != "agg"]
    headers = ["model", "prompt", *(f"{name} {SHORT[s]} med/p90 ms" for s in DISPLAY),
               *(f"{SHORT[s]}/agg" for s in others), "zero/replay"]  # fmt: skip
    if "token2" in extra:
        headers.append("token 2 at ms " + "/".join(SHORT[s] for s in DISPLAY))
    if "same" in extra:
        headers.append("same ids as agg " + "/".join(SHORT[s] for s in others))
        headers.append("same text as agg " + "/".join(SHORT[s] for s in others))
    body = []
    for r in rows:
        line = [r["model"], r["prompt_len"], *(_mp(r, s, metric) for s in DISPLAY),
                *(_x(r[f"{s}_{metric}_vs_agg"]) for s in others), _x(r[f"pd_{metric}_vs_replay"])]  # fmt: skip
        if "token2" in extra:
            line.append(" / ".join(_f0(_ms(r[f"{s}_token2_s_median"])) for s in DISPLAY))
        if "same" in extra:
            line.append(" ".join(r[f"{s}_same_ids"] for s in others))
            line.append(" ".join(r[f"{s}_same_text"] for s in others))
        body.append(line)
    return report.format_table(headers, body)


def latency_tables(rows: list[dict]) -> dict[str, str]:
    """The three client-side tables: TTFT, inter-token latency (with the second token), total."""
    return {
        "ttft": metric_table(rows, "ttft_s", "TTFT"),
        "itl": metric_table(rows, "itl_s", "ITL", ("token2",)),
        "total": metric_table(rows, "total_s", "total", ("same",)),
    }


def handoff_table(runs: list[dict]) -> str:
    headers = ["model", "system", "handoff overhead ms", "transfer ms", "claim ms", "P held (n) ms", "READ ms",
               "KiB read", "D TTFT ms", "D ITL ms", "D queue ms", "P prefill ms", "P e2e ms"]  # fmt: skip
    body = []
    for run in runs:
        for s in (s for s in HANDOFF_SYSTEMS if s in run["handoff"]):
            h = run["handoff"][s]
            body.append([run["model"], LABEL[s], _f1(h["handoff_overhead_ms"]), _f1(h["transfer_ms"]),
                         _f1(h.get("claim_ms")), _held(h), _f1(h.get("read_ms")), _f1(h.get("read_kib")),
                         _f1(h["d_ttft_ms"]), _f1(h["d_itl_ms"]), _f1(h["d_queue_ms"]), _f1(h.get("p_prefill_ms")),
                         _f1(h["p_e2e_ms"])])  # fmt: skip
    return report.format_table(headers, body)


def _per_request(r: dict, key: str, scale: float = 1e3) -> float | None:
    """A per-request series' mean over that request (sum delta / count delta), seconds in ms
    (``scale`` 1: as exported)."""
    m = r.get("metrics") or {}
    s, n = m.get(f"{key}_sum"), m.get(f"{key}_count")
    return None if s is None or not n else s / n * scale


def request_accounting(r: dict) -> dict[str, float | None]:
    """One handoff request's "P done -> D's first token", from the client's clock and the
    servers' series (ms): D's first token reaches the client as the second token with zero
    replay (P's is the first), as the first otherwise; P's e2e (arrival on P -> P done) taken
    off it leaves the handoff as the client sees it, and D's TTFT (arrival on D -> D's first
    token) splits it into what happens outside D (the proxy's hops) and in D: the transfer
    (claim, the wait for D's engine step, READ) and the rest (intake, one forward, output)."""
    d_first = r.get("token2_s") if r["system"] == "pd" else r.get("ttft_s")
    p_e2e = _per_request(r, "prefill:vllm:e2e_request_latency_seconds")
    d_ttft = _per_request(r, "decode:vllm:time_to_first_token_seconds")
    pd = CONNECTOR[r["system"]] == "pd"
    transfer = _per_request(r, "decode:vllm:pd_transfer_seconds" if pd else "decode:vllm:nixl_xfer_time_seconds")
    read = _per_request(r, "decode:vllm:pd_read_seconds" if pd else "decode:vllm:nixl_xfer_time_seconds")
    claim = _per_request(r, "decode:vllm:pd_claim_seconds") if pd else None
    handoff = d_first * 1e3 - p_e2e if d_first is not None and p_e2e is not None else None
    return {
        "first_ms": r["ttft_s"] * 1e3,
        "d_first_ms": None if d_first is None else d_first * 1e3,
        "p_e2e_ms": p_e2e,
        "handoff_ms": handoff,
        "outside_d_ms": handoff - d_ttft if handoff is not None and d_ttft is not None else None,
        "d_ttft_ms": d_ttft,
        "d_queue_ms": _per_request(r, "decode:vllm:request_queue_time_seconds"),
        "transfer_ms": transfer,
        "claim_ms": claim,
        "read_ms": read,
        "step_wait_ms": transfer - claim - read if None not in (transfer, claim, read) else None,
        "d_rest_ms": d_ttft - transfer if d_ttft is not None and transfer is not None else None,
        "d_prefill_ms": _per_request(r, "decode:vllm:request_prefill_time_seconds"),
        "d_itl_ms": _per_request(r, "decode:vllm:inter_token_latency_seconds"),
        "read_kib": _kib(_per_request(r, "decode:vllm:pd_transfer_bytes", 1.0)) if pd else None,
    }


ACCOUNTING = ("first_ms", "d_first_ms", "p_e2e_ms", "handoff_ms", "outside_d_ms", "d_ttft_ms", "d_queue_ms",
              "transfer_ms", "claim_ms", "read_ms", "step_wait_ms", "d_rest_ms", "d_prefill_ms", "d_itl_ms",
              "read_kib")  # fmt: skip


def accounting_rows(records: list[dict], lengths: list[int], q: float | None = None) -> list[dict]:
    """Per model, handoff system and prompt length: the median (or quantile ``q``) over the
    measured requests of each ``request_accounting`` figure, each figure on its own (requests
    sent twice left out: their deltas count both)."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        for s in HANDOFF_SYSTEMS:
            for n in lengths:
                recs = [r for r in records if r["model"] == model and r["system"] == s and r["prompt_len"] == n
                        and not r.get("retried")]  # fmt: skip
                figures = [request_accounting(r) for r in recs]
                row: dict[str, Any] = {"model": model, "system": s, "prompt_len": n, "n": len(recs)}
                for key in ACCOUNTING:
                    xs = [f[key] for f in figures if f[key] is not None]
                    row[key] = _median(xs) if q is None or not xs else quantile(xs, q)
                rows.append(row)
    return rows


def accounting_table(rows: list[dict]) -> str:
    headers = ["model", "system", "prompt", "1st token at client", "D's 1st at client", "P e2e",
               "P done -> D's 1st", "outside D", "D TTFT", "D queue", "transfer", "claim", "READ", "step wait",
               "D rest", "D prefill", "D ITL", "KiB read"]  # fmt: skip
    body = [[r["model"], LABEL[r["system"]], r["prompt_len"], *(_f1(r[k]) for k in ACCOUNTING)] for r in rows]
    return report.format_table(headers, body)


def prefix_caching_lengths(block: int) -> list[int]:
    """Prompt lengths around vLLM's Mamba block ``block`` (the align-mode checkpoint grid), two
    of them off the grid, ascending."""
    b = block
    return sorted({b - 1, b, b + 1, 2 * b - 1, 2 * b + 1, 3 * b + 1, b + b // 4 + 5, 2 * b - b // 3})


def token_deltas(before: dict[str, float | None], after: dict[str, float | None], prefix: str = "d") -> dict[str, float | None]:
    """A server's prompt tokens per source over one request, as record fields
    ``<prefix>_<source>`` (``d``: D, ``p``: P); None where a source is missing from either
    reading."""
    out: dict[str, float | None] = {}
    for source in TOKEN_SOURCES:
        t0, t1 = before.get(source), after.get(source)
        out[f"{prefix}_{source}"] = None if t0 is None or t1 is None else t1 - t0
    return out


def token_rows(records: list[dict], lengths: list[int]) -> list[dict]:
    """Per model, prompt length and system: the median over the measured requests of D's prompt
    (its tokens from all sources), the tokens D loaded from P, computed itself and found in its
    own prefix cache, the share of the client's prompt D computed, and the tokens P computed
    (``None`` where no request of that system carries the figure; aggregated serving has no
    D). A request sent twice (``retried``) is left out: its deltas count both sends."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        for n in lengths:
            for s in DISPLAY:
                recs = [r for r in records if r["model"] == model and r["system"] == s and r["prompt_len"] == n
                        and not r.get("retried")]  # fmt: skip
                with_d = [r for r in recs if r.get("d_local_compute") is not None]
                row: dict[str, Any] = {"model": model, "prompt_len": n, "system": s, "n": len(recs)}
                for source, key in (("local_compute", "computed"), ("external_kv_transfer", "loaded"),
                                    ("local_cache_hit", "cache_hit")):  # fmt: skip
                    row[key] = _median([r[f"d_{source}"] for r in with_d if r.get(f"d_{source}") is not None])
                row["d_prompt"] = _median([sum(r.get(f"d_{x}") or 0.0 for x in TOKEN_SOURCES) for r in with_d])
                row["computed_share"] = _median([r["d_local_compute"] / n for r in with_d])
                row["p_computed"] = _median([r["p_local_compute"] for r in recs if r.get("p_local_compute") is not None])
                rows.append(row)
    return rows


def token_table(rows: list[dict]) -> str:
    headers = ["model", "prompt", "system", "D prompt", "loaded from P", "D computed", "D cache hit",
               "D computed share", "P computed", "requests"]  # fmt: skip

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    body = [
        [r["model"], r["prompt_len"], LABEL[r["system"]], _f0(r["d_prompt"]), _f0(r["loaded"]), _f0(r["computed"]),
         _f0(r["cache_hit"]), pct(r["computed_share"]), _f0(r["p_computed"]), r["n"]]  # fmt: skip
        for r in rows
    ]
    return report.format_table(headers, body)


def prefill_rows(records: list[dict], lengths: list[int]) -> list[dict]:
    """Per model and prompt length, per system: the median over the measured requests of P's
    prefill time (``vllm:request_prefill_time_seconds`` on P: scheduled -> first token) and
    of the prompt tokens P computed; ``pd_vs_replay`` = zero replay's prefill / replay's."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        for n in lengths:
            row: dict[str, Any] = {"model": model, "prompt_len": n}
            for s in DISPLAY:
                recs = [r for r in records if r["model"] == model and r["system"] == s and r["prompt_len"] == n
                        and not r.get("retried")]  # fmt: skip
                row[f"{s}_prefill_ms"] = _median([x for r in recs if (x := _per_request(
                    r, "prefill:vllm:request_prefill_time_seconds")) is not None])  # fmt: skip
                row[f"{s}_p_computed"] = _median([r["p_local_compute"] for r in recs if r.get("p_local_compute") is not None])
            a, b = row["pd_prefill_ms"], row["replay_prefill_ms"]
            row["pd_vs_replay"] = a / b if a is not None and b else None
            rows.append(row)
    return rows


def prefill_table(rows: list[dict]) -> str:
    headers = ["model", "prompt", *(f"P prefill ms {SHORT[s]}" for s in DISPLAY), "zero/replay",
               "P computed " + "/".join(SHORT[s] for s in DISPLAY)]  # fmt: skip
    body = [[r["model"], r["prompt_len"], *(_f1(r[f"{s}_prefill_ms"]) for s in DISPLAY), _x(r["pd_vs_replay"]),
             " / ".join(_f0(r[f"{s}_p_computed"]) for s in DISPLAY)] for r in rows]  # fmt: skip
    return report.format_table(headers, body)


def plot(rows: list[dict], path: str, title: str) -> bool:
    plt = report.pyplot()
    if plt is None:
        return False
    import numpy as np

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 3.8 * len(models)), squeeze=False)
    width = 0.8 / len(SYSTEMS)
    for ax_row, model in zip(axes, models):
        mrows = [r for r in rows if r["model"] == model and r["prompt_len"] != "all"]
        xs = np.arange(len(mrows))
        overall = next(r for r in rows if r["model"] == model and r["prompt_len"] == "all")
        for ax, metric, name in zip(ax_row, ("ttft_s", "itl_s"), ("TTFT", "inter-token latency")):
            for i, s in enumerate(DISPLAY):
                med = np.array([r[f"{s}_{metric}_median"] or 0.0 for r in mrows]) * 1e3
                p90 = np.array([r[f"{s}_{metric}_p90"] or 0.0 for r in mrows]) * 1e3
                ax.bar(xs + (i - (len(SYSTEMS) - 1) / 2) * width, med, width, yerr=[np.zeros_like(med), p90 - med],
                       capsize=2, label=f"{LABEL[s]} (median, p90 whisker)", color=f"C{i}")  # fmt: skip
            ax.set_xticks(xs, [str(r["prompt_len"]) for r in mrows])
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("ms")
            ratios = ", ".join(f"{SHORT[s]} {_x(overall[f'{s}_{metric}_vs_agg'])}" for s in HANDOFF_SYSTEMS)
            ax.set_title(f"{model}: {name}; median / aggregated: {ratios}", fontsize=8)
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
