"""Connector statistics through vLLM's own pipeline: ``get_kv_connector_stats`` on both halves,
``build_kv_connector_stats`` to rebuild them in the logger process, and ``build_prom_metrics``
for Prometheus series next to vLLM's (``vllm:pd_*`` on the server's ``/metrics``).

The payload is a plain dict (vLLM ships it between processes): sample lists per histogram and
event counts. Events are stable labels: ``refused:<kind>`` (D refused P's offset),
``load_failed:<reason>``, ``claim_refused:<outcome>`` (on P), ``lease_expired``,
``handoff_offered``, ``handoff_accepted``, ``side_channel_rejected:<kind>``,
``rejected_before_engine`` (vLLM's stand-in for a request D's serving layer rejected),
``read_slow`` (a READ in flight past ``read_warn_seconds``), ``nixl_call_slow`` (a NIXL call
that held D's engine thread over a second). Gauges carry their last value per D rank
(``prefill_engines_connected``), sent in the interval they changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from pd_connector.engine.from_vllm.bases import KVConnectorPromMetrics, KVConnectorStats

HISTOGRAMS = {
    # name: (documentation, buckets)
    "transfer_seconds": (
        "Duration of one request's KV/state load, claim to completion.",
        [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    # transfer_seconds = claim_seconds + the wait for D's next engine step + read_seconds; on a
    # loaded CPU host the first two dominate.
    "claim_seconds": (
        "Duration of one request's claim: sent to P's side channel until P's grant arrived "
        "(includes P holding a claim that overtook its lease).",
        [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    "read_seconds": (
        "Duration of one request's NIXL READ, first post to completion (the part of "
        "transfer_seconds after P granted the claim).",
        [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    "claim_held_seconds": (
        "On P: how long a claim that arrived before its lease was held until the lease landed "
        "(or D's wait ran out).",
        [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0],
    ),
    "transfer_bytes": (
        "Bytes moved per request (attention KV plus recurrent state).",
        [2 ** (10 + i) for i in range(0, 25, 2)],
    ),
    "descriptors": (
        "NIXL descriptors per request, before NIXL merges adjacent ones.",
        [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384],
    ),
    "recompute_tokens": (
        "Prompt tokens D recomputes after an accepted handoff (N - replay_offset).",
        [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
    ),
    "handshake_seconds": (
        "Side-channel handshake latency with a new prefill engine.",
        [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0],
    ),
}


GAUGES = {
    "prefill_engines_connected": "Prefill engines this D rank holds a connection to (NIXL agent, "
    "descriptor lists, side-channel sockets), label 'rank'.",
}


@dataclass
class PDStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {name: [] for name in HISTOGRAMS}
        self.data["events"] = {}
        self.data["gauges"] = {}

    def set_gauge(self, name: str, rank: int, value: float) -> None:
        self.data["gauges"].setdefault(name, {})[str(rank)] = value

    def observe(self, name: str, value: float) -> None:
        self.data[name].append(value)

    def observe_all(self, name: str, values: list[float]) -> None:
        self.data[name].extend(values)

    def count(self, event: str, n: int = 1) -> None:
        events = self.data["events"]
        events[event] = events.get(event, 0) + n

    def is_empty(self) -> bool:
        return not self.data["events"] and not self.data["gauges"] and not any(self.data[name] for name in HISTOGRAMS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in HISTOGRAMS:
            self.data[name].extend(other.data.get(name, ()))
        for event, n in other.data.get("events", {}).items():
            self.count(event, n)
        for name, by_rank in other.data.get("gauges", {}).items():
            self.data["gauges"].setdefault(name, {}).update(by_rank)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Summary for vLLM's periodic "KV Transfer metrics" log line."""
        out: dict[str, int | float] = {}
        transfers = self.data["transfer_seconds"]
        out["Num transfers"] = len(transfers)
        if transfers:
            out["Avg transfer ms"] = round(1e3 * sum(transfers) / len(transfers), 3)
            out["Avg MB per transfer"] = round(sum(self.data["transfer_bytes"]) / len(transfers) / 2**20, 3)
            out["Avg descriptors"] = round(sum(self.data["descriptors"]) / len(transfers), 1)
        recompute = self.data["recompute_tokens"]
        if recompute:
            out["Avg recomputed tokens"] = round(sum(recompute) / len(recompute), 2)
        out.update(sorted(self.data["events"].items()))
        for name, by_rank in sorted(self.data["gauges"].items()):
            out.update((f"{name}[rank {rank}]", value) for rank, value in sorted(by_rank.items()))
        return out

    def take(self) -> "PDStats | None":
        """This interval's stats (None if nothing happened); starts a new interval."""
        if self.is_empty():
            return None
        taken = PDStats(data=self.data)
        self.reset()
        return taken


class Recorder:
    """Interval stats for vLLM plus cumulative event totals (logs, tests)."""

    def __init__(self) -> None:
        self.interval = PDStats()
        self.totals: Counter[str] = Counter()
        self.gauges: dict[tuple[str, int], float] = {}

    def count(self, event: str, n: int = 1) -> None:
        self.interval.count(event, n)
        self.totals[event] += n

    def observe(self, name: str, value: float) -> None:
        self.interval.observe(name, value)

    def set_gauge(self, name: str, rank: int, value: float) -> None:
        self.interval.set_gauge(name, rank, value)
        self.gauges[name, rank] = value

    def observe_all(self, name: str, values: list[float]) -> None:
        """Several samples at once (D records a step's handoffs in one call)."""
        self.interval.observe_all(name, values)


class PDPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._histograms = {}
        for name, (doc, buckets) in HISTOGRAMS.items():
            metric = self._histogram_cls(
                name=f"vllm:pd_{name}", documentation=doc, buckets=buckets, labelnames=labelnames
            )
            self._histograms[name] = {
                idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self._events = self._counter_cls(
            name="vllm:pd_events",
            documentation="pd_connector events: refusals, load failures, claims refused, "
            "lease expiries, handoffs (label 'event').",
            labelnames=[*labelnames, "event"],
        )
        self._gauges = {
            name: self._gauge_cls(
                name=f"vllm:pd_{name}", documentation=doc, multiprocess_mode="mostrecent",
                labelnames=[*labelnames, "rank"],
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self._histograms.items():
            for value in transfer_stats_data.get(name, ()):
                children[engine_idx].observe(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for event, n in transfer_stats_data.get("events", {}).items():
            self._events.labels(*labels, event).inc(n)
        for name, by_rank in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                for rank, value in by_rank.items():
                    self._gauges[name].labels(*labels, rank).set(value)
