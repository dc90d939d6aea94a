"""The end-to-end benchmark's handoff figures (README table) from two Prometheus snapshots, and
its prefix-caching table of D's prompt tokens by source."""

from pd_connector.dev.benchmarks.e2e_report import (
    handoff_figures,
    handoff_table,
    prefix_caching_lengths,
    prefix_caching_rows,
    prefix_caching_table,
    token_deltas,
)

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


# The prefix-caching case: D's prompt tokens by source per request, and the table over them.


def record(system, n, computed, loaded, hit=0.0, model="qwen3_next_mtp"):
    return {"model": model, "system": system, "prompt_len": n, "d_local_compute": computed,
            "d_external_kv_transfer": loaded, "d_local_cache_hit": hit}  # fmt: skip


def table_cells(records, lengths):
    header, _, *rows = prefix_caching_table(prefix_caching_rows(records, lengths)).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in row.strip("|").split("|")))) for row in rows]


def test_lengths_sit_around_the_mamba_block_with_two_off_the_grid():
    assert prefix_caching_lengths(384) == [383, 384, 385, 485, 640, 767, 769, 1153]


def test_token_deltas_are_per_source_and_none_where_a_source_is_missing():
    before = {"local_compute": 10.0, "external_kv_transfer": 100.0, "local_cache_hit": None}
    after = {"local_compute": 11.0, "external_kv_transfer": 483.0, "local_cache_hit": 0.0}
    assert token_deltas(before, after) == {"d_local_compute": 1.0, "d_external_kv_transfer": 383.0,
                                           "d_local_cache_hit": None}  # fmt: skip


def test_medians_per_system_and_the_share_of_the_prompt_d_computed():
    records = [
        record("pd", 384, 1, 383), record("pd", 384, 1, 383), record("pd", 384, 3, 381),
        record("nixl", 384, 384, 0), record("nixl", 384, 0, 384), record("nixl", 384, 384, 0),
        record("pd", 769, 1, 768), record("nixl", 769, 769, 0, hit=0),
    ]  # fmt: skip
    rows = table_cells(records, [384, 769])
    assert [r["prompt"] for r in rows] == ["384", "769"]
    assert (rows[0]["D computed pd"], rows[0]["D computed nixl"]) == ("1", "384")
    assert (rows[0]["loaded from P pd"], rows[0]["loaded from P nixl"]) == ("383", "0")
    assert (rows[0]["D computed share pd"], rows[0]["D computed share nixl"]) == ("0.3%", "100.0%")
    assert rows[0]["requests pd/nixl"] == "3/3"
    assert (rows[1]["D computed share pd"], rows[1]["D computed share nixl"]) == ("0.1%", "100.0%")


def test_a_system_without_figures_reads_dash_not_zero():
    """NixlConnector's requests all failed (no token figures recorded): '-' and 0 requests."""
    records = [record("pd", 383, 1, 382), {"model": "qwen3_next_mtp", "system": "nixl", "prompt_len": 383}]
    (row,) = table_cells(records, [383])
    assert (row["D computed nixl"], row["loaded from P nixl"], row["D computed share nixl"]) == ("-", "-", "-")
    assert row["D cache hit pd/nixl"] == "0/-"
    assert row["requests pd/nixl"] == "1/0"


def test_a_request_sent_twice_is_left_out():
    """After an error the bench sends once more; D's counters then cover both sends."""
    retried = record("pd", 400, 401, 0) | {"retried": True}
    (row,) = table_cells([record("pd", 400, 1, 399), retried, record("nixl", 400, 1, 399)], [400])
    assert (row["D computed pd"], row["requests pd/nixl"]) == ("1", "1/1")
