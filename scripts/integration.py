#!/usr/bin/env python
"""P/D integration check: aggregated baseline, P, D and the proxy; prompts on and around block
boundaries; P/D output compared with the baseline token by token; a table; non-zero exit on
any mismatch.

  --device cpu   (default) tiny random-weight models built offline, vLLM CPU, float32
  --device cuda  two GPUs (P and the baseline on GPU 0, D on GPU 1), real hybrids from the hub:
                 by default ibm-granite/granite-4.0-h-tiny with prefix caching (Mamba align mode:
                 D recomputes only its one-token tail) and Qwen/Qwen3.5-0.8B with native MTP, once
                 per speculative token count (--spec-tokens) and once skewed (P 1 token, D 3
                 tokens: D refuses P's offset and recomputes, or, with --hint, the proxy passes
                 D's requirement to P and the handoff is honoured).

Built on ``rig.handoff_table`` (``run_prompts``, ``print_table``) and
``rig.stack`` (baseline + P + D + proxy), with the CPU model matrix of
``rig.cpu_matrix``. It starts vLLM servers: on a shared box run it under
``flock /tmp/pd-e2e.lock``. Not a benchmark (those are ``python -m benchmarks``).

Examples:
  .venv/bin/python scripts/integration.py
  python scripts/integration.py --device cuda
  python scripts/integration.py --device cuda --models Qwen/Qwen3.5-0.8B --spec-tokens 1 3 --block-size 32
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The rig (rig/) is imported from the checkout this script runs from.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rig.cpu_matrix import ATTENTION_BLOCK, CPU_MODELS, boundary_lengths, random_prompt
from rig.handoff_table import WORK_DIR, print_table, run_prompts
from rig.stack import PDStack, StackConfig


def cpu_runs(args):
    from rig.tiny_models import build_model

    for kind in args.models or sorted(CPU_MODELS):
        config = StackConfig(
            model=str(build_model(kind, Path(args.work_dir) / "models")),
            server_args=CPU_MODELS[kind],
            log_dir=str(Path(args.work_dir) / "integration" / kind),
        )
        # float32: the P/D split moves logprobs by ~1e-6 at most (docs/testing.md).
        yield kind, config, ATTENTION_BLOCK[kind], 1e-5, 1e-4


MTP_MODELS = ("Qwen/Qwen3.5-0.8B",)


def _cuda_config(args, model, tag, *, all_args=(), prefill_args=(), decode_args=(), proxy_args=()):
    return StackConfig(
        model=model,
        served_model_name="model",
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        server_args=["--block-size", str(args.block_size), *all_args, *(args.vllm_arg or [])],
        # P and the baseline share GPU 0; D has GPU 1 to itself. The baseline runs D's config.
        baseline_args=["--gpu-memory-utilization", "0.4", *decode_args],
        prefill_args=["--gpu-memory-utilization", "0.4", *prefill_args],
        decode_args=["--gpu-memory-utilization", "0.8", *decode_args],
        proxy_args=list(proxy_args),
        device="cuda",
        baseline_env={"CUDA_VISIBLE_DEVICES": "0"},
        prefill_env={"CUDA_VISIBLE_DEVICES": "0"},
        decode_env={"CUDA_VISIBLE_DEVICES": "1"},
        log_dir=str(Path(args.work_dir) / "integration" / f"{model.replace('/', '_')}-{tag}"),
    )


def _mtp(k: int) -> list[str]:
    return ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": k})]


def cuda_runs(args):
    block = args.block_size
    # bf16: a differing token counts as a tie only below the baseline's own top-2 margin
    # of 4e-3 (the measured noise of the P/D split); logprobs are not held to a tolerance.
    for model in args.models or ["ibm-granite/granite-4.0-h-tiny", *MTP_MODELS]:
        if model not in MTP_MODELS:
            # vLLM's GPU default keeps prefix caching on: Mamba align mode.
            yield model, _cuda_config(args, model, "prefix-caching"), block, args.tie_margin, None
            continue
        for k in args.spec_tokens:
            yield f"{model} MTP {k}", _cuda_config(args, model, f"mtp{k}", all_args=_mtp(k)), block, args.tie_margin, None
        lo, hi = min(args.spec_tokens), max(args.spec_tokens)
        if lo != hi:
            hint = ["--decode-min-recompute", str(max(1, hi - 1))] if args.hint else []
            config = _cuda_config(
                args, model, f"skew{lo}-{hi}", prefill_args=_mtp(lo), decode_args=_mtp(hi), proxy_args=hint
            )
            yield f"{model} MTP P {lo} / D {hi}", config, block, args.tie_margin, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", nargs="*", help="cpu: tiny model kinds; cuda: hub model ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--work-dir", default=str(WORK_DIR))
    parser.add_argument("--block-size", type=int, default=128, help="cuda: attention block size")
    parser.add_argument("--dtype", default="bfloat16", help="cuda: model dtype")
    parser.add_argument("--max-model-len", type=int, default=4096, help="cuda")
    parser.add_argument("--tie-margin", type=float, default=4e-3, help="cuda: near-tie threshold")
    parser.add_argument("--vllm-arg", action="append", help="cuda: extra vLLM argument (repeat)")
    parser.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 2, 3], help="cuda: MTP token counts")
    parser.add_argument("--hint", action="store_true", help="cuda skew run: proxy passes D's minimum recompute to P")
    args = parser.parse_args(argv)

    runs = cpu_runs(args) if args.device == "cpu" else cuda_runs(args)
    failed = 0
    for name, config, block, tie_margin, logprob_tol in runs:
        with PDStack(config) as stack:
            prompts = [random_prompt(n, seed=0) for n in boundary_lengths(block)]
            rows = run_prompts(stack, prompts, args.max_tokens, tie_margin, logprob_tol)
        print_table(f"{name} (block {block})", rows)
        failed += sum(not r.ok for r in rows)
    print(f"\n{'OK' if not failed else f'{failed} MISMATCH(ES)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
