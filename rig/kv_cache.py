"""Waiting for vLLM servers to hold no KV block (a leak check after handoffs and refusals)."""

from __future__ import annotations

import time


def kv_cache_empty_within(servers, seconds: float) -> dict:
    """Poll ``vllm:kv_cache_usage_perc`` until it is 0 on every server: {} then, else the last
    readings by server log name once ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while True:
        usage = {s.log_path.stem: s.metric("vllm:kv_cache_usage_perc") for s in servers}
        if all(v == 0 for v in usage.values()):
            return {}
        if time.monotonic() > deadline:
            return usage
        time.sleep(0.2)
