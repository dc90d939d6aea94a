"""Output helpers shared by every benchmark: a plain-text table, JSON and a PNG under
``.artifacts/bench/`` (or ``out_dir``).

Stable API (other benchmarks import it):
- ``format_table(headers, rows) -> str`` / ``print_table(rows, columns, title="") -> str``
- ``write_json(name, data, out_dir=DEFAULT_OUT) -> path``
- ``write_plot(name, draw, out_dir=DEFAULT_OUT) -> path | None``: ``draw(plt)`` returns a figure
  (or None to skip); no PNG, with a printed note, when matplotlib is missing (``pip install
  pd-connector[bench]``) or drawing fails: the table and JSON are the record, a plot is a view.
- ``environment() -> dict``: host facts to store next to the figures.
- ``write(out_dir, name, data, plot=None) -> [paths]``: JSON plus ``plot(png_path) -> bool``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

DEFAULT_OUT = os.path.join(".artifacts", "bench")


def _looks_numeric(text: str) -> bool:
    t = text.strip().rstrip("%x").replace(",", "")
    try:
        float(t)
        return True
    except ValueError:
        return False


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table that is also valid Markdown: text left-aligned, numbers right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_looks_numeric(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        out = [v.rjust(w) if numeric[i] else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if numeric[i] else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])


def print_table(
    rows: Sequence[Mapping[str, Any] | Sequence[Any]],
    columns: Sequence[str | tuple[str, str] | tuple[str, str, str]],
    title: str = "",
) -> str:
    """Print and return a table. ``columns``: keys of dict rows (or headers of sequence rows),
    each optionally ``(key, header)`` or ``(key, header, format spec)``, e.g.
    ``("gbps", "GB/s", ".2f")``."""
    keys, headers, specs = [], [], []
    for col in columns:
        key, header, spec = (col, col, "") if isinstance(col, str) else (tuple(col) + ("",))[:3]
        keys.append(key)
        headers.append(header)
        specs.append(spec)
    body = []
    for row in rows:
        values = [row.get(k, "") for k in keys] if isinstance(row, Mapping) else list(row)
        body.append([format(v, s) if s and isinstance(v, (int, float)) else v for v, s in zip(values, specs)])
    text = format_table(headers, body)
    print((title + "\n" if title else "") + text, flush=True)
    return text


def write_json(name: str, data: Any, out_dir: str = DEFAULT_OUT) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a printed note) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'pd-connector[bench]')")
        return None
    return plt


def write_plot(name: str, draw: Callable[[Any], Any], out_dir: str = DEFAULT_OUT) -> str | None:
    """``out_dir/name.png`` from the figure ``draw(plt)`` returns; None when nothing was drawn."""
    plt = pyplot()
    if plt is None:
        return None
    try:
        fig = draw(plt)
        if fig is None:
            return None
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    except Exception as exc:  # a plot must never lose the measurements
        print(f"plot {name} failed: {exc!r}")
        return None


def environment() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "argv": sys.argv,
    }


def write(out_dir: str, name: str, data: dict, plot: Callable[[str], bool] | None = None) -> list[str]:
    """``out_dir/name.json`` and, when ``plot(png_path)`` draws one, ``name.png``."""
    paths = [write_json(name, data, out_dir)]
    if plot is not None:
        png = os.path.join(out_dir, f"{name}.png")
        try:
            if plot(png):
                paths.append(png)
        except Exception as exc:
            print(f"plot failed: {exc!r}")
    return paths
