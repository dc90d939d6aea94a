"""The connected-P-engines gauge through vLLM's stats pipeline: each D rank's value survives the
aggregation of the ranks' stats and lands on the rank's label of ``vllm:pd_prefill_engines_connected``."""

from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pd_connector.engine.metrics import PDPromMetrics, PDStats, Recorder


def test_each_d_ranks_connected_engines_reach_their_own_gauge_label():
    ranks = [Recorder(), Recorder()]
    ranks[0].set_gauge("prefill_engines_connected", 0, 3)
    ranks[1].set_gauge("prefill_engines_connected", 1, 1)
    ranks[1].set_gauge("prefill_engines_connected", 1, 2)  # the last value counts
    stats = ranks[0].interval.take().aggregate(ranks[1].interval.take())
    assert stats.data["gauges"] == {"prefill_engines_connected": {"0": 3, "1": 2}}
    assert stats.reduce()["prefill_engines_connected[rank 1]"] == 2
    assert ranks[0].interval.take() is None, "a gauge is sent in the interval it changed"
    assert not PDStats(data={"events": {"x": 1}}).data["gauges"], "stats from a peer without gauges"

    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = PDPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe(stats.data)
    value = partial(registry.get_sample_value, "vllm:pd_prefill_engines_connected")
    assert value({"engine": "0", "rank": "0"}) == 3 and value({"engine": "0", "rank": "1"}) == 2
