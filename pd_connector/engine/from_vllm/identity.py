"""What identifies P's state, read from vLLM: the model's identity (compared at the handshake)
and the prompt fingerprint's inputs (core/fingerprint.py: vLLM's block hashes where another
engine can reproduce them, the request's LoRA adapter, cache salt and multimodal items), each
independent of where the model or the adapter is mounted."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import OrderedDict
from typing import Any

from pd_connector.core.fingerprint import TOKENS, blocks_form, extra_keys, fingerprint, form_of, parse_blocks_form

__all__ = [
    "TOKENS",
    "adapter_files_digest",
    "fingerprint_form",
    "keyed_by_mount_path",
    "lora_identity",
    "mm_item_digest",
    "model_files_digest",
    "model_identity",
    "prompt_extra_keys",
    "prompt_fingerprint",
    "prompt_fingerprint_rehashed",
    "sibling_group",
]


def _name(path_or_id: Any) -> str:
    """A Hugging Face repo id whole (``org/name``: ``org1/X`` is not ``org2/X``); a local
    directory by its last component, since P and D may mount the same weights at different
    paths."""
    text = str(path_or_id or "").rstrip("/")
    if not text:
        return ""
    if os.path.isabs(text) or text.startswith((".", "~")) or os.path.isdir(text):
        return os.path.basename(text)
    return text


# Files whose bytes decide what a model computes from a prompt (weights sampled, see below).
_CONFIG_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# Bytes read from the start of each weights file's tensor data: enough to tell two trainings
# (or two random initialisations) of the same shapes apart, cheap at start-up for any size.
WEIGHT_SAMPLE_BYTES = 64 * 1024


def model_files_digest(path: Any) -> str:
    """A content fingerprint of a local model directory ("" for a hub id or a file): its config
    and tokenizer files, the names and sizes of its weight files, and the first
    ``WEIGHT_SAMPLE_BYTES`` of each one's tensor data (after a safetensors header). The same
    weights mounted at two paths agree; another model under the same directory name does not.
    Weights that differ only past each file's sample are not seen."""
    root = str(path or "")
    if not os.path.isdir(root):
        return ""
    h = hashlib.blake2b(digest_size=12)
    names = sorted(os.listdir(root))
    for name in names:
        full = os.path.join(root, name)
        if name in _CONFIG_FILES and os.path.isfile(full):
            with open(full, "rb") as f:
                h.update(f"{name}\0".encode() + f.read() + b"\0")
        elif name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(full):
            h.update(f"{name}\0{os.path.getsize(full)}\0".encode() + _weight_sample(full))
    return h.hexdigest()


def _weight_sample(path: str) -> bytes:
    with open(path, "rb") as f:
        if path.endswith(".safetensors"):
            head = f.read(8)
            if len(head) == 8:
                f.seek(8 + int.from_bytes(head, "little"))
        return f.read(WEIGHT_SAMPLE_BYTES)


def model_identity(model_config: Any) -> dict[str, Any]:
    """What names the weights and positions P's pages were computed with, from vLLM's
    ``ModelConfig`` (vllm/config/model.py): model and tokenizer with their revisions, the
    quantization method, the RoPE parameters of the resolved config (``--hf-overrides`` and
    rope scaling included: they move every position's rotation), and ``max_model_len`` only
    under a scaled RoPE, where the rotation can depend on it (longrope picks its factors by it,
    dynamic NTK scales with it); without scaling positions do not depend on it, and P and D may
    differ (a P serving shorter prompts). A local model directory is named by its last component
    (P and D may mount it at different paths) and identified by its content
    (``model_files_digest``)."""
    rope_parameters = getattr(getattr(model_config, "hf_text_config", None), "rope_parameters", None)
    rope = ""
    scaled = False
    if isinstance(rope_parameters, dict) and rope_parameters:
        rope = json.dumps(rope_parameters, sort_keys=True, default=str)
        kinds = [p.get("rope_type", "default") for p in iter_rope_dicts(rope_parameters)]
        scaled = any(kind != "default" for kind in kinds)
    return {
        "model": _name(model_config.model),
        "model_files": model_files_digest(model_config.model),
        "model_revision": str(getattr(model_config, "revision", None) or ""),
        "tokenizer": _name(getattr(model_config, "tokenizer", None) or model_config.model),
        "tokenizer_revision": str(getattr(model_config, "tokenizer_revision", None) or ""),
        "quantization": str(getattr(model_config, "quantization", None) or ""),
        "rope": rope,
        "max_model_len": int(getattr(model_config, "max_model_len", 0) or 0) if scaled else 0,
    }


def iter_rope_dicts(rope_parameters: dict) -> list[dict]:
    """One dict per layer type when nested (vLLM's iter_rope_parameters), else the dict."""
    nested = [v for v in rope_parameters.values() if isinstance(v, dict)]
    return nested if nested and len(nested) == len(rope_parameters) else [rope_parameters]


