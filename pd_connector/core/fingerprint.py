"""The handoff's prompt fingerprint: what ties the state P hands over to the prompt D serves.

P computes it over the R prompt tokens it prefilled plus what else decides that state (the
multimodal items placed before R, the LoRA adapter, the cache salt), returns it in
``kv_transfer_params`` (``pd_prompt_fingerprint``) and records it in the lease. D computes it over
its own ``prompt[:R]`` and refuses a handoff whose fingerprint differs (``prompt_mismatch``:
a router that re-rendered a chat template, tokenizer drift, another conversation); its claim
carries the fingerprint, so P grants the blocks only to a D whose prompt is the one P computed,
whatever a router rewrote in the parameters.

Two forms, named in the fingerprint (``"<version>:<form>:<hex>"``):

- ``b:<algo>:<block size>:<seed tag>``: vLLM's own prefix-cache block hash of the last full
  block before R (a chain over every earlier block's tokens and vLLM's extra keys, computed for
  every request of an engine with a KV connector: EngineCore's request_block_hasher), plus the
  fewer than ``block size`` tokens after it. Costs the same at any prompt length. Comparable
  only between engines with the same hash algorithm, block size and hash seed (the seed tag).
- ``t``: every token folded here, when the engine's block hashes are not comparable across
  processes (an xxhash algorithm without PYTHONHASHSEED: vLLM seeds it randomly per process),
  and for a prompt with a LoRA adapter or a multimodal item before R, whose block hashes name
  the adapter's path and the model's path (engine/from_vllm/identity.keyed_by_mount_path).

Both forms cover the same inputs besides the tokens (``extra_keys``), none of them a path.
Version 2: the adapter's files and the items' data instead of vLLM's identifiers.

Tokens are folded by CPython's tuple hash (xxHash-derived, 64 bits, one C loop); each step of
that fold is a bijection of the accumulator, so two token runs of equal length that differ in one
token always fold differently; other differences collide with probability ~2^-64. Everything is
then hashed with BLAKE2b. It detects accidents, not an adversary choosing prompts (who would need
to control the router, which sees every prompt anyway). A Python whose tuple hash differed would
make every handoff a loud ``prompt_mismatch``, never a silent one (pinned by a known-answer test).

Pure: ints, bytes, strings and tuples only.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence

import msgspec

# Bump when what a fingerprint covers changes: a peer of another version is refused by name.
FINGERPRINT_VERSION = 2
TOKENS = "t"
_PERSON = b"pd-prompt-v1"
_encode = msgspec.msgpack.Encoder().encode

# What a multimodal item, a LoRA adapter and a cache salt contribute (vLLM's own prefix-cache
# keys for the same things: generate_block_hash_extra_keys in vllm/v1/core/kv_cache_utils.py).
ExtraKey = tuple


def token_fold(tokens: Sequence[int], start: int, end: int) -> int:
    """CPython's 64-bit tuple hash of ``tokens[start:end]`` (token ids are non-negative ints)."""
    if len(tokens) < end:
        raise ValueError(f"{len(tokens)} tokens, fewer than the {end} to fingerprint")
    return hash(tuple(tokens) if start == 0 and len(tokens) == end else tuple(tokens[start:end]))


def blocks_form(algo: str, block_size: int, seed_tag: str) -> str:
    return f"b:{algo}:{block_size}:{seed_tag}"


def parse_blocks_form(form: str) -> tuple[str, int, str] | None:
    """(algorithm, hash block size, seed tag) of a blocks form, None for any other form."""
    parts = form.split(":")
    if len(parts) != 4 or parts[0] != "b" or not parts[2].isdigit() or int(parts[2]) <= 0:
        return None
    return parts[1], int(parts[2]), parts[3]


def form_of(fingerprint: str) -> str:
    """The form a fingerprint was computed in ("" if it is not one of ours)."""
    version, sep, rest = fingerprint.partition(":")
    form, sep2, _ = rest.rpartition(":")
    return form if sep and sep2 and version == str(FINGERPRINT_VERSION) else ""


def fingerprint(
    tokens: Sequence[int],
    length: int,
    extra: tuple[ExtraKey, ...] = (),
    *,
    form: str = TOKENS,
    chain: bytes = b"",
    chain_tokens: int = 0,
) -> str:
    """The fingerprint of ``tokens[:length]`` and the ``extra`` keys (tuples of str/int, in a
    canonical order chosen by the caller). ``chain``: vLLM's block hash covering
    ``tokens[:chain_tokens]`` (blocks form); the tokens after it are folded here."""
    header = _encode((FINGERPRINT_VERSION, sys.hash_info.width, form, length, chain_tokens, extra))
    h = hashlib.blake2b(header, digest_size=16, person=_PERSON)
    h.update(bytes(chain))
    h.update(token_fold(tokens, chain_tokens, length).to_bytes(8, "little", signed=True))
    return f"{FINGERPRINT_VERSION}:{form}:{h.hexdigest()}"


def extra_keys(
    mm_items: Sequence[tuple[str, int, int]] = (),
    lora_name: str | None = None,
    cache_salt: str | None = None,
    length: int | None = None,
    lora_files: str = "",
) -> tuple[ExtraKey, ...]:
    """The keys beyond the tokens that decide the state at ``length``, none of them a mount
    path: multimodal items ``(content digest, offset, placeholder length)`` starting before
    ``length`` (their embeddings replace the placeholder tokens), the LoRA adapter's name and
    the identity of its files (its numeric id is assigned per server), and the cache salt."""
    keys: list[ExtraKey] = []
    if lora_name:
        keys.append(("lora", lora_name, lora_files))
    if cache_salt:
        keys.append(("salt", cache_salt))
    keys.extend(
        ("mm", identifier, offset, size)
        for identifier, offset, size in mm_items
        if length is None or offset < length
    )
    return tuple(keys)
