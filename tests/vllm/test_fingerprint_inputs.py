"""The prompt fingerprint covers a prompt's multimodal items and LoRA adapter by their content, not
by where the files are mounted (P and D may mount the same weights at two paths), in both
fingerprint forms and at every R, against vLLM's real Scheduler and its own request objects
(MultiModalFeatureSpec with identifiers from vLLM's ProcessorInputs.get_mm_hashes, LoRARequest)."""

import json
import shutil

import numpy as np
import pytest
import torch
from rig.scheduler_harness import connector_half, finished_params, make_request, make_scheduler, run_step
from PIL import Image
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PlaceholderRange,
)
from vllm.multimodal.parse import MultiModalDataParser
from vllm.multimodal.processing.inputs import ProcessorInputs
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from pd_connector.engine.from_vllm import identity

HYBRID = ("attention", "mamba")
PROMPT = list(range(100, 140))
P_MODEL, D_MODEL = "/models/tiny-vl", "/mnt/weights/tiny-vl"  # one model, mounted twice
# R = N - 1 with 16-token hash blocks: 39 spans two full blocks, 11 is shorter than one.
LENGTHS = [40, 12]
FORMS = ["blocks", "tokens"]


def scheduler(model_dir, role, form="blocks"):
    """vLLM's Scheduler with an encoder budget (the tiny text model has none of its own)."""
    s = make_scheduler(model_dir, role, groups=HYBRID)
    s.max_num_encoder_input_tokens = 1024
    s.encoder_cache_manager = EncoderCacheManager(cache_size=1024)
    if form == "tokens":
        connector_half(s).prefill.fingerprint_form = connector_half(s).decode.fingerprint_form = (identity.TOKENS, 0)
    return s


def prefill(p, prompt, **request_kw):
    req = make_request(prompt, {"do_remote_decode": True}, block_size=p.hash_block_size, **request_kw)
    p.add_request(req)
    for _ in range(3):
        _, outputs = run_step(p)
        done = finished_params(outputs)
        if req.request_id in done:
            return done[req.request_id]
    raise AssertionError("P did not finish")


def accepted(d, prompt, params, **request_kw) -> bool:
    """Whether D accepts P's handoff (True) or refuses it as prompt_mismatch (False)."""
    before = connector_half(d).stats["refused:prompt_mismatch"]
    req = make_request(prompt, dict(params), **request_kw)
    d.add_request(req)
    out, _ = run_step(d)
    refused = connector_half(d).stats["refused:prompt_mismatch"] > before
    assert refused or req.request_id in out.kv_connector_metadata.to_recv
    return not refused


# --- multimodal items -------------------------------------------------------------------------


def media(modality: str, seed: int):
    rng = np.random.default_rng(seed)
    if modality == "image":
        return Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    return rng.standard_normal(1600).astype(np.float32), 16000


