"""A picture of the Grafana dashboard (dashboards/pd_connector.json) from a real run, without
Grafana: scrape a running P, D and proxy, evaluate each panel's PromQL, draw the grid.

    flock /tmp/pd-e2e.lock .venv/bin/python -m rig.dashboard_render             # run, scrape, draw
    .venv/bin/python -m rig.dashboard_render --scrapes .artifacts/dashboard/scrapes.jsonl.gz  # redraw

The run: a ``PDStack`` (P, D and ``pd-connector proxy``, no baseline) of a tiny model, driven
for ``--seconds`` with mixed requests from two client threads: zero replay through the proxy,
requests the proxy sends down the replay flow (``n`` > 1, an output penalty), replay handoffs
straight to P and D, and a few that D refuses (another prompt than P's, an altered first token,
a handoff naming a host D may not contact). A scraper reads ``/metrics`` of all three every
second and adds the labels a Prometheus scrape adds (``job``, ``instance``: the dashboard's
``$job``/``$instance``/``$proxy`` are left at All). The scrapes are saved (``--scrapes`` redraws
them without servers).

The evaluator covers exactly what the dashboard's queries use and refuses anything else with
an error naming it: selectors with ``=``, ``!=``, ``=~``, ``!~`` matchers, range selectors,
``rate``/``increase`` (Prometheus's extrapolation), ``histogram_quantile`` (its bucket
interpolation), ``sum``/``max`` with ``by``, ``sort_desc``, ``/`` between vectors (one-to-one on
identical label sets) and number literals. ``$__rate_interval`` is ``--rate-window`` (Grafana
would derive 4 scrape intervals, 4 s here: too noisy to read), ``$__range`` the whole run.

Drawn with matplotlib in the dashboard's grid (24 columns; a grid unit 30 px high as in
Grafana), each panel with its title and unit: time series, stat (last value and its sparkline),
table, state timeline, rows. A caption says it is rendered here from a real run's scrapes, not
a Grafana screenshot. Tooling for docs/img/dashboard.png (docs/operations.md, "Dashboard"); the
package never imports it.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rig.dashboard import DASHBOARD, load

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "img" / "dashboard.png"
DEFAULT_SCRAPES = ROOT / ".artifacts" / "dashboard" / "scrapes.jsonl.gz"
LOOKBACK_S = 300.0  # Prometheus's staleness window for an instant selector

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs, the metric name under "__name__"


class Unsupported(ValueError):
    """A query uses PromQL this evaluator does not cover: said loudly, never guessed at."""


# ---- scrapes -------------------------------------------------------------------------------------


@dataclass
class Scrapes:
    """Every sample of every scrape: series (labels incl. __name__) -> [(t, value)], t ascending."""

    series: dict[Labels, list[tuple[float, float]]] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, t: float, job: str, instance: str, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        if not self.times or self.times[-1] != t:
            self.times.append(t)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {**sample.labels, "__name__": sample.name, "job": job, "instance": instance}
                key = tuple(sorted(labels.items()))
                self.series.setdefault(key, []).append((t, float(sample.value)))

    @classmethod
    def read(cls, path: Path) -> "Scrapes":
        out = cls()
        with gzip.open(path, "rt") as f:
            for line in f:
                rec = json.loads(line)
                if "meta" in rec:
                    out.meta.update(rec["meta"])
                    continue
                out.add(rec["t"], rec["job"], rec["instance"], rec["text"])
        out.times = sorted(set(out.times))
        return out


# ---- PromQL: the subset the dashboard uses -------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<duration>\[\s*\d+(?:\.\d+)?[smhd]\s*\])
  | (?P<number>\d+(?:\.\d+)?(?![\w:]))
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|=|/|\(|\)|\{|\}|,)
""", re.X)
AGGREGATIONS = {"sum": sum, "max": max}
FUNCTIONS = {"rate", "increase", "histogram_quantile", "sort_desc"}


