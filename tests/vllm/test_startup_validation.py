"""Start-up refusals: one actionable message each."""

import json
import socket
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from pd_connector.core.settings import parse_settings
from pd_connector.transport.backends import missing_backends_message
from pd_connector.core.compat import compat_differences
from pd_connector.transport.side_channel import SideChannelError, SideChannelServer
from pd_connector.core.settings import UnsupportedConfig
from pd_connector.engine.from_vllm.refusals import check_supported
from pd_connector.engine.from_vllm.engine_compat import engine_compat
from pd_connector.engine.from_vllm.vllm_config import layouts_from_kv_cache_config


def _config(tp=1, pp=1, dcp=1, device="cpu", platform="cpu"):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp
        ),
        kv_transfer_config=SimpleNamespace(kv_buffer_device=device),
        device_config=SimpleNamespace(device_type=platform),
    )


@pytest.mark.parametrize("kw, words", [
    ({"pp": 2}, "pipeline_parallel_size=1"),
    ({"dcp": 2}, "decode_context_parallel_size=1"),
    ({"device": "cpu", "platform": "cuda"}, '"kv_buffer_device":"cuda"'),
])
def test_unsupported_deployments_are_refused_with_what_to_change(kw, words):
    with pytest.raises(UnsupportedConfig, match=words.replace("(", r"\(")):
        check_supported(_config(**kw))


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_supported_deployment_passes_at_any_tensor_parallel_size(tp):
    check_supported(_config(tp=tp))


def test_chunked_local_attention_is_refused_at_start_up():
    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, attention_chunk_size=64)
    config = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)])
    with pytest.raises(UnsupportedConfig, match="chunked local attention"):
        layouts_from_kv_cache_config(config, (0,))


def test_secret_in_extra_config_is_refused_because_vllm_logs_it():
    with pytest.raises(ValueError, match="PD_CONNECTOR_SHARED_SECRET"):
        parse_settings({"shared_secret": "hunter2"})


# --- with real vLLM config objects ------------------------------------------------------------


def _vllm_config(model_dir, *, role="kv_consumer", extra=None, dtype="float32", disable_hma=None,
                 block_size=16, **model_kw):
    from vllm.config import (
        AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
        VllmConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype=dtype, seed=0, max_model_len=256, **model_kw),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
            is_encoder_decoder=False, disable_hybrid_kv_cache_manager=disable_hma,
        ),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto",
                                 enable_prefix_caching=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="PDConnector", kv_connector_module_path="pd_connector.connector",
            kv_role=role, kv_buffer_device="cpu", kv_connector_extra_config=extra or {},
        ),
        device_config=DeviceConfig("cpu"),
        attention_config=AttentionConfig(backend=None),
    )  # fmt: skip


def _kv_cache_config(*, block_size=16, attention_dtype=torch.float32, ssm_dtype=None, mamba_block_size=None):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    groups = [KVCacheGroupSpec(["attn"], FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=32, dtype=attention_dtype))]
    if ssm_dtype is not None:
        groups.append(KVCacheGroupSpec(["mamba"], MambaSpec(
            block_size=mamba_block_size or block_size, shapes=((4, 4), (4, 4)),
            dtypes=(torch.float32, ssm_dtype))))
    return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=groups)


def test_missing_nixl_backend_is_refused_listing_the_available_ones(model_dir):
    """NIXL itself only warns and returns an agent without the backend; we refuse at start-up."""
    # nixl._api, not nixl: pytest puts tests/ on sys.path (tests/conftest.py), where tests/nixl
    # passes for a namespace package "nixl" wherever NIXL itself is not installed.
    pytest.importorskip("nixl._api", reason="NIXL is not installed (nixl==1.5.1)")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pd_connector.connector import PDConnector

    config = _vllm_config(model_dir, extra={"nixl_backends": ["UCX", "NO_SUCH_BACKEND"]})
    with pytest.raises(UnsupportedConfig) as info:
        PDConnector(config, KVConnectorRole.WORKER, _kv_cache_config())
    message = str(info.value)
    assert "nixl_backends" in message and "NO_SUCH_BACKEND" in message
    assert "available: " in message and "UCX" in message.split("available: ")[1]


