"""The Grafana dashboard (dashboards/pd_connector.json) against the metrics that exist.

- :func:`queried_metrics`: every metric name a panel or a template variable of the dashboard
  queries (a small PromQL tokenizer, :func:`metric_names`);
- :func:`declared_metrics`: every sample name the code exports: the connector's ``vllm:pd_*``
  (read from ``pd_connector/engine/metrics.py`` with ``ast``, so that tests/unit imports no vLLM),
  the proxy's ``pd_proxy_*`` (``ProxyMetrics.render``) and the few of vLLM's own the dashboard uses
  (:data:`VLLM_OWN`);
- :func:`exported_samples` / :func:`missing`: the same check against live ``/metrics`` texts
  (tests/e2e/test_dashboard_metrics.py).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "dashboards" / "pd_connector.json"
ENGINE_METRICS = ROOT / "pd_connector" / "engine" / "metrics.py"

# vLLM's own series the dashboard reads: exposed sample name -> (the name vLLM registers, the file
# of the vLLM package that registers it).
VLLM_OWN = {
    "vllm:prompt_tokens_by_source_total": ("vllm:prompt_tokens_by_source", "v1/metrics/loggers.py"),
    "vllm:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "v1/metrics/loggers.py"),
}

# Suffixes of the samples each Prometheus metric type exposes (exposition format 0.0.4).
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}

# PromQL functions, aggregation operators and keywords, and Grafana's query-variable functions:
# identifiers that are never metric names.
NOT_METRICS = frozenset("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp
clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg
delta deriv exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters double_exponential_smoothing hour
idelta increase irate label_join label_replace last_over_time ln log2 log10 mad_over_time
max_over_time min_over_time minute month pi predict_linear present_over_time quantile_over_time rad
rate resets round scalar sgn sin sinh sort sort_by_label sort_by_label_desc sort_desc sqrt
stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector year
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
by without on ignoring group_left group_right bool and or unless offset atan2 inf nan
label_values label_names metrics query_result
""".split())

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)
_LABEL_VALUES_ALL = re.compile(r"^\s*label_values\s*\(\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+\S+")


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


