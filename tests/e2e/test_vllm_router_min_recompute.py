"""A speculative skew cell behind vllm-router, which passes no ``pd_min_recompute_tokens``: P
runs MTP with 1 token, D (the tiny Qwen3-Next hybrid) MTP with 3, so D must recompute at least 2
prompt tokens and refuses P's default offset N - 1. P's ``min_recompute_tokens: 2`` setting makes
every handoff one D honours; the same P without it (negative control) is refused every time.
Output equals D's own aggregated output either way (bf16 oracle, spec_matrix)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pd_connector.core.recompute_profile import min_recompute_tokens
from rig.cpu_matrix import random_prompt
from rig.oracle import complete
from rig.placement import cpu_binds
from rig.ports import free_port
from rig.servers import VllmServer, source_checkout_env, start_many
from rig.spec_matrix import (
    HONOURED,
    REFUSED_OFFSET,
    SETUPS,
    SPEC_EXTRA_CONFIG,
    InstanceSpec,
    SpecInstance,
    check_bf16,
    expected_outcome,
)
from rig.stack import kv_transfer_config
from rig.tiny_models import build_model
from rig.router import VllmRouter, router_binary

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed: run scripts/setup_router_venv.sh"),
]

MAX_TOKENS = 12
P_SETUP, D_SETUP = SETUPS["mtp1"], SETUPS["mtp3"]
FLOOR = min_recompute_tokens(D_SETUP.profile)  # 2: what D logs as its minimum at start-up
LENGTHS = (33, 129)


@pytest.fixture(scope="module")
def cell(spec_instances, models_root, artifacts):
    """P with the floor (started here), P without it and D (the session's MTP 1 and MTP 3
    instances, conftest.py: the same configuration), and a vllm-router per P, each routing to
    the same D."""
    spec = InstanceSpec(model=str(build_model("qwen3_next_mtp", models_root)), log_dir=artifacts / "router_skew")
    p_plain, d = spec_instances[P_SETUP.name], spec_instances[D_SETUP.name]
    assert (p_plain.setup, d.setup) == (P_SETUP, D_SETUP)
    # Next to the running instances: the binding a group of all of them would give the last one.
    bind, bind_env = cpu_binds(len(spec_instances) + 1)[-1]
    kv = kv_transfer_config("kv_both", free_port(), "cpu", **SPEC_EXTRA_CONFIG, min_recompute_tokens=FLOOR)
    p_floor = SpecInstance(P_SETUP, VllmServer(
        spec.model, dtype=spec.dtype, max_model_len=spec.max_model_len,
        extra_args=[*spec.server_args, *P_SETUP.server_args(), "--kv-transfer-config", kv],
        env={**source_checkout_env(), **bind_env}, omp_threads_bind=bind, log_path=spec.log_dir / "p_floor.log",
    ))  # fmt: skip
    start_many([p_floor.server], timeout=900)
    try:
        with VllmRouter([p_floor.server.base_url], [d.server.base_url], log_path=spec.log_dir / "router-floor.log") as floor, \
             VllmRouter([p_plain.server.base_url], [d.server.base_url], log_path=spec.log_dir / "router-plain.log") as plain:
            yield SimpleNamespace(d=d, routers={"floor": floor, "plain": plain})
    finally:
        p_floor.server.stop()


def external_tokens(inst: SpecInstance) -> float:
    return inst.server.metric("vllm:prompt_tokens_by_source", {"source": "external_kv_transfer"}) or 0.0


def through(cell, which: str) -> tuple[dict, float, list[str]]:
    """Each prompt through one router: the oracle's failures, and how D's counters moved."""
    d, router = cell.d, cell.routers[which]
    before, external = d.events(), external_tokens(d)
    failures = []
    for n in LENGTHS:
        prompt = random_prompt(n, seed=51)
        verdict = check_bf16(d.reference(prompt, MAX_TOKENS), complete(router.url, "tiny", prompt, MAX_TOKENS))
        if not verdict.ok:
            failures.append(f"{which} n={n}: {verdict.describe()}")
    deadline = time.monotonic() + 15  # vLLM publishes a step's stats a little later: poll
    while True:
        after = d.events()
        moved = {e: after.get(e, 0) - before.get(e, 0) for e in ("handoff_accepted", REFUSED_OFFSET)}
        if sum(moved.values()) >= len(LENGTHS) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    time.sleep(1)  # the per-source prompt counts come with the same stats
    return moved, external_tokens(d) - external, failures


def test_rule_expects_refusal_without_the_floor_and_a_handoff_with_it():
    for n in LENGTHS:
        assert expected_outcome(P_SETUP, D_SETUP, n)[0] == REFUSED_OFFSET
        assert expected_outcome(P_SETUP, D_SETUP, n, p_floor=FLOOR) == (HONOURED, n - FLOOR)


def test_p_side_floor_hands_the_skew_cell_over_behind_vllm_router(cell):
    moved, external, failures = through(cell, "floor")
    assert not failures, "\n".join(failures)
    assert moved == {"handoff_accepted": len(LENGTHS), REFUSED_OFFSET: 0}, moved
    # D loaded N - 2 prompt tokens of each prompt from P.
    assert external == sum(n - FLOOR for n in LENGTHS), external


def test_without_the_floor_vllm_router_handoffs_are_refused(cell):
    """Negative control: the same cell, P without the setting."""
    moved, external, failures = through(cell, "plain")
    assert not failures, "\n".join(failures)
    assert moved == {"handoff_accepted": 0, REFUSED_OFFSET: len(LENGTHS)}, moved
    assert external == 0