def test_missing_backends_message_is_none_when_all_are_available():
    assert missing_backends_message(["UCX"], ["POSIX", "UCX"]) is None
    message = missing_backends_message(["UCX", "GDS"], ["UCX"])
    assert "names GDS," in message and "(available: UCX)" in message


@pytest.fixture
def busy_port():
    """A port held by another process's listening socket (not a side channel of ours)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_side_channel_port_in_use_names_host_port_and_the_setting(busy_port):
    with pytest.raises(SideChannelError) as info:
        SideChannelServer("127.0.0.1", busy_port, lambda message: message)
    message = str(info.value)
    assert f"127.0.0.1:{busy_port}" in message and "Address already in use" in message
    assert "side_channel_port" in message and "PD_CONNECTOR_SIDE_CHANNEL_PORT" in message


@pytest.mark.parametrize("host", ["192.0.2.123", "p.example.invalid"])
def test_side_channel_host_that_is_not_local_names_the_setting(host, busy_port):
    """A foreign IP (EADDRNOTAVAIL) or a host name (libzmq reads it as an interface: ENODEV)."""
    with pytest.raises(SideChannelError) as info:
        SideChannelServer(host, busy_port, lambda message: message)
    message = str(info.value)
    assert f"{host}:{busy_port}" in message and "not an IP address of this machine" in message
    assert "side_channel_host" in message and "PD_CONNECTOR_SIDE_CHANNEL_HOST" in message


# --- handshake: P and D must agree; the refusal names each differing setting ------------------


def _compat(model_dir, **kw):
    config_kw = {k: kw.pop(k) for k in ("dtype", "hf_overrides") if k in kw}
    config = _vllm_config(model_dir, **config_kw)
    if "speculative" in kw:
        # engine_compat reads only the method, whether it has drafter KV and the draft model.
        config.speculative_config = SimpleNamespace(
            method=kw.pop("speculative"), model=None, uses_draft_kv_cache=lambda: True
        )
    kv_cache_config = _kv_cache_config(**kw)
    return engine_compat(config, kv_cache_config, tuple(range(len(kv_cache_config.kv_cache_groups))))


@pytest.mark.parametrize("theirs, named", [
    ({"block_size": 24}, "group 0 block_size: local 16, remote 24 (not an integral ratio)"),
    ({"dtype": "float16"}, "dtype: local 'torch.float32', remote 'torch.float16'"),
    ({"speculative": "mtp"}, "speculative: local 'none', remote 'mtp'"),
    # Same page size, other content: only the dtype names it.
    ({"ssm_dtype": torch.bfloat16}, "kv_cache_dtype: local 'auto (pages: float32 | float32+float16)'"
                                    ", remote 'auto (pages: float32 | float32+bfloat16)'"),
    ({"attention_dtype": torch.uint8}, "kv_cache_dtype: "),
])
def test_handshake_names_the_setting_p_and_d_differ_in(model_dir, theirs, named):
    mine = _compat(model_dir, ssm_dtype=torch.float16)
    diffs = compat_differences(mine, _compat(model_dir, **{"ssm_dtype": torch.float16, **theirs}))
    assert any(d.startswith(named) for d in diffs), diffs
    assert compat_differences(mine, _compat(model_dir, ssm_dtype=torch.float16)) == []


def test_mamba_block_size_alone_is_no_difference(model_dir):
    """Prefix caching on one side only changes the Mamba group's block size (the align-mode
    block on one side, max_model_len on the other); one state slot is copied either way, so
    such a pair is compatible. An attention block size neither of which divides the other still
    is a difference (sub-blocks of one would straddle blocks of the other), named as such; an
    integral ratio is re-cut (core/block_phases.py)."""
    mine = _compat(model_dir, ssm_dtype=torch.float16, mamba_block_size=256)
    assert compat_differences(mine, _compat(model_dir, ssm_dtype=torch.float16, mamba_block_size=64)) == []
    assert compat_differences(mine, _compat(model_dir, ssm_dtype=torch.float16, mamba_block_size=256, block_size=32)) == []
    diffs = compat_differences(mine, _compat(model_dir, ssm_dtype=torch.float16, mamba_block_size=256, block_size=24))
    assert "group 0 block_size: local 16, remote 24 (not an integral ratio)" in diffs, diffs
    assert all(d.startswith("group 0 ") for d in diffs), diffs


def test_handshake_names_a_different_model(model_dir, tmp_path):
    from rig.tiny_models import build_model

    other = str(build_model("llama", tmp_path / "other-root"))
    renamed = tmp_path / "other-model"
    renamed.symlink_to(other)
    diffs = compat_differences(_compat(model_dir), _compat(str(renamed)))
    assert diffs == ["model: local 'llama', remote 'other-model'", "tokenizer: local 'llama', remote 'other-model'"]
    # The protocol version is checked on every side-channel frame before anything else:
    # tests/nixl/test_side_channel.py::test_wrong_protocol_version_gets_reject_naming_both_versions.


def test_handshake_names_rope_overrides_that_move_positions(model_dir):
    """--hf-overrides (or rope scaling) rotate every position differently: the basename-only
    handshake let such a pair through and D decoded on keys rotated for other positions."""
    mine = _compat(model_dir)
    theta = json.loads(mine.rope)["rope_theta"]
    scaled = _compat(model_dir, hf_overrides={"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": theta}})
    diffs = compat_differences(mine, scaled)
    assert [d.split(":")[0] for d in diffs] == ["rope", "max_model_len"], diffs
    assert diffs[1] == "max_model_len: local 0, remote 256"  # compared under a scaled RoPE only
    other_theta = _compat(model_dir, hf_overrides={"rope_parameters": {"rope_type": "default", "rope_theta": theta * 2}})
    assert [d.split(":")[0] for d in compat_differences(mine, other_theta)] == ["rope"]


def _model_config(model="org1/X", **kw):
    fields = dict(model=model, revision=None, tokenizer=None, tokenizer_revision=None, quantization=None,
                  max_model_len=4096, hf_text_config=SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    return SimpleNamespace(**{**fields, **kw})


@pytest.mark.parametrize("theirs, field", [
    ({"model": "org2/X"}, "model"),  # the basename-only check let another org's X through
    ({"revision": "v2"}, "model_revision"),
    ({"tokenizer": "org1/X-chat"}, "tokenizer"),
    ({"tokenizer_revision": "abc"}, "tokenizer_revision"),
    ({"quantization": "fp8"}, "quantization"),
    ({"hf_text_config": SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})}, "rope"),
])
def test_model_identity_names_what_decides_weights_and_positions(theirs, field):
    from pd_connector.engine.from_vllm.identity import model_identity

    mine, other = model_identity(_model_config()), model_identity(_model_config(**theirs))
    assert {k for k in mine if mine[k] != other[k]} >= {field}


def test_model_identity_tolerates_what_does_not_change_the_pages():
    from pd_connector.engine.from_vllm.identity import model_identity

    # The same weights mounted at different paths on P's and D's hosts.
    assert model_identity(_model_config("/mnt/a/X")) == model_identity(_model_config("/models/X/"))
    # Without RoPE scaling a P serving shorter prompts than D is fine.
    assert model_identity(_model_config(max_model_len=1024)) == model_identity(_model_config())
    yarn = SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    assert model_identity(_model_config(hf_text_config=yarn))["max_model_len"] == 4096


def test_another_model_under_the_same_directory_name_is_refused_at_the_handshake_by_name(model_dir, tmp_path):
    """The handshake compared the directory's basename only: another model saved as ``X`` (a
    retrained or re-initialised copy, another config) passed, and D decoded on its state. The
    same weights mounted at two paths still pair."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    import msgspec

    from pd_connector.core.compat import compat_differences
    from pd_connector.core.protocol import EngineCompat
    from pd_connector.engine.from_vllm.identity import model_files_digest, model_identity

    same_a, same_b, other = (shutil.copytree(model_dir, tmp_path / d / "X") for d in ("a", "b", "c"))
    assert model_identity(_model_config(str(same_a))) == model_identity(_model_config(str(same_b)))
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(weights)
    first = next(iter(tensors))
    tensors[first] = tensors[first] + torch.ones_like(tensors[first])  # same shapes, other values
    save_file(tensors, weights, metadata={"format": "pt"})
    mine, theirs = model_identity(_model_config(str(same_a))), model_identity(_model_config(str(other)))
    assert mine["model"] == theirs["model"] == "X" and mine["model_files"] != theirs["model_files"]
    compat = EngineCompat("X", "float32", "auto", [], "", 1, "cpu")
    diffs = compat_differences(
        msgspec.structs.replace(compat, model_files=mine["model_files"]),
        msgspec.structs.replace(compat, model_files=theirs["model_files"]),
    )
    assert diffs == [f"model_files: local {mine['model_files']!r}, remote {theirs['model_files']!r}"]
    # config.json edited (another architecture setting) differs too; a hub id has no content.
    config = other / "config.json"
    config.write_text(config.read_text().replace("{", '{"pd_test_marker": 1, ', 1))
    assert model_files_digest(other) != theirs["model_files"]
    assert model_files_digest("org1/X") == ""


