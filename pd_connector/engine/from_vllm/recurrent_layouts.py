"""How vLLM shards each recurrent layer's states over TP, as ``core.shards.StateLayout``.

An allow-list by the layer's class (the module vLLM registered under the layer's name in
``compilation_config.static_forward_context``), each rule read off that class's code in vLLM
0.32 and 0.33 (unchanged between them). A rank's channels and heads are always its contiguous
``1 / TP`` share, in the order below; the rule's global sizes come from the module and are
checked against the spec through vLLM's own shape function, so a spec of another shape (e.g.
ReplaySSM's ring states) is refused:

- ``MambaMixer`` (Jamba, Mamba, FalconMamba; mamba_mixer.py): conv state of the intermediate
  channels x (``conv1d`` and ``in_proj`` are column-parallel over ``intermediate_size``), SSM
  state ``(I, N)`` by those channels (``A``, ``D`` loaded split on dim 0); no speculative rows
  (``mamba1_state_shape``).
- ``MambaMixer2`` (Nemotron-H, Granite-4-H, Falcon-H1, Zamba2, Bamba): conv ``[x | B | C]``, B and
  C by groups, or the single group on every rank when TP does not divide ``n_groups`` (then
  ``conv1d`` is a plain ``ColumnParallelLinear`` loaded by ``mamba_v2_sharded_weight_loader``
  with ``duplicate_groups``); SSM state ``(H, P, S)`` by heads (``mamba2_state_shape``).
- ``ShortConv`` (LFM2; short_conv.py): one conv state over ``conv_dim`` channels (``conv`` is
  column-parallel; ``B * x`` is what it convolves), ``short_conv_state_shape``.
- GDN (``QwenGatedDeltaNetAttention``, ``OlmoHybridGatedDeltaNetAttention``): conv ``[Q | K | V]``
  (``mamba_v2_sharded_weight_loader`` / the fused conv loader: each of q, k, v split on its own),
  recurrent state ``(Hv, dv, dk)`` by value heads (``gated_delta_net_state_shape``).
- KDA (``KimiGatedDeltaNetAttention`` for Kimi Linear, ``KimiK3DeltaAttention`` without its
  RecoverSSM records, ``BailingMoeV3KimiDeltaAttention``, ``Glm5NextLinearAttention``): conv
  ``[Q | K | V]``, each ``num_heads x head_dim`` (``_make_fused_conv1d_weight_loader``; Bailing
  ``conv_state.chunk(3)``, GLM-5 ``cat(q_conv1d, k_conv1d, v_conv1d)``), recurrent state
  ``(H, D, D)`` by heads (``A_log`` narrowed per rank; ``kda_state_shape``).
- ``MiniMaxText01LinearAttention`` (linear_attn/minimax_linear_attn.py): one state ``(H, D, D)``
  by heads (``tp_slope`` is the rank's contiguous slice of the per-head decay rates;
  ``linear_attention_state_shape``).
"""

from __future__ import annotations

from typing import Any, Callable

from pd_connector.core import shards
from pd_connector.core.shards import ConvPart, StateLayout

_LAYERS = "vllm.model_executor.layers.mamba."


def _calc() -> Any:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator


def _mamba1(m: Any, tp: int) -> tuple[StateLayout, Any]:
    i = m.intermediate_size
    shapes = _calc().mamba1_state_shape(tp, i, m.ssm_state_size, m.conv_kernel_size)
    return StateLayout((ConvPart("x", i),), "ssm_channel", i), shapes


def _mamba2(m: Any, tp: int) -> tuple[StateLayout, Any]:
    # Replicated exactly when MambaMixer2 built conv1d unmerged: n_groups (1) not divisible by TP.
    replicated = tp > 1 and type(m.conv1d).__name__ != "MergedColumnParallelLinear"
    group = ConvPart("B", m.ssm_state_size, True) if replicated else ConvPart("B", m.n_groups * m.ssm_state_size)
    layout = StateLayout((ConvPart("x", m.intermediate_size), group, group._replace(axis="C")), "ssm_head", m.num_heads)
    shapes = _calc().mamba2_state_shape(
        tp, m.intermediate_size, m.n_groups, m.num_heads, m.head_dim, m.ssm_state_size, m.conv_kernel_size, m.num_spec
    )
    return layout, shapes


