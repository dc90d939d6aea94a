"""NIXL between two processes on two namespaced "hosts" (``rig/netns.py``): UCX picks
tcp by itself, and the transfer benchmark's ``tcp`` section runs and checks its bytes. The
negative control shows why each host gets a boot id of its own: on the machine's own boot id
UCX takes the two namespaces for one machine and reads over cma, and the same check fails."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rig import devices
from rig.netns import unavailable_reason

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(bool(unavailable_reason()), reason=f"two namespaced hosts: {unavailable_reason()}"),
    pytest.mark.skipif(devices.on_cuda(), reason="DRAM between two namespaced hosts: nothing of it is on the GPU"),
]

SMALL_CASE = [("llama-8b", 1024, 32, True)]


def _args(**kw):
    base = dict(budget_mib=4, pool_factor=1.5, reps=1, warmup=0, seed=0, chunk_mib=32, num_threads=0,
                ucx_error_handling="peer", progress_delay_us=None)
    return SimpleNamespace(**{**base, **kw})


def test_bench_transfer_tcp_section_reads_over_tcp_between_two_hosts(tmp_path, capsys):
    from benchmarks import transfer

    argv = ["--sections", "tcp", "--reps", "1", "--warmup", "0", "--budget-mib", "4", "--out", str(tmp_path)]
    assert transfer.main(argv) == 0
    data = json.loads((tmp_path / "bench_transfer.json").read_text())
    link = data["tcp_link"]
    assert link["read_transports"] == ["tcp"] and link["inter_node"], link
    cases = data["tcp"]
    assert len(cases) == 3 and all(c["verified"] for c in cases)
    assert all(set(c["samples"]) == {"connector", "raw", "memcpy"} for c in cases)
    out = capsys.readouterr().out
    assert "UCX's READ went over tcp/" in out and "(inter-node)" in out and "c/raw" in out


def test_on_one_boot_id_ucx_takes_the_namespaces_for_one_machine_and_reads_over_cma():
    from benchmarks import transfer_tcp

    out = transfer_tcp.run(_args(), SMALL_CASE, own_boot_ids=False)
    assert all(r["verified"] for r in out["results"])
    assert "cma" in out["read_transports"] and not out["inter_node"], out
