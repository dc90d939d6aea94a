"""What pd_connector refuses at start-up, by vLLM setting, with the setting to change named."""

from __future__ import annotations

from typing import Any

from pd_connector.core.settings import UnsupportedConfig


def check_hybrid_kv_cache_manager(vllm_config: Any) -> None:
    """A hybrid model needs vLLM's hybrid KV-cache manager (one KV-cache group per layer kind).

    With ``--disable-hybrid-kv-cache-manager`` vLLM 0.32 tries to merge the Mamba layers' specs
    into one attention-like spec and fails in ``get_kv_cache_configs`` with "Failed to promote
    local KV cache specs to one unified type" (vllm/v1/core/kv_cache_utils.py,
    _promote_local_kv_cache_specs), which names neither the model nor the flag."""
    model = getattr(vllm_config, "model_config", None)
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if model is None or not getattr(scheduler, "disable_hybrid_kv_cache_manager", False):
        return
    if getattr(model, "is_hybrid", False):
        raise UnsupportedConfig(
            "pd_connector: this is a hybrid model (attention plus Mamba/SSM/linear-attention "
            "layers), which needs vLLM's hybrid KV-cache manager: remove "
            "--disable-hybrid-kv-cache-manager (scheduler_config.disable_hybrid_kv_cache_manager)"
            " on both the prefill and the decode instance"
        )


def check_sleep_mode(vllm_config: Any) -> None:
    """Sleep releases the KV cache's memory and wake maps new pages, but pd_connector does not
    re-register them with NIXL (it has no ``unregister_kv_caches``/``restore_kv_caches``): a
    peer's READ after a wake would copy stale pages. vLLM 0.33 refuses
    ``--enable-sleep-mode`` itself when ``PDConnector.supports_sleep_mode`` says False
    (``VllmConfig._verify_kv_transfer_compat``); 0.32 has no such hook, so we refuse here."""
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enable_sleep_mode", False):
        raise UnsupportedConfig(
            "pd_connector does not support sleep mode: after a wake the KV cache lives in new "
            "memory that pd_connector has not registered with NIXL; remove --enable-sleep-mode "
            "(model_config.enable_sleep_mode) on both the prefill and the decode instance"
        )


def check_supported(vllm_config: Any) -> None:
    """Refuse, at start-up, what this version cannot transfer correctly."""
    check_hybrid_kv_cache_manager(vllm_config)
    check_sleep_mode(vllm_config)
    parallel = vllm_config.parallel_config
    # Tensor parallelism is supported (core/shards.py); pipeline and decode-context parallelism
    # split the KV cache by layer or by token, which the page maps do not describe yet.
    for name in ("pipeline_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1) or 1
        if size != 1:
            raise UnsupportedConfig(
                f"pd_connector supports {name}=1 only (got {size}); tensor parallelism is "
                "supported (any P and D sizes where one divides the other)"
            )
    device = vllm_config.kv_transfer_config.kv_buffer_device
    platform = vllm_config.device_config.device_type
    if device != platform:
        raise UnsupportedConfig(
            f"kv_buffer_device={device!r} but the KV cache lives on {platform!r}; pd_connector "
            f"transfers the KV cache in place: set \"kv_buffer_device\":\"{platform}\""
        )
