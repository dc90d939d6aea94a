"""The end-to-end benchmark's handoff figures (README table) from two Prometheus snapshots."""

from pd_connector.dev.benchmarks.e2e_report import handoff_figures, handoff_table

CLAIM, HELD = "decode:vllm:pd_claim_seconds", "prefill:vllm:pd_claim_held_seconds"


def snap(claim_sum=0.0, claim_n=0, held_sum=0.0, held_n=0, with_held=True):
    out = {f"{CLAIM}_sum": claim_sum, f"{CLAIM}_count": claim_n}
    if with_held:
        out |= {f"{HELD}_sum": held_sum, f"{HELD}_count": held_n}
    return out


def cells(before, after, system="pd"):
    """The table's first row, computed from these snapshots as ``system``'s figures."""
    run = {"model": "m", "handoff": {"pd": handoff_figures(before, after, system), "nixl": handoff_figures({}, {}, "nixl")}}
    header, _, pd_row, _ = handoff_table([run]).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    return dict(zip(names, (c.strip() for c in pd_row.strip("|").split("|"))))


def test_claim_is_the_mean_over_the_measured_requests_only():
    row = cells(snap(0.010, 2), snap(0.030, 6))
    assert row["claim ms"] == "5.0"


def test_no_held_claim_reads_none_and_held_ones_show_mean_and_count():
    assert cells(snap(), snap(0.01, 1))["P held (n) ms"] == "none"
    assert cells(snap(held_sum=1.0, held_n=1), snap(0.01, 1, held_sum=1.3, held_n=4))["P held (n) ms"] == "100.0 (3)"


def test_a_prefill_without_the_series_reads_dash():
    """NixlConnector's P exports no vllm:pd_claim_held_seconds: not 'none', unknown."""
    assert cells(snap(with_held=False), snap(with_held=False), system="nixl")["P held (n) ms"] == "-"
