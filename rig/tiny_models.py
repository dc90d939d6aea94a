"""Tiny random-weight HF models and a byte-level BPE tokenizer, built fully offline.

The test machines have no model hub access, so every model the e2e tests serve is generated here
from a fixed seed: a 1024-entry byte-level BPE tokenizer trained on torch's own ``.py`` files and
architectures that vLLM CPU 0.32.0 can serve (docs/testing.md, "Tiny models"):

- ``llama``: plain attention (LlamaForCausalLM); ``llama_kv1``: the same with one KV head
  (replicated on every rank at TP 2).
- ``nemotron_h``: Mamba2 + attention hybrid, layer pattern ``M*M-`` (NemotronHForCausalLM), one
  SSM group (replicated at TP 2); ``nemotron_h_g2``: two groups (one per rank at TP 2).
- ``granite_hybrid``: ``[mamba, attention, mamba, attention]``, no experts
  (GraniteMoeHybridForCausalLM); ``granite_moe_hybrid``: the same with 4 routed experts, 2 per
  token (MoE: vLLM steps its DP ranks in lockstep, and ``--enable-expert-parallel`` shards them).
- ``qwen3_next_mtp``: Qwen3-Next (gated delta net linear attention + full attention, MoE), 8
  layers with full attention every 4th, plus 3 native MTP modules (``num_nextn_predict_layers``),
  for ``{"method": "mtp"}`` speculative decoding (speculative_models.py); ``qwen3_next_mtp_tp2``:
  the same with two GDN key heads, so it runs at TP 2.
- ``eagle_llama``: an EAGLE-1 drafter (one Llama layer) for the 64-wide targets above.
- ``jamba``, ``falcon_h1``, ``kimi_linear``, ``lfm2``: the other hybrid families
  (family_models.py).

Weights are saved in **float32**: bf16 is not stable across the P/D split on CPU (aggregated
prefill of N tokens vs. P prefilling N-1 and D computing the last one accumulate differently), so
exact-match oracles need float32 (docs/testing.md, "How outputs are compared"). The exception is ``qwen3_next_mtp``:
vLLM CPU's GDN kernel runs only in bf16 ("CPU GDN attention requires BF16"), so tests on it use
the margin-aware oracle.

Usage::

    from rig.tiny_models import build_model
    model_dir = build_model("nemotron_h", tmp_root)

    python -m rig.tiny_models --out /tmp/tiny [--kind llama --kind nemotron_h]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from rig import family_models

MODEL_KINDS: tuple[str, ...] = (
    "llama", "llama_kv1", "nemotron_h", "nemotron_h_g2", "granite_hybrid", "qwen3_next_mtp", "qwen3_next_mtp_tp2",
    "eagle_llama", "granite_moe_hybrid", "jamba", "falcon_h1", "kimi_linear", "lfm2",
)
# Kinds built by speculative_models.py rather than from a transformers class alone.
_BF16_KINDS = ("qwen3_next_mtp", "qwen3_next_mtp_tp2")

# Bump whenever anything below changes the produced files: a cached model dir whose marker
# carries another spec is rebuilt instead of silently reused.
_SPEC_VERSION = 2
_MARKER = "pd_tiny_model.json"
_SEED = 0
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
# HF's default initializer_range is 0.02; with hidden size 64 that gives logits with a std of
# about 0.16, an almost flat distribution. Measured with HF float32 greedy generation (5 random
# prompts of 60-255 tokens x 24 tokens, all three kinds): at 0.02 about 20% of positions have a
# top-1/top-2 logprob margin below 1e-2, and dropping prompt token 10 changed the hybrids' output
# in only 1-2 of 5 prompts (weak negative controls: early tokens barely reach the output). At
# 0.2 the median margin is ~0.3, 1-2% of positions are below 1e-2, 22-24 of 24 generated tokens
# are distinct, and both "drop token 10" and "alter the second-to-last token" changed the output
# on 5/5 prompts for every kind. Correctness of the comparisons still rests on float32 and the
# margin-aware oracle, not on this.
_INIT_STD = 0.2
_MAX_POSITIONS = 2048
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _training_files() -> list[Path]:
    """Local text to train the tokenizer on: torch's top-level .py files, in a fixed order.

    find_spec avoids importing torch just to locate it; sorting makes the corpus (and hence the
    learned merges) independent of directory listing order.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise RuntimeError("torch is not importable; it is needed as tokenizer training text")
    files = sorted(Path(spec.origin).parent.glob("*.py"))
    if not files:
        raise RuntimeError(f"no .py files next to {spec.origin}")
    return files


