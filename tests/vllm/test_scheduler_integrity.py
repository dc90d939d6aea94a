"""What ties a handoff to its prompt and its readers, against vLLM's real Scheduler: the prompt
fingerprint, n > 1 siblings, the lease P announces, and failures that must not escape into
EngineCore."""

import time

import pytest
from rig.scheduler_harness import connector_half, finished_params, make_request, make_scheduler, run_step
from vllm.lora.request import LoRARequest
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.core import pairing
from pd_connector.core.fingerprint import extra_keys, fingerprint
from pd_connector.engine.from_vllm import identity
from rig.faults import SKIP_PROMPT_CHECK

HYBRID = ("attention", "mamba")
PROMPT = list(range(100, 140))


def prefill(p, prompt, params=None, **request_kw):
    req = make_request(prompt, {"do_remote_decode": True, **(params or {})}, block_size=p.hash_block_size, **request_kw)
    p.add_request(req)
    for _ in range(3):
        out, outputs = run_step(p)
        done = finished_params(outputs)
        if req.request_id in done:
            return req, done[req.request_id]
    raise AssertionError("P did not finish")


def decode(model_dir, prompt, params, faults=False, **request_kw):
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, faults=faults)
    req = make_request(prompt, dict(params), **request_kw)
    d.add_request(req)
    out, _ = run_step(d)
    return d, req, out


# --- the prompt fingerprint ---------------------------------------------------------------------


def test_p_returns_the_prompt_fingerprint_and_the_lease_it_keeps_before_a_claim(model_dir):
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID, extra_config={"claim_deadline_seconds": 7})
    req, params = prefill(p, PROMPT)
    r = params["replay_offset"]
    # vLLM hashes every block of every request when a connector is loaded: P reuses that chain.
    assert params["pd_prompt_fingerprint"].startswith("2:b:sha256:16:")
    assert params["pd_prompt_fingerprint"] == identity.prompt_fingerprint(req, r, *connector_half(p).prefill.fingerprint_form)
    assert params["pd_lease_seconds"] == 7  # the claim deadline, below lease_seconds
    out, _ = run_step(p)
    lease = out.kv_connector_metadata.to_send[req.request_id]
    assert lease.fingerprint == params["pd_prompt_fingerprint"] and lease.requests == 1
    assert lease.deadline - time.monotonic() == pytest.approx(7, abs=1.0)


def test_d_refuses_another_prompt_of_the_same_length_as_prompt_mismatch(model_dir):
    """A router that re-rendered the prompt, or sent D another conversation: D decoded on P's
    state for tokens it does not have, with no error."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    other = PROMPT[:20] + [7] + PROMPT[21:]  # one token differs
    d, req, out = decode(model_dir, other, params)
    half = connector_half(d)
    assert half.stats["refused:prompt_mismatch"] == 1
    assert out.num_scheduled_tokens == {req.request_id: 40}, "recomputed locally"
    (release,) = out.kv_connector_metadata.to_release
    assert release.lease.request_id == params["remote_request_id"]
    assert release.request_id == req.request_id, "released as this D request's reader"
    assert "prompt_mismatch" in release.reason and "first 39 tokens of this 40-token prompt" in release.reason
    assert str(other[20:30])[1:-1] not in release.reason


def test_d_accepts_a_prompt_that_differs_only_in_the_tail_it_recomputes(model_dir):
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    d, req, out = decode(model_dir, PROMPT[:-1] + [5], params)
    task = out.kv_connector_metadata.to_recv[req.request_id]
    assert task.fingerprint == params["pd_prompt_fingerprint"], "the claim carries the fingerprint"
    assert "refused:prompt_mismatch" not in connector_half(d).stats


@pytest.mark.parametrize(
    "p_kw, d_kw",
    [
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}),
        ({"cache_salt": "tenant-a"}, {}),
        ({"lora_request": LoRARequest("sql", 1, "/a")}, {"lora_request": LoRARequest("chat", 1, "/a")}),
        ({"lora_request": LoRARequest("sql", 1, "/a")}, {}),
    ],
)
def test_cache_salt_and_lora_adapter_are_part_of_the_fingerprint(model_dir, p_kw, d_kw):
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT, **p_kw)
    d, _, _ = decode(model_dir, PROMPT, params, **d_kw)
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1
    # The same salt, and the same adapter under another server's numeric id, agree (the adapter
    # by its files or, here, its path: tests/vllm/test_fingerprint_inputs.py).
    same = {k: (LoRARequest(v.lora_name, 7, v.lora_path) if k == "lora_request" else v) for k, v in p_kw.items()}
    d, _, _ = decode(model_dir, PROMPT, params, **same)
    assert "refused:prompt_mismatch" not in connector_half(d).stats


@pytest.mark.parametrize("where", ["in_a_full_block", "in_the_tail_after_the_last_full_block"])
def test_blocks_form_covers_every_token_before_the_offset(model_dir, where):
    """The blocks form reuses vLLM's chain for the full blocks and folds the rest: a change in
    either part is a mismatch."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    at = 5 if where == "in_a_full_block" else 35  # R = 39, 16-token blocks: 32..38 is the tail
    other = PROMPT[:at] + [3] + PROMPT[at + 1 :]
    d, _, _ = decode(model_dir, other, params)
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1


