"""The P/D handoff table of the demo and scripts/integration.py: for each prompt, aggregated
serving vs P/D, in the replay flow (P's params straight to D) and through the proxy (zero replay),
with D's own count of prompt tokens loaded from P and computed."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rig.oracle import compare

# Where the demo and scripts/integration.py build their models and keep their logs.
WORK_DIR = Path(os.environ.get("PD_CONNECTOR_HOME", Path.home() / ".cache" / "pd_connector"))


@dataclass
class Row:
    n: int
    replay_offset: int
    blocks: str
    recomputed: int
    verdict: str
    ok: bool
    # Through the proxy (zero replay): D's own count of prompt tokens loaded from P and computed.
    zero_replay: str = "-"


def _d_tokens(stack, before: dict, at_least: float, seconds: float = 10.0) -> dict:
    """D's prompt tokens by source since ``before``, once ``at_least`` of them are counted (the
    counters arrive with vLLM's step stats)."""
    deadline = time.monotonic() + seconds
    while True:
        now = stack.decode.prompt_tokens_by_source()
        delta = {k: now[k] - before[k] for k in now}
        if sum(delta.values()) >= at_least or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def run_prompts(stack, prompts: Sequence[Sequence[int]], max_tokens: int, tie_margin: float, logprob_tol: float | None) -> list[Row]:
    """Baseline vs P/D for each prompt: the replay flow (P's params straight to D with the
    client's prompt), then through the proxy, which resumes D at P's first token (zero replay)."""
    rows = []
    for prompt in prompts:
        ref = stack.reference(prompt, max_tokens)
        params, got = stack.handoff(prompt, max_tokens)
        offset = int(params.get("replay_offset", 0))
        verdict = compare(ref, got, tie_margin=tie_margin, logprob_tol=logprob_tol)
        before = stack.decode.prompt_tokens_by_source()
        via_proxy = compare(ref, stack.via_proxy(prompt, max_tokens), tie_margin=tie_margin, logprob_tol=logprob_tol)
        d = _d_tokens(stack, before, len(prompt))
        zero = f"{d['external_kv_transfer']:.0f} / {d['local_compute']:.0f}"
        blocks = "/".join(str(len(g)) for g in params.get("remote_block_ids") or []) or "-"
        text = verdict.describe() + ("" if via_proxy.ok else f" | via proxy: {via_proxy.describe()}")
        rows.append(Row(len(prompt), offset, blocks, len(prompt) - offset, text, verdict.ok and via_proxy.ok, zero))
    return rows


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    print("replay: P hands over replay_offset tokens and D recomputes the rest of the client's prompt;")
    print("zero replay (through pd-connector proxy): D's prompt is P's plus P's first token; D's own")
    print("vllm:prompt_tokens_by_source shows the tokens it loaded from P / computed (N / 1; a first")
    print("token that is part of a character takes the replay flow: 0 / N)\n")
    print(f"{'prompt':>6} {'replay_offset':>13} {'blocks/group':>12} {'D recomputes':>12} {'zero replay: loaded / computed':>31}  result")
    for r in rows:
        print(f"{r.n:>6} {r.replay_offset:>13} {r.blocks:>12} {r.recomputed:>12} {r.zero_replay:>31}  {r.verdict}")
