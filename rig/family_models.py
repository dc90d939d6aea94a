"""Tiny random-weight models of the hybrid families the README names beyond Nemotron-H, Granite-4-H
and Qwen3-Next: Jamba (Mamba1 layers), Falcon-H1 (attention and Mamba2 side by side in every
block), Kimi Linear (KDA linear attention + MLA) and an LFM2-style model (short convolutions).
Called by ``tiny_models.build_model`` (which owns caching, the tokenizer and the marker).

Each is the smallest shape of its vLLM class: hidden size 64, attention head dim 32 (CPU
attention's minimum), two KV heads where a model has them (one per rank at TP 2), two layers of
each kind (``lfm2``: four short-convolution layers and no attention). Which of them vLLM CPU 0.32
serves, and the exact error of those it does not: docs/testing.md ("Hybrid families").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAMILY_KINDS = ("jamba", "falcon_h1", "kimi_linear", "lfm2")


def config(kind: str, common: dict[str, Any]) -> Any:
    """The transformers config of ``kind`` (Kimi Linear: vLLM's own config class)."""
    if kind == "jamba":
        from transformers import JambaConfig

        # Layers 1 and 3 attention, 0 and 2 Mamba1 (attn_layer_period/offset); one expert per
        # layer is vLLM's dense MLP (JambaMambaDecoderLayer: MoE only for num_experts > 1).
        return JambaConfig(
            **common, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
            num_attention_heads=2, num_key_value_heads=2, num_experts=1, num_experts_per_tok=1,
            expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=8,
        )  # fmt: skip
    if kind == "falcon_h1":
        from transformers import FalconH1Config

        # Every block runs attention and Mamba2 on the same input (FalconH1ParallelHybrid).
        return FalconH1Config(
            **common, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            head_dim=32, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64,
        )  # fmt: skip
    if kind == "lfm2":
        from transformers import Lfm2Config

        # Short convolutions only: vLLM CPU 0.32's Lfm2Attention is not a function of the prompt
        # alone (docs/testing.md, "Hybrid families"), so no output oracle holds with it.
        return Lfm2Config(
            **{k: v for k, v in common.items() if k != "intermediate_size"}, intermediate_size=128,
            num_hidden_layers=4, layer_types=["conv"] * 4,
            num_attention_heads=2, num_key_value_heads=2, conv_L_cache=3, conv_bias=False,
            block_auto_adjust_ff_dim=False, norm_eps=1e-5,
            # The hub checkpoints' names for the widths vLLM's Lfm2 reads (transformers uses
            # hidden_size): conv channels and the feed-forward's input.
            conv_dim=64, conv_dim_out=64, block_dim=64,
        )  # fmt: skip
    if kind == "kimi_linear":
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

        # vLLM's KimiLinearConfig (kda_layers / full_attn_layers are 1-based): layers 1 and 3
        # KDA, 2 and 4 MLA without RoPE (vLLM's MLA for Kimi is NoPE-only), dense MLPs.
        return KimiLinearConfig(
            **{k: v for k, v in common.items() if k not in ("dtype",)}, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, head_dim=32, kv_lora_rank=32,
            q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            mla_use_nope=True, num_experts=None,
            linear_attn_config={
                "kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 32, "num_heads": 2,
                "short_conv_kernel_size": 4,
            },
            architectures=["KimiLinearForCausalLM"], torch_dtype="float32",
        )  # fmt: skip
    raise ValueError(f"unknown family kind {kind!r}")


def write(kind: str, out: Path, common: dict[str, Any], seed: int) -> None:
    import torch

    cfg = config(kind, common)
    if kind == "kimi_linear":
        _write_kimi_linear(cfg, out, common, seed)
        return
    from transformers import FalconH1ForCausalLM, JambaForCausalLM, Lfm2ForCausalLM

    cls = {"jamba": JambaForCausalLM, "falcon_h1": FalconH1ForCausalLM, "lfm2": Lfm2ForCausalLM}[kind]
    torch.manual_seed(seed)
    cls(cfg).to(torch.float32).eval().save_pretrained(out)


def _write_kimi_linear(cfg: Any, out: Path, common: dict[str, Any], seed: int) -> None:
    """Kimi Linear in the checkpoint layout vLLM loads (the hub's names: q/k/v_conv1d, f_a/f_b
    projections on the attention module; transformers' own class renames and stacks them), with
    weights drawn from transformers' KimiLinearForCausalLM of the same shapes."""
    import torch
    from safetensors.torch import save_file
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    heads, head_dim = cfg.linear_attn_config["num_heads"], cfg.linear_attn_config["head_dim"]
    hf = KimiLinearConfig(
        **{k: v for k, v in common.items() if k != "dtype"}, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=None, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
        mlp_layer_types=["dense"] * cfg.num_hidden_layers,
        layer_types=[
            "linear_attention" if i + 1 in cfg.linear_attn_config["kda_layers"] else "full_attention"
            for i in range(cfg.num_hidden_layers)
        ],
        linear_head_dim=head_dim, linear_num_heads=heads,
        linear_conv_kernel_dim=cfg.linear_attn_config["short_conv_kernel_size"],
    )  # fmt: skip
    torch.manual_seed(seed)
    state = KimiLinearForCausalLM(hf).to(torch.float32).state_dict()
    tensors = {}
    for name, tensor in state.items():
        name = name.replace(".forget_gate.", ".")
        if name.endswith("self_attn.conv1d.weight"):
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):
                tensors[name.replace("conv1d", f"{part}_conv1d")] = chunk.contiguous()
            continue
        if name.endswith("self_attn.A_log"):
            tensor = tensor.reshape(heads)
        tensors[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