@pytest.mark.parametrize("p_block, d_block", [(16, 32), (32, 16), (16, 4096)])
def test_a_fingerprint_at_another_hash_block_size_is_rehashed_not_refused(model_dir, p_block, d_block):
    """Prefix caching on one side only gives P and D other hash block sizes (a hybrid hashes at
    its Mamba block with it, at the whole context without it): D could not compute P's form and
    refused every handoff as prompt_mismatch. D rebuilds vLLM's chain at P's size; a prompt
    that differs is still refused."""
    make_scheduler(model_dir, "kv_producer", groups=HYBRID)  # seeds vLLM's NONE_HASH
    theirs = f"b:sha256:{p_block}:tag"
    p_req = make_request(PROMPT, None, block_size=p_block)
    p_digest = identity.prompt_fingerprint(p_req, 39, theirs, p_block)
    d_req = make_request(PROMPT, None, block_size=d_block)
    assert identity.prompt_fingerprint_rehashed(d_req, 39, theirs, f"b:sha256:{d_block}:tag") == p_digest
    other = make_request(PROMPT[:5] + [3] + PROMPT[6:], None, block_size=d_block)
    assert identity.prompt_fingerprint_rehashed(other, 39, theirs, f"b:sha256:{d_block}:tag") != p_digest
    # Another algorithm or seed cannot be rebuilt here: refused by name as before.
    assert identity.prompt_fingerprint_rehashed(d_req, 39, theirs, f"b:sha256_cbor:{d_block}:tag") is None
    assert identity.prompt_fingerprint_rehashed(d_req, 39, theirs, f"b:sha256:{d_block}:other") is None


def test_a_fingerprint_in_the_tokens_form_is_checked_too(model_dir):
    """A P whose block hashes are not comparable across engines (xxhash without PYTHONHASHSEED)
    folds every token; D checks that form whatever its own."""
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID)
    connector_half(p).prefill.fingerprint_form = connector_half(p).decode.fingerprint_form = (identity.TOKENS, 0)
    _, params = prefill(p, PROMPT)
    assert params["pd_prompt_fingerprint"] == fingerprint(PROMPT, 39)
    d, req, out = decode(model_dir, PROMPT, params)
    assert req.request_id in out.kv_connector_metadata.to_recv
    d, _, _ = decode(model_dir, PROMPT[:-2] + [1, 2], params)
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1


def test_a_fingerprint_form_d_cannot_compute_is_refused_naming_the_settings(model_dir):
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    params = {**params, "pd_prompt_fingerprint": "2:b:xxhash:16:deadbeef:" + "0" * 32}
    d, _, out = decode(model_dir, PROMPT, params)
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1
    (release,) = out.kv_connector_metadata.to_release
    assert "b:xxhash:16:deadbeef" in release.reason and "PYTHONHASHSEED" in release.reason


