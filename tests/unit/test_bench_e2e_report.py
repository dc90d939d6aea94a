"""The end-to-end benchmark's report: handoff figures (README table) from two Prometheus
snapshots or per-request deltas, the systems' order, the client-side tables and their ratios
against aggregated serving, where "P done -> D's first token" goes, D's and P's prompt tokens by
source per request, and P's prefill time."""

from benchmarks.e2e_report import (
    DEPLOYMENT,
    SYSTEMS,
    accounting_rows,
    accounting_table,
    first_difference,
    handoff_figures,
    handoff_from_records,
    handoff_table,
    latency_tables,
    prefill_rows,
    prefill_table,
    prefix_caching_lengths,
    request_accounting,
    request_order,
    summarize,
    token_deltas,
    token_rows,
    token_table,
)
from benchmarks.e2e_servers import stream_timings

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


# D's and P's prompt tokens by source per request, and the table over them (every mode).


def record(system, n, computed, loaded, hit=0.0, model="qwen3_next_mtp", p_computed=None):
    return {"model": model, "system": system, "prompt_len": n, "d_local_compute": computed,
            "d_external_kv_transfer": loaded, "d_local_cache_hit": hit, "p_local_compute": p_computed}  # fmt: skip


def table_cells(records, lengths):
    header, _, *rows = token_table(token_rows(records, lengths)).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in row.strip("|").split("|")))) for row in rows]


def by_system(cells):
    return {(c["prompt"], c["system"]): c for c in cells}


def test_lengths_sit_around_the_mamba_block_with_two_off_the_grid():
    assert prefix_caching_lengths(384) == [383, 384, 385, 485, 640, 767, 769, 1153]


def test_token_deltas_are_per_source_and_none_where_a_source_is_missing():
    before = {"local_compute": 10.0, "external_kv_transfer": 100.0, "local_cache_hit": None}
    after = {"local_compute": 11.0, "external_kv_transfer": 483.0, "local_cache_hit": 0.0}
    assert token_deltas(before, after) == {"d_local_compute": 1.0, "d_external_kv_transfer": 383.0,
                                           "d_local_cache_hit": None}  # fmt: skip
    assert token_deltas(before, after, "p")["p_local_compute"] == 1.0


def test_medians_per_system_and_the_share_of_the_prompt_d_computed():
    records = [
        record("pd", 384, 1, 383), record("pd", 384, 1, 383), record("pd", 384, 3, 381),
        record("nixl", 384, 384, 0), record("nixl", 384, 0, 384), record("nixl", 384, 384, 0),
        record("pd", 769, 1, 768), record("nixl", 769, 769, 0, hit=0),
    ]  # fmt: skip
    cells = by_system(table_cells(records, [384, 769]))
    zero, nixl = cells[("384", "zero replay")], cells[("384", "NixlConnector")]
    assert (zero["D computed"], nixl["D computed"]) == ("1", "384")
    assert (zero["loaded from P"], nixl["loaded from P"]) == ("383", "0")
    assert (zero["D computed share"], nixl["D computed share"]) == ("0.3%", "100.0%")
    assert (zero["requests"], nixl["requests"]) == ("3", "3")
    assert cells[("769", "zero replay")]["D computed share"] == "0.1%"


def test_zero_replay_shows_n_loaded_one_computed_on_an_n_plus_1_prompt_and_replay_n_minus_1():
    """The accounting the bench exists to show: zero replay's D gets P's N prompt tokens plus
    P's first token, loads N and computes 1; replay's D loads N - 1 and recomputes the last;
    P computes N with zero replay and aggregated serving, N - 1 with replay."""
    records = [record("pd", 64, 1, 64, model="m", p_computed=64), record("replay", 64, 1, 63, model="m", p_computed=63),
               {"model": "m", "system": "agg", "prompt_len": 64, "p_local_compute": 64.0}]  # fmt: skip
    cells = by_system(table_cells(records, [64]))
    zero, replay, agg = cells[("64", "zero replay")], cells[("64", "replay")], cells[("64", "aggregated")]
    assert (zero["D prompt"], zero["loaded from P"], zero["D computed"], zero["P computed"]) == ("65", "64", "1", "64")
    assert (replay["D prompt"], replay["loaded from P"], replay["D computed"], replay["P computed"]) == ("64", "63", "1", "63")
    assert (agg["D prompt"], agg["D computed"], agg["P computed"], agg["requests"]) == ("-", "-", "64", "1")


