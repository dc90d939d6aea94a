"""The Grafana dashboard (dashboards/pd_connector.json) queries only metrics the code declares, and
is a Grafana dashboard model an import accepts (docs/operations.md, "Dashboard"). Its metrics on
live servers: tests/e2e/test_dashboard_metrics.py."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from rig.dashboard import (
    ENGINE_METRICS,
    VLLM_OWN,
    declared_engine_metrics,
    declared_metrics,
    declared_proxy_metrics,
    load,
    metric_names,
    queried_metrics,
    queries,
    undeclared,
    variable_query_metrics,
)

MADE_UP = "vllm:pd_made_up_metric_total"


def with_target(dashboard: dict, expr: str) -> dict:
    bad = copy.deepcopy(dashboard)
    panel = next(p for p in bad["panels"] if p.get("targets"))
    panel["targets"].append({**panel["targets"][0], "expr": expr, "refId": "Z"})
    return bad


# ---- the tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("expr, names", [
    ('sum by (instance, event) (rate(vllm:pd_events_total{job=~"$job",event=~"refused:.*"}[$__rate_interval]))',
     {"vllm:pd_events_total"}),
    ("histogram_quantile(0.95, sum by (le) (rate(vllm:pd_read_seconds_bucket[5m])))",
     {"vllm:pd_read_seconds_bucket"}),
    ("sum(rate(a_sum[1m])) / sum(rate(a_count[1m]))", {"a_sum", "a_count"}),
    ("rate (x_total [5m]) > bool 0", {"x_total"}),
    ("a/ignoring(le) b", {"a", "b"}),
    ("sum(x) without (rank) or on(instance) group_left(role) y", {"x", "y"}),
    ('max by (role) (pd_proxy_upstream_healthy{instance=~"${proxy}"}) offset 5m', {"pd_proxy_upstream_healthy"}),
    ('label_replace(up, "dst", "$1", "src", "(.*)")', {"up"}),
    ("sort_desc(sum by (event) (increase(vllm:pd_events_total[$__range])))", {"vllm:pd_events_total"}),
    ("clamp_min(m, 1e3) * 0.5", {"m"}),
])
def test_metric_names_finds_the_selected_metrics_only(expr, names):
    assert metric_names(expr) == names


def test_variable_query_takes_the_selector_not_the_label():
    assert variable_query_metrics('label_values(vllm:pd_transfer_seconds_count{job=~"$job"}, instance)') == {
        "vllm:pd_transfer_seconds_count"}
    assert variable_query_metrics("label_values(job)") == set()
    assert variable_query_metrics("query_result(max(up))") == {"up"}


# ---- what the code declares, read without vLLM ----------------------------------------------


def test_engine_metrics_are_read_from_the_source():
    declared = declared_engine_metrics()
    # Counter samples end in _total; every histogram has its three sample families.
    assert declared["vllm:pd_events_total"] == "counter"
    assert declared["vllm:pd_prefill_engines_connected"] == "gauge"
    for name in ("transfer_seconds", "claim_seconds", "read_seconds", "transfer_bytes", "recompute_tokens"):
        assert {f"vllm:pd_{name}{s}" for s in ("_bucket", "_sum", "_count")} <= set(declared), name


def test_engine_reader_follows_the_source():
    """Negative control: a histogram dropped from HISTOGRAMS, or the counter renamed, changes what
    the reader returns (it reads the code, not a copy of the names)."""
    source = ENGINE_METRICS.read_text()
    assert '    "descriptors": (' in source and 'name="vllm:pd_events"' in source
    dropped = source.replace('    "descriptors": (', '    "_unused": (', 1)
    assert "vllm:pd_descriptors_bucket" not in declared_engine_metrics(dropped)
    renamed = source.replace('name="vllm:pd_events"', 'name="vllm:pd_happenings"', 1)
    assert "vllm:pd_happenings_total" in declared_engine_metrics(renamed)
    assert "vllm:pd_events_total" not in declared_engine_metrics(renamed)


def test_proxy_metrics_are_its_rendered_families():
    declared = declared_proxy_metrics()
    assert declared["pd_proxy_requests_total"] == "counter"
    assert declared["pd_proxy_resume_total"] == "counter"
    assert declared["pd_proxy_upstream_healthy"] == "gauge"
    assert all(name.startswith("pd_proxy_") for name in declared)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_vllms_own_metrics_are_registered_by_vllm():
    """The vLLM series the dashboard reads are registered in vLLM's source (read, not imported:
    tests/unit imports no vLLM)."""
    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    for sample, (registered, path) in VLLM_OWN.items():
        assert f'name="{registered}"' in (root / path).read_text(), (sample, path)


# ---- the dashboard ---------------------------------------------------------------------------


def test_dashboard_is_a_grafana_model_with_a_prometheus_datasource_variable():
    dash = load()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance", "proxy"} <= set(variables)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["refId"] and target["datasource"]["uid"] == "${datasource}"
            assert metric_names(target["expr"]), (panel["title"], target["expr"])


def test_dashboard_covers_p_d_and_the_proxy():
    queried = queried_metrics(load())
    for name in ("vllm:pd_events_total", "vllm:pd_transfer_seconds_bucket", "vllm:pd_read_seconds_bucket",
                 "vllm:pd_claim_seconds_bucket", "vllm:pd_transfer_bytes_sum", "vllm:pd_recompute_tokens_bucket",
                 "vllm:pd_prefill_engines_connected", "vllm:prompt_tokens_by_source_total",
                 "pd_proxy_requests_total", "pd_proxy_resume_total", "pd_proxy_upstream_healthy"):
        assert name in queried, name
    exprs = " ".join(q for _, _, q in queries(load()))
    for event in ("handoff_offered", "handoff_accepted", "refused:", "load_failed:", "lease_expired"):
        assert event in exprs, event


def test_every_metric_the_dashboard_queries_is_declared():
    assert undeclared(load(), declared_metrics()) == {}


def test_an_undeclared_metric_is_reported_with_its_panel():
    """Negative control: a made-up metric in a copy of the dashboard is reported."""
    dash = load()
    bad = with_target(dash, f"sum(rate({MADE_UP}[5m]))")
    title = next(p for p in bad["panels"] if p.get("targets"))["title"]
    assert undeclared(bad, declared_metrics()) == {MADE_UP: [title]}
