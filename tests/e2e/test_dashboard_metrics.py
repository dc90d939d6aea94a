"""Every metric the Grafana dashboard (dashboards/pd_connector.json) queries is exported by a live
P, D or proxy after one handoff through the proxy; a metric that is not is reported (negative
control). The declared names, without servers: tests/unit/test_dashboard.py."""

from __future__ import annotations

import copy
import time

import pytest

from rig.cpu_matrix import random_prompt
from pd_connector.urls import OPENER
from rig.dashboard import exported_samples, load, missing

pytestmark = pytest.mark.e2e

MADE_UP = "vllm:pd_made_up_metric_total"


def metrics_text(base_url: str) -> str:
    with OPENER.open(base_url.rstrip("/") + "/metrics", timeout=30) as resp:
        return resp.read().decode("utf-8", "replace")


def test_every_metric_the_dashboard_queries_is_exported(stack):
    if stack.kind != "nemotron_h":
        pytest.skip("the dashboard's metrics do not depend on the model: checked once")
    dash = load()
    before = stack.decode.prompt_tokens_by_source()["external_kv_transfer"]
    prompt = random_prompt(70, seed=3_141)
    got = stack.via_proxy(prompt, 4)
    assert len(got.token_ids) == 4, got
    urls = {"P": stack.prefill.base_url, "D": stack.decode.base_url, "proxy": stack.proxy_url}
    # vLLM publishes the connector's stats with the engine's next scheduler stats: poll briefly.
    deadline = time.monotonic() + 60
    while True:
        texts = {side: metrics_text(url) for side, url in urls.items()}
        absent = missing(dash, texts)
        if not absent or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert absent == {}, f"queried by the dashboard, exported by none of P, D, proxy: {absent}"
    # The handoff reached the dashboard's proof panel: D loaded prompt tokens from P.
    assert stack.decode.prompt_tokens_by_source()["external_kv_transfer"] > before
    # Each side exports its own families (the rows of the dashboard).
    samples = {side: exported_samples(text) for side, text in texts.items()}
    assert "vllm:pd_prefill_engines_connected" in samples["D"]
    assert "vllm:pd_events_total" in samples["P"] and "vllm:pd_events_total" in samples["D"]
    assert {"pd_proxy_requests_total", "pd_proxy_resume_total", "pd_proxy_upstream_healthy"} <= samples["proxy"]

    # Negative control: a made-up metric in a copy of the dashboard is reported missing.
    bad = copy.deepcopy(dash)
    panel = next(p for p in bad["panels"] if p.get("targets"))
    panel["targets"].append({**panel["targets"][0], "expr": f"sum(rate({MADE_UP}[5m]))", "refId": "Z"})
    assert missing(bad, texts) == {MADE_UP: [panel["title"]]}
