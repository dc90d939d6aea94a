"""PNG of the transfer benchmark: per model and block size, the connector's throughput relative
to raw NIXL and to memcpy against prompt length (scattered solid, contiguous dashed; the dotted
line is the target, 0.9 of raw NIXL), and where measured (DRAM) the kernel's copy of the same
runs relative to one range (grey: the ceiling of one thread's transfer over cma), with worker
threads the connector relative to raw NIXL as one descriptor per thread (orange), plus GB/s of
the layout and stall sections."""

from __future__ import annotations

import numpy as np

TARGET_RATIO = 0.9  # the target: the connector at >= 90% of raw NIXL on the same bytes


def plot(plt, results: dict, knob_rows) -> object | None:
    main = results.get("main", [])
    models = list(dict.fromkeys(r.model for r in main))
    blocks = list(dict.fromkeys(r.user_block for r in main))
    extra = [s for s in ("layout", "stall", "tcp") if results.get(s)]
    if not models and not extra:
        return None
    ncols = max(len(blocks), len(extra), 1)
    nrows = len(models) + (1 if extra else 0)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for i, model in enumerate(models):
        for j, ub in enumerate(blocks):
            ax = axes[i][j]
            rs = [r for r in main if r.model == model and r.user_block == ub]
            # Ratios, not GB/s: each is a median of per-rep ratios of interleaved runs, so load
            # on a shared box cancels out; the GB/s are in the table and the JSON.
            for mode, style in (("scattered", "-"), ("contiguous", "--")):
                sel = sorted((r for r in rs if r.blocks == mode), key=lambda r: r.tokens)
                if not sel:
                    continue
                x = [r.tokens for r in sel]
                curves = [(("connector", "raw"), "o", "C0"), (("connector", "memcpy"), "^", "C2")]
                if all("raw_threads" in r.samples for r in sel):
                    curves.append((("connector", "raw_threads"), "s", "C1"))
                if all("cma_runs" in r.samples for r in sel):
                    curves.append((("cma_runs", "cma_one"), "x", "grey"))
                for (num, den), marker, color in curves:
                    ax.plot(x, [r.ratio(num, den) for r in sel], marker + style, color=color, label=f"{num}/{den} {mode}")
            ax.axhline(TARGET_RATIO, color="grey", lw=0.8, ls=":")
            ax.set_ylim(0, max([1.3] + [1.1 * y for line in ax.get_lines() for y in line.get_ydata()]))
            bs = rs[0].block_size if rs else ub
            ax.set_title(f"{model}  block {ub}" + (f"->{bs}" if bs != ub else ""), fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens", fontsize=8)
            ax.set_ylabel("throughput ratio", fontsize=8)
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=6)
        for j in range(len(blocks), ncols):
            axes[i][j].axis("off")
    if extra:
        row = axes[-1]
        for k, section in enumerate(extra):
            ax, rs = row[k], results[section]
            variants = list(dict.fromkeys(v for r in rs for v in r.samples))
            xs = np.arange(len(rs))
            width = 0.8 / max(1, len(variants))
            for n, v in enumerate(variants):
                ax.bar(xs + n * width, [r.gbps(v) for r in rs], width, label=v)
            ax.set_xticks(xs + 0.4 - width / 2, [f"{r.model}\n{r.tokens // 1024}k {r.blocks[:4]} t{r.knobs.get('num_threads', '')}" for r in rs],
                          fontsize=6, rotation=45, ha="right")
            ax.set_title(f"{section}: GB/s (median)", fontsize=9)
            ax.legend(fontsize=6)
        for k in range(len(extra), ncols):
            row[k].axis("off")
    fig.tight_layout()
    return fig
