"""Speculative decoding across the handoff on vLLM CPU: a Qwen3-Next hybrid (GDN + attention)
with native MTP, P x D over {off, MTP 1, 2, 3 tokens}.

Four kv_both instances, one per configuration (spec_matrix.py): every instance is the aggregated
reference for its own configuration, and any two form a P/D pair. GDN runs only in bf16 on CPU,
so outputs are compared with the margin-aware oracle (see TIE_MARGIN) and every oracle has a
negative control. Prefix caching is off: hybrid + speculative decoding crashes in align mode on
CPU (cpu-recipes 10.3/10.4); the align-mode offset grid is covered in tests/vllm.
"""

from __future__ import annotations

import time

import pytest

from pd_connector.scheduler import FAULT_RESUME_SHIFT
from pd_connector.testing.cpu_matrix import boundary_lengths, random_prompt
from pd_connector.testing.servers import start_many
from pd_connector.testing.spec_matrix import (
    HONOURED,
    LAYOUT_EVENTS,
    REFUSED_LAYOUT,
    REFUSED_OFFSET,
    SPEC_EXTRA_CONFIG,
    check_bf16 as check,
    InstanceSpec,
    expected_outcome,
    handoff,
    make_instances,
)
from pd_connector.testing.tiny_models import build_model

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12

SETUP_NAMES = ("off", "mtp1", "mtp2", "mtp3")


@pytest.fixture(scope="module")
def instances(models_root, artifacts):
    spec = InstanceSpec(
        model=str(build_model("qwen3_next_mtp", models_root)),
        log_dir=artifacts / "speculative",
        extra_config=SPEC_EXTRA_CONFIG,
        env={"PD_CONNECTOR_FAULT_INJECTION": "1"},
    )
    insts = make_instances(spec, SETUP_NAMES)
    try:
        start_many([i.server for i in insts.values()], timeout=900)
        yield insts
    finally:
        for inst in insts.values():
            inst.server.stop()


class _References:
    """Aggregated outputs per (D configuration, prompt), computed once."""

    def __init__(self, instances):
        self.instances = instances
        self.cache = {}

    def __call__(self, name, prompt):
        key = (name, tuple(prompt))
        if key not in self.cache:
            self.cache[key] = self.instances[name].reference(prompt, MAX_TOKENS)
        return self.cache[key]


@pytest.fixture(scope="module")
def references(instances):
    return _References(instances)


def _wait_for_event_delta(inst, before, events, expected=1, timeout=15.0):
    """vLLM publishes connector stats with the step's outputs: poll briefly for the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        after = inst.events()
        delta = sum(after.get(e, 0) - before.get(e, 0) for e in events)
        if delta >= expected or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


@pytest.mark.parametrize(("p_name", "d_name"), [("mtp1", "mtp1"), ("mtp2", "mtp2"), ("mtp2", "mtp1"), ("mtp1", "mtp2")])
def test_mtp_pd_matches_aggregated_at_block_boundaries(instances, references, p_name, d_name):
    """Agreeing (or compatible) MTP configurations: every handoff honoured, output equal to D's
    aggregated output at lengths on and around block boundaries."""
    p, d = instances[p_name], instances[d_name]
    failures = []
    for n in boundary_lengths(32):
        prompt = random_prompt(n, seed=21)
        params, got = handoff(p, d, prompt, MAX_TOKENS)
        outcome, offset = expected_outcome(p.setup, d.setup, n)
        assert outcome == HONOURED and params.get("replay_offset", 0) == offset, (n, params)
        verdict = check(references(d_name, prompt), got)
        if not verdict.ok:
            failures.append(f"n={n} R={offset}: {verdict.describe()}")
    assert not failures, "\n".join(failures)


def test_skew_matrix_matches_aggregated_on_the_decode_config(instances, references):
    """Every (P, D) cell: output equal to D's aggregated output, through an honoured offset or
    a counted refusal exactly where the offset rule says; with the router's hint
    (pd_min_recompute_tokens) the offset refusals become honoured handoffs."""
    lengths = (33, 65, 129)
    rows, failures = [], []
    for p_name in SETUP_NAMES:
        for d_name in SETUP_NAMES:
            p, d = instances[p_name], instances[d_name]
            seen = []
            for n in lengths:
                prompt = random_prompt(n, seed=22)
                for hint in (False, True):
                    outcome, offset = expected_outcome(p.setup, d.setup, n, hint)
                    if hint and outcome != REFUSED_OFFSET and expected_outcome(p.setup, d.setup, n)[0] != REFUSED_OFFSET:
                        continue  # the hint only matters where the raw flow is refused
                    events = {HONOURED: ("handoff_accepted",), REFUSED_LAYOUT: LAYOUT_EVENTS}.get(outcome, (outcome,))
                    before = d.events()
                    params, got = handoff(p, d, prompt, MAX_TOKENS, hint=hint)
                    delta = _wait_for_event_delta(d, before, events)
                    verdict = check(references(d_name, prompt), got)
                    label = f"P={p_name} D={d_name} n={n}{' hint' if hint else ''} R={params.get('replay_offset')}"
                    if params.get("replay_offset") != offset:
                        failures.append(f"{label}: P offered {params.get('replay_offset')}, rule says {offset}")
                    if delta < 1:
                        failures.append(f"{label}: expected one of {events} on D, got {d.events()}")
                    if not verdict.ok:
                        failures.append(f"{label}: {verdict.describe()}")
                    seen.append(outcome.split(":")[0] + ("+hint" if hint else ""))
            rows.append(f"P={p_name:6} D={d_name:6} " + ", ".join(sorted(set(seen))))
    print("\nPDConnector skew matrix (identical to aggregated on D's config in every cell):\n" + "\n".join(rows))
    assert not failures, "\n".join(failures)


def test_desynced_offset_is_caught_by_the_bf16_oracle(instances, references):
    """Negative control for the bf16 thresholds (spec_matrix.BF16_TIE_MARGIN): D resumes one token early on the state P computed for R
    (what vLLM's NixlConnector does when P and D back off differently). Must fail nearly always."""
    p, d = instances["mtp2"], instances["mtp1"]
    lengths = (33, 64, 65, 100, 129, 200)
    caught = []
    for n in lengths:
        prompt = random_prompt(n, seed=23)
        params = {**p.prefill(prompt), FAULT_RESUME_SHIFT: -1}
        caught.append(not check(references("mtp1", prompt), d.decode(prompt, params, MAX_TOKENS)).ok)
    assert sum(caught) >= len(lengths) - 1, f"only {sum(caught)}/{len(lengths)} desyncs detected: {caught}"
