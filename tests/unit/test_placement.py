"""Where concurrently running vLLM CPU instances go (rig.placement), and that
the P/D stack takes its placement from there. Nothing is started: VllmServer only records the
environment it would start with."""

import os

import pytest

from rig.placement import cpu_binds
from rig.stack import PDStack, StackConfig


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def test_instances_never_share_a_pinned_core(two_cores):
    """Regression: the multi-turn pair was made as two groups of one instance, both pinned to
    core 0; P's worker, spinning between steps, starved D's worker for minutes and the first
    handshake timed out in CI. Beyond the core count instances are left unpinned."""
    assert cpu_binds(2) == [("0", {}), ("1", {})]
    assert cpu_binds(1) + cpu_binds(1, first_core=1) == [("0", {}), ("1", {})]
    assert cpu_binds(4) == [("nobind", {"OMP_NUM_THREADS": "1"})] * 4


def _placement(stack: PDStack) -> list[tuple[str, str | None]]:
    return [(s.env["VLLM_CPU_OMP_THREADS_BIND"], s.env.get("OMP_NUM_THREADS")) for s in stack.servers]


def test_stack_baseline_no_longer_shares_a_pinned_core_with_prefill(two_cores, tmp_path, monkeypatch):
    """Regression: the aggregated baseline was pinned to core 0 next to P, all three running at
    once. Three instances on two cores: all unpinned, one OpenMP thread each."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    stack = PDStack(StackConfig(model="/m", log_dir=str(tmp_path)))
    assert _placement(stack) == [("nobind", "1")] * 3


def test_stack_without_baseline_pins_prefill_and_decode_to_their_own_cores(two_cores, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    stack = PDStack(StackConfig(model="/m", log_dir=str(tmp_path), with_baseline=False))
    assert _placement(stack) == [("0", None), ("1", None)]  # stack.servers: P, then D


def test_stack_server_env_overrides_placement_env(two_cores, tmp_path):
    stack = PDStack(StackConfig(model="/m", log_dir=str(tmp_path), decode_env={"OMP_NUM_THREADS": "2"}))
    assert stack.decode.env["OMP_NUM_THREADS"] == "2" and stack.prefill.env["OMP_NUM_THREADS"] == "1"


def test_stack_off_cpu_leaves_binding_to_vllm(two_cores, tmp_path):
    stack = PDStack(StackConfig(model="/m", log_dir=str(tmp_path), device="cuda"))
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in stack.servers] == ["auto"] * 3
