"""Results of the transfer benchmark (``benchmarks.transfer``): one ``Result`` per
case with every rep's timings, and the tables printed from them. Pure (numpy)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from benchmarks import report
from benchmarks.transfer_shapes import MiB


@dataclass
class Result:
    section: str
    model: str
    tokens: int
    user_block: int
    block_size: int
    layout: str
    blocks: str
    layers: str
    nbytes: int
    desc: int  # descriptor indices the connector plans
    runs: int  # descriptors NIXL moves after its merge (contiguous runs, cut for worker threads)
    knobs: dict = field(default_factory=dict)
    samples: dict = field(default_factory=dict)  # variant -> per-rep seconds
    stages_ms: dict = field(default_factory=dict)  # variant -> median of per-rep stages
    verified: bool = False
    load: float = 0.0
    contig: int = 0  # contiguous runs before any cut for worker threads (0: not measured)

    def runs_cell(self) -> str:
        """``runs``, with the contiguous runs it was cut from in brackets where they differ."""
        return f"{self.runs} ({self.contig})" if self.contig and self.contig != self.runs else str(self.runs)

    def median_s(self, v: str) -> float:
        return float(np.median(self.samples[v])) if self.samples.get(v) else 0.0

    def gbps(self, v: str) -> float:
        t = self.median_s(v)
        return self.nbytes / t / 1e9 if t else 0.0

    def ratio(self, num: str, den: str) -> float:
        """Median over reps of t(den) / t(num): the throughput of ``num`` relative to ``den``."""
        a, b = self.samples.get(num), self.samples.get(den)
        return float(np.median(np.array(b) / np.array(a))) if a and b else 0.0


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def progress(r: Result) -> None:
    g = " ".join(f"{v} {r.gbps(v):.2f}" for v in r.samples)
    print(f"  {r.model} {fmt_tokens(r.tokens)} b{r.user_block} {r.layout} {r.blocks}: {g} GB/s (load {r.load:.1f})", flush=True)


def table_rows(results: list[Result], variants) -> list[dict]:
    rows = []
    for r in results:
        bs = str(r.block_size) if r.block_size == r.user_block else f"{r.user_block}>{r.block_size}"
        row = {"model": r.model, "layers": r.layers, "tok": fmt_tokens(r.tokens), "bs": bs, "layout": r.layout,
               "blocks": r.blocks, "MiB": round(r.nbytes / MiB), "desc": r.desc, "runs": r.runs_cell()}
        for v in variants:
            row[v] = r.gbps(v)
        row["c/raw"] = r.ratio("connector", "raw")
        row["c/memcpy"] = r.ratio("connector", "memcpy")
        row["c/raw thr"] = r.ratio("connector", "raw_threads") if "raw_threads" in r.samples else ""
        row["cma runs/one"] = r.ratio("cma_runs", "cma_one") if "cma_runs" in r.samples else ""
        row["c/cma runs"] = r.ratio("connector", "cma_runs") if "cma_runs" in r.samples else ""
        row["stall_ms"] = r.stages_ms.get("connector", {}).get("post", 0.0)
        row["ok"] = "y" if r.verified else "NO"
        rows.append(row)
    return rows


def print_results(results, variants, title, extra=()) -> str:
    cols = ["model", "layers", "tok", "bs", "blocks", "MiB", "desc", "runs", *extra,
            *[(v, v, ".2f") for v in variants], ("c/raw", "c/raw", ".2f"), ("c/memcpy", "c/memcpy", ".2f"),
            *([("c/raw thr", "c/raw thr", ".2f")] if "raw_threads" in variants else []),
            *([("cma runs/one", "cma runs/one", ".2f"), ("c/cma runs", "c/cma runs", ".2f")] if "cma_runs" in variants else []),
            ("stall_ms", "stall ms", ".1f"), "ok"]
    rows = table_rows(results, variants)
    for r, res in zip(rows, results):
        r.update({k: res.knobs.get(k, "") for k in ("unpacked_desc", "unpacked_runs", "num_threads", "checkpoints")})
        r["checkpoint_mib"] = res.knobs.get("checkpoint_bytes", 0) / MiB
        r["1read_stall"] = res.stages_ms["one_read"]["post"] if "one_read" in res.stages_ms else ""
        r["unpacked/c"] = res.ratio("unpacked", "connector") if "unpacked" in res.samples else ""
    return report.print_table(rows, cols, title)


def summary_table(results: list[Result], target: float = 0.9) -> str:
    """The main section at a glance: connector / raw NIXL per (model, block size, block ids)
    against prompt length, with the descriptors NIXL moved and GB/s at the longest length, and
    whether every length >= 4k tokens reaches ``target``. Where the kernel path ran
    (DRAM): at the longest length, the kernel's own copy of the connector's runs relative to one
    range of the same bytes (the ceiling of any transfer over cma for those ranges) and the
    connector relative to that copy. With worker threads, the connector relative to raw NIXL as
    one descriptor per thread (``raw_threads``) at the longest length."""
    keys = list(dict.fromkeys((r.model, r.user_block, r.blocks) for r in results))
    lengths = sorted({r.tokens for r in results})
    cma = any("cma_runs" in r.samples for r in results)
    threads = any("raw_threads" in r.samples for r in results)
    longest = fmt_tokens(lengths[-1]) if lengths else ""
    headers = ["model", "bs", "blocks", *[f"c/raw {fmt_tokens(t)}" for t in lengths], f"runs (contig) {longest}",
               "conn/raw/memcpy GB/s", *([f"c/raw thr {longest}"] if threads else []),
               *([f"cma runs/one {longest}", f"c/cma runs {longest}"] if cma else []),
               f">= {target} at >= 4k"]
    rows = []
    for model, ub, blocks in keys:
        by_len = {r.tokens: r for r in results if (r.model, r.user_block, r.blocks) == (model, ub, blocks)}
        last = by_len[max(by_len)]
        kernel = [f"{last.ratio('cma_runs', 'cma_one'):.2f}", f"{last.ratio('connector', 'cma_runs'):.2f}"]
        if "cma_runs" not in last.samples:
            kernel = [""] * 2
        bs = str(last.block_size) if last.block_size == ub else f"{ub}>{last.block_size}"
        long = [r.ratio("connector", "raw") for t, r in by_len.items() if t >= 4096]
        rows.append([
            model, bs, blocks,
            *[f"{by_len[t].ratio('connector', 'raw'):.2f}" if t in by_len else "" for t in lengths],
            last.runs_cell(),
            "/".join(f"{last.gbps(v):.1f}" for v in ("connector", "raw", "memcpy")),
            *([f"{last.ratio('connector', 'raw_threads'):.2f}" if "raw_threads" in last.samples else ""] if threads else []),
            *(kernel if cma else []),
            ("yes" if min(round(x, 2) for x in long) >= target else "NO") if long else "",  # as shown
        ])
    return report.format_table(headers, rows)