# ---- what the dashboard queries --------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers followed by a label matcher, a
    range, whitespace, an operator, ``,`` or ``)`` (anything but ``(``), once string literals,
    Grafana variables, matcher and range contents and ``by (...)``-style label lists are gone,
    minus PromQL's functions and keywords."""
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub("", text)
    text = _MATCHERS.sub("{}", text)
    text = _RANGE.sub("[]", text)
    text = _LABEL_LIST.sub(r"\1", text)
    names = set()
    for m in _IDENTIFIER.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group() in NOT_METRICS:
            continue
        names.add(m.group())
    return names


def variable_query_metrics(query: str) -> set[str]:
    """Metric names in a query variable: ``label_values(<selector>, <label>)`` selects the
    selector's metric (its trailing label name is not one), ``label_values(<label>)`` none;
    anything else is PromQL."""
    if _LABEL_VALUES_ALL.match(query):
        return set()
    m = _LABEL_VALUES.match(query)
    return metric_names(m.group(1)) if m else metric_names(query)


def _all_panels(panels: Iterable[dict]) -> Iterable[dict]:
    for panel in panels:
        yield panel
        yield from _all_panels(panel.get("panels", ()))  # a collapsed row holds its panels


def queries(dashboard: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(kind, where, query) for every panel target and query variable: kind is "panel" or
    "variable", where the panel's title or the variable's name."""
    out = []
    for panel in _all_panels(dashboard.get("panels", ())):
        for target in panel.get("targets", ()):
            if target.get("expr"):
                out.append(("panel", panel.get("title", "?"), target["expr"]))
    for var in dashboard.get("templating", {}).get("list", ()):
        if var.get("type") == "query":
            query = var.get("query")
            query = query.get("query", "") if isinstance(query, dict) else (query or "")
            out.append(("variable", var["name"], query))
    return out


def queried_metrics(dashboard: Mapping[str, Any]) -> dict[str, list[str]]:
    """Metric name -> where the dashboard queries it (panel titles, ``$variable``s)."""
    found: dict[str, list[str]] = {}
    for kind, where, query in queries(dashboard):
        names = variable_query_metrics(query) if kind == "variable" else metric_names(query)
        for name in names:
            found.setdefault(name, []).append(where if kind == "panel" else f"${where}")
    return found


# ---- what the code declares ------------------------------------------------------------------


def samples(name: str, kind: str) -> list[str]:
    """The sample names a metric of that type exposes (prometheus_client names a counter's
    samples ``<name>_total`` whether or not it was registered with the suffix)."""
    base = name.removesuffix("_total") if kind == "counter" else name
    return [base + suffix for suffix in SUFFIXES[kind]]

_KIND_OF_FACTORY = {"_histogram_cls": "histogram", "_counter_cls": "counter", "_gauge_cls": "gauge"}


def _dict_keys(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level ``NAME = {"key": ...}`` dicts: name -> their string keys."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = keys
    return out


def _iterated_dict(iterable: ast.expr, dicts: Mapping[str, list[str]]) -> list[str] | None:
    """The keys a ``for`` loop or comprehension draws from ``D`` or ``D.items()``/``D.keys()``."""
    if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Attribute):
        iterable = iterable.func.value
    return dicts.get(iterable.id) if isinstance(iterable, ast.Name) else None


def _names_of(call: ast.Call, keys: list[str] | None) -> list[str]:
    """The metric name(s) a ``self._<kind>_cls(name=...)`` call registers."""
    arg = next((k.value for k in call.keywords if k.arg == "name"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and keys is not None:
        def render(key: str) -> str:
            return "".join(v.value if isinstance(v, ast.Constant) else key for v in arg.values)
        return [render(key) for key in keys]
    raise ValueError(f"cannot read the metric name at line {call.lineno}: {ast.unparse(call)[:80]}")


def declared_engine_metrics(source: str | None = None) -> dict[str, str]:
    """Exposed sample name -> type of every series ``PDPromMetrics`` (pd_connector/engine/
    metrics.py) registers, read from the source: each ``self._histogram_cls / _counter_cls /
    _gauge_cls(name=...)`` call, an f-string name expanded over the keys of the module-level dict
    its loop or comprehension iterates (``HISTOGRAMS``, ``GAUGES``)."""
    tree = ast.parse(source if source is not None else ENGINE_METRICS.read_text())
    dicts = _dict_keys(tree)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PDPromMetrics")
    keys_of_call: dict[int, list[str]] = {}
    for node in ast.walk(cls):
        loops = [node] if isinstance(node, ast.For) else getattr(node, "generators", [])
        for loop in loops:
            keys = _iterated_dict(loop.iter, dicts)
            if keys is not None:
                for inner in ast.walk(node):  # breadth first: the innermost loop's keys win
                    keys_of_call[id(inner)] = keys
    out = {}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _KIND_OF_FACTORY):
            kind = _KIND_OF_FACTORY[node.func.attr]
            for name in _names_of(node, keys_of_call.get(id(node))):
                out.update(dict.fromkeys(samples(name, kind), kind))
    return out


def declared_proxy_metrics() -> dict[str, str]:
    """Exposed sample name -> type of every family ``pd-connector proxy`` renders on /metrics."""
    from pd_connector.proxy.routing import ProxyMetrics

    out = {}
    for line in ProxyMetrics().render([]).splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out.update(dict.fromkeys(samples(name, kind), kind))
    return out


def declared_metrics() -> dict[str, str]:
    """Every sample name the dashboard may query: the connector's, the proxy's, :data:`VLLM_OWN`."""
    return {**declared_engine_metrics(), **declared_proxy_metrics(),
            **{name: "vllm" for name in VLLM_OWN}}


def undeclared(dashboard: Mapping[str, Any], declared: Mapping[str, str]) -> dict[str, list[str]]:
    """Queried metric names the code does not declare -> where the dashboard queries them."""
    return {name: where for name, where in sorted(queried_metrics(dashboard).items()) if name not in declared}


# ---- what live servers export ------------------------------------------------------------------


def exported_samples(text: str) -> set[str]:
    """Sample names in a Prometheus exposition text (comment lines ignored)."""
    return {m.group(1) for line in text.splitlines() if not line.startswith("#") and (m := _SAMPLE.match(line))}


def missing(dashboard: Mapping[str, Any], texts: Mapping[str, str]) -> dict[str, list[str]]:
    """Queried metric names with no sample in any of the ``/metrics`` texts (source -> text)."""
    exported = set().union(*(exported_samples(t) for t in texts.values()))
    return {name: where for name, where in sorted(queried_metrics(dashboard).items()) if name not in exported}
