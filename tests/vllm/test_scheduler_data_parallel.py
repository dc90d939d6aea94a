"""What data parallelism changes for the connector, against vLLM's real Scheduler: each DP rank is
its own prefill engine (vLLM's ``<id>_dp<k>``) on its own ports, a D engine reads from any of
them, and an engine with only connector work keeps being stepped (what DP's lockstep relies on)."""

import pytest
from rig.scheduler_harness import connector_half, finished_params, make_request, make_scheduler, run_step
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.core.settings import parse_settings
from pd_connector.engine.from_vllm.vllm_config import dp_placement

BASE = 5660
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def p_engine(model_dir, dp_index, **kw):
    return make_scheduler(model_dir, "kv_producer", extra_config={"side_channel_port": BASE}, dp_index=dp_index, **kw)


def prefill(p, prompt):
    req = make_request(prompt, dict(P_PARAMS), block_size=p.hash_block_size)
    p.add_request(req)
    for _ in range(3):
        done = finished_params(run_step(p)[1])
        if req.request_id in done:
            return req, done[req.request_id]
    raise AssertionError("P did not finish")


def test_each_p_engine_of_a_dp_group_names_itself_and_its_own_port(model_dir):
    prompt = list(range(100, 140))
    got = [prefill(p_engine(model_dir, k), prompt)[1] for k in (0, 1)]
    assert [g["remote_engine_id"].rsplit("_", 1)[1] for g in got] == ["dp0", "dp1"]
    assert got[0]["remote_engine_id"] != got[1]["remote_engine_id"]
    assert [g["remote_port"] for g in got] == [BASE, BASE + 1]


def test_dp_x_tp_params_name_the_dp_ranks_tp_rank_0_port(model_dir):
    """P DP 2 x TP 2: DP rank 1's TP ranks listen on BASE + 2 and BASE + 3; D reaches rank r at
    remote_port + r."""
    _, params = prefill(p_engine(model_dir, 1, tp_size=2), list(range(100, 140)))
    assert (params["remote_port"], params["tp_size"]) == (BASE + 2, 2)


def test_one_d_engine_reads_from_either_p_engine_of_a_dp_group(model_dir):
    prompt = list(range(100, 140))
    d = make_scheduler(model_dir, "kv_consumer", dp_index=0)
    for k in (1, 0):
        _, params = prefill(p_engine(model_dir, k), prompt)
        req = make_request(prompt, dict(params))
        d.add_request(req)
        out, _ = run_step(d)
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        task = out.kv_connector_metadata.to_recv[req.request_id]
        assert (task.lease.engine_id, task.lease.port) == (params["remote_engine_id"], BASE + k)
        run_step(d, kv_output=KVConnectorOutput(finished_recving={req.request_id}))
    assert connector_half(d).stats["handoff_accepted"] == 2


def test_a_p_rank_holding_only_leases_is_still_stepped_until_they_end(model_dir):
    """vLLM's DP loop (DPEngineCoreProc.run_busy_loop) steps a rank while its scheduler
    ``has_requests()``, and counts it idle in the DP wave when it has no unfinished request: a
    P rank whose only work is a lease must still be stepped, so that its worker reports
    ``finished_sending`` and expires leases, without holding the wave open."""
    p = p_engine(model_dir, 1, dp_lockstep=True)
    req, _ = prefill(p, list(range(100, 140)))
    assert not p.has_unfinished_requests() and p.has_requests()
    run_step(p)
    run_step(p, kv_output=KVConnectorOutput(finished_sending={req.request_id}))
    assert not p.has_requests()


def test_a_d_rank_waiting_for_its_read_counts_as_unfinished(model_dir):
    """A D rank whose only request waits for its READ keeps the DP wave running (it steps and
    joins the collectives with dummy batches) until the load ends."""
    prompt = list(range(100, 140))
    _, params = prefill(p_engine(model_dir, 0), prompt)
    d = make_scheduler(model_dir, "kv_consumer", dp_index=1, dp_lockstep=True)
    req = make_request(prompt, dict(params))
    d.add_request(req)
    run_step(d)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and d.has_unfinished_requests()


@pytest.mark.parametrize("lockstep", [False, True])
def test_dp_placement_reads_the_rank_vllm_keeps_and_whether_ranks_step_together(model_dir, lockstep):
    s = make_scheduler(model_dir, "kv_producer", dp_index=1, dp_lockstep=lockstep)
    assert dp_placement(s.vllm_config) == (1, lockstep)


def test_a_worker_in_a_lockstep_dp_group_never_waits_in_an_idle_step(model_dir):
    from pd_connector.engine.worker_side import WorkerSide

    settings = parse_settings({"idle_step_wait_ms": 5.0})
    for lockstep, wait in ((False, 0.005), (True, 0.0)):
        s = make_scheduler(model_dir, "kv_producer", dp_index=1, dp_lockstep=lockstep)
        worker = WorkerSide(s.vllm_config, s.kv_cache_config, settings)
        assert worker._idle_wait_s == wait and worker.dp_index == 1


def _worker(model_dir, dp_index, base):
    from pd_connector.core.protocol import Welcome
    from pd_connector.engine.worker_side import WorkerSide

    s = make_scheduler(model_dir, "kv_producer", dp_index=dp_index)
    worker = WorkerSide(s.vllm_config, s.kv_cache_config, parse_settings({"side_channel_port": base}))
    welcome = Welcome(worker.engine_id, "agent", b"", [], worker.compat)
    return worker, welcome


def test_two_instances_on_overlapping_ports_refuse_at_start_up_naming_the_scheme(model_dir):
    """A second DP-2 instance whose side_channel_port is one above the first's: its DP rank 0
    wants the first instance's DP rank 1 port. The bind refusal names the port, the setting and
    the scheme that fixes it."""
    from rig.ports import free_ports
    from pd_connector.transport.side_channel import SideChannelError

    base = free_ports(3)
    first, welcome = _worker(model_dir, 1, base)  # the first instance's DP rank 1: base + 1
    held = first._start_lease_server(welcome, None)
    try:
        second, welcome2 = _worker(model_dir, 0, base + 1)
        with pytest.raises(SideChannelError) as refused:
            second._start_lease_server(welcome2, None)
        text = str(refused.value)
        assert f":{base + 1}" in text and "side_channel_port" in text and "dp_index" not in text
        assert "DP rank 0" in text and "d * t consecutive ports" in text
        # Apart by the first instance's range (2 ports), the two start side by side.
        third, welcome3 = _worker(model_dir, 0, base + 2)
        third._start_lease_server(welcome3, None).close()
    finally:
        held.close()


def test_a_dp_rank_past_the_last_port_is_refused_before_binding(model_dir):
    from pd_connector.core.settings import UnsupportedConfig

    worker, welcome = _worker(model_dir, 1, 65535)
    with pytest.raises(UnsupportedConfig, match="side_channel_port to at most 65534"):
        worker._start_lease_server(welcome, None)
