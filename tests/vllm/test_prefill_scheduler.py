"""P half against vLLM's real Scheduler and KV-cache manager."""

import pytest
from rig.scheduler_harness import connector_half, finished_params, make_request, make_scheduler, run_step
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.core.protocol import PROTOCOL_VERSION

P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def prefill(scheduler, n, params=None, steps=4):
    req = make_request(list(range(10, 10 + n)), dict(params or P_PARAMS))
    scheduler.add_request(req)
    for _ in range(steps):
        _, outputs = run_step(scheduler)
        done = finished_params(outputs)
        if req.request_id in done:
            return req, done[req.request_id]
    raise AssertionError("prefill did not finish")


@pytest.mark.parametrize("groups", [("attention",), ("attention", "mamba"), ("mamba", "attention", "mamba")])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 32, 33, 40])
def test_p_computes_exactly_the_replay_offset_and_returns_it(model_dir, groups, n):
    s = make_scheduler(model_dir, "kv_producer", groups=groups)
    req, params = prefill(s, n)
    r = params["replay_offset"]
    assert r == n - 1  # no speculation: one recompute token for hybrids and attention alike
    assert params["pd_protocol_version"] == PROTOCOL_VERSION
    assert params["remote_num_tokens"] == r
    if r == 0:
        # Nothing worth handing over: P prefills normally and D will recompute everything.
        assert params["do_remote_prefill"] is False and params["remote_block_ids"] == []
        return
    # A hybrid (no prefix caching here) holds the state at exactly R in its own slot; an
    # attention-only model prefills the whole prompt as aggregated serving does (its KV of [0, R)
    # is the same either way).
    assert req.num_computed_tokens == (n if groups == ("attention",) else r), "P must hold the state at exactly R"
    assert params["do_remote_prefill"] is True
    for kind, ids in zip(groups, params["remote_block_ids"]):
        if kind == "mamba":
            assert len(ids) == 1 and ids[0] > 0
        else:
            assert len(ids) == -(-r // 16) and 0 not in ids
    # NixlConnector-compatible superset, for routers that forward the dict.
    for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"):
        assert key in params


def test_p_holds_blocks_until_finished_sending(model_dir):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    req, params = prefill(s, 40)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() < free_before, "blocks leased"
    out, _ = run_step(s)
    lease = out.kv_connector_metadata.to_send[req.request_id]
    assert lease.block_ids == params["remote_block_ids"]
    run_step(s, kv_output=KVConnectorOutput(finished_sending={req.request_id}))
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert req.request_id not in s.requests


def test_p_truncation_is_idempotent_when_the_request_is_re_added(model_dir):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    req = make_request(list(range(10, 50)), dict(P_PARAMS))
    half = connector_half(s)
    half.on_new_request(req)
    half.on_new_request(req)  # e.g. preempted and re-admitted: must not truncate twice
    assert req.num_prompt_tokens == 39 and len(req.prompt_token_ids) == 39
    assert req.max_tokens == 1


def test_p_backs_off_further_when_decode_states_its_requirement(model_dir):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    _, params = prefill(s, 40, {**P_PARAMS, "pd_min_recompute_tokens": 3})
    assert params["replay_offset"] == 37


@pytest.mark.parametrize("bad", [-1, "3", 2.5, True, None])
def test_p_ignores_malformed_min_recompute_and_counts_it(model_dir, bad):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    _, params = prefill(s, 40, {**P_PARAMS, "pd_min_recompute_tokens": bad})
    assert params["replay_offset"] == 39
    if bad is not None:
        assert connector_half(s).stats["bad_min_recompute"] == 1


def test_p_aborted_request_hands_over_nothing_and_frees_blocks(model_dir):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    req = make_request(list(range(10, 50)), dict(P_PARAMS))
    s.add_request(req)
    s.schedule()
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    out, _ = run_step(s)
    assert not out.kv_connector_metadata.to_send
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_p_prompt_logprobs_request_hands_over_nothing(model_dir):
    s = make_scheduler(model_dir, "kv_producer", groups=("attention", "mamba"))
    req = make_request(list(range(10, 50)), dict(P_PARAMS))
    req.sampling_params.prompt_logprobs = 1
    assert req.get_skip_reading_prefix_cache() or True
    connector_half(s).on_new_request(req)
    if req.get_skip_reading_prefix_cache():
        assert req.num_prompt_tokens == 40  # D recomputes the whole prompt anyway
