"""The transfer benchmark's summary (README table): connector / raw per length and the >= 0.9
verdict at >= 4k tokens, from per-rep samples."""

from pd_connector.benchmarks.transfer_report import Result, summary_table


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


def test_the_verdict_follows_the_ratio_as_printed():
    """0.8996 prints as 0.90: the row must not say NO next to a 0.90 it shows."""
    by = rows(summary_table([result(4096, "scattered", 1.0 / 0.8996)]))
    assert by["scattered"][3] == "0.90" and by["scattered"][-1] == "yes"