def item(modality: str, model_path: str, seed: int, offset: int = 4, length: int = 6) -> MultiModalFeatureSpec:
    """One item as vLLM's input processor hands it to EngineCore: the identifier from vLLM's own
    hasher (which hashes the model's path with the item), the data a stand-in for the processor's
    output (a deterministic tensor of the item)."""
    raw = media(modality, seed)
    pi = ProcessorInputs(prompt=[], mm_data_items=MultiModalDataParser(target_sr=16000).parse_mm_data({modality: raw}))
    (identifier,) = pi.get_mm_hashes(model_path, "sha256")[modality]
    pixels = torch.from_numpy(np.asarray(raw if modality == "image" else raw[0], dtype=np.float32))
    data = MultiModalKwargsItem({"values": MultiModalFieldElem(data=pixels, field=MultiModalBatchedField())})
    return MultiModalFeatureSpec(
        data=data,
        modality=modality,
        identifier=identifier,
        mm_position=PlaceholderRange(offset, length),
        mm_hash=identifier,
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("modality", ["image", "audio"])
def test_multimodal_prompt_with_the_model_at_two_paths_is_not_refused_as_prompt_mismatch(model_dir, modality, n, form):
    """vLLM's item identifier hashes model_config.model, the full path: with P and D mounting
    the model at two paths every image or audio prompt was refused prompt_mismatch."""
    assert item(modality, P_MODEL, 1).identifier != item(modality, D_MODEL, 1).identifier
    params = prefill(scheduler(model_dir, "kv_producer", form), PROMPT[:n], mm_features=[item(modality, P_MODEL, 1)])
    d = scheduler(model_dir, "kv_consumer")
    assert params["replay_offset"] == n - 1
    assert accepted(d, PROMPT[:n], params, mm_features=[item(modality, D_MODEL, 1)])
    # Negative controls: another item, the same item placed elsewhere, or no item at all.
    assert not accepted(d, PROMPT[:n], params, mm_features=[item(modality, D_MODEL, 2)])
    assert not accepted(d, PROMPT[:n], params, mm_features=[item(modality, D_MODEL, 1, offset=3)])
    assert not accepted(d, PROMPT[:n], params)


def test_a_multimodal_item_whose_data_this_engine_never_saw_is_never_handed_over_blindly(model_dir):
    """EngineCore gets an item without its data when the processor cache holds it
    (mm_processor_cache_type "shm"): P hands over nothing rather than fingerprint the item by a
    path-keyed identifier, and D refuses rather than accept it unseen."""
    bare = item("image", P_MODEL, 3)
    bare.data, bare.identifier = None, "never-seen-on-p"
    p = scheduler(model_dir, "kv_producer")
    params = prefill(p, PROMPT, mm_features=[bare])
    assert params["replay_offset"] == 0 and connector_half(p).stats["p_no_fingerprint"] == 1
    params = prefill(scheduler(model_dir, "kv_producer"), PROMPT, mm_features=[item("image", P_MODEL, 3)])
    d = scheduler(model_dir, "kv_consumer")
    unseen = item("image", D_MODEL, 3)
    unseen.data, unseen.identifier = None, "never-seen-on-d"
    assert not accepted(d, PROMPT, params, mm_features=[unseen])


# --- LoRA adapters ----------------------------------------------------------------------------


def adapter(root, name: str, seed: int):
    """A PEFT-style adapter directory: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    g = torch.Generator().manual_seed(seed)
    weights = {"base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 64, generator=g)}
    save_file(weights, path / "adapter_model.safetensors")
    return str(path)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", LENGTHS)
def test_lora_adapter_at_two_paths_is_not_refused_as_prompt_mismatch(model_dir, tmp_path, n, form):
    """vLLM's block hashes key the adapter by name and path: in the blocks form the same
    adapter mounted at another path on D was refused."""
    on_p = adapter(tmp_path / "p", "sql", seed=1)
    on_d = str(shutil.copytree(on_p, tmp_path / "d" / "adapters" / "sql-v1"))
    params = prefill(scheduler(model_dir, "kv_producer", form), PROMPT[:n], lora_request=LoRARequest("sql", 1, on_p))
    d = scheduler(model_dir, "kv_consumer")
    assert accepted(d, PROMPT[:n], params, lora_request=LoRARequest("sql", 5, on_d))
    assert not accepted(d, PROMPT[:n], params), "negative control: no adapter on D"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", LENGTHS)
def test_another_adapter_under_the_same_name_is_refused_as_prompt_mismatch(model_dir, tmp_path, n, form):
    """The tokens form and prompts shorter than one hash block keyed the adapter by its name
    only: an adapter re-pointed under the same name was accepted, and D decoded on state P
    computed with another adapter."""
    on_p = adapter(tmp_path / "p", "sql", seed=1)
    retrained = adapter(tmp_path / "d", "sql", seed=2)
    params = prefill(scheduler(model_dir, "kv_producer", form), PROMPT[:n], lora_request=LoRARequest("sql", 1, on_p))
    d = scheduler(model_dir, "kv_consumer")
    assert not accepted(d, PROMPT[:n], params, lora_request=LoRARequest("sql", 1, retrained))
    assert accepted(d, PROMPT[:n], params, lora_request=LoRARequest("sql", 1, on_p)), "negative control"


def test_adapter_files_digest_follows_the_content_not_the_path(tmp_path):
    one = adapter(tmp_path / "a", "x", seed=1)
    copy = str(shutil.copytree(one, tmp_path / "b"))
    assert identity.adapter_files_digest(one) == identity.adapter_files_digest(copy)
    assert identity.adapter_files_digest(one) != identity.adapter_files_digest(adapter(tmp_path / "c", "x", seed=2))
    assert identity.lora_identity(LoRARequest("x", 1, "org/adapter")) == "id:org/adapter", "a hub id, whole"
