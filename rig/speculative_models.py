"""Tiny models for speculative decoding on vLLM CPU: a Qwen3-Next target with native MTP modules
and an EAGLE-1 drafter. Called by ``tiny_models.build_model`` (which owns caching, the tokenizer
and the completeness marker). Why these shapes: below, and docs/testing.md.

- ``qwen3_next_mtp``: 8 layers, full attention every 4th (layers 3 and 7), 6 GDN layers. vLLM
  puts every drafting layer in one KV-cache group only if the target has at least as many GDN
  layers as full-attention plus MTP layers (``llm_base_proposer.py``: "All drafting layers should
  belong to the same kv cache group"); 6 >= 2 + 3. GDN's CPU kernel needs linear key/value head
  dims of 128 and bf16. The MTP modules are copies of the last full-attention layer plus the
  ``mtp.fc`` / norm tensors vLLM's ``Qwen3NextMTP`` loads; vLLM reads them from the target
  checkpoint, so the speculative config names only ``{"method": "mtp"}``.
- ``eagle_llama``: vLLM's ``EagleLlamaForCausalLM`` layout (one decoder layer without input norm,
  ``fc`` over [embedding, hidden], no final norm or head), float32 like the Mamba2 targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MTP_MODULES = 3
_QWEN_LAYERS = 8
_QWEN_FULL_ATTENTION_INTERVAL = 4
# bf16 rounding noise grows with activation size; the float32 models' 0.2 (tiny_models._INIT_STD)
# gave logprob differences of 0.03-0.25 between P/D and aggregated serving here.
QWEN_INIT_STD = 0.02
# ...but at 0.02 everywhere the GDN layers barely reach the output: D resuming one token early
# (a desync) was caught on only 4 of 10 prompts by the bf16 oracle. Scaling only the GDN input
# projection (q/k/v/z) by 2 and its output projection by 4 makes the recurrent path matter:
# measured (vLLM CPU, self-handoff, 10 prompts of 31-257 tokens) the desync is caught on 10/10
# (8 with a different first token), while agreeing handoffs still differ from aggregated
# serving by at most 4e-3 in logprob (one bf16 step, as without the scaling). Powers of
# two keep the scaling exact in bf16.
GDN_WEIGHT_SCALES = {"linear_attn.in_proj_qkvz.weight": 2.0, "linear_attn.out_proj.weight": 4.0}


def write(kind: str, out: Path, tok, common: dict[str, Any], seed: int) -> None:
    if kind == "qwen3_next_mtp":
        _write_qwen3_next_mtp(out, common, seed)
    elif kind == "qwen3_next_mtp_tp2":
        # vLLM splits GDN's key heads over TP ranks: one key head cannot run at TP 2.
        _write_qwen3_next_mtp(out, common, seed, key_heads=2)
    elif kind == "eagle_llama":
        _write_eagle_llama(out, tok, common, seed)
    else:  # pragma: no cover - tiny_models validates kinds first
        raise ValueError(f"unknown speculative model kind {kind!r}")


def _write_qwen3_next_mtp(out: Path, common: dict[str, Any], seed: int, key_heads: int = 1) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **{**common, "dtype": torch.bfloat16, "initializer_range": QWEN_INIT_STD},
        num_hidden_layers=_QWEN_LAYERS,
        full_attention_interval=_QWEN_FULL_ATTENTION_INTERVAL,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_value_heads=2 * key_heads,
        linear_num_key_heads=key_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        # Every token goes to every expert (top-k = all): top-k routing would turn bf16 rounding
        # noise into a different expert, i.e. logprob jumps of 0.1-0.3 between P/D and aggregated
        # serving, far above the tie margin the oracle can tolerate. (Dense MLPs everywhere are
        # refused: vLLM's Qwen3Next wants at least one MoE layer, "No Qwen3Next layer found".)
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_nextn_predict_layers=MTP_MODULES,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            for suffix, scale in GDN_WEIGHT_SCALES.items():
                if name.endswith(suffix):
                    weight.mul_(scale)
    model.save_pretrained(out)
    weights_file = out / "model.safetensors"
    tensors = load_file(weights_file)
    last_full = max(i for i, t in enumerate(config.layer_types) if t == "full_attention")
    prefix = f"model.layers.{last_full}."
    generator = torch.Generator().manual_seed(seed + 1)
    hidden = config.hidden_size
    for i in range(MTP_MODULES):
        for name, tensor in list(tensors.items()):
            if name.startswith(prefix):
                tensors[f"mtp.layers.{i}.{name[len(prefix):]}"] = tensor.clone()
    tensors["mtp.fc.weight"] = (
        torch.randn(hidden, 2 * hidden, generator=generator) * QWEN_INIT_STD
    ).to(torch.bfloat16)
    for norm in ("pre_fc_norm_hidden", "pre_fc_norm_embedding", "norm"):
        tensors[f"mtp.{norm}.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, weights_file, metadata={"format": "pt"})


def _write_eagle_llama(out: Path, tok, common: dict[str, Any], seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(
        **common,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
    )
    config.architectures = ["LlamaForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    generator = torch.Generator().manual_seed(seed + 2)
    std = common["initializer_range"]
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim

    def rand(*shape: int):
        return torch.randn(*shape, generator=generator) * std

    tensors = {
        "fc.weight": rand(h, 2 * h),
        "embed_tokens.weight": rand(vocab, h),
        "layers.0.self_attn.q_proj.weight": rand(q_out, h),
        "layers.0.self_attn.k_proj.weight": rand(kv_out, h),
        "layers.0.self_attn.v_proj.weight": rand(kv_out, h),
        "layers.0.self_attn.o_proj.weight": rand(h, q_out),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
