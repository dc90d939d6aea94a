"""P x D over TP {1, 2} x {1, 2} on vLLM CPU, for every layer kind the connector shards.

One TP-1 and one TP-2 ``kv_both`` instance per model (``rig/tp_matrix.py``): each cell
is a handoff from one to the other or to itself, checked against the D instance serving the
prompt itself (aggregated, at D's TP), with D's own accounting
(``vllm:prompt_tokens_by_source``) showing that R tokens came from P and N - R were computed.

Models: attention with 2 KV heads and with 1 (replicated at TP 2); Mamba2 hybrids with
n_groups 1 (replicated at TP 2) and 2; the Qwen3-Next-style GDN hybrid in bf16 with MTP on both
sides (bf16 rule: the equal-TP cell at D's TP and aggregated serving there, both up to the
baseline's near-ties: bf16 sums in another order at another TP size).
"""

from __future__ import annotations

import threading

import pytest

from rig.cpu_matrix import TP_MODELS, boundary_lengths, random_prompt
from rig.oracle import compare
from rig.spec_matrix import BF16_LOGPROB_TOL, BF16_TIE_MARGIN
from rig.tiny_models import build_model
from rig.faults import RESUME_SHIFT
from rig.tp_matrix import make_instances, running, warm_up

pytestmark = pytest.mark.e2e

CELLS = [(1, 1), (1, 2), (2, 1), (2, 2)]
MAX_TOKENS = 8
# Eight lengths on and around the 32-token blocks, plus a long one.
LENGTHS = [b for b in boundary_lengths(32) if b >= 5][:8] + [400]


@pytest.fixture(scope="module", params=sorted(TP_MODELS))
def tp(request, tmp_path_factory):
    kind = request.param
    dtype, flags = TP_MODELS[kind]
    model = build_model(kind, tmp_path_factory.getbasetemp() / "models")
    instances = make_instances(
        model,
        tmp_path_factory.mktemp(f"tp-{kind}"),
        dtype=dtype,
        server_args=flags,
        faults=True,  # the rig's FaultInjectingConnector: inert unless a request asks
    )
    with running(instances):
        warm_up(instances)
        yield kind, dtype, instances


def handoff(p, d, prompt, **extra):
    params = p.prefill(prompt)
    before = d.prompt_tokens()
    got = d.decode(prompt, {**params, **extra}, MAX_TOKENS)
    after = d.prompt_tokens()
    return params, got, {k: after[k] - before[k] for k in after}


def exact(dtype: str) -> bool:
    return dtype == "float32"