def test_a_fingerprint_of_another_version_is_refused_naming_the_version(model_dir):
    """Version 1 keyed LoRA adapters and multimodal items by name and path: not comparable."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    params = {**params, "pd_prompt_fingerprint": "1:" + params["pd_prompt_fingerprint"].partition(":")[2]}
    d, _, out = decode(model_dir, PROMPT, params)
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1
    (release,) = out.kv_connector_metadata.to_release
    assert "fingerprint version (this instance's: 2)" in release.reason


def test_fingerprint_form_follows_the_engines_block_hashing(monkeypatch):
    from types import SimpleNamespace

    def form(algo, block=16):
        return identity.fingerprint_form(
            SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo)),
            SimpleNamespace(hash_block_size=block),
        )

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    sha, size = form("sha256")
    assert sha.startswith("b:sha256:16:") and size == 16
    assert form("sha256", block=None) == (identity.TOKENS, 0)
    assert form("xxhash") == (identity.TOKENS, 0), "seeded per process: not comparable"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert form("xxhash")[0].startswith("b:xxhash:16:")
    assert form("sha256")[0] != sha, "the seed is part of the form"


def test_fingerprint_covers_multimodal_items_placed_before_the_offset():
    at = extra_keys([("img-1", 5, 10)], length=39)
    assert fingerprint(PROMPT, 39, at) != fingerprint(PROMPT, 39, extra_keys([("img-2", 5, 10)], length=39))
    assert fingerprint(PROMPT, 39, at) != fingerprint(PROMPT, 39, extra_keys([("img-1", 6, 10)], length=39))
    # An item after the offset is D's to compute: it does not change what P hands over.
    assert extra_keys([("img-1", 39, 10)], length=39) == ()


def test_fault_connector_lets_another_prompt_through_as_before_the_check(model_dir):
    """Negative control of the e2e comparison: with the check skipped (rig/fault_connector.py),
    D accepts another prompt's handoff and claims with P's fingerprint (so P grants it)."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    d, req, out = decode(model_dir, list(range(300, 340)), {**params, SKIP_PROMPT_CHECK: True}, faults=True)
    assert out.kv_connector_metadata.to_recv[req.request_id].fingerprint == params["pd_prompt_fingerprint"]
    d, _, _ = decode(model_dir, list(range(300, 340)), {**params, SKIP_PROMPT_CHECK: True})
    assert connector_half(d).stats["refused:prompt_mismatch"] == 1, "PDConnector ignores the key"


# --- n > 1 -----------------------------------------------------------------------------------------


def test_p_siblings_of_one_n_request_share_one_lease(model_dir):
    """vLLM runs n children "i_<parent>" and returns one child's params for the request: a lease
    per child left n - 1 of them orphaned until their deadline."""
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID)
    reqs = [make_request(PROMPT, {"do_remote_decode": True}, request_id=f"{i}_cmpl-x-1a2b3c4d") for i in range(3)]
    for req in reqs:
        p.add_request(req)
    params, leases = {}, {}
    for _ in range(3):
        out, outputs = run_step(p)
        leases.update(out.kv_connector_metadata.to_send)
        params.update(finished_params(outputs))
    assert len(params) == 3 and len(leases) == 1
    (lease_id,) = leases
    assert all(pp == params[lease_id] for pp in params.values()), "every child returns the leased one"
    assert connector_half(p).stats["handoff_shared"] == 2
    # A router that sent P the client's n (not pd_decode_requests) has n decode requests read it.
    assert leases[lease_id].requests == 3
    out, _ = run_step(p, kv_output=KVConnectorOutput(finished_sending={lease_id}))
    assert not p.requests, "the other children's blocks were freed when they finished"


def test_p_children_with_other_prompts_are_not_merged(model_dir):
    """With request-id randomisation off, two clients' "0_x" and "1_x" look like siblings: the
    fingerprint keeps their handoffs apart."""
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID)
    _, a = prefill(p, PROMPT, request_id="0_x")
    _, b = prefill(p, list(range(300, 340)), request_id="1_x")
    assert a["remote_request_id"] != b["remote_request_id"]


def test_p_lease_waits_for_the_decode_requests_the_router_announces(model_dir):
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID)
    req, _ = prefill(p, PROMPT, {"pd_decode_requests": 3})
    out, _ = run_step(p)
    assert out.kv_connector_metadata.to_send[req.request_id].requests == 3
    req, _ = prefill(p, PROMPT, {"pd_decode_requests": 0})
    out, _ = run_step(p)
    assert out.kv_connector_metadata.to_send[req.request_id].requests == 1
    assert connector_half(p).stats["bad_decode_requests"] == 1


# --- lifecycle -------------------------------------------------------------------------------------