def test_a_system_without_figures_reads_dash_not_zero():
    """NixlConnector's requests all failed (no token figures recorded): '-' and 0 requests."""
    records = [record("pd", 383, 1, 382)]
    cells = by_system(table_cells(records, [383]))
    nixl = cells[("383", "NixlConnector")]
    assert (nixl["D computed"], nixl["loaded from P"], nixl["D computed share"]) == ("-", "-", "-")
    assert (cells[("383", "zero replay")]["D cache hit"], nixl["D cache hit"]) == ("0", "-")
    assert (cells[("383", "zero replay")]["requests"], nixl["requests"]) == ("1", "0")


def test_a_request_sent_twice_is_left_out():
    """After an error the bench sends once more; the counters then cover both sends."""
    retried = record("pd", 400, 401, 0) | {"retried": True}
    cells = by_system(table_cells([record("pd", 400, 1, 399), retried, record("nixl", 400, 1, 399)], [400]))
    assert (cells[("400", "zero replay")]["D computed"], cells[("400", "zero replay")]["requests"]) == ("1", "1")


# The systems' order, the client-side summaries and their ratios.


def test_every_system_serves_each_prompt_once_and_the_deployments_alternate_which_goes_first():
    orders = [request_order(k) for k in range(6)]
    assert all(sorted(o) == sorted(SYSTEMS) for o in orders)
    assert [o[0] == "nixl" for o in orders] == [False, True] * 3
    # The pd_connector deployment's systems stay together (one pause/resume per deployment)
    # and each is first after its deployment resumes equally often over six prompts.
    for o in orders:
        pd_slots = [i for i, s in enumerate(o) if DEPLOYMENT[s] == "pd"]
        assert pd_slots == list(range(pd_slots[0], pd_slots[0] + 3))
    firsts = [next(s for s in o if DEPLOYMENT[s] == "pd") for o in orders]
    assert sorted(firsts) == sorted(["pd", "replay", "agg"] * 2)


def timed(system, n, ttft, token2, itl, total, same=True, model="m"):
    return {"model": model, "system": system, "prompt_len": n, "ttft_s": ttft, "token2_s": token2, "itl_s": itl,
            "total_s": total, "same_ids": None if system == "agg" else same,
            "same_text": None if system == "agg" else same}  # fmt: skip


def test_ratios_are_against_aggregated_serving_and_zero_replay_against_replay():
    records = [timed("agg", 16, 0.010, 0.015, 0.005, 0.085), timed("pd", 16, 0.012, 0.060, 0.008, 0.130),
               timed("replay", 16, 0.050, 0.055, 0.005, 0.125), timed("nixl", 16, 0.500, 0.505, 0.005, 0.575, False)]
    (row, overall) = summarize([{"model": "m", "records": records}], [16])
    assert row["pd_ttft_s_vs_agg"] == 1.2 and row["replay_ttft_s_vs_agg"] == 5.0
    assert abs(row["pd_ttft_s_vs_replay"] - 0.24) < 1e-12
    assert abs(row["pd_itl_s_vs_replay"] - 1.6) < 1e-12
    assert (row["pd_same_ids"], row["nixl_same_ids"], row["agg_same_ids"]) == ("1/1", "0/1", "0/0")
    assert overall["prompt_len"] == "all" and overall["nixl_n"] == 1
    tables = latency_tables([row])
    header, _, line = tables["ttft"].splitlines()
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in line.strip("|").split("|")]))
    assert (cells["TTFT zero med/p90 ms"], cells["zero/agg"], cells["zero/replay"], cells["nixl/agg"]) == ("12 / 12", "1.20", "0.24", "50.00")
    header, _, line = tables["itl"].splitlines()
    assert line.strip("|").split("|")[-1].strip() == "15 / 60 / 55 / 505"
    assert [c.strip() for c in tables["total"].splitlines()[-1].strip("|").split("|")[-2:]] == ["1/1 1/1 0/1"] * 2


def test_stream_timings_from_the_tokens_arrival_times():
    assert stream_timings([0.1, 0.4, 0.5, 0.7]) == {"token2_s": 0.4, "itl_s": (0.7 - 0.1) / 3}
    # Tokens merged into one chunk arrive together: the ITL is still over every token.
    assert stream_timings([0.1, 0.1, 0.1, 0.7]) == {"token2_s": 0.1, "itl_s": (0.7 - 0.1) / 3}
    assert stream_timings([0.1]) == {"token2_s": None, "itl_s": None}


