"""A LoRA adapter across the handoff, on vLLM CPU (it serves LoRA: PunicaWrapperCPU). vLLM's
block hashes key an adapter by its name and path, so the same adapter mounted at another path on
D was refused, and the tokens form keyed it by name only, so another adapter under the same name
was accepted: the fingerprint now keys it by name and files. Its own P and D (started with
--enable-lora; no baseline, no proxy): D serving the prompt alone is the reference."""

import json
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from pd_connector.core.params import PREFILL_REQUEST_PARAMS
from rig.cpu_matrix import CPU_MODELS, random_prompt
from rig.oracle import compare, complete
from rig.stack import PDStack, StackConfig
from rig.tiny_models import build_model

pytestmark = pytest.mark.e2e

LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
EXTERNAL = ("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"})
PROMPT = random_prompt(80, seed=60)


def adapter(path, model_dir: str, seed: int) -> str:
    """A PEFT LoRA adapter for the tiny llama (q_proj and v_proj of both layers, rank 8)."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    outs = {"q_proj": config["num_attention_heads"] * head, "v_proj": config["num_key_value_heads"] * head}
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": sorted(outs), "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": model_dir,
    }))
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(8, hidden, generator=g)
            weights[f"{name}.lora_B.weight"] = torch.randn(out, 8, generator=g)
    save_file(weights, path / "adapter_model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def lora(models_root, artifacts, tmp_path_factory):
    model = str(build_model("llama", models_root))
    root = tmp_path_factory.mktemp("lora")
    on_p = adapter(root / "p" / "sql", model, seed=1)
    on_d = str(shutil.copytree(on_p, root / "d" / "mnt" / "sql-v1"))  # the same adapter, elsewhere
    config = StackConfig(
        model=model,
        server_args=CPU_MODELS["llama"],
        prefill_args=[*LORA_ARGS, "--lora-modules", f"sql={on_p}"],
        decode_args=[*LORA_ARGS, "--lora-modules", f"sql={on_d}"],
        decode_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        with_baseline=False,
        with_proxy=False,
        log_dir=str(artifacts / "lora"),
    )
    with PDStack(config) as stack:
        stack.retrained = adapter(root / "retrained" / "sql", model, seed=2)
        yield stack


def handoff(stack, prompt):
    """P's params and D's completion, both under the adapter "sql" (PDStack.handoff serves the
    base model)."""
    prefill = complete(
        stack.prefill.base_url, "sql", prompt, 1, logprobs=None, kv_transfer_params=dict(PREFILL_REQUEST_PARAMS)
    )
    params = prefill.kv_transfer_params
    return params, complete(stack.decode.base_url, "sql", prompt, 8, kv_transfer_params=params, timeout=600.0)


def loaded(stack) -> float:
    return stack.decode.metric(*EXTERNAL) or 0.0


def wait_loaded(stack, at_least: float) -> float:
    deadline = time.monotonic() + 10
    while loaded(stack) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    return loaded(stack)


def test_lora_adapter_at_two_paths_hands_over(lora):
    before = loaded(lora)
    params, got = handoff(lora, PROMPT)
    assert params["replay_offset"] == len(PROMPT) - 1
    assert compare(complete(lora.decode.base_url, "sql", PROMPT, 8), got, tie_margin=1e-5, logprob_tol=1e-4).ok
    assert wait_loaded(lora, before + params["replay_offset"]) - before == params["replay_offset"]
    assert "refusing the handoff" not in lora.decode.log_text()


def test_another_adapter_under_the_same_name_is_refused(lora):
    """Negative control of the one above, and the failure it pins: D re-points "sql" at another
    adapter; P's state was computed with the first."""
    base = lora.decode.base_url
    for path, body in (("unload", {"lora_name": "sql"}), ("load", {"lora_name": "sql", "lora_path": lora.retrained})):
        request = urllib.request.Request(
            f"{base}/v1/{path}_lora_adapter", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=60).read()
    before = loaded(lora)
    prompt = random_prompt(80, seed=61)
    _, got = handoff(lora, prompt)
    assert compare(complete(base, "sql", prompt, 8), got, tie_margin=1e-5, logprob_tol=1e-4).ok
    assert "refusing the handoff (prompt_mismatch)" in lora.decode.log_text()
    assert loaded(lora) == before, "nothing loaded from P"
