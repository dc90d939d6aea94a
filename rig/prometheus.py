"""vLLM's Prometheus ``/metrics``: parse the exposition text, and read it from a local server.

``parse_metric`` / ``parse_metric_labels`` are pure (tests feed them text); ``read_metric`` /
``read_metric_labels`` GET ``/metrics`` first.
"""

from __future__ import annotations

import re
from typing import Mapping
from pd_connector.urls import OPENER

__all__ = ["parse_metric", "parse_metric_labels", "read_metric", "read_metric_labels"]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _labels(text: str | None) -> dict[str, str]:
    # Exposition format escapes \\, \" and \n inside label values.
    return {
        k: _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
        for k, v in _LABEL.findall(text or "")
    }


def parse_metric(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    """Sum of all samples of metric ``name`` whose labels include ``labels``; None if none match.

    vLLM names counters ``vllm:foo_total`` in the exposition; if no sample is named exactly
    ``name``, ``name + "_total"`` is tried, so both spellings work. None (rather than 0) lets a
    test distinguish "metric absent" (wrong name, metric not registered) from "zero".
    """
    want = dict(labels or {})
    for candidate in (name, f"{name}_total"):
        total, found = 0.0, False
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            if not m or m.group(1) != candidate:
                continue
            got = _labels(m.group(3))
            if any(got.get(k) != v for k, v in want.items()):
                continue
            total += float(m.group(4))
            found = True
        if found:
            return total
    return None


def parse_metric_labels(text: str, name: str) -> list[dict[str, str]]:
    """Label sets of every sample of ``name`` (for info-style gauges such as cache_config_info)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#") and m.group(1) == name:
            out.append(_labels(m.group(3)))
    return out


def read_metric_labels(base_url: str, name: str, timeout: float = 10.0) -> list[dict[str, str]]:
    """GET ``base_url/metrics`` and return :func:`parse_metric_labels` of it."""
    with OPENER.open(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return parse_metric_labels(resp.read().decode("utf-8", "replace"), name)


def read_metric(
    base_url: str, name: str, labels: Mapping[str, str] | None = None, timeout: float = 10.0
) -> float | None:
    """GET ``base_url/metrics`` and return :func:`parse_metric` of it."""
    with OPENER.open(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return parse_metric(resp.read().decode("utf-8", "replace"), name, labels)
