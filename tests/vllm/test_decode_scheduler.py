"""D half against vLLM's real Scheduler: validate P's offset, load exactly R, recompute [R, N)."""

import pytest
from rig.scheduler_harness import connector_half, finished_params, make_request, make_scheduler, run_step
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

HYBRID = ("attention", "mamba")


def p_params(model_dir, prompt, groups, sizes=None, **extra):
    """Real P output for ``prompt`` (what a router would forward to D); ``sizes``: block-size
    arguments of make_scheduler."""
    p = make_scheduler(model_dir, "kv_producer", groups=groups, **(sizes or {}))
    req = make_request(prompt, {"do_remote_decode": True, **extra}, block_size=p.hash_block_size)
    p.add_request(req)
    for _ in range(3):
        done = finished_params(run_step(p)[1])
        if req.request_id in done:
            return done[req.request_id]
    raise AssertionError("P did not finish")


def admit(d, prompt, params):
    req = make_request(prompt, dict(params) if isinstance(params, dict) else params)
    d.add_request(req)
    out, _ = run_step(d)
    return req, out


@pytest.mark.parametrize("groups", [("attention",), HYBRID, ("mamba", "attention", "mamba")])
@pytest.mark.parametrize("n", [2, 16, 17, 32, 33, 47])
def test_d_loads_exactly_the_offset_and_recomputes_the_tail(model_dir, groups, n):
    prompt = list(range(100, 100 + n))
    params = p_params(model_dir, prompt, groups)
    r = params["replay_offset"]
    d = make_scheduler(model_dir, "kv_consumer", groups=groups)
    req, out = admit(d, prompt, params)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == r
    assert out.num_scheduled_tokens == {}
    task = out.kv_connector_metadata.to_recv[req.request_id]
    assert task.num_tokens == r and task.lease.request_id == params["remote_request_id"]
    local = d.kv_cache_manager.get_blocks(req.request_id).get_block_ids()
    for kind, sent, pairs, mine in zip(groups, params["remote_block_ids"], task.pairs, local):
        if kind == "mamba":
            assert pairs == [(sent[0], clip_ssm_state_blocks(list(mine), 0)[0])]
        else:
            assert pairs == list(zip(sent, mine[: len(sent)])), "position-by-position"
    # The worker reports the load done: D now prefills exactly N - R tokens.
    out, _ = run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    out, _ = run_step(d)
    assert out.num_scheduled_tokens == {req.request_id: n - r}


TAMPERED = {
    "offset_at_prompt_length": lambda p, n: {**p, "replay_offset": n, "remote_num_tokens": n},
    "negative_offset": lambda p, n: {**p, "replay_offset": -1},
    "bool_offset": lambda p, n: {**p, "replay_offset": True},
    "string_offset": lambda p, n: {**p, "replay_offset": "30"},
    "missing_offset": lambda p, n: {k: v for k, v in p.items() if k != "replay_offset"},
    "other_protocol_version": lambda p, n: {**p, "pd_protocol_version": 99},
    "offset_disagrees_with_remote_num_tokens": lambda p, n: {**p, "replay_offset": p["replay_offset"] - 1},
    "null_block_id": lambda p, n: {**p, "remote_block_ids": [[0] + p["remote_block_ids"][0][1:], p["remote_block_ids"][1]]},
    "block_ids_not_a_list": lambda p, n: {**p, "remote_block_ids": "1,2,3"},
    "port_out_of_range": lambda p, n: {**p, "remote_port": 70000},
}


@pytest.mark.parametrize("tamper", sorted(TAMPERED))
def test_d_refuses_tampered_params_and_prefills_locally(model_dir, tamper):
    n = 40
    prompt = list(range(100, 100 + n))
    params = TAMPERED[tamper](p_params(model_dir, prompt, HYBRID), n)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    req, out = admit(d, prompt, params)
    assert out.num_scheduled_tokens == {req.request_id: n}, "full local prefill"
    assert not out.kv_connector_metadata.to_recv
    stats = connector_half(d).stats
    assert sum(v for k, v in stats.items() if k.startswith("refused:")) == 1


