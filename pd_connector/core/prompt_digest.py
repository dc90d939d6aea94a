"""The handoff's prompt fingerprint: what ties the state P hands over to the prompt D serves.

P computes it over the R prompt tokens it prefilled plus what else decides that state (the
multimodal items placed before R, the LoRA adapter, the cache salt), returns it in
``kv_transfer_params`` (``pd_prompt_digest``) and records it in the lease. D computes it over
its own ``prompt[:R]`` and refuses a handoff whose fingerprint differs (``prompt_mismatch``:
a router that re-rendered a chat template, tokenizer drift, another conversation); its claim
carries the fingerprint, so P grants the blocks only to a D whose prompt is the one P computed,
whatever a router rewrote in the parameters.

The tokens are folded by CPython's tuple hash (xxHash-derived, 64 bits, one C loop: ~2 ns a
token, a third of serialising them for a cryptographic hash; see docs/benchmarks.md). Each step
of that fold is a bijection of the accumulator, so two prompts of equal length that differ in
one token always fold differently; other differences collide with probability ~2^-64. The fold,
the length and the extra keys are then hashed with BLAKE2b. It detects accidents, not an
adversary choosing prompts (who would need to control the router, which sees every prompt
anyway). ``DIGEST_VERSION`` names the function; a Python whose tuple hash differed would make
every handoff a loud ``prompt_mismatch``, never a silent one (pinned by a known-answer test).

Pure: ints, strings and tuples only.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence

import msgspec

DIGEST_VERSION = 1
_PERSON = b"pd-prompt-v1"
_encode = msgspec.msgpack.Encoder().encode

# What a multimodal item, a LoRA adapter and a cache salt contribute (vLLM's own prefix-cache
# keys for the same things: generate_block_hash_extra_keys in vllm/v1/core/kv_cache_utils.py).
ExtraKey = tuple


def token_fold(tokens: Sequence[int], length: int) -> int:
    """CPython's 64-bit tuple hash of ``tokens[:length]`` (token ids are non-negative ints)."""
    if len(tokens) < length:
        raise ValueError(f"{len(tokens)} tokens, fewer than the {length} to fingerprint")
    return hash(tuple(tokens) if len(tokens) == length else tuple(tokens[:length]))


def prompt_digest(tokens: Sequence[int], length: int, extra: tuple[ExtraKey, ...] = ()) -> str:
    """``"<version>:<32 hex digits>"`` for the first ``length`` tokens and ``extra`` keys
    (tuples of str/int, in a canonical order chosen by the caller)."""
    header = _encode((DIGEST_VERSION, sys.hash_info.width, length, extra))
    h = hashlib.blake2b(header, digest_size=16, person=_PERSON)
    h.update(token_fold(tokens, length).to_bytes(8, "little", signed=True))
    return f"{DIGEST_VERSION}:{h.hexdigest()}"


def extra_keys(
    mm_items: Sequence[tuple[str, int, int]] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
    length: int | None = None,
) -> tuple[ExtraKey, ...]:
    """The keys beyond the tokens that decide the state at ``length``: multimodal items
    ``(identifier, offset, placeholder length)`` starting before ``length`` (their embeddings
    replace the placeholder tokens), the LoRA adapter's name (its numeric id is assigned per
    server), and the cache salt."""
    keys: list[ExtraKey] = []
    if lora_name:
        keys.append(("lora", lora_name))
    if cache_salt:
        keys.append(("salt", cache_salt))
    keys.extend(
        ("mm", identifier, offset, size)
        for identifier, offset, size in mm_items
        if length is None or offset < length
    )
    return tuple(keys)