def sibling_group(request_id: str) -> str | None:
    """The parent of an ``n > 1`` child request: vLLM names child i ``f"{i}_{parent_id}"``
    (ParentRequest.get_child_info, vllm/v1/engine/parallel_sampling.py), and the parent id
    carries a random suffix (InputProcessor.assign_request_id). None for other ids."""
    index, sep, parent = request_id.partition("_")
    return parent if sep and parent and index.isdigit() else None


def prompt_extra_keys(request: Any, length: int) -> tuple | None:
    """What besides the first ``length`` prompt tokens decides the state there
    (core/fingerprint.extra_keys), from vLLM's ``Request``, in a form independent of where the
    model and the adapter are mounted: each multimodal item by its processed data
    (``mm_item_digest``), the LoRA adapter by its name and files (``lora_identity``). None when
    the prompt cannot be fingerprinted (prompt embeddings: the state depends on tensors, not
    tokens; a multimodal item before ``length`` whose data this engine never saw)."""
    if request.prompt_embeds is not None:
        return None
    lora, salt, features = request.lora_request, request.cache_salt, request.mm_features
    if not (lora or salt or features):
        return ()  # the common case, on every handoff: no attribute chase
    items = []
    for f in features or ():
        offset, size = int(f.mm_position.offset), int(f.mm_position.length)
        if offset >= length:
            continue
        digest = mm_item_digest(f)
        if digest is None:
            return None
        items.append((digest, offset, size))
    name = getattr(lora, "lora_name", None)
    return extra_keys(items, name, salt, length, lora_identity(lora) if lora else "")


def keyed_by_mount_path(request: Any, length: int) -> bool:
    """Whether vLLM's block hashes of this prompt's first ``length`` tokens depend on where the
    files are mounted: its multimodal identifiers hash ``model_config.model`` (the full path:
    ``ProcessorInputs.get_mm_hashes`` in vllm/multimodal/processing/inputs.py) and its LoRA key
    is the adapter's name and path (``_gen_lora_extra_hash_keys`` in
    vllm/v1/core/kv_cache_utils.py). Such prompts are fingerprinted in the tokens form."""
    if request.lora_request:
        return True
    return any(int(f.mm_position.offset) < length for f in request.mm_features or ())


# Content digests of multimodal items by vLLM's identifier: the identifier names the same item
# within this process (vLLM's own encoder and processor caches rely on it), and an item's data
# is None in EngineCore when the processor cache had it (mm_processor_cache_type "shm").
_MM_DIGESTS: OrderedDict[str, str] = OrderedDict()
_MM_DIGESTS_MAX = 4096


def mm_item_digest(feature: Any) -> str | None:
    """A multimodal item by its modality and processed data (vLLM's ``MultiModalKwargsItem``:
    pixel values, audio features and their grids, what the encoder computes the embeddings
    from), hashed as vLLM's MultiModalHasher frames tensors; None if this engine has neither the
    data nor an earlier digest for its identifier."""
    key = str(feature.identifier)
    digest = _MM_DIGESTS.get(key)
    if digest is not None:
        _MM_DIGESTS.move_to_end(key)
        return digest
    if feature.data is None:
        return None
    from vllm.multimodal.hasher import MultiModalHasher

    data = feature.data.get_data()
    digest = MultiModalHasher.hash_kwargs(
        "sha256", modality=str(feature.modality), data={k: data[k] for k in sorted(data)}
    )[:32]
    _MM_DIGESTS[key] = digest
    if len(_MM_DIGESTS) > _MM_DIGESTS_MAX:
        _MM_DIGESTS.popitem(last=False)
    return digest


def lora_identity(lora_request: Any) -> str:
    """A LoRA adapter by its files when ``lora_path`` is a local directory (``files:`` and
    ``adapter_files_digest``: the same adapter at two paths agrees, another adapter under the
    same name does not), else by the path or hub id whole (``id:``)."""
    path = str(getattr(lora_request, "lora_path", "") or "")
    digest = adapter_files_digest(path, int(getattr(lora_request, "lora_int_id", 0) or 0))
    return f"files:{digest}" if digest else f"id:{path}"