@pytest.fixture(scope="module")
def hybrid_model_dir(tmp_path_factory) -> str:
    import os
    from pathlib import Path

    from rig.tiny_models import build_model

    root = Path(os.environ.get("PD_TEST_MODEL_ROOT") or tmp_path_factory.mktemp("models"))
    return str(build_model("nemotron_h", root))


def test_hybrid_model_without_the_hybrid_kv_cache_manager_is_refused_naming_the_flag(
    hybrid_model_dir, model_dir
):
    """vLLM itself fails later with "Failed to promote local KV cache specs to one unified type";
    the layout query is the first call we get, before that point."""
    from pd_connector.connector import PDConnector

    config = _vllm_config(hybrid_model_dir, disable_hma=True)
    assert config.model_config.is_hybrid
    for check in (PDConnector.get_required_kvcache_layout, check_supported):
        with pytest.raises(UnsupportedConfig, match="remove --disable-hybrid-kv-cache-manager"):
            check(config)
    # With vLLM's default (HMA on, since PDConnector supports it) the same model passes, and so
    # does an attention-only model with HMA off.
    assert PDConnector.get_required_kvcache_layout(_vllm_config(hybrid_model_dir)) == "LBHNC"
    check_supported(_vllm_config(model_dir, disable_hma=True))