def tokenize(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise Unsupported(f"PromQL not covered at {expr[pos:pos + 20]!r} in {expr!r}")
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


@dataclass
class Selector:
    name: str
    matchers: list[tuple[str, str, str]]  # (label, op, value)
    window: float | None = None  # seconds, for a range selector


@dataclass
class Call:
    func: str
    args: list[Any]


@dataclass
class Aggregate:
    op: str
    by: list[str]
    arg: Any


@dataclass
class Divide:
    left: Any
    right: Any


class Parser:
    def __init__(self, expr: str):
        self.expr = expr
        self.tokens = tokenize(expr)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, text: str | None = None, kind: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (text is not None and tok[1] != text) or (kind is not None and tok[0] != kind):
            raise Unsupported(f"expected {text or kind} at token {self.i} ({tok}) in {self.expr!r}")
        self.i += 1
        return tok

    def parse(self):
        node = self.expression()
        if self.peek() is not None:
            raise Unsupported(f"unexpected {self.peek()} in {self.expr!r}")
        return node

    def expression(self):
        node = self.term()
        while self.peek() == ("op", "/"):
            self.take("/")
            node = Divide(node, self.term())
        if self.peek() is not None and self.peek()[0] == "ident" and self.peek()[1] in ("and", "or", "unless"):
            raise Unsupported(f"set operator {self.peek()[1]!r} in {self.expr!r}")
        return node

    def labels(self) -> list[str]:
        self.take("(")
        names = []
        while self.peek() != ("op", ")"):
            names.append(self.take(kind="ident")[1])
            if self.peek() == ("op", ","):
                self.take(",")
        self.take(")")
        return names

    def term(self):
        kind, text = self.take()
        if kind == "number":
            return float(text)
        if text == "(":
            node = self.expression()
            self.take(")")
            return node
        if kind != "ident":
            raise Unsupported(f"unexpected {text!r} in {self.expr!r}")
        if text in AGGREGATIONS:
            by = None
            if self.peek() == ("ident", "by"):
                self.take()
                by = self.labels()
            self.take("(")
            arg = self.expression()
            self.take(")")
            if by is None and self.peek() == ("ident", "by"):
                self.take()
                by = self.labels()
            if self.peek() is not None and self.peek()[1] in ("without", "on", "ignoring", "group_left", "group_right"):
                raise Unsupported(f"{self.peek()[1]!r} in {self.expr!r}")
            return Aggregate(text, by or [], arg)
        if text in FUNCTIONS:
            self.take("(")
            args = [self.expression()]
            while self.peek() == ("op", ","):
                self.take(",")
                args.append(self.expression())
            self.take(")")
            return Call(text, args)
        if self.peek() == ("op", "("):
            raise Unsupported(f"function or operator {text!r} in {self.expr!r}")
        matchers = []
        if self.peek() == ("op", "{"):
            self.take("{")
            while self.peek() != ("op", "}"):
                label = self.take(kind="ident")[1]
                op = self.take(kind="op")[1]
                if op not in ("=", "!=", "=~", "!~"):
                    raise Unsupported(f"matcher operator {op!r} in {self.expr!r}")
                value = json.loads(self.take(kind="string")[1])
                matchers.append((label, op, value))
                if self.peek() == ("op", ","):
                    self.take(",")
            self.take("}")
        window = None
        if self.peek() is not None and self.peek()[0] == "duration":
            spec = self.take()[1].strip("[] ")
            window = float(spec[:-1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[spec[-1]]
        return Selector(text, matchers, window)


def substitute(expr: str, rate_window_s: float, range_s: float) -> str:
    """Grafana's variables: every template variable All (``.*``), ``$__rate_interval`` and
    ``$__range`` as given; any other ``$`` variable is refused."""
    expr = expr.replace("$__rate_interval", f"{int(rate_window_s)}s").replace("$__range", f"{int(math.ceil(range_s)) + 1}s")
    for var in ("$job", "$instance", "$proxy"):
        expr = expr.replace(var, ".*")
    if "$" in expr:
        raise Unsupported(f"a Grafana variable this renderer does not set in {expr!r}")
    return expr


# ---- evaluation ----------------------------------------------------------------------------------

Vector = dict[Labels, float]


def _matches(labels: Mapping[str, str], matchers: Iterable[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        got = labels.get(label, "")
        if op == "=" and got != value or op == "!=" and got == value:
            return False
        if op in ("=~", "!~") and (re.fullmatch(value, got) is not None) != (op == "=~"):
            return False
    return True


def extrapolated(points: Sequence[tuple[float, float]], start: float, end: float, is_rate: bool) -> float | None:
    """Prometheus's ``extrapolatedRate`` (promql/functions.go) for a counter: the increase over
    the samples in (start, end] with counter resets, extrapolated towards the window's edges (not
    past half an average sample interval beyond the first/last sample, nor below zero)."""
    if len(points) < 2:
        return None
    result = points[-1][1] - points[0][1]
    for (_, prev), (_, cur) in zip(points, points[1:]):
        if cur < prev:
            result += prev
    sampled = points[-1][0] - points[0][0]
    if sampled <= 0:
        return None
    to_start, to_end = points[0][0] - start, end - points[-1][0]
    average = sampled / (len(points) - 1)
    if result > 0 and points[0][1] >= 0:
        to_zero = sampled * (points[0][1] / result)
        to_start = min(to_start, to_zero)
    threshold = average * 1.1
    interval = sampled
    interval += to_start if to_start < threshold else average / 2
    interval += to_end if to_end < threshold else average / 2
    result *= interval / sampled
    return result / (end - start) if is_rate else result


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``bucketQuantile`` over (upper bound, cumulative count) pairs."""
    if not buckets:
        return math.nan
    buckets = sorted(buckets)
    if buckets[-1][0] != math.inf:
        return math.nan
    counts = []
    for _, c in buckets:  # monotonic, as Prometheus enforces
        counts.append(max(c, counts[-1]) if counts else c)
    total = counts[-1]
    if total == 0 or math.isnan(total):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    rank = q * total
    b = bisect.bisect_left(counts, rank)
    if b == len(buckets) - 1:
        return buckets[-2][0] if len(buckets) > 1 else math.nan
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    lower, below = (0.0, 0.0) if b == 0 else (buckets[b - 1][0], counts[b - 1])
    upper, count = buckets[b][0], counts[b] - below
    return lower + (upper - lower) * ((rank - below) / count) if count else upper


class Evaluator:
    def __init__(self, scrapes: Scrapes):
        self.scrapes = scrapes
        self._selected: dict[str, list[tuple[dict[str, str], list[tuple[float, float]]]]] = {}

    def _select(self, sel: Selector):
        key = repr((sel.name, sel.matchers))
        if key not in self._selected:
            found = []
            for labels, points in self.scrapes.series.items():
                d = dict(labels)
                if d["__name__"] == sel.name and _matches(d, sel.matchers):
                    found.append((d, points))
            self._selected[key] = found
        return self._selected[key]

    def evaluate(self, node, t: float):
        """An instant vector (Labels -> value) or a float, at time ``t``."""
        if isinstance(node, float):
            return node
        if isinstance(node, Selector):
            if node.window is not None:
                raise Unsupported(f"a range selector outside rate/increase: {node.name}")
            out: Vector = {}
            for labels, points in self._select(node):
                i = bisect.bisect_right(points, (t, math.inf)) - 1
                if i >= 0 and t - points[i][0] <= LOOKBACK_S:
                    out[_key(labels, drop_name=False)] = points[i][1]
            return out
        if isinstance(node, Call):
            return self._call(node, t)
        if isinstance(node, Aggregate):
            arg = self.evaluate(node.arg, t)
            groups: dict[Labels, list[float]] = {}
            for labels, value in arg.items():
                d = dict(labels)
                groups.setdefault(tuple(sorted((k, d[k]) for k in node.by if k in d)), []).append(value)
            return {k: AGGREGATIONS[node.op](v) for k, v in groups.items()}
        if isinstance(node, Divide):
            left, right = self.evaluate(node.left, t), self.evaluate(node.right, t)
            if isinstance(left, float) or isinstance(right, float):
                raise Unsupported("scalar division")
            out = {}
            for labels, value in left.items():
                if labels in right:
                    den = right[labels]
                    out[labels] = value / den if den else (math.nan if value == 0 else math.copysign(math.inf, value))
            return out
        raise Unsupported(f"node {node!r}")

    def _call(self, node: Call, t: float):
        if node.func in ("rate", "increase"):
            (sel,) = node.args
            if not isinstance(sel, Selector) or sel.window is None:
                raise Unsupported(f"{node.func} of something other than a range selector")
            out: Vector = {}
            start = t - sel.window
            for labels, points in self._select(sel):
                lo = bisect.bisect_right(points, (start, math.inf))
                hi = bisect.bisect_right(points, (t, math.inf))
                value = extrapolated(points[lo:hi], start, t, node.func == "rate")
                if value is not None:
                    out[_key(labels, drop_name=True)] = value
            return out
        if node.func == "histogram_quantile":
            q, vec = node.args
            if not isinstance(q, float):
                raise Unsupported("histogram_quantile with a non-literal quantile")
            groups: dict[Labels, list[tuple[float, float]]] = {}
            for labels, value in self.evaluate(vec, t).items():
                d = dict(labels)
                le = d.pop("le", None)
                if le is None:
                    continue
                groups.setdefault(tuple(sorted(d.items())), []).append((float(le), value))
            return {k: bucket_quantile(q, b) for k, b in groups.items()}
        if node.func == "sort_desc":
            (arg,) = node.args
            vec = self.evaluate(arg, t)
            return dict(sorted(vec.items(), key=lambda kv: -kv[1] if not math.isnan(kv[1]) else math.inf))
        raise Unsupported(f"function {node.func}")


def _key(labels: Mapping[str, str], drop_name: bool) -> Labels:
    return tuple(sorted((k, v) for k, v in labels.items() if not (drop_name and k == "__name__")))


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    if not fmt:
        return ", ".join(f"{k}={v}" for k, v in labels if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip()


# ---- units ---------------------------------------------------------------------------------------


def _si(value: float, suffixes=("", " K", " M", " G", " T")) -> tuple[float, str]:
    i = 0
    while abs(value) >= 1000 and i < len(suffixes) - 1:
        value, i = value / 1000, i + 1
    return value, suffixes[i]


def _num(value: float, decimals: int | None = None) -> str:
    if decimals is not None:
        return f"{value:.{decimals}f}"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return f"{value:.2f}".rstrip("0").rstrip(".") if abs(value) >= 0.01 else f"{value:.2g}"


def format_value(value: float, unit: str | None, decimals: int | None = None) -> str:
    """A value in a Grafana unit, as Grafana writes it."""
    if value is None or math.isnan(value):
        return "-"
    if unit == "percentunit":
        return f"{_num(value * 100, decimals)}%"
    if unit == "s":
        if value == 0:
            return "0 s"
        for scale, name in ((1, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if abs(value) >= scale:
                return f"{_num(value / scale, decimals)} {name}"
        return f"{_num(value / 1e-9, decimals)} ns"
    if unit == "Bps":
        v, s = _si(value, (" B/s", " kB/s", " MB/s", " GB/s"))
        return f"{_num(v, decimals)}{s}"
    if unit in ("ops", "reqps"):
        v, s = _si(value)
        return f"{_num(v, decimals)}{s} {'ops/s' if unit == 'ops' else 'req/s'}"
    if unit in ("short", None, "none"):
        v, s = _si(value)
        return f"{_num(v, decimals)}{s}"
    raise Unsupported(f"unit {unit!r}")


# ---- drawing -------------------------------------------------------------------------------------

COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0",
          "#37872d", "#fade2a", "#ff9830", "#96d98d", "#ffb357", "#ca95e5", "#c4162a", "#1f60c4"]
BG, PANEL, GRID, TEXT, MUTED = "#111217", "#181b1f", "#2c3235", "#d8d9da", "#8e8e8e"
UNIT_PX, WIDTH_PX = 30, 1500


def _panels(dashboard: Mapping[str, Any]) -> list[dict]:
    out = []
    for panel in dashboard.get("panels", ()):
        out.append(panel)
        out += panel.get("panels", ())  # a collapsed row's
    return out


def evaluate_panel(ev: Evaluator, panel: Mapping[str, Any], times: Sequence[float], rate_window_s: float,
                   range_s: float) -> list[tuple[str, list[float]]]:
    """Per series of the panel's targets: (legend, value at each of ``times``; NaN where absent)."""
    series: dict[str, list[float]] = {}
    for target in panel.get("targets", ()):
        expr = target.get("expr")
        if not expr:
            continue
        node = Parser(substitute(expr, rate_window_s, range_s)).parse()
        for i, t in enumerate(times):
            vec = ev.evaluate(node, t)
            if isinstance(vec, float):
                raise Unsupported(f"a scalar panel query: {expr!r}")
            for labels, value in vec.items():
                name = legend(target.get("legendFormat", ""), labels)
                series.setdefault(name, [math.nan] * len(times))[i] = value
    return sorted(series.items())


def draw(dashboard: Mapping[str, Any], scrapes: Scrapes, out: Path, rate_window_s: float, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from datetime import datetime

    panels = _panels(dashboard)
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    title_px, caption_px = 44, 34
    height_px = bottom * UNIT_PX + title_px + caption_px
    dpi = 100
    fig = plt.figure(figsize=(WIDTH_PX / dpi, height_px / dpi), dpi=dpi, facecolor=BG)
    col_px = WIDTH_PX / 24
    times = scrapes.times
    t0 = times[0]
    range_s = times[-1] - t0
    stamps = [datetime.fromtimestamp(t) for t in times]

    def box(gp, pad=4):
        x0 = gp["x"] * col_px + pad
        y0 = title_px + gp["y"] * UNIT_PX + pad
        w, h = gp["w"] * col_px - 2 * pad, gp["h"] * UNIT_PX - 2 * pad
        return x0 / WIDTH_PX, 1 - (y0 + h) / height_px, w / WIDTH_PX, h / height_px

    fig.text(8 / WIDTH_PX, 1 - 28 / height_px, dashboard.get("title", "dashboard"), color=TEXT, fontsize=15,
             fontweight="bold")
    fig.text(1 - 8 / WIDTH_PX, 1 - 28 / height_px,
             f"{stamps[0]:%Y-%m-%d %H:%M:%S} to {stamps[-1]:%H:%M:%S}   rate window {int(rate_window_s)} s   "
             "job, instance, proxy: All", color=MUTED, fontsize=9, ha="right")
    fig.text(8 / WIDTH_PX, 12 / height_px, caption, color="#ffb357", fontsize=9.5)
    ev = Evaluator(scrapes)
    for panel in panels:
        gp = panel["gridPos"]
        kind = panel.get("type")
        if kind == "row":
            x, y, w, h = box(gp, pad=2)
            fig.text(x, y + h / 2, panel.get("title", ""), color=TEXT, fontsize=12, fontweight="bold", va="center")
            continue
        x, y, w, h = box(gp)
        frame = fig.add_axes((x, y, w, h))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        head = 24 / height_px
        frame.text(0.012, 1 - 6 / (h * height_px), panel.get("title", ""), transform=frame.transAxes, color=TEXT,
                   fontsize=9.5, fontweight="bold", va="top")
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        unit, decimals = defaults.get("unit"), defaults.get("decimals")
        data = evaluate_panel(ev, panel, times, rate_window_s, range_s)
        inner = (x + 0.006, y + 0.004, w - 0.012, h - head - 0.006)
        if kind == "timeseries":
            _timeseries(fig, inner, data, stamps, unit, decimals, mdates)
        elif kind == "stat":
            _stat(fig, inner, data, stamps, unit, decimals, defaults)
        elif kind == "table":
            _table(fig, inner, panel, data, unit, decimals)
        elif kind == "state-timeline":
            _state_timeline(fig, inner, data, stamps, defaults, mdates)
        else:
            raise Unsupported(f"panel type {kind!r} ({panel.get('title')})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi, facecolor=BG)
    plt.close(fig)
    _shrink(out)


def _legend_rows(fig, rect, names: Sequence[str], colors: Sequence[str], fontsize=7.5) -> float:
    """A Grafana-style list legend under a graph; returns the height (figure fraction) it takes."""
    x, y, w, h = rect
    fig_w, fig_h = fig.get_size_inches() * fig.dpi
    char_px = fontsize * fig.dpi / 72 * 0.58  # DejaVu Sans: about 0.58 em a character
    widths = [len(n) * char_px + 26 for n in names]
    lines, line, used = [], [], 0.0
    for i, px in enumerate(widths):
        if line and used + px > w * fig_w:
            lines.append(line)
            line, used = [], 0.0
        line.append(i)
        used += px
    if line:
        lines.append(line)
    line_h = (fontsize + 5) / fig_h
    lines = lines[:3]  # at most three lines, as a small Grafana panel shows without scrolling
    for row, members in enumerate(lines):
        cx = x
        yy = y + (len(lines) - row - 1) * line_h + line_h * 0.2
        for i in members:
            fig.add_artist(matplotlib_rect(fig, cx, yy + line_h * 0.25, 10 / fig_w, line_h * 0.35, colors[i]))
            fig.text(cx + 14 / fig_w, yy, names[i], color=TEXT, fontsize=fontsize, va="bottom")
            cx += widths[i] / fig_w
    return len(lines) * line_h + (4 / fig_h if lines else 0)


def matplotlib_rect(fig, x, y, w, h, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, transform=fig.transFigure, figure=fig, color=color)


def _style_axes(ax) -> None:
    ax.set_facecolor(PANEL)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.tick_params(colors=MUTED, labelsize=7, length=0)
    ax.grid(True, color=GRID, linewidth=0.6)


def _timeseries(fig, rect, data, stamps, unit, decimals, mdates) -> None:
    x, y, w, h = rect
    colors = [COLORS[i % len(COLORS)] for i in range(len(data))]
    used = _legend_rows(fig, rect, [name for name, _ in data], colors)
    left = 58 / (fig.get_size_inches()[0] * fig.dpi)
    ax = fig.add_axes((x + left, y + used + 0.006, w - left - 0.004, h - used - 0.008))
    _style_axes(ax)
    finite_max = 0.0
    for (name, values), color in zip(data, colors):
        ax.plot(stamps, values, color=color, linewidth=1.1)
        vals = [v for v in values if not math.isnan(v) and not math.isinf(v)]
        finite_max = max([finite_max, *vals])
    if not data:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, color=MUTED, ha="center", va="center", fontsize=10)
    ax.set_ylim(bottom=0, top=finite_max * 1.1 if finite_max > 0 else 1)
    ax.set_xlim(stamps[0], stamps[-1])
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
    ax.yaxis.set_major_formatter(lambda v, _pos: format_value(v, unit, decimals))
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(4))


def _stat(fig, rect, data, stamps, unit, decimals, defaults) -> None:
    x, y, w, h = rect
    n = max(len(data), 1)
    for i, (name, values) in enumerate(data or [("No data", [])]):
        cell = (x + i * w / n, y, w / n, h)
        last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
        ax = fig.add_axes((cell[0] + 0.002, cell[1] + 0.002, cell[2] - 0.004, cell[3] * 0.45))
        ax.set_axis_off()
        color = COLORS[i % len(COLORS)]
        if values:
            ax.fill_between(stamps, [0 if math.isnan(v) else v for v in values], color=color, alpha=0.25, linewidth=0)
            ax.plot(stamps, values, color=color, linewidth=1)
            ax.set_ylim(defaults.get("min", 0), defaults.get("max", None) or None)
            ax.set_xlim(stamps[0], stamps[-1])
        fig.text(cell[0] + cell[2] / 2, cell[1] + cell[3] * 0.78, name, color=TEXT, fontsize=9, ha="center")
        fig.text(cell[0] + cell[2] / 2, cell[1] + cell[3] * 0.52, format_value(last, unit, decimals), color=color,
                 fontsize=24, fontweight="bold", ha="center")


def _table(fig, rect, panel, data, unit, decimals) -> None:
    """The table of an instant query over the range: one row per series, Value descending."""
    x, y, w, h = rect
    target = panel["targets"][0]
    rows = [(name, next((v for v in reversed(values) if not math.isnan(v)), math.nan)) for name, values in data]
    rows.sort(key=lambda r: -r[1] if not math.isnan(r[1]) else math.inf)
    fig_h = fig.get_size_inches()[1] * fig.dpi
    line_h = 13 / fig_h
    columns = [part.split("=", 1)[0] for part in rows[0][0].split(", ")] if rows and not target.get("legendFormat") else []
    fig.text(x + 0.004, y + h - line_h, "  |  ".join(columns) or "series", color=MUTED, fontsize=7.5, fontweight="bold")
    fig.text(x + w - 0.004, y + h - line_h, "Value", color=MUTED, fontsize=7.5, fontweight="bold", ha="right")
    room = int((h - 1.5 * line_h) / line_h)
    shown = rows if len(rows) <= room else rows[: room - 1]
    for i, (name, value) in enumerate(shown):
        yy = y + h - (i + 2) * line_h - 2 / fig_h
        label = "  |  ".join(part.split("=", 1)[1] for part in name.split(", ")) if columns else name
        fig.text(x + 0.004, yy, label, color=TEXT, fontsize=7.5)
        fig.text(x + w - 0.004, yy, format_value(value, unit, decimals), color=TEXT, fontsize=7.5, ha="right")
    if len(shown) < len(rows):
        fig.text(x + 0.004, y + 0.002, f"... {len(rows) - len(shown)} more rows", color=MUTED, fontsize=7.5)


def _state_timeline(fig, rect, data, stamps, defaults, mdates) -> None:
    x, y, w, h = rect
    mapping = {}
    for m in defaults.get("mappings", ()):
        for value, spec in m.get("options", {}).items():
            mapping[float(value)] = spec
    left = 150 / (fig.get_size_inches()[0] * fig.dpi)
    ax = fig.add_axes((x + left, y + 0.008, w - left - 0.004, h - 0.012))
    _style_axes(ax)
    ax.grid(False)
    palette = {"green": "#73bf69", "red": "#f2495c"}
    for row, (name, values) in enumerate(data):
        for i in range(len(values) - 1):
            v = values[i]
            if math.isnan(v):
                continue
            spec = mapping.get(float(v), {})
            ax.barh(row, mdates.date2num(stamps[i + 1]) - mdates.date2num(stamps[i]), left=mdates.date2num(stamps[i]),
                    height=0.8, color=palette.get(spec.get("color"), "#8e8e8e"), linewidth=0)
        last = next((v for v in reversed(values) if not math.isnan(v)), math.nan)
        ax.text(mdates.date2num(stamps[len(stamps) // 2]), row, mapping.get(last, {}).get("text", ""), color="#111217",
                fontsize=8, ha="center", va="center")
    ax.set_yticks(range(len(data)))
    ax.set_yticklabels([name for name, _ in data], fontsize=7.5, color=TEXT)
    ax.set_xlim(stamps[0], stamps[-1])
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=6))
    ax.invert_yaxis()


def _shrink(path: Path) -> None:
    """A 256-colour palette PNG: the picture is flat colours, a fraction of the RGBA size."""
    from PIL import Image

    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


# ---- the run -------------------------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode("utf-8", "replace")


class Scraper(threading.Thread):
    """``/metrics`` of each target every ``interval`` s, appended to a gzipped JSON-lines file."""

    def __init__(self, targets: Mapping[str, tuple[str, str]], path: Path, interval: float = 1.0,
                 meta: Mapping[str, Any] | None = None):
        super().__init__(name="scraper", daemon=True)
        self.targets, self.path, self.interval, self.meta = targets, path, interval, dict(meta or {})
        self.stop = threading.Event()
        self.count = 0

    def run(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(self.path, "wt") as f:
            f.write(json.dumps({"meta": {**self.meta, "interval_s": self.interval}}) + "\n")
            next_t = time.time()
            while not self.stop.is_set():
                t = round(time.time(), 3)
                for instance, (job, url) in self.targets.items():
                    try:
                        text = _get(url.rstrip("/") + "/metrics")
                    except OSError:
                        continue  # a missed scrape, as Prometheus would record
                    f.write(json.dumps({"t": t, "job": job, "instance": instance, "text": text}) + "\n")
                self.count += 1
                next_t += self.interval
                self.stop.wait(max(0.0, next_t - time.time()))


def drive(stack, seconds: float, log: Callable[[str], None] = print) -> dict[str, int]:
    """Mixed requests for ``seconds`` from two client threads; returns how many of each kind."""
    from pd_connector.core.params import KEY_FIRST_TOKEN, KEY_RESUME, RESUME_FIRST_TOKEN
    from rig.cpu_matrix import random_prompt
    from rig.oracle import complete

    model = stack.config.served_model_name
    counts: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def zero_replay(i):
        stack.via_proxy(random_prompt(40 + (i * 37) % 360, seed=50_000 + i), 8 + i % 12)

    def proxy_replay(i):  # the proxy sends these down the replay flow, each with its reason
        extra = {"n": 2, "temperature": 0.7} if i % 2 else {"presence_penalty": 0.5}  # vLLM: n > 1 not greedy
        complete(stack.proxy_url, model, random_prompt(60 + (i * 29) % 200, seed=51_000 + i), 8, extra=extra)

    def direct_replay(i):
        stack.handoff(random_prompt(32 + (i * 53) % 300, seed=52_000 + i), 8)

    def refused(i):  # D refuses, and recomputes: another prompt, another first token, a foreign host
        prompt = random_prompt(70 + i % 50, seed=53_000 + i)
        which = i % 3
        if which == 0:
            params = stack.prefill_only(prompt)
            stack.decode_with(random_prompt(len(prompt), seed=54_000 + i), params, 4)
        elif which == 1:
            params = stack.prefill_only(prompt, **{KEY_RESUME: RESUME_FIRST_TOKEN})
            first = params[KEY_FIRST_TOKEN]
            stack.decode_with(prompt + [first + 1 if first < 900 else first - 1], params, 4)
        else:
            params = stack.prefill_only(prompt)
            stack.decode_with(prompt, {**params, "remote_host": "10.255.0.1"}, 4)

    plan = [zero_replay, zero_replay, zero_replay, direct_replay, proxy_replay, zero_replay, direct_replay]

    def client(worker: int) -> None:
        i = worker
        while time.monotonic() < deadline:
            # Refusals in two bursts (a third and two thirds in), so the refusal panels show them.
            elapsed = seconds - (deadline - time.monotonic())
            kind = refused if (i % 23 == 0 or abs(elapsed / seconds - 0.66) < 0.03) else plan[i % len(plan)]
            try:
                kind(i)
                name = kind.__name__
            except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
                name = f"{kind.__name__}:error"
                log(f"request {i} ({kind.__name__}) failed: {exc}")
            with lock:
                counts[name] = counts.get(name, 0) + 1
            i += 2

    threads = [threading.Thread(target=client, args=(w,), daemon=True) for w in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return counts


def run(kind: str, seconds: float, scrapes_path: Path, log_dir: Path) -> dict[str, int]:
    from rig.cpu_matrix import CPU_MODELS
    from rig.stack import PDStack, StackConfig
    from rig.tiny_models import build_model

    model = build_model(kind, log_dir / "models")
    config = StackConfig(model=str(model), server_args=CPU_MODELS[kind], with_baseline=False,
                         log_dir=str(log_dir / "logs"))
    print(f"starting P, D ({kind}) and pd-connector proxy; logs in {config.log_dir}", flush=True)
    with PDStack(config) as stack:
        stack.warm_up()
        targets = {"P": ("vllm-pd", stack.prefill.base_url), "D": ("vllm-pd", stack.decode.base_url),
                   "proxy": ("pd-proxy", stack.proxy_url)}
        scraper = Scraper(targets, scrapes_path, meta={"kind": kind, "seconds": seconds})
        scraper.start()
        time.sleep(5)  # a few idle scrapes first: rates start from a baseline
        print(f"driving {seconds:.0f} s of mixed requests, scraping P, D and proxy every second", flush=True)
        counts = drive(stack, seconds)
        time.sleep(8)  # the last steps' stats, and the idle tail
        scraper.stop.set()
        scraper.join()
    print(f"requests: {counts}; {scraper.count} scrapes in {scrapes_path}", flush=True)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=Path, help="render these saved scrapes (no servers)")
    ap.add_argument("--save-scrapes", type=Path, default=DEFAULT_SCRAPES, help="where a run saves its scrapes")
    ap.add_argument("--seconds", type=float, default=90.0, help="how long a run drives requests")
    ap.add_argument("--kind", default="nemotron_h", help="tiny model (rig.cpu_matrix.CPU_MODELS)")
    ap.add_argument("--rate-window", type=float, default=15.0, help="$__rate_interval, seconds")
    ap.add_argument("--dashboard", type=Path, default=DASHBOARD)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    dashboard = load(args.dashboard)
    # Every query is parsed before any server starts: an unsupported one fails at once.
    for panel in _panels(dashboard):
        for target in panel.get("targets", ()):
            if target.get("expr"):
                Parser(substitute(target["expr"], args.rate_window, 60)).parse()
    path = args.scrapes
    if path is None:
        path = args.save_scrapes
        run(args.kind, args.seconds, path, path.parent)
    scrapes = Scrapes.read(path)
    caption = (f"Rendered by rig/dashboard_render.py from a real run's /metrics scrapes (P, D and pd-connector "
               f"proxy on vLLM CPU, tiny {scrapes.meta.get('kind', 'model')}, scraped every second), "
               "not a Grafana screenshot.")
    draw(dashboard, scrapes, args.out, args.rate_window, caption)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
