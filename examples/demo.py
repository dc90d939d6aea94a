"""The demo (``make demo``): one P/D run on CPU with a tiny hybrid model, checked token by token
against aggregated serving, in the replay flow and through ``pd-connector proxy`` (zero replay).

Run from the checkout: ``python -m examples.demo`` (or ``python examples/demo.py``). It builds the
model offline, starts an aggregated baseline, P, D and the proxy (``rig.stack``), prints the table
of ``rig.handoff_table`` and exits non-zero on any mismatch."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the rig is imported from the checkout's root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rig.cpu_matrix import ATTENTION_BLOCK, CPU_MODELS, boundary_lengths, random_prompt  # noqa: E402
from rig.handoff_table import WORK_DIR, print_table, run_prompts  # noqa: E402
from rig.stack import PDStack, StackConfig  # noqa: E402
from rig.tiny_models import build_model  # noqa: E402

def main() -> int:
    kind = "nemotron_h"
    print(f"building a tiny random-weight {kind} hybrid (Mamba2 + attention, float32) offline ...")
    model = build_model(kind, WORK_DIR / "models")
    config = StackConfig(model=str(model), server_args=CPU_MODELS[kind], log_dir=str(WORK_DIR / "demo-logs"))
    print(f"starting aggregated baseline, prefill (P) and decode (D) vLLM CPU servers; logs in {config.log_dir}")
    with PDStack(config) as stack:
        prompts = [random_prompt(n, seed=0) for n in boundary_lengths(ATTENTION_BLOCK[kind])]
        rows = run_prompts(stack, prompts, max_tokens=16, tie_margin=1e-5, logprob_tol=1e-4)
    print_table(f"P/D handoff vs aggregated serving ({kind}, float32, block size 32)", rows)
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} prompts token-identical to aggregated serving")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
