"""One engine's facts that both prompt rules read: what its configuration demands of the tail D
recomputes (``RecomputeProfile``, ``min_recompute_tokens``) and where its vLLM keeps a prompt's
recurrent state (``mamba_checkpoint_position``). The replay offset (core/handoff.py) and the
prompt checkpoints (core/checkpoints.py) both build on them; neither owns them.

Pure: ints and msgspec Structs only. No vLLM, torch, NIXL or sockets.
"""

from __future__ import annotations

import msgspec


class RecomputeProfile(msgspec.Struct, frozen=True):
    """What one engine's configuration demands of the prompt tail it recomputes itself.

    Extracted from vLLM config by the adapter (engine/from_vllm/vllm_config.py
    ``profile_from_vllm``); kept as plain fields so the rules are testable without vLLM.
    """

    # Any Mamba/SSM/GDN/linear-attention group: its state cannot be rolled back, so D must
    # recompute at least the last prompt token on top of the state it receives.
    has_recurrent_state: bool = False
    # vLLM's ``VllmConfig.num_prefill_lookahead_tokens``: 0 without EAGLE-family drafting, 1 for
    # EAGLE/EAGLE3/single-module MTP, K for multi-module MTP with K speculative tokens. The last
    # ``lookahead - 1`` prompt positions of the drafter's KV depend on tokens P never had.
    prefill_lookahead: int = 0
    # Sliding-window groups with bounded replay (``prefix_replay_tokens > 0``, DeepSeek-V4.1):
    # their window is laid out for the next token only, so D recomputes at least one token
    # (vLLM's ``_prefill_backoff`` backs off 1 for them, not the window: a P/D load restores
    # the window, ``Scheduler._load_restores_replay_window``). The >= 1 floor covers it.
    bounded_replay: bool = False
    # The unit u: with prefix caching in Mamba ``align`` mode, vLLM looks Mamba state up (and
    # registers it) only at multiples of this many tokens, the Mamba group's cache-hit
    # alignment: the ``prefix_match_unit`` when it is finer than the block, else the block
    # size. 0 = no prefix caching of recurrent state (no checkpoints).
    checkpoint_unit: int = 0
    # vLLM's ``SpeculativeConfig.use_eagle_block_drop()`` with prefix caching: the prompt
    # checkpoint sits one unit earlier (``get_mamba_prefill_checkpoint_position``:
    # floor(N/u)*u - u, "the EAGLE drop").
    eagle_drop: bool = False


def min_recompute_tokens(profile: RecomputeProfile) -> int:
    """The fewest prompt tokens an engine with ``profile`` must recompute after a handoff.

    Always >= 1: vLLM needs at least one computed prompt token to produce logits (it rewinds a
    full hit by one token in ``Scheduler._update_waiting_for_remote_kv``); making that explicit
    keeps "D recomputes exactly N - R tokens" true for attention-only models too.
    """
    return max(1, profile.prefill_lookahead - 1)


def mamba_checkpoint_position(num_tokens: int, unit: int, drop: bool) -> int:
    """Where vLLM keeps a prompt's reusable Mamba state: ``get_mamba_prefill_checkpoint_position``
    (vllm/v1/kv_cache_interface.py), restated so the core needs no vLLM (tests/vllm compare them).
    The last multiple of ``unit`` below ``num_tokens``, one unit earlier with the EAGLE drop.
    vLLM 0.33's ``num_hash_lookahead_tokens`` is left out: vLLM keeps it 0 under a KV connector."""
    limit = num_tokens if drop else num_tokens - 1
    position = limit // unit * unit - (unit if drop else 0)
    return max(position, 0)


__all__ = ["RecomputeProfile", "mamba_checkpoint_position", "min_recompute_tokens"]
