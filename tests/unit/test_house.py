"""The package's house rules (docs/architecture.md, "Packages"), checked on the source itself.

- core is pure: importing all of it loads no vLLM, torch, NIXL, ZMQ or HTTP client;
- the product never imports pd_connector.dev (tooling: demo, testing, benchmarks);
- one concern per module: no module over MAX_LINES lines;
- the subpackages depend one way: core <- transport <- engine; proxy and check on core and urls.

Imports are read with ``ast`` (every ``import`` statement, wherever it sits), so a lazy import
inside a function counts as much as one at the top. Each rule's checker has a negative control.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pd_connector"
MAX_LINES = 400
# Top-level modules (not subpackages) that subpackages may import.
SHARED_MODULES = {"urls"}
# What each subpackage may import from pd_connector besides itself.
ALLOWED = {
    "core": set(),
    "transport": {"core"},
    "engine": {"core", "transport"},
    "proxy": {"core"} | SHARED_MODULES,
    "check": {"core"} | SHARED_MODULES,
}
FORBIDDEN_IN_CORE = ("vllm", "torch", "nixl", "zmq", "aiohttp", "http.client", "urllib.request")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def imported(source: str, name: str) -> set[str]:
    """Every module name ``source`` (the module ``name``) imports, relative imports resolved;
    ``from a import b`` yields ``a`` and ``a.b`` (b may be a submodule)."""
    out: set[str] = set()
    package = name.split(".")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # The module's package is itself for an __init__, but ``name`` cannot tell: the
                # product uses no relative imports, and this only has to be right for them.
                base = ".".join(package[: len(package) - node.level] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def subpackage(module: str) -> str | None:
    """``pd_connector.core.layout`` -> ``core``; a top-level module -> its name; else None."""
    parts = module.split(".")
    if parts[0] != "pd_connector" or len(parts) < 2:
        return None
    return parts[1]


def layer_violations(sources: dict[str, str]) -> list[str]:
    """``module -> source`` of the layered subpackages; one line per import across a rule."""
    found = []
    for name, source in sources.items():
        own = subpackage(name)
        if own not in ALLOWED:
            continue
        for target in sorted(imported(source, name)):
            other = subpackage(target)
            if other is None or other == own or target == "pd_connector":
                continue
            if other not in ALLOWED[own]:
                found.append(f"{name} imports {target} ({own} may import {sorted(ALLOWED[own]) or 'only itself'})")
    return found


def product_modules() -> list[Path]:
    dev = PACKAGE / "dev"
    return [p for p in modules() if dev not in p.parents and p != PACKAGE / "cli.py"]


def imports_dev(source: str, name: str) -> list[str]:
    return sorted(t for t in imported(source, name) if t == "pd_connector.dev" or t.startswith("pd_connector.dev."))


# ---- (a) core is pure ---------------------------------------------------------------------------

_LOAD_AND_LIST = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by_importing(names: list[str]) -> set[str]:
    """``sys.modules`` of a fresh interpreter after importing ``names`` (nothing else imported)."""
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_LIST, *names], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return set(json.loads(done.stdout))


def forbidden_among(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_IN_CORE))


def test_importing_all_of_core_loads_no_vllm_torch_nixl_zmq_or_http():
    core = [module_name(p) for p in modules(PACKAGE / "core")]
    assert "pd_connector.core.protocol" in core and len(core) > 5
    loaded = loaded_by_importing(core)
    assert set(core) <= loaded
    assert forbidden_among(loaded) == [], "pd_connector.core must stay pure"


def test_purity_check_sees_a_module_that_imports_zmq():
    """Negative control: the side channel imports zmq, and the check says so."""
    assert "zmq" in forbidden_among(loaded_by_importing(["pd_connector.transport.side_channel"]))


# ---- (b) the product does not import the dev tooling --------------------------------------------


def test_the_product_never_imports_pd_connector_dev():
    product = product_modules()
    assert PACKAGE / "connector.py" in product and PACKAGE / "cli.py" not in product
    assert not any(PACKAGE / "dev" in p.parents for p in product)
    offenders = {module_name(p): imports_dev(p.read_text(), module_name(p)) for p in product}
    assert {m: t for m, t in offenders.items() if t} == {}


@pytest.mark.parametrize("line", [
    "import pd_connector.dev.testing.oracle",
    "from pd_connector.dev import demo",
    "from pd_connector.dev.benchmarks.report import write_json",
    "def lazy():\n    from pd_connector.dev.testing import stack",
])
def test_dev_import_check_sees_every_form_of_import(line):
    assert imports_dev(line, "pd_connector.engine.worker")


def test_dev_import_check_ignores_lookalike_names():
    assert imports_dev("import pd_connector.devices\nfrom pd_connector import urls", "pd_connector.check.run") == []


# ---- (c) module size ----------------------------------------------------------------------------


def test_no_module_is_over_the_line_limit():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in modules()}
    assert len(sizes) > 40
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_LINES}
    assert over == {}, f"split these by concern (limit {MAX_LINES} lines): {over}"


# ---- (d) subpackages depend one way -------------------------------------------------------------

# transport/sender_client.py takes engine/metadata.py's task types (RecvTask, ReleaseTask,
# ExtendTask) for the P it calls: an engine -> transport -> engine cycle, until those calls take
# a core type instead. Listed here so that no other crossing hides behind it.
def sources_of(layer: str) -> dict[str, str]:
    return {module_name(p): p.read_text() for p in modules(PACKAGE / layer)}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_subpackage_imports_only_the_layers_below_it(layer):
    sources = sources_of(layer)
    assert sources, layer
    assert layer_violations(sources) == []


@pytest.mark.parametrize("name, source", [
    ("pd_connector.core.layout", "from pd_connector.transport import nixl"),
    ("pd_connector.core.layout", "import pd_connector.engine.compat"),
    ("pd_connector.transport.nixl", "from pd_connector.engine.metadata import RecvTask"),
    ("pd_connector.engine.worker", "from pd_connector.proxy import server"),
    ("pd_connector.proxy.flow", "from pd_connector.engine import scheduler"),
    ("pd_connector.check.run", "from pd_connector.transport import side_channel"),
    ("pd_connector.check.run", "from pd_connector import connector"),
    ("pd_connector.core.pairing", "from .. import urls"),
])
def test_layer_check_sees_an_import_across_the_rules(name, source):
    assert layer_violations({name: source})


def test_layer_check_allows_the_documented_directions():
    assert layer_violations({
        "pd_connector.core.handoff": "from pd_connector.core.protocol import KEY_VERSION\nimport msgspec",
        "pd_connector.transport.nixl": "from pd_connector.core import layout",
        "pd_connector.engine.decode.receiver": "from pd_connector.transport.nixl import NixlTransport\nfrom pd_connector.core import leases",
        "pd_connector.proxy.server": "from pd_connector.urls import normalize_url\nfrom pd_connector.core.protocol import KEY_REPLAY_OFFSET",
        "pd_connector.check.client": "from pd_connector.urls import OPENER\nimport pd_connector",
    }) == []