def test_every_tp_cell_matches_aggregated_and_d_loads_the_prompt_from_p(tp):
    kind, dtype, inst = tp
    failures = []
    outputs = {}
    refs = {(d_tp, n): inst[d_tp].reference(random_prompt(n, seed=3), MAX_TOKENS) for d_tp in inst for n in LENGTHS}
    for p_tp, d_tp in CELLS:
        p, d = inst[p_tp], inst[d_tp]
        for n in LENGTHS:
            prompt = random_prompt(n, seed=3)
            ref = refs[d_tp, n]
            params, got, tokens = handoff(p, d, prompt)
            r = params.get("replay_offset")
            if params.get("tp_size") != p_tp or r != n - 1:
                failures.append(f"P{p_tp}->D{d_tp} n={n}: params {params}")
                continue
            # D's own accounting: R tokens from P, N - R computed (the handoff happened).
            if (tokens["external_kv_transfer"], tokens["local_compute"]) != (r, n - r):
                failures.append(f"P{p_tp}->D{d_tp} n={n}: D's prompt tokens by source {tokens}, R={r}")
            outputs[p_tp, d_tp, n] = got
            if exact(dtype):
                if got.token_ids != ref.token_ids:
                    failures.append(f"P{p_tp}->D{d_tp} n={n}: {got.token_ids} != aggregated {ref.token_ids}")
            else:
                verdict = compare(ref, got, tie_margin=BF16_TIE_MARGIN, logprob_tol=BF16_LOGPROB_TOL)
                if not verdict.ok:
                    failures.append(f"P{p_tp}->D{d_tp} n={n}: {verdict.describe()}")
    if not exact(dtype):
        # bf16: another TP size sums in another order, so a cell across TP sizes may part from
        # both equal-TP cells at a near-tie (measured: P1->D2 at n=65 and P2->D1 at n=96 took
        # another token where P1->D1 and P2->D2 agreed). It must match the equal-TP cell at D's
        # TP up to the same near-tie rule as aggregated serving.
        for (p_tp, d_tp, n), got in outputs.items():
            same = outputs.get((d_tp, d_tp, n))
            if p_tp != d_tp and same is not None:
                verdict = compare(same, got, tie_margin=BF16_TIE_MARGIN, logprob_tol=BF16_LOGPROB_TOL)
                if not verdict.ok:
                    failures.append(f"P{p_tp}->D{d_tp} n={n} vs the equal-TP cell: {verdict.describe()}")
    assert not failures, f"{kind}:\n" + "\n".join(failures)


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_a_concurrent_batch_across_tp_sizes_matches_aggregated(tp, p_tp, d_tp):
    kind, dtype, inst = tp
    p, d = inst[p_tp], inst[d_tp]
    prompts = [random_prompt(n, seed=11) for n in (33, 64, 95, 130, 200, 257)]
    refs = [d.reference(pr, MAX_TOKENS) for pr in prompts]
    params = [p.prefill(pr) for pr in prompts]
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = d.decode(prompts[i], params[i], MAX_TOKENS)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for ref, got, pr in zip(refs, results, prompts):
        assert got is not None
        if exact(dtype):
            assert got.token_ids == ref.token_ids, f"{kind} n={len(pr)}"
        else:
            assert compare(ref, got, tie_margin=BF16_TIE_MARGIN, logprob_tol=BF16_LOGPROB_TOL).ok, f"{kind} n={len(pr)}"


def test_a_handoff_one_token_off_across_tp_is_caught(tp):
    """Negative control: D resuming one token early on P's state (fault injection) across TP
    sizes must fail the same comparison on most prompts."""
    kind, dtype, inst = tp
    if kind.startswith("llama"):
        pytest.skip("attention-only: a one-token shift re-reads correct KV (no recurrent state)")
    p, d = inst[2], inst[1]
    caught = 0
    for n in (40, 70, 130, 200):
        prompt = random_prompt(n, seed=5)
        ref = d.reference(prompt, MAX_TOKENS)
        _, got, _ = handoff(p, d, prompt, **{RESUME_SHIFT: -1})
        ok = got.token_ids == ref.token_ids if exact(dtype) else compare(
            ref, got, tie_margin=BF16_TIE_MARGIN, logprob_tol=BF16_LOGPROB_TOL
        ).ok
        caught += not ok
    assert caught >= 3, f"{kind}: only {caught} of 4 desynced handoffs were caught"


def test_an_unsupported_tp_pair_is_refused_counted_and_recomputed(tp):
    """P claiming a TP size D cannot pair with (3 against D's 2) is refused before anything
    moves, named with both sizes, counted, and D's answer is still aggregated serving's."""
    kind, dtype, inst = tp
    if kind != "llama":
        pytest.skip("one model is enough for the refusal path")
    p, d = inst[1], inst[2]
    prompt = random_prompt(70, seed=9)
    ref = d.reference(prompt, MAX_TOKENS)
    before = d.events().get("load_failed:tp_mismatch", 0)
    params = {**p.prefill(prompt), "tp_size": 3}
    got = d.decode(prompt, params, MAX_TOKENS)
    assert got.token_ids == ref.token_ids
    # Worker-side events are counted by each D rank that sees them (vLLM sums the ranks' stats).
    assert d.events().get("load_failed:tp_mismatch", 0) == before + d.tp
    log = d.server.log_path.read_text()
    assert "prefill TP 3 and decode TP 2" in log