def test_first_difference_compares_token_ids_else_text():
    assert first_difference({"token_ids": [5, 6, 7]}, {"token_ids": [5, 6, 7]}) is None
    assert first_difference({"token_ids": [5, 6, 7]}, {"token_ids": [5, 9, 7]}) == 1
    assert first_difference({"token_ids": [5, 6]}, {"token_ids": [5, 6, 7]}) == 2
    assert first_difference({"text": "abc", "token_ids": []}, {"text": "abd", "token_ids": [1]}) == 2


# Per-request deltas: the handoff figures per system and where "P done -> D's first token" goes.


def deltas(system, n=64, ttft=0.020, token2=0.050, p_e2e=0.015, d_ttft=0.025, transfer=0.012, claim=0.003,
           read=0.004, nbytes=65536.0, prefill=0.008, retried=False):  # fmt: skip
    pd = system in ("pd", "replay")
    m = {"prefill:vllm:e2e_request_latency_seconds_sum": p_e2e, "prefill:vllm:e2e_request_latency_seconds_count": 1.0,
         "prefill:vllm:request_prefill_time_seconds_sum": prefill, "prefill:vllm:request_prefill_time_seconds_count": 1.0,
         "decode:vllm:time_to_first_token_seconds_sum": d_ttft, "decode:vllm:time_to_first_token_seconds_count": 1.0,
         "decode:vllm:inter_token_latency_seconds_sum": 0.005 * 14, "decode:vllm:inter_token_latency_seconds_count": 14.0}  # fmt: skip
    if pd:
        m |= {"decode:vllm:pd_transfer_seconds_sum": transfer, "decode:vllm:pd_transfer_seconds_count": 1.0,
              "decode:vllm:pd_claim_seconds_sum": claim, "decode:vllm:pd_claim_seconds_count": 1.0,
              "decode:vllm:pd_read_seconds_sum": read, "decode:vllm:pd_read_seconds_count": 1.0,
              "decode:vllm:pd_transfer_bytes_sum": nbytes, "decode:vllm:pd_transfer_bytes_count": 1.0}  # fmt: skip
    else:
        m |= {"decode:vllm:nixl_xfer_time_seconds_sum": read, "decode:vllm:nixl_xfer_time_seconds_count": 1.0}
    return {"model": "m", "system": system, "prompt_len": n, "ttft_s": ttft, "token2_s": token2, "metrics": m,
            "retried": retried}  # fmt: skip


def test_handoff_figures_are_means_of_each_systems_own_requests():
    """Zero replay and replay share P and D: each system's figures come from its own requests'
    deltas, not from counters both moved."""
    records = [deltas("pd", claim=0.002), deltas("pd", claim=0.004), deltas("replay", claim=0.010)]
    assert abs(handoff_from_records(records, "pd")["claim_ms"] - 3.0) < 1e-9
    assert abs(handoff_from_records(records, "replay")["claim_ms"] - 10.0) < 1e-9
    assert handoff_from_records(records, "pd")["read_kib"] == 64.0
    nixl = handoff_from_records([deltas("nixl", read=0.3)], "nixl")
    assert nixl["claim_ms"] is None and abs(nixl["transfer_ms"] - 300.0) < 1e-9


def test_zero_replay_accounts_the_handoff_at_its_second_token_and_replay_at_its_first():
    zero = request_accounting(deltas("pd", ttft=0.020, token2=0.050, p_e2e=0.015, d_ttft=0.025))
    assert abs(zero["d_first_ms"] - 50.0) < 1e-9 and abs(zero["handoff_ms"] - 35.0) < 1e-9
    assert abs(zero["outside_d_ms"] - 10.0) < 1e-9  # 35 - D's 25
    assert abs(zero["step_wait_ms"] - 5.0) < 1e-9 and abs(zero["d_rest_ms"] - 13.0) < 1e-9  # 12 - 3 - 4; 25 - 12
    replay = request_accounting(deltas("replay", ttft=0.045, token2=0.050, p_e2e=0.015))
    assert abs(replay["d_first_ms"] - 45.0) < 1e-9 and abs(replay["handoff_ms"] - 30.0) < 1e-9
    nixl = request_accounting(deltas("nixl", read=0.3))
    assert nixl["claim_ms"] is None and nixl["step_wait_ms"] is None and nixl["read_kib"] is None


