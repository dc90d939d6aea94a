"""Two ``kv_both`` vLLM CPU instances of one model whose attention block sizes differ (forced
with ``--block-size``), at TP sizes of choice, for the e2e cells of unequal block sizes
(tests/e2e/test_block_sizes*.py).

Each instance is P, D and the aggregated reference, so a handoff runs from the smaller-block
instance to the larger one and back; D's own ``vllm:prompt_tokens_by_source`` says how many
prompt tokens it loaded from P and how many it computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from rig.cpu_matrix import random_prompt
from rig.placement import cpu_binds
from rig.ports import free_ports
from rig.servers import VllmServer, source_checkout_env, start_many
from rig.spec_matrix import SETUPS, SPEC_EXTRA_CONFIG, SpecInstance, handoff
from rig.stack import kv_transfer_config, tp_args

DIRECTIONS = ("p_blocks_smaller", "p_blocks_larger")


@contextmanager
def block_size_pair(
    model: str, log_dir: Path, dtype: str, flags: Sequence[str], blocks: tuple[int, int], max_model_len: int,
    tp: tuple[int, int] = (1, 1),
):
    """(small, large) started instances with attention blocks ``blocks`` at TP sizes ``tp``
    (the blocks checked against what vLLM reports: its hybrid alignment may raise a requested
    size), each the rig's FaultInjectingConnector for the negative controls (inert unless asked)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for (bind, bind_env), block, size, name in zip(cpu_binds(list(tp)), blocks, tp, ("small", "large")):
        config = kv_transfer_config("kv_both", free_ports(size), "cpu", faults=True, **SPEC_EXTRA_CONFIG)
        servers.append(
            VllmServer(
                model, dtype=dtype, max_model_len=max_model_len,
                extra_args=[*flags, "--block-size", str(block), *tp_args(size), "--kv-transfer-config", config],
                env={**source_checkout_env(), **bind_env},
                omp_threads_bind=bind, log_path=log_dir / f"{name}.log",
            )  # fmt: skip
        )
    try:
        start_many(servers, timeout=900)
        pair = tuple(SpecInstance(SETUPS["off"], server) for server in servers)
        for inst, block in zip(pair, blocks):
            cache = inst.server.cache_config()
            assert int(cache["block_size"]) == block, cache
        # The first READ between two instances can stall on a 2-core box (docs/operations.md,
        # "Unanswered first calls"): one unchecked handoff each way before counting tokens.
        warm = random_prompt(40, seed=7)
        for p, d in (pair, pair[::-1]):
            handoff(p, d, warm, 1)
        yield pair
    finally:
        for server in servers:
            server.stop()


def p_and_d(pair: tuple[SpecInstance, SpecInstance], direction: str) -> tuple[SpecInstance, SpecInstance]:
    return pair if direction == "p_blocks_smaller" else (pair[1], pair[0])


def counted_handoff(p: SpecInstance, d: SpecInstance, prompt: Sequence[int], max_tokens: int):
    """(P's params, D's completion, tokens D loaded, tokens D computed) of one handoff."""
    before = d.server.prompt_tokens_by_source()
    params, out = handoff(p, d, prompt, max_tokens)
    time.sleep(1.0)  # the counters arrive with the step's stats
    after = d.server.prompt_tokens_by_source()
    loaded = after["external_kv_transfer"] - before["external_kv_transfer"]
    return params, out, loaded, after["local_compute"] - before["local_compute"]