def _short_conv(m: Any, tp: int) -> tuple[StateLayout, Any]:
    shapes = _calc().short_conv_state_shape(tp, m.conv_dim, m.L_cache, m.num_spec)
    return StateLayout((ConvPart("channel", m.conv_dim),), "channel", m.conv_dim), shapes


def _gdn(m: Any, tp: int) -> tuple[StateLayout, Any]:
    qk = ConvPart("q", m.num_k_heads * m.head_k_dim)
    layout = StateLayout((qk, qk._replace(axis="k"), ConvPart("v", m.num_v_heads * m.head_v_dim)), "value_head", m.num_v_heads)
    shapes = _calc().gated_delta_net_state_shape(
        tp, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel_size, m.num_spec
    )
    return layout, shapes


def _kda(m: Any, tp: int) -> tuple[StateLayout, Any]:
    if getattr(m, "use_recoverssm", False):
        raise shards.ShardError("KDA RecoverSSM records: not described per TP shard")
    proj = m.num_heads * m.head_dim
    num_spec = getattr(m, "num_spec", getattr(m, "num_speculative_tokens", None))
    shapes = _calc().kda_state_shape(tp, m.num_heads, m.head_dim, conv_kernel_size=m.conv_size, num_spec=num_spec)
    return StateLayout((ConvPart("q", proj), ConvPart("k", proj), ConvPart("v", proj)), "head", m.num_heads), shapes


def _linear(m: Any, tp: int) -> tuple[StateLayout, Any]:
    shapes = _calc().linear_attention_state_shape(num_heads=m.num_heads, tp_size=tp, head_dim=m.head_dim)
    return StateLayout((), "head", m.num_heads), shapes


RULES: dict[str, Callable[[Any, int], tuple[StateLayout, Any]]] = {
    _LAYERS + "mamba_mixer.MambaMixer": _mamba1,
    _LAYERS + "mamba_mixer2.MambaMixer2": _mamba2,
    _LAYERS + "short_conv.ShortConv": _short_conv,
    _LAYERS + "gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention": _gdn,
    _LAYERS + "gdn.olmo_gdn_linear_attn.OlmoHybridGatedDeltaNetAttention": _gdn,
    _LAYERS + "gdn.kimi_gdn_linear_attn.KimiGatedDeltaNetAttention": _kda,
    "vllm.models.kimi_k3.nvidia.kda.KimiK3DeltaAttention": _kda,
    "vllm.models.kimi_k3.amd.kda.KimiK3DeltaAttention": _kda,
    "vllm.model_executor.models.bailing_moe_v3.BailingMoeV3KimiDeltaAttention": _kda,
    "vllm.models.glm5next.common.kda.Glm5NextLinearAttention": _kda,
    _LAYERS + "linear.minimax_linear_attn.MiniMaxText01LinearAttention": _linear,
}


def class_path(module: Any) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def state_layout(module: Any, spec: Any, tp: int) -> StateLayout:
    """The layout of ``module``'s states at TP ``tp``, or ``ShardError`` naming why there is none:
    a class not on the list, or a spec whose shapes are not the ones vLLM's shape function gives
    for the module's sizes (the per-rank shapes the segments are computed from)."""
    if module is None:
        raise shards.ShardError("no vLLM layer registered under this name to read its sharding from")
    rule = RULES.get(class_path(module))
    if rule is None:
        kind = getattr(getattr(spec, "mamba_type", None), "name", "?")
        raise shards.ShardError(f"{class_path(module)} ({kind}): no TP layout known for this layer class")
    layout, shapes = rule(module, tp)
    want = tuple(tuple(int(x) for x in shape) for shape in shapes)
    have = tuple(tuple(int(x) for x in shape) for shape in spec.shapes)
    if want != have:
        raise shards.ShardError(
            f"{type(module).__name__}: spec states {have}, but the layer's sizes give {want} at TP {tp}"
        )
    return layout
