"""Two ``kv_both`` vLLM CPU instances of one model whose attention block sizes differ (forced
with ``--block-size``), for the e2e cells of unequal block sizes (tests/e2e/test_block_sizes*.py).

Each instance is P, D and the aggregated reference, so a handoff runs from the smaller-block
instance to the larger one and back; D's own ``vllm:prompt_tokens_by_source`` says how many
prompt tokens it loaded from P and how many it computed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from pd_connector.dev.rig.spec_matrix import SPEC_EXTRA_CONFIG, InstanceSpec, SpecInstance, handoff, make_instances, running
from pd_connector.engine import faults

DIRECTIONS = ("p_blocks_smaller", "p_blocks_larger")


@contextmanager
def block_size_pair(model: str, log_dir: Path, dtype: str, flags: Sequence[str], blocks: tuple[int, int], max_model_len: int):
    """(small, large) started instances with attention blocks ``blocks`` (checked against what
    vLLM reports: its hybrid alignment may raise a requested size), each honouring the fault
    switch of the negative controls (inert unless a request asks)."""
    spec = InstanceSpec(
        model=model, log_dir=log_dir, dtype=dtype, max_model_len=max_model_len,
        server_args=(*flags, "--block-size", str(blocks[0])), extra_config=SPEC_EXTRA_CONFIG, env={faults.ENV: "1"},
    )  # fmt: skip
    small = make_instances(spec, ["off"])
    large_spec = dataclasses.replace(spec, log_dir=log_dir / "large", server_args=(*flags, "--block-size", str(blocks[1])))
    large = make_instances(large_spec, ["off"], first_core=1)
    with running(small, large):
        pair = small["off"], large["off"]
        for inst, block in zip(pair, blocks):
            cache = inst.server.cache_config()
            assert int(cache["block_size"]) == block, cache
        # The first READ between two instances can stall on a 2-core box (docs/operations.md,
        # "Unanswered first calls"): one unchecked handoff each way before counting tokens.
        from pd_connector.dev.rig.cpu_matrix import random_prompt

        warm = random_prompt(40, seed=7)
        for p, d in ((pair[0], pair[1]), (pair[1], pair[0])):
            handoff(p, d, warm, 1)
        yield pair


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
