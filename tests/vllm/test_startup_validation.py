"""Start-up refusals: one actionable message each."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from pd_connector.config import parse_settings
from pd_connector.vllm_compat import UnsupportedConfig, check_supported, layouts_from_kv_cache_config


def _config(tp=1, pp=1, dcp=1, device="cpu", platform="cpu"):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp
        ),
        kv_transfer_config=SimpleNamespace(kv_buffer_device=device),
        device_config=SimpleNamespace(device_type=platform),
    )


@pytest.mark.parametrize("kw, words", [
    ({"tp": 2}, "tensor_parallel_size=1"),
    ({"pp": 2}, "pipeline_parallel_size=1"),
    ({"dcp": 2}, "decode_context_parallel_size=1"),
    ({"device": "cpu", "platform": "cuda"}, '"kv_buffer_device":"cuda"'),
])
def test_unsupported_deployments_are_refused_with_what_to_change(kw, words):
    with pytest.raises(UnsupportedConfig, match=words.replace("(", r"\(")):
        check_supported(_config(**kw))


def test_supported_deployment_passes():
    check_supported(_config())


def test_chunked_local_attention_is_refused_at_start_up():
    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=64)
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    with pytest.raises(UnsupportedConfig, match="chunked local attention"):
        layouts_from_kv_cache_config(config, (0,))


def test_secret_in_extra_config_is_refused_because_vllm_logs_it():
    with pytest.raises(ValueError, match="PD_CONNECTOR_SHARED_SECRET"):
        parse_settings({"shared_secret": "hunter2"})