def build_tokenizer():
    """Train the byte-level BPE tokenizer and wrap it as a PreTrainedTokenizerFast.

    Deterministic: same corpus and same trainer settings give the same merges (checked by hashing
    tokenizer.json over repeated builds).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte must be representable, otherwise arbitrary token-id prompts could decode to
        # text that does not re-encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in _training_files()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = _CHAT_TEMPLATE
    if len(fast) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(fast)} entries, expected {VOCAB_SIZE}")
    return fast


def common_config(tok) -> dict[str, Any]:
    """Config fields every tiny model shares (vocabulary, ids, width, init)."""
    import torch

    return dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=_MAX_POSITIONS,
        hidden_size=64,
        intermediate_size=128,
        initializer_range=_INIT_STD,
        tie_word_embeddings=False,
        dtype=torch.float32,
    )


def _model_config(kind: str, tok) -> Any:
    """HF config for ``kind``: hidden size 64, head_dim 32 (the smallest CPU_ATTN supports)."""
    common = common_config(tok)
    if kind in ("llama", "llama_kv1"):
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1 if kind == "llama_kv1" else 2,
            head_dim=32,
        )
    if kind in ("nemotron_h", "nemotron_h_g2"):
        from transformers import NemotronHConfig

        # "M*M-": Mamba2, attention, Mamba2, MLP. transformers 5 converts the legacy pattern into
        # layers_block_type; vLLM reads it back through the hybrid_override_pattern property.
        return NemotronHConfig(
            **common,
            hybrid_override_pattern="M*M-",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2 if kind == "nemotron_h_g2" else 1,
            conv_kernel=4,
            expand=2,
            chunk_size=64,
        )
    if kind in ("granite_hybrid", "granite_moe_hybrid"):
        from transformers import GraniteMoeHybridConfig

        # granite_moe_hybrid: 4 routed experts, 2 per token, besides the shared MLP (vLLM runs
        # a MoE model's DP ranks in lockstep and can shard its experts: data parallel tests).
        moe = {"num_local_experts": 4, "num_experts_per_tok": 2}
        return GraniteMoeHybridConfig(
            **common,
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            num_attention_heads=2,  # head_dim = 64 / 2 = 32
            num_key_value_heads=1,
            **(moe if kind == "granite_moe_hybrid" else {"num_local_experts": 0}),  # dense: only the shared MLP
            shared_intermediate_size=128,
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
        )
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def _spec(kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "spec_version": _SPEC_VERSION,
        "seed": _SEED,
        "init_std": _INIT_STD,
        "vocab_size": VOCAB_SIZE,
        "dtype": "bfloat16" if kind in _BF16_KINDS else "float32",
    }


def _is_complete(model_dir: Path, kind: str) -> bool:
    try:
        return json.loads((model_dir / _MARKER).read_text()) == _spec(kind)
    except (OSError, ValueError):
        return False


def _write_model(kind: str, out: Path) -> None:
    import torch
    from transformers import (
        GraniteMoeHybridForCausalLM,
        LlamaForCausalLM,
        NemotronHForCausalLM,
    )

    classes = {
        "llama": LlamaForCausalLM,
        "llama_kv1": LlamaForCausalLM,
        "nemotron_h": NemotronHForCausalLM,
        "nemotron_h_g2": NemotronHForCausalLM,
        "granite_hybrid": GraniteMoeHybridForCausalLM,
        "granite_moe_hybrid": GraniteMoeHybridForCausalLM,
    }
    tok = build_tokenizer()
    if kind in family_models.FAMILY_KINDS:
        family_models.write(kind, out, common_config(tok), _SEED)
        tok.save_pretrained(out)
        (out / _MARKER).write_text(json.dumps(_spec(kind), sort_keys=True))
        return
    if kind not in classes:
        from rig import speculative_models

        speculative_models.write(kind, out, tok, common_config(tok), _SEED)
        tok.save_pretrained(out)
        (out / _MARKER).write_text(json.dumps(_spec(kind), sort_keys=True))
        return
    config = _model_config(kind, tok)
    # Seed right before construction: the weights are whatever the constructor's init draws, so
    # the same seed + same config + same torch give bit-identical safetensors.
    torch.manual_seed(_SEED)
    model = classes[kind](config).to(torch.float32).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # The marker goes last: its presence (with the right spec) is what "complete" means.
    (out / _MARKER).write_text(json.dumps(_spec(kind), sort_keys=True))


def build_model(kind: str, root: Path) -> Path:
    """Return ``root / kind``, building it first unless a complete copy is already there.

    Building happens in a private temp dir that is renamed into place only when complete, so an
    interrupted build never leaves a directory that a later call would reuse; concurrent builders
    (e.g. pytest-xdist workers) each build privately and the first rename wins.
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")
    root = Path(root)
    final = root / kind
    if _is_complete(final, kind):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{kind}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_model(kind, tmp)
        if final.exists():
            if _is_complete(final, kind):  # another builder finished first
                return final
            # Stale (older spec or pre-marker leftovers): move aside first so that the rename
            # below is the only moment `final` changes, then delete.
            stale = root / f".{kind}.stale-{uuid.uuid4().hex[:8]}"
            try:
                final.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            except FileNotFoundError:
                pass
        try:
            tmp.rename(final)
        except OSError:
            # Lost a race to a concurrent builder; accept its result only if complete.
            if not _is_complete(final, kind):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="root directory; one subdir per kind")
    ap.add_argument(
        "--kind",
        action="append",
        choices=MODEL_KINDS,
        help="model kind to build (repeatable); default: all",
    )
    args = ap.parse_args(argv)
    for kind in args.kind or MODEL_KINDS:
        print(build_model(kind, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
