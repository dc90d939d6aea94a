"""Tables, plot and profile text of the scheduler-side benchmark
(``benchmarks.scheduler``)."""

from __future__ import annotations

import cProfile
import io
import pstats

from benchmarks import report

TARGET_US = 50.0  # the target: at most 50 µs per request on each half (docs/benchmarks.md)


def best_run(runs: list[dict], **labels) -> dict:
    """The run with the smallest connector total (all its figures from that one run); every
    run's totals are kept under ``runs``."""
    best = dict(min(runs, key=lambda r: r["connector_us_per_request"]))
    best.update(labels)
    best["runs_connector_us_per_request"] = [r["connector_us_per_request"] for r in runs]
    best["runs_vllm_us_per_request"] = [r["vllm_us_per_request"] for r in runs]
    return best


def fingerprint_us(r: dict) -> float:
    """µs per request of the prompt fingerprint, inside on_new_request (scheduler_timing)."""
    from benchmarks.scheduler_timing import FINGERPRINT

    return r["hooks"].get(FINGERPRINT, {}).get("us_per_request", 0.0)


def top_hooks(r: dict, k: int = 2) -> str:
    own = [kv for kv in r["hooks"].items() if not kv[0].startswith("nested:")]
    ranked = sorted(own, key=lambda kv: -kv[1]["us_per_request"])[:k]
    return ", ".join(f"{label.split('.')[-1]} {h['us_per_request']:.1f}" for label, h in ranked)


def table(results: list[dict]) -> str:
    headers = ["config", "block", "prompt", "half", "ours µs/req", f"<= {TARGET_US:.0f}", "of which fingerprint", "ours wall", "vLLM µs/req", "of which GC", "ours/vLLM", "runs (ours)", "largest hooks (µs/req)"]
    rows = [
        [
            r["config"],
            r.get("block_size", ""),
            r["prompt_len"],
            r["role"],
            f"{r['connector_us_per_request']:.1f}",
            "yes" if r["connector_us_per_request"] <= TARGET_US else "NO",
            f"{fingerprint_us(r):.1f}",
            f"{r['connector_wall_us_per_request']:.1f}",
            f"{r['vllm_us_per_request']:.0f}",
            f"{r.get('gc_us_per_request', {}).get('vllm', 0.0):.0f}",
            f"{r['connector_us_per_request'] / r['vllm_us_per_request'] * 100:.1f}%",
            "/".join(f"{x:.0f}" for x in r["runs_connector_us_per_request"]),
            top_hooks(r),
        ]
        for r in results
    ]
    return report.format_table(headers, rows)


def plot(results: list[dict], path: str, title: str) -> bool:
    plt = report.pyplot()
    if plt is None:
        return False
    import numpy as np

    configs = sorted({r["config"] for r in results})
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4.2), squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        rows = [r for r in results if r["config"] == cfg]
        lens = sorted({r["prompt_len"] for r in rows})
        xs = np.arange(len(lens))
        for i, role in enumerate(("P", "D")):
            vals = [next((r["connector_us_per_request"] for r in rows if r["role"] == role and r["prompt_len"] == n), 0) for n in lens]
            bars = ax.bar(xs + (i - 0.5) * 0.38, vals, 0.38, label=f"{role}: pd_connector hooks", color=f"C{i}")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.axhline(TARGET_US, color="red", ls="--", lw=1, label=f"target {TARGET_US:.0f} µs")

        def vllm_own(role, n):
            return next((r["vllm_us_per_request"] for r in rows if r["role"] == role and r["prompt_len"] == n), 0)

        ax.set_xticks(xs, [f"{n} tokens\nvLLM's own: P {vllm_own('P', n):.0f}, D {vllm_own('D', n):.0f}" for n in lens], fontsize=7)
        ax.set_ylabel("µs per request (CPU time)")
        ax.set_ylim(0, 1.25 * max([TARGET_US, *(r["connector_us_per_request"] for r in rows)]))
        ax.set_title(f"{cfg}", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def print_profile(profiler: cProfile.Profile, limit: int = 25) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.sort_stats("tottime").print_stats(r"pd_connector|logging|msgspec", limit)
    text = buf.getvalue()
    print(text)
    return text