def test_sleep_mode_is_refused_at_start_up(model_dir, monkeypatch):
    """After a wake the KV cache lives in memory pd_connector never registered with NIXL.
    vLLM 0.33 asks the connector (``supports_sleep_mode``) and refuses itself; 0.32 never asks,
    so ``check_supported`` refuses. Either way the engine does not start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.platforms import current_platform

    from pd_connector.connector import PDConnector

    assert PDConnector.supports_sleep_mode(None) is False
    # The CPU platform has no sleep mode at all (ModelConfig: "Sleep mode is not supported on
    # current platform"); pretend it has, to reach the connector's part.
    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # vLLM 0.33
        with pytest.raises(ValueError, match="PDConnector does not support sleep mode"):
            _vllm_config(model_dir, enable_sleep_mode=True)
        # Negative control: it is our answer vLLM refuses on, not sleep mode as such.
        monkeypatch.setattr(PDConnector, "supports_sleep_mode", classmethod(lambda cls, config: True))
    config = _vllm_config(model_dir, enable_sleep_mode=True)
    assert config.model_config.enable_sleep_mode
    for check in (PDConnector.get_required_kvcache_layout, check_supported):
        with pytest.raises(UnsupportedConfig, match="remove --enable-sleep-mode"):
            check(config)
    check_supported(_vllm_config(model_dir))
