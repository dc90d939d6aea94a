"""The hybrid families beyond Nemotron-H, Granite-4-H and Qwen3-Next that vLLM CPU 0.32 serves,
P/D against aggregated serving on real servers: Falcon-H1 (attention and Mamba2 side by side in
every block) and an LFM2-style model of short convolutions. Jamba (Mamba1) and Kimi Linear (KDA +
MLA) do not run on vLLM CPU; their layouts are tested in process (tests/vllm/
test_state_shard_layout.py, tests/nixl/test_tp_transfer.py) and the exact errors are in
docs/testing.md ("Hybrid families").

Per family two float32 ``kv_both`` instances (rig/tp_matrix.py), ``tp1`` and ``tp2``,
each P, D and the aggregated reference at its TP size: the cells P1 -> D1 (``tp1`` handing a
request to itself, NIXL loopback: the same side channel, claim, READ and pairing as two
instances), P1 -> D2 and P2 -> D1. Prefix caching is off, so a reference never reads KV a
handoff wrote. D's ``vllm:prompt_tokens_by_source`` shows R tokens from P and N - R computed in
every cell.
"""

from __future__ import annotations

import pytest

from rig.cpu_matrix import REQUESTED_BLOCK, random_prompt
from rig.tiny_models import build_model
from rig.faults import RESUME_SHIFT
from rig.tp_matrix import make_instances, running, warm_up

pytestmark = pytest.mark.e2e

# kind -> instances (name, TP size). Prefix caching off: Mamba2 crashes in align mode on CPU, and
# a reference served by an instance must not come from KV a handoff wrote.
FAMILIES = {
    "falcon_h1": (("tp1", 1), ("tp2", 2)),
    "lfm2": (("tp1", 1), ("tp2", 2)),
}
FLAGS = ["--block-size", str(REQUESTED_BLOCK), "--no-enable-prefix-caching"]
MAX_TOKENS = 8
LENGTHS = [5, 31, 33, 64, 130, 257]  # on and around the 32-token attention blocks


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    kind = request.param
    names, sizes = zip(*FAMILIES[kind])
    model = build_model(kind, tmp_path_factory.getbasetemp() / "models")
    instances = make_instances(
        model, tmp_path_factory.mktemp(f"family-{kind}"), sizes=sizes, server_args=FLAGS, names=names,
        faults=True,  # the rig's FaultInjectingConnector: inert unless a request asks (negative control)
    )  # fmt: skip
    with running(instances):
        warm_up(instances)
        yield kind, instances


def handoff(p, d, prompt, **extra):
    params = p.prefill(prompt)
    before = d.prompt_tokens()
    got = d.decode(prompt, {**params, **extra}, MAX_TOKENS)
    after = d.prompt_tokens()
    return params, got, {k: after[k] - before[k] for k in after}


def check_cell(p, d, ref, lengths, seed) -> list[str]:
    failures = []
    for n in lengths:
        prompt = random_prompt(n, seed=seed)
        params, got, tokens = handoff(p, d, prompt)
        r = params.get("replay_offset")
        if r != n - 1 or params.get("tp_size") != p.tp:
            failures.append(f"n={n}: params {params}")
            continue
        if (tokens["external_kv_transfer"], tokens["local_compute"]) != (r, n - r):
            failures.append(f"n={n}: D's prompt tokens by source {tokens}, R={r}")
        want = ref.reference(prompt, MAX_TOKENS).token_ids
        if got.token_ids != want:
            failures.append(f"n={n}: {got.token_ids} != aggregated {want}")
    return failures


# (P, D) per cell; D's own instance is the aggregated reference.
CELLS = {"P1->D1": ("tp1", "tp1"), "P1->D2": ("tp1", "tp2"), "P2->D1": ("tp2", "tp1")}


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_pd_matches_aggregated_token_for_token_and_d_loads_the_prompt_from_p(family, cell):
    kind, inst = family
    p, d = (inst[name] for name in CELLS[cell])
    failures = check_cell(p, d, d, LENGTHS, seed=3)
    assert not failures, f"{kind} {cell}:\n" + "\n".join(failures)


def test_a_handoff_one_token_off_is_caught(family):
    """Negative control: D resuming one token early on P's state (fault injection) must fail the
    same comparison on most prompts."""
    kind, inst = family
    caught = 0
    for n in (40, 70, 130, 200):
        prompt = random_prompt(n, seed=5)
        want = inst["tp1"].reference(prompt, MAX_TOKENS).token_ids
        _, got, _ = handoff(inst["tp2"], inst["tp1"], prompt, **{RESUME_SHIFT: -1})
        caught += got.token_ids != want
    assert caught >= 3, f"{kind}: only {caught} of 4 desynced handoffs were caught"
