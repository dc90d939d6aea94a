"""Speculative decoding across the handoff on vLLM CPU: a Qwen3-Next hybrid (GDN + attention)
with native MTP, P x D over {off, MTP 1, 2, 3 tokens}.

Four kv_both instances, one per configuration (spec_matrix.py; started once per session and
shared with test_vllm_router_min_recompute.py, conftest.py): every instance is the aggregated
reference for its own configuration, and any two form a P/D pair. GDN runs only in bf16 on CPU,
so outputs are compared with the margin-aware oracle (see TIE_MARGIN) and every oracle has a
negative control. Prefix caching is off: hybrid + speculative decoding crashes in align mode on
CPU (docs/testing.md); the align-mode offset grid is covered in tests/vllm.
"""

from __future__ import annotations

import time

import pytest

from rig.cpu_matrix import boundary_lengths, random_prompt
from rig.spec_matrix import (
    HONOURED,
    LAYOUT_EVENTS,
    MATRIX_SETUPS,
    REFUSED_LAYOUT,
    REFUSED_OFFSET,
    caught_desyncs,
    check_bf16 as check,
    expected_outcome,
    handoff,
)

pytestmark = pytest.mark.e2e

MAX_TOKENS = 12

SETUP_NAMES = MATRIX_SETUPS


@pytest.fixture(scope="module")
def instances(spec_instances):
    """The session's kv_both instances, one per configuration of SETUP_NAMES (conftest.py)."""
    return spec_instances


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


def _wait_for_events(instances, before, expected, timeout=30.0):
    """Poll until every D's event counters moved by at least ``expected[d][event_group]``.

    vLLM publishes connector stats with a step's outputs, sometimes a logging interval later, so
    the counters are checked once for the whole matrix rather than after every handoff."""
    deadline = time.monotonic() + timeout
    while True:
        moved = {}
        for d_name, wanted in expected.items():
            after = instances[d_name].events()
            moved[d_name] = {
                events: sum(after.get(e, 0) - before[d_name].get(e, 0) for e in events) for events in wanted
            }
        done = all(moved[d][ev] >= n for d, wanted in expected.items() for ev, n in wanted.items())
        if done or time.monotonic() > deadline:
            return moved
        time.sleep(0.5)


@pytest.mark.parametrize(("p_name", "d_name"), [("mtp2", "mtp2"), ("mtp2", "mtp1"), ("mtp1", "mtp2")])
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
    lengths = (33, 129)
    rows, failures = [], []
    before = {name: inst.events() for name, inst in instances.items()}
    expected: dict[str, dict[tuple[str, ...], int]] = {name: {} for name in instances}
    for p_name in SETUP_NAMES:
        for d_name in SETUP_NAMES:
            p, d = instances[p_name], instances[d_name]
            seen = []
            for n in lengths:
                prompt = random_prompt(n, seed=22)
                raw_outcome = expected_outcome(p.setup, d.setup, n)[0]
                for hint in (False, True) if raw_outcome == REFUSED_OFFSET else (False,):
                    outcome, offset = expected_outcome(p.setup, d.setup, n, hint)
                    events = {HONOURED: ("handoff_accepted",), REFUSED_LAYOUT: LAYOUT_EVENTS}.get(outcome, (outcome,))
                    expected[d_name][events] = expected[d_name].get(events, 0) + 1
                    params, got = handoff(p, d, prompt, MAX_TOKENS, hint=hint)
                    label = f"P={p_name} D={d_name} n={n}{' hint' if hint else ''} R={params.get('replay_offset')}"
                    if params.get("replay_offset") != offset:
                        failures.append(f"{label}: P offered {params.get('replay_offset')}, rule says {offset}")
                    verdict = check(references(d_name, prompt), got)
                    if not verdict.ok:
                        failures.append(f"{label}: {verdict.describe()}")
                    seen.append(outcome.split(":")[0] + ("+hint" if hint else ""))
            rows.append(f"P={p_name:5} D={d_name:5} " + ", ".join(sorted(set(seen))))
    print("\nPDConnector skew matrix (output equal to aggregated on D's config in every cell):\n" + "\n".join(rows))
    moved = _wait_for_events(instances, before, expected)
    for d_name, wanted in expected.items():
        for events, n in wanted.items():
            if moved[d_name][events] < n:
                failures.append(f"D={d_name}: {events} moved by {moved[d_name][events]}, expected {n}")
    assert not failures, "\n".join(failures)


def test_desynced_offset_is_caught_by_the_bf16_oracle(instances, references):
    """Negative control for the bf16 thresholds (spec_matrix.BF16_TIE_MARGIN): D resumes one token
    early on the state P computed for R (what vLLM's NixlConnector does when P and D back off
    differently). Must fail nearly always. Regression: on the first tiny Qwen3-Next (GDN weights
    at init std 0.02) only 2 of 6 were caught; speculative_models.GDN_WEIGHT_SCALES fixed that."""
    lengths = (33, 64, 65, 100, 129, 200)
    prompts = [random_prompt(n, seed=23) for n in lengths]
    caught = caught_desyncs(
        instances["mtp2"], instances["mtp1"], prompts, MAX_TOKENS, lambda prompt: references("mtp1", prompt)
    )
    assert sum(caught) >= len(lengths) - 1, f"only {sum(caught)}/{len(lengths)} desyncs detected: {caught}"
