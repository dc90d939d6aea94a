"""P x D under data parallelism on vLLM CPU: every P engine of a DP group is its own prefill
source, and any D engine reads from any of them.

Two ``kv_both`` instances per model behind one API server each (vLLM's internal load balancer,
``rig/dp_matrix.py``): "dp2" with ``--data-parallel-size 2`` and "dp1" with one engine.
llama's dp1 runs at TP 2, so P DP 2 x TP 1 -> D DP 1 x TP 2 is the unequal-TP DP x TP cell;
nemotron_h is the Mamba2 hybrid. (vLLM CPU 0.32 runs no MoE model at DP 2, docs/testing.md: the
lockstep and expert-parallel cases are covered in process, tests/vllm/test_scheduler_data_parallel.py.)
A request goes to DP rank k with ``X-data-parallel-rank``; each cell is one P engine -> one D
engine, checked token for token against D's engine serving the prompt itself, with that D
engine's ``vllm:prompt_tokens_by_source`` (labelled by engine) showing R tokens from P and N - R
computed.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading

import pytest

from rig.cpu_matrix import DP_MODELS, random_prompt
from rig.tiny_models import build_model
from rig.faults import RESUME_SHIFT
from rig.dp_matrix import engines, make_instances, running, warm_up
from rig.router import VllmRouter, router_binary

pytestmark = pytest.mark.e2e

MAX_TOKENS = 6
LENGTHS = (37, 96)


@pytest.fixture(scope="module", params=sorted(DP_MODELS))
def dp(request, tmp_path_factory):
    kind = request.param
    shapes, flags, per_instance = DP_MODELS[kind]
    model = build_model(kind, tmp_path_factory.getbasetemp() / "models")
    instances = make_instances(
        model,
        tmp_path_factory.mktemp(f"dp-{kind}"),
        shapes,
        server_args=flags,
        per_instance_args=per_instance,
        faults=True,  # the rig's FaultInjectingConnector: inert unless a request asks
    )
    with running(instances):
        warm_up(instances)
        yield kind, instances


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def complete_concurrently(url: str, prompts: list) -> list:
    """Every prompt sent at once to a router in front of the instances; each one's Completion
    (None where it failed: the caller's comparison names it)."""
    from rig.oracle import complete

    results: list = [None] * len(prompts)

    def run(i):
        results[i] = complete(url, "tiny", prompts[i], MAX_TOKENS, timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


# D's load failures that mean P's side channel did not answer in time (CPU starvation,
# docs/operations.md "Unanswered first calls"): named in a failure's message.
STARVED = ("load_failed:claim", "load_failed:handshake")


def starved_loads(d, before: list[dict[str, float]]) -> int:
    """How many of D's loads failed for want of an answer from P since ``before`` (per engine)."""
    return sum(
        d.events(j).get(e, 0.0) - before[j].get(e, 0.0) for j in range(d.dp) for e in STARVED
    )


def partial_characters(proxy_url: str) -> float:
    """The proxy's count of first tokens that are part of a character (the replay flow)."""
    from rig.prometheus import parse_metric
    from pd_connector.urls import OPENER

    with OPENER.open(proxy_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return parse_metric(text, "pd_proxy_resume_total", {"mode": "replay", "reason": "partial_character"}) or 0.0


def assert_every_handoff_loaded(kind: str, loaded: float, prompts: list, starved: int, tail: int = 1) -> None:
    """D loaded N - ``tail`` tokens of every prompt (1 under replay, 0 under zero replay, where
    D's prompt is P's N tokens plus P's first token). A handoff D recomputed because P's side
    channel did not answer fails here too: that is the CPU starvation to fix at its root
    (docs/operations.md, "Unanswered first calls"), not to wave through."""
    full = sum(len(pr) - tail for pr in prompts)
    assert loaded == full, f"{kind}: D loaded {loaded} tokens of {full} ({starved} loads without an answer from P)"


def label(inst, rank) -> str:
    return f"{inst.name}[dp{rank}]"


def test_every_p_engine_hands_off_to_every_d_engine_token_for_token(dp):
    """P DP 2 -> D DP 1, P DP 1 -> D DP 2, P DP 2 -> D DP 2 (and DP 1 -> DP 1), each P engine to
    each D engine: P's params name the engine holding the blocks and its own port, and D's
    engine loads R tokens and computes N - R."""
    kind, inst = dp
    failures = []
    for d, j in engines(inst):
        refs = {n: d.reference(random_prompt(n, seed=21), MAX_TOKENS, rank=j) for n in LENGTHS}
        for i, (p, k) in enumerate(engines(inst)):
            # One length per cell, the lengths alternating over the cells (CI time).
            for n in (LENGTHS[(i + j) % len(LENGTHS)],):
                prompt = random_prompt(n, seed=21)
                params = p.prefill(prompt, rank=k)
                cell = f"{kind} P {label(p, k)} -> D {label(d, j)} n={n}"
                engine_id, port = params.get("remote_engine_id", ""), params.get("remote_port")
                named = engine_id.endswith(f"_dp{k}") if p.dp > 1 else "_dp" not in engine_id
                if not named or port != p.port_of(k) or params.get("tp_size") != p.tp:
                    failures.append(f"{cell}: params name {engine_id} at {port}, tp {params.get('tp_size')}")
                    continue
                r = params["replay_offset"]
                before = d.prompt_tokens(j)
                got = d.decode(prompt, params, MAX_TOKENS, rank=j)
                tokens = delta(before, d.prompt_tokens(j))
                if (tokens["external_kv_transfer"], tokens["local_compute"]) != (r, n - r):
                    failures.append(f"{cell}: D's prompt tokens by source {tokens}, R={r}")
                if got.token_ids != refs[n].token_ids:
                    failures.append(f"{cell}: {got.token_ids} != aggregated {refs[n].token_ids}")
    assert not failures, "\n".join(failures)


def test_a_concurrent_batch_is_served_by_both_ranks_of_p_and_d(dp):
    """No rank header: vLLM's load balancer spreads a concurrent batch over both P engines and
    both D engines; every request still matches aggregated serving, and each D engine's
    accounting shows the loads it did."""
    kind, inst = dp
    p = d = inst["dp2"]
    prompts = [random_prompt(n, seed=31) for n in (40, 57, 64, 71, 90, 101, 120, 133)]
    refs = [d.reference(pr, MAX_TOKENS) for pr in prompts]
    params: list = [None] * len(prompts)
    results: list = [None] * len(prompts)

    def prefill(i):
        params[i] = p.prefill(prompts[i])

    def decode(i):
        results[i] = d.decode(prompts[i], params[i], MAX_TOKENS)

    before = [d.prompt_tokens(j) for j in range(d.dp)]
    for step in (prefill, decode):
        threads = [threading.Thread(target=step, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    sources = {pr["remote_engine_id"].rsplit("_", 1)[1] for pr in params}
    assert sources == {"dp0", "dp1"}, f"{kind}: P engines that served the batch: {sources}"
    loaded = [delta(before[j], d.prompt_tokens(j))["external_kv_transfer"] for j in range(d.dp)]
    assert all(x > 0 for x in loaded), f"{kind}: tokens each D engine loaded: {loaded}"
    assert sum(loaded) == sum(pr["replay_offset"] for pr in params)
    for ref, got, pr in zip(refs, results, prompts):
        assert got is not None and got.token_ids == ref.token_ids, f"{kind} n={len(pr)}"


def test_params_naming_another_dp_rank_are_refused_and_recomputed(dp):
    """Negative control of the per-rank identity: P DP rank 0's params pointed at rank 1's port
    reach an engine that holds none of the blocks. D must fail the load there (the handshake
    names another engine, or, with rank 0 already connected, rank 1 refuses the claim for a
    lease it never had) and recompute (no token loaded), still answering aggregated serving's
    tokens, and the failure is counted on the D engine that had it (``engine`` label)."""
    kind, inst = dp
    p = d = inst["dp2"]
    prompt = random_prompt(70, seed=41)
    ref = d.reference(prompt, MAX_TOKENS, rank=1)
    params = {**p.prefill(prompt, rank=0), "remote_port": p.port_of(1)}
    before, events = d.prompt_tokens(1), [d.events(0), d.events(1)]
    got = d.decode(prompt, params, MAX_TOKENS, rank=1)
    tokens = delta(before, d.prompt_tokens(1))
    assert tokens["external_kv_transfer"] == 0 and tokens["local_compute"] == len(prompt), tokens
    assert got.token_ids == ref.token_ids
    after = [d.events(0), d.events(1)]
    moved = [{e: n - events[j].get(e, 0.0) for e, n in after[j].items() if n > events[j].get(e, 0.0)} for j in (0, 1)]
    failed = [sum(n for e, n in m.items() if e.startswith("load_failed:")) for m in moved]
    assert failed == [0, 1], moved


def test_a_handoff_one_token_off_from_a_dp_rank_is_caught(dp):
    """Negative control of the oracle: D resuming one token early on P DP rank 1's state (fault
    injection) must fail the same comparison on most prompts."""
    kind, inst = dp
    if kind.startswith("llama"):
        pytest.skip("attention-only: a one-token shift re-reads correct KV (no recurrent state)")
    p, d = inst["dp2"], inst["dp1"]
    caught = 0
    for n in (40, 70, 130, 200):
        prompt = random_prompt(n, seed=5)
        ref = d.reference(prompt, MAX_TOKENS)
        got = d.decode(prompt, {**p.prefill(prompt, rank=1), RESUME_SHIFT: -1}, MAX_TOKENS)
        caught += got.token_ids != ref.token_ids
    assert caught >= 3, f"{kind}: only {caught} of 4 desynced handoffs were caught"


def test_the_proxy_in_front_of_dp_instances_matches_aggregated(dp, tmp_path):
    """``pd-connector proxy`` with a DP-2 P and a DP-2 D: vLLM's load balancers pick the ranks,
    P's params name the one that prefilled, and a concurrent batch matches aggregated serving
    with D's engines loading every handoff."""
    from rig.proxy_process import ProxyProcess

    kind, inst = dp
    p = d = inst["dp2"]
    prompts = [random_prompt(n, seed=61) for n in (45, 66, 87, 108, 129, 150)]
    refs = [d.reference(pr, MAX_TOKENS) for pr in prompts]
    proxy = ProxyProcess(p.server.base_url, d.server.base_url, tmp_path / "proxy.log", {"PYTHONPATH": p.server.env.get("PYTHONPATH", "")})
    try:
        before, events = d.prompt_tokens(), [d.events(j) for j in range(d.dp)]
        results = complete_concurrently(proxy.url, prompts)
        tokens = delta(before, d.prompt_tokens())
        partial = partial_characters(proxy.url)
    finally:
        proxy.stop()
    # The proxy resumes D at P's first token (zero replay): D loads all N prompt tokens, except
    # for a first token that is part of a character, which takes the replay flow (D computes the
    # prompt: docs/operations.md, partial_character). Which prompts those were is not known.
    loaded = tokens["external_kv_transfer"]
    replayed = [c for c in itertools.combinations(prompts, int(partial)) if loaded == sum(map(len, prompts)) - sum(map(len, c))]
    if not replayed:
        assert_every_handoff_loaded(kind, loaded, prompts, starved_loads(d, events), tail=0)
    assert int(partial) < len(prompts), f"{kind}: no request took zero replay"
    for ref, got, pr in zip(refs, results, prompts):
        assert got is not None and got.token_ids == ref.token_ids, f"{kind} n={len(pr)}"


@pytest.mark.skipif(router_binary() is None, reason="vllm-router is not installed: run scripts/setup_router_venv.sh")
def test_vllm_router_with_dp_aware_routing_in_front_of_dp_instances_matches_aggregated(dp, tmp_path):
    """vllm-router's DP-aware routing (``--intra-node-data-parallel-size 2``: it steers each
    request to a rank with ``X-data-parallel-rank``) in front of a DP-2 P and a DP-2 D: P's
    params name the engine that prefilled, D's engines load every handoff, and a concurrent
    batch matches aggregated serving."""
    kind, inst = dp
    p = d = inst["dp2"]
    prompts = [random_prompt(n, seed=71) for n in (44, 65, 86, 107, 128, 149)]
    refs = [d.reference(pr, MAX_TOKENS) for pr in prompts]
    dp_args = ["--intra-node-data-parallel-size", str(p.dp), "--api-key", "pd-e2e"]
    # One kv_both instance is both pools: vllm-router keys workers by URL, so P goes by another
    # name of the same address (else the decode pool replaces the prefill one: "0 prefill").
    prefill_url = p.server.base_url.replace("127.0.0.1", "localhost")
    with VllmRouter([prefill_url], [d.server.base_url], tmp_path / "vllm-router.log", extra_args=dp_args) as router:
        before, events = [d.prompt_tokens(j) for j in range(d.dp)], [d.events(j) for j in range(d.dp)]
        results = complete_concurrently(router.url, prompts)
        loaded = [delta(before[j], d.prompt_tokens(j))["external_kv_transfer"] for j in range(d.dp)]
    assert_every_handoff_loaded(kind, sum(loaded), prompts, starved_loads(d, events))
    assert all(x > 0 for x in loaded), f"{kind}: the router steered no handoff to a D rank: {loaded}"
    for ref, got, pr in zip(refs, results, prompts):
        assert got is not None and got.token_ids == ref.token_ids, f"{kind} n={len(pr)}"


def test_check_reports_every_dp_engine_it_reached(dp):
    from pd_connector.check.run import run_check

    kind, inst = dp
    rep = run_check(inst["dp2"].server.base_url, inst["dp1"].server.base_url, timeout=300)
    assert rep.ok, rep.format()
    line = next(i for i in rep.info if i.startswith("P's DP engines reached"))
    assert "(2; D has 1)" in line and "_dp0 at" in line and "_dp1 at" in line and "DIFFER" not in line, line


def _rank_processes(server, rank: int) -> list[int]:
    """PIDs of DP rank ``rank``'s engine core and worker, from the lines they logged (vLLM
    prefixes each with its process name and pid), checked against the server's process group."""
    text = server.log_text()
    pids = set(re.findall(rf"\(EngineCore_DP{rank} pid=(\d+)\)", text))
    pids |= set(re.findall(rf"\(\S+ pid=(\d+)\)[^\n]*pd_connector worker: DP rank {rank},", text))
    members = set(server.group_pids())
    return sorted(int(p) for p in pids if int(p) in members)


def test_a_p_rank_killed_mid_handoff_is_recomputed_and_other_handoffs_load(dp):
    """P DP rank 1 dies between its prefill and D's READ. D recomputes its handoff, correctly,
    while a handoff from another P instance in the same moments still loads. vLLM takes the
    rest of that P instance down with the rank (``MPClient`` shuts the client down when any
    engine core exits, vllm/v1/engine/core_client.py), so DP rank 0's handoff is loaded if its
    READ won the race and recomputed otherwise: either way D answers aggregated serving's
    tokens. Last test of the module: it kills a shared server's rank."""
    kind, inst = dp
    if kind != sorted(DP_MODELS)[-1]:
        pytest.skip("once per module, on the last model's servers")
    p, other, d = inst["dp2"], inst["dp1"], inst["dp1"]
    prompts = {k: random_prompt(80 + 10 * k, seed=51) for k in (0, 1, 2)}
    refs = {k: d.reference(prompts[k], MAX_TOKENS) for k in prompts}
    params = {0: p.prefill(prompts[0], rank=0), 1: p.prefill(prompts[1], rank=1), 2: other.prefill(prompts[2])}
    victims = _rank_processes(p.server, 1)
    assert len(victims) == 2, f"DP rank 1's engine core and worker not found: {victims}"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    got, tokens = {}, {}
    for k in (1, 2, 0):
        before = d.prompt_tokens()
        got[k] = d.decode(prompts[k], params[k], MAX_TOKENS, timeout=300)
        tokens[k] = delta(before, d.prompt_tokens())
    assert tokens[1]["external_kv_transfer"] == 0 and tokens[1]["local_compute"] == len(prompts[1]), tokens
    assert tokens[2]["external_kv_transfer"] == params[2]["replay_offset"], tokens
    assert tokens[0]["external_kv_transfer"] in (0, params[0]["replay_offset"]), tokens
    for k in prompts:
        assert got[k].token_ids == refs[k].token_ids, k
