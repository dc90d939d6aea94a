"""The transfer benchmark's summary (README table): connector / raw per length and the >= 0.9
verdict at >= 4k tokens, from per-rep samples."""

from benchmarks.transfer_report import Result, summary_table


def result(tokens: int, blocks: str, conn_s: float, raw_s: float = 1.0) -> Result:
    return Result(
        "main", "llama-8b", tokens, 16, 16, "layer-outer", blocks, "32/32", 1 << 20, 64, 64 if blocks == "scattered" else 2,
        samples={"connector": [conn_s] * 3, "raw": [raw_s] * 3, "memcpy": [0.5] * 3},
    )


def rows(table: str) -> dict[str, list[str]]:
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[2]] = cells
    return out


def test_a_length_of_4k_or_more_below_the_target_fails_the_row_and_shorter_ones_do_not():
    table = summary_table([
        result(1024, "scattered", 2.0), result(4096, "scattered", 1.0 / 0.85),  # 0.50, 0.85
        result(1024, "contiguous", 2.0), result(4096, "contiguous", 1.0 / 0.95),  # 0.50, 0.95
    ])
    by = rows(table)
    assert by["scattered"][3:5] == ["0.50", "0.85"] and by["scattered"][-1] == "NO"
    assert by["contiguous"][3:5] == ["0.50", "0.95"] and by["contiguous"][-1] == "yes"
    assert by["scattered"][5] == "64" and by["contiguous"][5] == "2", "runs at the longest length"


def test_runs_cut_for_worker_threads_show_the_contiguous_runs_they_came_from():
    r = result(4096, "contiguous", 1.0)
    r.runs, r.contig = 18, 6
    assert rows(summary_table([r]))["contiguous"][4] == "18 (6)"
    r.runs = r.contig = 6
    assert rows(summary_table([r]))["contiguous"][4] == "6"


def test_the_verdict_follows_the_ratio_as_printed():
    """0.8996 prints as 0.90: the row must not say NO next to a 0.90 it shows."""
    by = rows(summary_table([result(4096, "scattered", 1.0 / 0.8996)]))
    assert by["scattered"][3] == "0.90" and by["scattered"][-1] == "yes"


def test_the_kernel_columns_show_the_cma_ceiling_and_the_connector_against_it():
    """With the kernel paths measured (DRAM), the summary shows, at the longest length, the
    kernel's copy of the runs relative to one range, and the connector relative to that copy."""
    r = result(4096, "scattered", 1.0 / 0.8)
    r.samples.update({"cma_runs": [1.0 / 0.9] * 3, "cma_one": [1.0] * 3})  # kernel: 0.90 of one range
    table = summary_table([r])
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    cells = dict(zip(header, rows(table)["scattered"]))
    assert cells["cma runs/one 4k"] == "0.90"
    assert cells["c/cma runs 4k"] == "0.89"  # 0.8 / 0.9
    assert cells[">= 0.9 at >= 4k"] == "NO"
    assert "cma runs/one 4k" not in summary_table([result(4096, "scattered", 1.0)])  # no kernel path: no column


def test_with_worker_threads_the_summary_shows_the_connector_against_one_descriptor_per_thread():
    """``raw_threads``: raw NIXL as one descriptor per worker thread, the best NIXL itself does
    with the connector's threads; the verdict stays against raw NIXL's one descriptor."""
    r = result(4096, "scattered", 1.0 / 1.4)
    r.samples["raw_threads"] = [1.0 / 1.5] * 3  # 1.5x one descriptor
    table = summary_table([r])
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    cells = dict(zip(header, rows(table)["scattered"]))
    assert cells["c/raw 4k"] == "1.40" and cells["c/raw thr 4k"] == "0.93"  # 1.4 / 1.5
    assert cells[">= 0.9 at >= 4k"] == "yes"
    assert "c/raw thr" not in summary_table([result(4096, "scattered", 1.0)])


def test_knob_settings_mark_the_connectors_default_and_quick_keeps_no_threads_and_two():
    from benchmarks.transfer import knob_settings
    from pd_connector.core.settings import ConnectorSettings

    default = ConnectorSettings().nixl_num_threads
    full = knob_settings(quick=False)
    marked = [name for name, threads, env, delay in full if "(default)" in name]
    assert marked == [f"num_threads={default} (default)"]
    # Every other setting is measured on top of the default thread count.
    assert all(threads == default for name, threads, env, delay in full if not name.startswith("num_threads="))
    quick = [name for name, *_ in knob_settings(quick=True)]
    assert quick[0].startswith("num_threads=0") and quick[1].startswith("num_threads=2") and quick[2] == "UCX_TLS=tcp"