def test_source_block_selection_error_hands_over_nothing_instead_of_escaping_into_engine_core(model_dir, monkeypatch):
    p = make_scheduler(model_dir, "kv_producer", groups=HYBRID)

    def broken(*_a, **_k):
        raise pairing.PairingError("P's Mamba table holds only scratch slots")

    monkeypatch.setattr(pairing, "select_source_blocks", broken)
    free_before = p.kv_cache_manager.block_pool.get_num_free_blocks()
    req, params = prefill(p, PROMPT)
    assert params["do_remote_prefill"] is False and params["remote_block_ids"] == []
    assert params["pd_prompt_fingerprint"] == ""
    out, _ = run_step(p)
    assert not out.kv_connector_metadata.to_send
    assert connector_half(p).stats["p_pairing_failed"] == 1
    assert p.kv_cache_manager.block_pool.get_num_free_blocks() == free_before


def test_queued_handoffs_are_extended_on_the_cadence_of_the_lease_p_keeps(model_dir):
    """D extended queued handoffs every third of its own lease_seconds: a P keeping them for
    less than a third of that lost the leases of requests still queued on D."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    params = {**params, "pd_lease_seconds": 0.6}
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, num_blocks=3, extra_config={"lease_seconds": 120})
    req = make_request(PROMPT, params)
    d.add_request(req)  # too large to admit: stays queued
    run_step(d)
    time.sleep(0.25)
    out, _ = run_step(d)
    (extension,) = out.kv_connector_metadata.to_extend
    assert extension.request_ids == [params["remote_request_id"]]


def test_a_handoff_is_kept_alive_from_acceptance_until_the_worker_reports_the_load(model_dir):
    """One keep-alive clock on D: the scheduler extends a handoff while it is queued and while
    its load runs (a READ that outlived the lease would copy blocks P has reused), on the
    cadence of the lease P announced, and stops once every D rank reported the load ended."""
    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    params = {**params, "pd_lease_seconds": 0.6}
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID, extra_config={"lease_seconds": 120})
    req = make_request(PROMPT, params)
    d.add_request(req)
    out, _ = run_step(d)
    assert req.request_id in out.kv_connector_metadata.to_recv  # admitted: the load starts
    time.sleep(0.25)
    out, _ = run_step(d)
    (extension,) = out.kv_connector_metadata.to_extend
    assert extension.request_ids == [params["remote_request_id"]]
    run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    time.sleep(0.25)
    out, _ = run_step(d)
    assert out.kv_connector_metadata.to_extend == []


def test_a_tiny_lease_is_extended_no_more_often_than_the_floor(model_dir):
    """However short a lease P announces, D's clock asks at most every
    leases.MIN_EXTEND_INTERVAL_S (the receiver's clock held this floor before there was one
    clock)."""
    from pd_connector.core.leases import MIN_EXTEND_INTERVAL_S

    _, params = prefill(make_scheduler(model_dir, "kv_producer", groups=HYBRID), PROMPT)
    d = make_scheduler(model_dir, "kv_consumer", groups=HYBRID)
    d.add_request(make_request(PROMPT, {**params, "pd_lease_seconds": 0.003}))
    run_step(d)  # admitted: the load starts
    started, sent = time.monotonic(), 0
    while time.monotonic() - started < 0.5:
        out, _ = run_step(d)
        sent += len(out.kv_connector_metadata.to_extend)
    assert 1 <= sent <= 0.5 / MIN_EXTEND_INTERVAL_S + 1


def test_bounded_replay_window_backs_off_one_token_as_vllm_does_not_the_whole_window():
    """DeepSeek-V4.1's bounded-replay sliding window: a P/D load restores it, so vLLM backs off
    one token (_prefill_backoff); the profile took prefix_replay_tokens (the window) and P
    handed over N - 128 of N tokens."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    from pd_connector.core.handoff import plan_handoff
    from pd_connector.core.recompute_profile import min_recompute_tokens
    from pd_connector.engine.from_vllm.vllm_config import profile_from_vllm

    spec = SlidingWindowMLASpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, sliding_window=128, bounded_replay=True
    )
    assert spec.prefix_replay_tokens == 128
    config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        speculative_config=None,
        num_prefill_lookahead_tokens=0,
    )
    profile = profile_from_vllm(config, SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]))
    assert profile.bounded_replay and min_recompute_tokens(profile) == 1
    assert plan_handoff(1000, profile).replay_offset == 999
