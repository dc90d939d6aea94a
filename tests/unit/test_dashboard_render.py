"""rig/dashboard_render.py's PromQL evaluator, which draws docs/img/dashboard.png: every query of
the dashboard parses, the functions compute what Prometheus computes on hand-made samples, and
PromQL it does not cover is refused (negative control: a dashboard copy with one such query)."""

from __future__ import annotations

import copy
import math

import pytest

from rig.dashboard import load
from rig.dashboard_render import (
    Evaluator,
    Parser,
    Scrapes,
    Unsupported,
    bucket_quantile,
    extrapolated,
    format_value,
    substitute,
)


def _parse_all(dashboard) -> int:
    count = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", ()):
            if target.get("expr"):
                Parser(substitute(target["expr"], 15, 120)).parse()
                count += 1
    return count


def test_every_dashboard_query_parses_and_an_uncovered_one_is_refused():
    dash = load()
    assert _parse_all(dash) >= 30
    bad = copy.deepcopy(dash)
    panel = next(p for p in bad["panels"] if p.get("targets"))
    panel["targets"].append({"expr": "topk(3, rate(vllm:pd_events_total[5m]))", "refId": "Z"})
    with pytest.raises(Unsupported, match="topk"):
        _parse_all(bad)


@pytest.mark.parametrize("expr", [
    "rate(x[5m]) * 2", "abs(x)", "sum without (a) (x)", "x offset 5m", "x + 1", "avg(x)",
    'x{a="b"} and y', "rate(x)", "sum(x) by (a) on (b)",
])
def test_uncovered_promql_is_refused(expr):
    with pytest.raises(Unsupported):
        Evaluator(Scrapes()).evaluate(Parser(expr).parse(), 0.0)


def test_a_grafana_variable_it_does_not_set_is_refused():
    with pytest.raises(Unsupported):
        substitute('x{a=~"$datasource"}', 15, 60)


def test_rate_and_increase_extrapolate_as_prometheus_does():
    per_second = [(float(t), 2.0 * t) for t in range(0, 21)]
    window = [p for p in per_second if 10 < p[0] <= 20]
    assert extrapolated(window, 10, 20, is_rate=True) == pytest.approx(2.0)
    assert extrapolated(window, 10, 20, is_rate=False) == pytest.approx(20.0)
    # A counter reset: the value before the reset is added back.
    reset = [(11.0, 100.0), (12.0, 102.0), (13.0, 1.0), (14.0, 3.0)]
    assert extrapolated(reset, 10.5, 14, is_rate=False) == pytest.approx((3 - 100 + 102) * 3.5 / 3)
    # Not extrapolated below zero: a counter born inside the window.
    born = [(18.0, 1.0), (19.0, 2.0), (20.0, 3.0)]
    assert extrapolated(born, 10, 20, is_rate=False) == pytest.approx(3.0)
    assert extrapolated(born[:1], 10, 20, is_rate=True) is None


def test_histogram_quantile_interpolates_within_a_bucket():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert bucket_quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1  # in +Inf: the last finite bound
    assert math.isnan(bucket_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]))


def _scrapes() -> Scrapes:
    s = Scrapes()
    for t in range(0, 11):
        text = "\n".join([
            "# TYPE e counter",
            f'e_total{{event="a"}} {t}',
            f'e_total{{event="b"}} {3 * t}',
            "# TYPE h histogram",
            f'h_bucket{{le="1.0"}} {t}',
            f'h_bucket{{le="+Inf"}} {2 * t}',
            f"h_sum {t}",
            f"h_count {2 * t}",
        ])
        s.add(float(t), "vllm-pd", "D", text)
        s.add(float(t), "vllm-pd", "P", text)
    return s


def test_aggregation_division_and_sort_on_scrapes():
    pytest.importorskip("prometheus_client")
    ev = Evaluator(_scrapes())
    by_event = ev.evaluate(Parser('sum by (event) (rate(e_total{instance=~".*"}[4s]))').parse(), 10.0)
    assert by_event == {(("event", "a"),): pytest.approx(2.0), (("event", "b"),): pytest.approx(6.0)}
    share = ev.evaluate(Parser(
        'sum by (instance) (rate(e_total{event="a"}[4s])) / sum by (instance) (rate(e_total[4s]))').parse(), 10.0)
    assert share == {(("instance", "D"),): pytest.approx(0.25), (("instance", "P"),): pytest.approx(0.25)}
    p50 = ev.evaluate(Parser("histogram_quantile(0.5, sum by (le) (rate(h_bucket[4s])))").parse(), 10.0)
    assert p50 == {(): pytest.approx(1.0)}
    ordered = ev.evaluate(Parser('sort_desc(sum by (event) (increase(e_total{instance="D"}[20s])))').parse(), 10.0)
    assert [dict(k)["event"] for k in ordered] == ["b", "a"]
    assert ev.evaluate(Parser('max by (instance) (e_total{event!="b"})').parse(), 10.0) == {
        (("instance", "D"),): 10.0, (("instance", "P"),): 10.0}


def test_units_read_as_grafana_writes_them():
    assert format_value(0.973, "percentunit", 1) == "97.3%"
    assert format_value(0.0123, "s") == "12.3 ms"
    assert format_value(123456, "Bps") == "123 kB/s"
    assert format_value(2.5, "ops") == "2.5 ops/s"
    assert format_value(4, "reqps") == "4 req/s"
    with pytest.raises(Unsupported):
        format_value(1, "dtdurationms")
