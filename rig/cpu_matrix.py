"""The CPU test matrix: which tiny models run P/D on vLLM CPU 0.32.0, with which flags.

Facts behind the flags (docs/testing.md, "What vLLM CPU can and cannot run"):
- float32 everywhere: bf16 flips near-tied tokens of random models across the P/D split.
- Mamba2 hybrids need ``--no-enable-prefix-caching`` (the CPU SSD kernel crashes in align mode).
- ``--block-size 32``: CPU attention wants multiples of 32; small blocks put block boundaries
  inside short prompts, which is where off-by-one handoffs show.
"""

from __future__ import annotations

import random

REQUESTED_BLOCK = 32

CPU_MODELS: dict[str, list[str]] = {
    "llama": ["--block-size", str(REQUESTED_BLOCK)],
    "nemotron_h": ["--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching"],
    "granite_hybrid": ["--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching"],
}
# The attention block vLLM actually uses (measured; vLLM raises it until an attention page is at
# least a Mamba page: Granite's single KV head needs 64 tokens in float32).
ATTENTION_BLOCK: dict[str, int] = {"llama": 32, "nemotron_h": 32, "granite_hybrid": 64}
HYBRIDS = ("nemotron_h", "granite_hybrid")


def boundary_lengths(block: int = REQUESTED_BLOCK) -> list[int]:
    """Prompt lengths on and around block boundaries, plus the degenerate and long cases."""
    b = block
    return [1, 2, 5, b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1, 3 * b, 3 * b + 7, 6 * b + 8, 8 * b + 1, 400]


def random_prompt(n: int, seed: int) -> list[int]:
    """Token ids 4..999: the tiny tokenizer's four special tokens are 0..3."""
    rng = random.Random(seed * 7919 + n)
    return [rng.randrange(4, 1000) for _ in range(n)]


# The warm-up handoffs' prompts (stack.PDStack.warm_up, tp_matrix.warm_up): a seed no test uses,
# so a warm-up never leaves a test's prompt in a prefix cache.
WARM_UP_SEED = 987_654


# Connector settings exercised end to end per model (defaults elsewhere): the authenticated side
# channel and the recurrent-state digest on one hybrid.
E2E_EXTRA_CONFIG: dict[str, dict] = {
    kind: {
        "handshake_timeout_seconds": 3,
        # Every lease must end by D's completion or release, or at the claim deadline when D
        # cannot reach P (tampered address): a lease that waited for lease_seconds would hold
        # P's cache past the leak checks' 10 s. D's first handoff from P, which took 5-8 s on a
        # loaded CI box, happens before the tests (PDStack.warm_up).
        "lease_seconds": 600,
        "claim_deadline_seconds": 8,
        **({"verify_state_digest": True} if kind == "nemotron_h" else {}),
    }
    for kind in CPU_MODELS
}
E2E_SECRET: dict[str, str] = {"nemotron_h": "e2e-shared-secret"}


# The tensor-parallel matrix (tests/e2e/test_tensor_parallel.py): kind -> (dtype, vLLM flags).
# Prefix caching off: the oracle is the D instance itself, whose cache must not serve a
# reference from KV a handoff wrote. Qwen3-Next's GDN runs only in bf16 on vLLM CPU.
TP_MODELS: dict[str, tuple[str, list[str]]] = {
    "llama": ("float32", ["--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching"]),
    "llama_kv1": ("float32", ["--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching"]),
    "nemotron_h": ("float32", CPU_MODELS["nemotron_h"]),
    "nemotron_h_g2": ("float32", CPU_MODELS["nemotron_h"]),
    "qwen3_next_mtp_tp2": (
        "bfloat16",
        [
            "--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching",
            "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
        ],
    ),  # fmt: skip
}


# The data-parallel matrix (tests/e2e/test_data_parallel.py): kind -> ({instance: (DP, TP)},
# vLLM flags for all, flags per instance). llama's dp1 runs at TP 2 (the unequal-TP DP x TP
# cell). Dense models only: vLLM CPU 0.32 cannot run a MoE model at DP 2, with or without
# --enable-expert-parallel (docs/testing.md). Prefix caching off: the oracle is D's own engine,
# whose cache must not serve a reference from KV a handoff wrote.
DP_MODELS: dict[str, tuple[dict[str, tuple[int, int]], list[str], dict[str, list[str]]]] = {
    "llama": ({"dp2": (2, 1), "dp1": (1, 2)}, TP_MODELS["llama"][1], {}),
    "nemotron_h": ({"dp2": (2, 1), "dp1": (1, 1)}, CPU_MODELS["nemotron_h"], {}),
}