def test_d_refusal_releases_p_blocks_when_params_decode(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    params["replay_offset"] = params["remote_num_tokens"] = 40
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    _, out = admit(d, prompt, params)
    (release,) = out.kv_connector_metadata.to_release
    assert release.lease.request_id == params["remote_request_id"]


def test_d_refuses_an_offset_above_its_own_requirement(model_dir):
    """Config skew: D needs 3 recompute tokens (e.g. multi-module MTP), P offered N - 1."""
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    half = connector_half(d)
    half.decode.profile = type(half.profile)(has_recurrent_state=True, prefill_lookahead=4)
    _, out = admit(d, prompt, params)
    assert half.stats["refused:offset_above_requirement"] == 1
    assert list(out.num_scheduled_tokens.values()) == [40]


def test_d_failed_load_is_recomputed_locally_by_default(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    req, _ = admit(d, prompt, params)
    rid = req.request_id
    run_step(d, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    out, _ = run_step(d)
    assert out.num_scheduled_tokens == {rid: 40}
    assert req.status == RequestStatus.RUNNING


def test_d_failed_load_fails_the_request_under_fail_policy(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, extra_config={"load_failure_policy": "fail"})
    req, _ = admit(d, prompt, params)
    rid = req.request_id
    _, outputs = run_step(d, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    assert rid in finished_params(outputs)
    assert req.status == RequestStatus.FINISHED_ERROR


def test_d_aborted_before_admission_releases_p(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, num_blocks=3)  # too small to admit
    req = make_request(prompt, dict(params))
    d.add_request(req)
    run_step(d)
    d.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(d)
    assert [t.lease.request_id for t in out.kv_connector_metadata.to_release] == [params["remote_request_id"]]


def test_d_local_prefix_hit_loads_only_the_missing_blocks(model_dir):
    shared = list(range(200, 248))  # 3 full blocks
    d = make_scheduler(model_dir, "kv_consumer", groups=("attention",), prefix_caching=True)
    warm = make_request(shared + [5, 6, 7], None, max_tokens=1)
    d.add_request(warm)
    for _ in range(3):
        run_step(d)
    prompt = shared + list(range(300, 312))
    params = p_params(model_dir, prompt, ("attention",))
    r = params["replay_offset"]
    req, out = admit(d, prompt, params)
    task = out.kv_connector_metadata.to_recv[req.request_id]
    assert task.num_tokens == r - 48
    (pairs,) = task.pairs
    mine = d.kv_cache_manager.get_blocks(req.request_id).get_block_ids()[0]
    assert pairs == [(params["remote_block_ids"][0][3], mine[3])], "only the block past the hit"


def test_d_mamba_scratch_slots_are_never_written(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, num_speculative_blocks=2)
    req, out = admit(d, prompt, params)
    mamba_table = d.kv_cache_manager.get_blocks(req.request_id).get_block_ids()[1]
    (pair,) = out.kv_connector_metadata.to_recv[req.request_id].pairs[1]
    assert pair[1] == clip_ssm_state_blocks(list(mamba_table), 2)[0]
    assert pair[1] not in mamba_table[len(mamba_table) - 2 :] or len(mamba_table) <= 2


def test_d_mismatched_group_count_is_refused(model_dir):
    prompt = list(range(100, 140))
    params = p_params(model_dir, prompt, ("attention",))
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    _, out = admit(d, prompt, params)
    assert connector_half(d).stats["refused:group_mismatch"] == 1
    assert list(out.num_scheduled_tokens.values()) == [40]


def test_d_reports_each_accepted_handoff_in_the_step_that_admits_it(model_dir):
    """D pairs and records a step's accepted handoffs in one pass (build_connector_meta), not
    one by one inside the admission loop: none may be lost, counted twice, reported a step
    late, or paired with another request's blocks."""
    prompts = [list(range(100 + 50 * i, 140 + 50 * i)) for i in range(3)]
    params = [p_params(model_dir, prompt, HYBRID) for prompt in prompts]
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    reqs = [make_request(prompt, dict(pp)) for prompt, pp in zip(prompts, params)]
    for req in reqs:
        d.add_request(req)
    out, outputs = run_step(d)
    assert len(out.kv_connector_metadata.to_recv) == 3
    for req, pp in zip(reqs, params):
        task = out.kv_connector_metadata.to_recv[req.request_id]
        attention, mamba = d.kv_cache_manager.get_blocks(req.request_id).get_block_ids()
        assert task.lease.request_id == pp["remote_request_id"]
        assert task.pairs[0] == list(zip(pp["remote_block_ids"][0], attention))
        assert task.pairs[1] == [(pp["remote_block_ids"][1][0], clip_ssm_state_blocks(list(mamba), 0)[0])]
    assert connector_half(d).stats["handoff_accepted"] == 3
    (stats,) = [eco.scheduler_stats.kv_connector_stats for eco in outputs.values() if eco.scheduler_stats]
    assert stats["events"]["handoff_accepted"] == 3
    assert stats["recompute_tokens"] == [40 - pp["replay_offset"] for pp in params]
    _, outputs = run_step(d)
    later = [eco.scheduler_stats.kv_connector_stats for eco in outputs.values() if eco.scheduler_stats]
    assert not any(s and s["recompute_tokens"] for s in later), "reported once"


def test_d_unpairable_handoff_reaches_the_worker_as_a_failed_load(model_dir):
    """P's params decode and the offset is fine, but P sent fewer attention blocks than the
    offset needs (a P with another block size, or edited params): pairing fails at the end of
    the step, the worker gets a task without pairs (it reports the load failed, and vLLM
    recomputes), and the refusal is counted; the other handoff of the same step is unaffected."""
    prompts = [list(range(100, 140)), list(range(200, 240))]
    params = [p_params(model_dir, prompt, HYBRID) for prompt in prompts]
    params[0]["remote_block_ids"] = [params[0]["remote_block_ids"][0][:1], params[0]["remote_block_ids"][1]]
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    reqs = [make_request(prompt, dict(pp)) for prompt, pp in zip(prompts, params)]
    for req in reqs:
        d.add_request(req)
    out, _ = run_step(d)
    tasks = out.kv_connector_metadata.to_recv
    assert tasks[reqs[0].request_id].pairs is None
    assert tasks[reqs[1].request_id].pairs is not None
    assert connector_half(d).stats["refused:pairing"] == 1
    rid = reqs[0].request_id
    run_step(d, kv_output=KVConnectorOutput(finished_recving={rid}, failed_recving={rid}))
    out, _ = run_step(d)
    assert out.num_scheduled_tokens.get(rid) == 40, "recomputed locally"


@pytest.mark.parametrize("n", [2, 63, 64, 65, 200])
def test_hybrid_laid_out_as_vllm_does_loads_the_offset_and_pairs_the_one_state_slot(model_dir, n):
    """vLLM never gives a hybrid 16-token blocks: the attention block grows until its page holds
    a Mamba state (Platform._align_hybrid_block_size) and, without prefix caching, the Mamba
    group's block is max_model_len (one per request). Here 64-token attention blocks and a
    256-token Mamba block: the prompt ends inside, at, and past a block boundary."""
    sizes = dict(block_size=64, mamba_block_size=256, max_model_len=256)
    prompt = list(range(100, 100 + n))
    params = p_params(model_dir, prompt, HYBRID, sizes)
    r = params["replay_offset"]
    assert r == n - 1 and len(params["remote_block_ids"][0]) == -(-r // 64)
    assert len(params["remote_block_ids"][1]) == 1, "one Mamba state slot"
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, **sizes)
    dreq = make_request(prompt, dict(params), block_size=d.hash_block_size)
    d.add_request(dreq)
    out, _ = run_step(d)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS and dreq.num_computed_tokens == r
    task = out.kv_connector_metadata.to_recv[dreq.request_id]
    attn, mamba = d.kv_cache_manager.get_blocks(dreq.request_id).get_block_ids()
    assert list(task.pairs[0]) == list(zip(params["remote_block_ids"][0], attn))
    assert list(task.pairs[1]) == [(params["remote_block_ids"][1][0], mamba[-1])]
    run_step(d, kv_output=KVConnectorOutput(finished_recving={dreq.request_id}))
    out, _ = run_step(d)
    assert out.num_scheduled_tokens == {dreq.request_id: n - r}


def rejection_notice(params, abort_immediately=True):
    """What vLLM's AsyncLLM.notify_kv_transfer_request_rejected submits when D's serving layer
    rejects a request before the engine: prompt [0], max_tokens 1, the original params."""
    req = make_request([0], dict(params), max_tokens=1)
    req.abort_immediately = abort_immediately
    return req


def test_rejection_notice_releases_p_lease_without_counting_a_refusal(model_dir):
    params = p_params(model_dir, list(range(100, 140)), HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    req = rejection_notice(params)
    d.add_request(req)  # as EngineCore.add_request does for abort_immediately requests
    d.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(d)
    released = [t.lease.request_id for t in out.kv_connector_metadata.to_release]
    assert released == [params["remote_request_id"]], "P's blocks freed now, not at lease expiry"
    assert not out.kv_connector_metadata.to_recv
    stats = connector_half(d).stats
    assert stats.get("rejected_before_engine") == 1
    assert not [k for k in stats if k.startswith("refused:")]


def test_same_stand_in_without_the_abort_flag_is_a_refused_offset(model_dir):
    """Negative control: the flag, not the 1-token prompt, is what marks vLLM's notice."""
    params = p_params(model_dir, list(range(100, 140)), HYBRID)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    d.add_request(rejection_notice(params, abort_immediately=False))
    stats = connector_half(d).stats
    assert stats.get("refused:offset_out_of_range") == 1 and "rejected_before_engine" not in stats