def test_accounting_rows_are_medians_per_system_and_length_without_retried_requests():
    records = [deltas("pd", d_ttft=0.020), deltas("pd", d_ttft=0.030), deltas("pd", d_ttft=0.040),
               deltas("pd", d_ttft=9.0, retried=True), deltas("replay", n=16)]  # fmt: skip
    rows = {(r["system"], r["prompt_len"]): r for r in accounting_rows(records, [16, 64])}
    assert rows[("pd", 64)]["n"] == 3 and abs(rows[("pd", 64)]["d_ttft_ms"] - 30.0) < 1e-9
    assert rows[("replay", 64)]["n"] == 0 and rows[("replay", 64)]["d_ttft_ms"] is None
    assert "zero replay" in accounting_table(list(rows.values()))


def test_prefill_rows_compare_ps_prefill_for_zero_replay_and_replay():
    records = [deltas("pd", prefill=0.011) | {"p_local_compute": 64.0},
               deltas("replay", prefill=0.010) | {"p_local_compute": 63.0}]  # fmt: skip
    (row,) = prefill_rows(records, [64])
    assert abs(row["pd_vs_replay"] - 1.1) < 1e-9 and (row["pd_p_computed"], row["replay_p_computed"]) == (64.0, 63.0)
    assert row["agg_prefill_ms"] is None
    cells = prefill_table([row]).splitlines()[-1]
    assert "- / 64 / 63 / -" in cells and "1.10" in cells  # agg / zero / replay / nixl


# The bench's per-request readings (e2e.py): deltas, and when the counters hold the request.


def reading(p_e2e=0.0, p_tokens=0.0, d_e2e=None, d_xfer=None, d_tokens=None, d_computed=0.0):
    out = {"prefill": {"series": {"prefill:vllm:e2e_request_latency_seconds_count": p_e2e},
                       "tokens": {"local_compute": p_tokens}}}  # fmt: skip
    if d_e2e is not None:
        series = {"decode:vllm:e2e_request_latency_seconds_count": d_e2e}
        if d_xfer is not None:
            series["decode:vllm:pd_transfer_seconds_count"] = d_xfer
        out["decode"] = {"series": series, "tokens": {"local_compute": d_computed, "external_kv_transfer": d_tokens}}
    return out


def test_a_request_is_counted_once_p_and_d_and_the_transfer_hold_it():
    from benchmarks.e2e import request_counted

    before = reading(d_e2e=0, d_xfer=0, d_tokens=0)
    assert request_counted("pd", before, reading(1, 64, 1, 1, 64, 1), 64)
    assert not request_counted("pd", before, reading(1, 64, 1, 0, 64, 1), 64)  # the transfer not in yet
    assert not request_counted("replay", before, reading(1, 63, 0, 1, 63, 1), 64)  # D's e2e not in yet
    assert not request_counted("replay", before, reading(1, 63, 1, 1, 63, 0), 64)  # D's computed token not in yet
    assert request_counted("replay", before, reading(1, 63, 1, 1, 63, 1), 64)
    # Aggregated serving: P alone; a series a server does not export is not waited for.
    assert request_counted("agg", reading(), reading(1, 64), 64)
    assert not request_counted("agg", reading(), reading(0, 64), 64)
    assert request_counted("nixl", reading(d_e2e=0, d_tokens=0), reading(1, 64, 1, None, 64), 64)


def test_request_deltas_keep_every_series_and_both_servers_tokens():
    from benchmarks.e2e import request_deltas

    out = request_deltas(reading(2, 100, 3, 3, 500, 7), reading(3, 164, 4, 4, 564, 8))
    assert out["metrics"]["decode:vllm:pd_transfer_seconds_count"] == 1
    assert (out["p_local_compute"], out["d_external_kv_transfer"], out["d_local_compute"]) == (64, 64, 1)
    assert "d_local_compute" not in request_deltas(reading(), reading(1, 64))  # aggregated: no D


def test_the_quiet_accounting_takes_a_quantile_of_each_figure():
    records = [deltas("pd", d_ttft=x) for x in (0.020, 0.030, 0.040, 0.050, 0.900)]
    (row,) = [r for r in accounting_rows(records, [64], q=0.25) if r["system"] == "pd"]
    assert abs(row["d_ttft_ms"] - 30.0) < 1e-9