@functools.lru_cache(maxsize=256)
def adapter_files_digest(path: str, adapter_id: int = 0) -> str:
    """A content fingerprint of a local LoRA adapter directory ("" for anything else): every
    byte of its ``adapter_config.json`` and weight files (adapters are small next to a model).
    Computed once per path and vLLM adapter id (``lora_int_id``), as vLLM loads an adapter once
    per id (vllm/lora/worker_manager.py); ``adapter_id`` only keys that cache."""
    if not os.path.isdir(path):
        return ""
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if (name == "adapter_config.json" or name.endswith(_WEIGHT_SUFFIXES)) and os.path.isfile(full):
            h.update(f"{name}\0{os.path.getsize(full)}\0".encode())
            with open(full, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


# vLLM seeds these block hashes randomly per process unless PYTHONHASHSEED is set
# (resolve_none_hash_seed in vllm/v1/core/kv_cache_utils.py): not comparable across engines.
_PER_PROCESS_SEEDED = ("xxhash", "xxhash_cbor")


def fingerprint_form(vllm_config: Any, kv_cache_config: Any) -> tuple[str, int]:
    """(form, hash block size) of this engine's prompt fingerprints (core/fingerprint.py):
    vLLM's own block hashes when another engine can reproduce them (EngineCore hashes every
    request's blocks when a KV connector is loaded, at kv_cache_config.hash_block_size, with
    --prefix-caching-hash-algo and a seed from PYTHONHASHSEED or vLLM's fixed default), else
    every token folded."""
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "") or "")
    block = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
    seed = os.environ.get("PYTHONHASHSEED")
    if not algo or block <= 0 or (seed is None and algo in _PER_PROCESS_SEEDED):
        return TOKENS, 0
    if seed is None:
        from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

        seed = DEFAULT_NONE_HASH_SEED
    return blocks_form(algo, block, hashlib.blake2b(seed.encode(), digest_size=4).hexdigest()), block


def prompt_fingerprint(request: Any, length: int, form: str = TOKENS, block_size: int = 0) -> str | None:
    """The fingerprint of a vLLM ``Request``'s first ``length`` prompt tokens in ``form``, or
    None if it cannot have one (prompt embeddings, a multimodal item's data missing, or no block
    hashes for the blocks form). In the tokens form whatever ``form`` asks when vLLM's block
    hashes depend on mount paths (``keyed_by_mount_path``): P then sends that form, and D,
    asked for a blocks form for such a prompt, computes one P's cannot equal."""
    extra = prompt_extra_keys(request, length)
    tokens = request.prompt_token_ids
    if extra is None or tokens is None or len(tokens) < length:
        return None
    if form == TOKENS or keyed_by_mount_path(request, length):
        return fingerprint(tokens, length, extra)
    full = length // block_size
    hashes = getattr(request, "block_hashes", None) or ()
    if len(hashes) < full:
        return None
    chain = hashes[full - 1] if full else b""
    return fingerprint(tokens, length, extra, form=form, chain=chain, chain_tokens=full * block_size)


def prompt_fingerprint_rehashed(request: Any, length: int, theirs: str, mine: str) -> str | None:
    """The fingerprint in another engine's blocks form that differs from ours (``mine``) only in
    the hash block size, e.g. prefix caching on one side only (a hybrid hashes at its Mamba
    block with it, at the whole context without it): vLLM's block-hash chain rebuilt at that
    size the way EngineCore's request hasher builds it (``get_request_block_hasher`` in
    vllm/v1/core/kv_cache_utils.py; this process's hash seed is the one the tag names). None
    if the algorithm or seed differ too."""
    theirs_form, mine_form = parse_blocks_form(theirs), parse_blocks_form(mine)
    if theirs_form is None or mine_form is None:
        return None
    algo, block_size, seed_tag = theirs_form
    if (algo, seed_tag) != (mine_form[0], mine_form[2]):
        return None
    if keyed_by_mount_path(request, length):
        return prompt_fingerprint(request, length)
    extra = prompt_extra_keys(request, length)
    tokens = request.prompt_token_ids
    if extra is None or tokens is None or len(tokens) < length:
        return None
    full = length // block_size
    chain: bytes = b""
    if full:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        hash_fn, parent, mm_index = get_hash_fn_by_name(algo), None, 0
        for start in range(0, full * block_size, block_size):
            keys, mm_index = generate_block_hash_extra_keys(request, start, start + block_size, mm_index)
            parent = hash_block_tokens(hash_fn, parent, tokens[start : start + block_size], keys)
        chain = parent
    return fingerprint(tokens, length, extra, form=theirs, chain=chain, chain_tokens=full * block_size)


# The choice of form, for both roles (engine/prefill/prefill_scheduler.py offers, engine/decode/
# scheduler.py checks): the engine's own form where it has one, every token folded otherwise.
def fingerprint_to_offer(request: Any, length: int, mine: tuple[str, int]) -> str | None:
    """P's fingerprint of the ``length`` tokens it prefilled: in this engine's form, every token
    folded where its block hashes are missing; None: nothing D could check."""
    return prompt_fingerprint(request, length, *mine) or prompt_fingerprint(request, length)


def fingerprint_to_check(request: Any, length: int, theirs: str, mine: tuple[str, int]) -> str | None:
    """D's fingerprint of its own first ``length`` tokens in the form P used (``theirs``): the
    tokens form, our own blocks form, or another hash block size of it (rehashed); None for a
    form we cannot compute (another hash algorithm or seed)."""
    form = form_of(theirs)
    if form == TOKENS:
        return prompt_fingerprint(request, length)
    if form == mine[0]:
        return prompt_fingerprint(request, length, *mine)
    return prompt_fingerprint_rehashed(request, length, form, mine[0])
