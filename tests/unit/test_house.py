"""The package's house rules (docs/architecture.md, "Packages"), checked on the source itself.

- core is pure: importing all of it loads no vLLM, torch, NIXL, ZMQ, sockets or HTTP client;
- the wheel is the product: it holds what the connector, the proxy and check reach, and nothing
  of the tooling beside it (rig/, benchmarks/, examples/, scripts/, tests/) nor a test framework
  or plotting library;
- the subpackages depend one way: core <- transport <- engine; proxy and check on core and urls;
- no product module names a fault: the negative controls' fault injection is the rig's
  connector subclass (rig/fault_connector.py), reaching the product only through its seams;
- unit tests import no vLLM, neither directly nor through a module that loads it on import.

Imports are read with ``ast`` (every ``import`` statement, wherever it sits), so a lazy import
inside a function counts as much as one at the top. Each rule's checker has a negative control.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pd_connector"
TESTS = ROOT / "tests"
RIG = ROOT / "rig"
# Top-level names of the tooling beside the package (run from a checkout, never installed).
TOOLING = ("rig", "benchmarks", "examples", "scripts", "tests", "support")
# Libraries only tooling uses: a product module importing one is test or benchmark code.
TOOLING_LIBRARIES = ("pytest", "hypothesis", "matplotlib")
# What runs the product: vLLM loads the connector, operators run the command (proxy, check).
PRODUCT_ROOTS = ["pd_connector.connector", "pd_connector.cli", "pd_connector.proxy.server", "pd_connector.check.run"]
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
FORBIDDEN_IN_CORE = ("vllm", "torch", "nixl", "zmq", "socket", "aiohttp", "http.client", "urllib.request")


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
    """``pd_connector.core.descriptors`` -> ``core``; a top-level module -> its name; else None."""
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
    return [p for p in modules() if p != PACKAGE / "cli.py"]


def imports_tooling(source: str, name: str) -> list[str]:
    return sorted(t for t in imported(source, name) if t.split(".")[0] in TOOLING + TOOLING_LIBRARIES)


# ---- (a) core is pure ---------------------------------------------------------------------------

_LOAD_AND_LIST = """
import importlib, json, sys
sys.path[1:1] = json.loads(sys.argv[1])
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by_importing(names: list[str], paths: tuple[Path, ...] = ()) -> set[str]:
    """``sys.modules`` of a fresh interpreter after importing ``names`` (nothing else imported),
    ``paths`` on its sys.path after the checkout."""
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_LIST, json.dumps([str(p) for p in paths]), *names],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
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


# ---- (b) the wheel is the product ---------------------------------------------------------------


def test_the_package_imports_no_tooling_test_framework_or_plotting():
    sources = {module_name(p): p.read_text() for p in modules()}
    assert "pd_connector.connector" in sources and "pd_connector.cli" in sources
    offenders = {name: imports_tooling(source, name) for name, source in sources.items()}
    assert {m: t for m, t in offenders.items() if t} == {}


@pytest.mark.parametrize("line", [
    "import rig.oracle",
    "from rig import stack",
    "from benchmarks.report import write_json",
    "import examples.demo",
    "import pytest",
    "from hypothesis import given",
    "def lazy():\n    import matplotlib.pyplot as plt",
    "def lazy():\n    from rig import fake_upstreams",
])
def test_tooling_check_sees_every_form_of_import(line):
    assert imports_tooling(line, "pd_connector.engine.worker_side")


def test_tooling_check_ignores_lookalike_names():
    source = "import rigid\nfrom pd_connector import urls\nimport pytestlike\nfrom .rig import x"
    assert imports_tooling(source, "pd_connector.check.run") == []


def unreached(sources: dict[str, str], roots: list[str]) -> list[str]:
    """Modules of the package (``pd_connector.*`` in ``sources``) that no import chain from
    ``roots`` reaches; a package counts as reached with any module in it."""
    seen: set[str] = set()
    todo = [r for r in roots if r in sources]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in sources]
        todo += [t for t in imported(sources[name], name) if t in sources]
    return sorted(m for m in sources if m.startswith("pd_connector") and m not in seen)


def test_the_wheel_holds_what_the_connector_proxy_and_check_reach():
    """A module no product entry point reaches is tooling: it belongs in rig/ or benchmarks/."""
    sources = {module_name(p): p.read_text() for p in modules()}
    assert unreached(sources, PRODUCT_ROOTS) == []


def test_reach_check_sees_a_harness_put_back_into_the_package():
    """Negative control: rig/'s TP matrix moved into the package is reached by no entry point;
    nor is the proxy once its only importer is gone."""
    sources = {module_name(p): p.read_text() for p in modules()}
    sources["pd_connector.tp_matrix"] = (RIG / "tp_matrix.py").read_text()
    assert unreached(sources, PRODUCT_ROOTS) == ["pd_connector.tp_matrix"]
    assert "pd_connector.proxy.flow" in unreached(sources, ["pd_connector.connector"])


def test_the_wheel_packages_only_pd_connector():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["pd_connector*"]' in text


# ---- (c) module size ----------------------------------------------------------------------------


MAX_FUNCTION_LINES = 60
# A longer product function carries its reason on the line above its ``def`` (or decorator).
LONG_REASON = "# Long:"


def long_functions(source: str) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines without a ``# Long:`` reason above them."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            reason = lines[first - 2].strip() if first >= 2 else ""
            if length > MAX_FUNCTION_LINES and not reason.startswith(LONG_REASON):
                out.append(f"{node.name} ({length} lines)")
    return out


def test_no_product_function_is_over_the_limit_without_a_reason():
    over = {module_name(p): found for p in product_modules() if (found := long_functions(p.read_text()))}
    assert over == {}, f"split these, or write why they are whole ('{LONG_REASON} ...' above the def): {over}"


def test_function_length_check_sees_a_long_function_and_accepts_a_reason():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}") == [f"f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(f"# Long: one table of settings.\ndef f():\n{body}") == []
    assert long_functions(f"# Long: why.\n@decorator\nasync def g():\n{body}") == []
    assert long_functions("def short():\n    return 1\n") == []


# ---- (d) subpackages depend one way -------------------------------------------------------------

# transport/lease_client.py takes engine/metadata.py's task types (RecvTask, ReleaseTask,
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
    ("pd_connector.core.descriptors", "from pd_connector.transport import nixl"),
    ("pd_connector.core.descriptors", "import pd_connector.engine.compat"),
    ("pd_connector.transport.nixl", "from pd_connector.engine.metadata import RecvTask"),
    ("pd_connector.engine.worker_side", "from pd_connector.proxy import server"),
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
        "pd_connector.transport.nixl": "from pd_connector.core import descriptors",
        "pd_connector.engine.decode.receiver": "from pd_connector.transport.nixl import NixlTransport\nfrom pd_connector.core import leases",
        "pd_connector.proxy.server": "from pd_connector.urls import normalize_url\nfrom pd_connector.core.protocol import KEY_REPLAY_OFFSET",
        "pd_connector.check.client": "from pd_connector.urls import OPENER\nimport pd_connector",
    }) == []


# ---- (e) no product module names a fault ----------------------------------------------------------

# Words of an identifier: split at "_" and "." and at camelCase ("FaultInjector": Fault, Injector).
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+")
# A string that is a name (a params key, an environment variable, a module path), not prose.
_NAME_LIKE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _names(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append(node.id)
        elif isinstance(node, ast.Attribute):
            out.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(node.name)
        elif isinstance(node, ast.arg):
            out.append(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            out.append(node.arg)
        elif isinstance(node, ast.alias):
            out += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME_LIKE.fullmatch(node.value):
            out.append(node.value)
    return out


def fault_names(source: str) -> list[str]:
    """Identifiers, imports and name-like strings of ``source`` with a word starting "fault"
    ("DEFAULT", "setdefault" are one word each: not a fault; prose in strings is not read)."""
    words = lambda name: (w.lower() for part in re.split(r"[_.]", name) for w in _WORD.findall(part))  # noqa: E731
    return sorted({n for n in _names(ast.parse(source)) if any(w.startswith("fault") for w in words(n))})


def test_no_product_module_names_a_fault():
    """Fault injection is test tooling: rig/fault_connector.py subclasses the connector and
    overrides the product's neutral seams; the product holds no switch, key or field for it."""
    found = {module_name(p): names for p in modules() if (names := fault_names(p.read_text()))}
    assert found == {}


@pytest.mark.parametrize("source", [
    "from pd_connector.engine import faults",
    "import rig.fault_connector",
    "from rig.fault_receiver import corrupted",
    "self._faults = None",
    "class FaultInjector:\n    pass",
    "def accept(request, fault=None):\n    pass",
    "task.mark(fault_kind=1)",
    "def injectFaults():\n    pass",
    "ENABLED = os.environ.get('PD_CONNECTOR_FAULT_INJECTION') == '1'",
    "shift = params.get('_pd_fault_resume_shift')",
])
def test_fault_check_sees_every_form_of_naming_one(source):
    """Negative control: each of these, put in a product module, fails the check above."""
    assert fault_names(source)


def test_fault_check_ignores_default_and_prose():
    source = (
        "DEFAULT_TIMEOUT_S = 1\nd.setdefault(k, v)\ndefaults = {}\nclass Defaults:\n    pass\n"
        "'''The client's request is at fault.'''\nlog('a fault on P')\n"
    )
    assert fault_names(source) == []


# ---- (f) unit tests import no vLLM --------------------------------------------------------------


def first_party_modules() -> set[str]:
    """The package's modules and rig/'s, by import name."""
    return {module_name(p) for p in modules()} | {module_name(p) for p in modules(RIG)}


def vllm_reached(sources: dict[str, str]) -> list[str]:
    """The vLLM modules test modules (``name -> source``) import: their own ``vllm`` imports
    (lazy ones included), and what importing every first-party module they name loads (a module
    that imports vLLM when it is imported, e.g. one whose base classes are vLLM's)."""
    first_party = first_party_modules()
    direct, named = set(), set()
    for name, source in sources.items():
        targets = imported(source, name)
        direct |= {t for t in targets if t.split(".")[0] == "vllm"}
        named |= targets & first_party
    loaded = loaded_by_importing(sorted(named))
    return sorted(direct | {m for m in loaded if m == "vllm" or m.startswith("vllm.")})


def test_unit_tests_import_no_vllm():
    sources = {p.stem: p.read_text() for p in sorted((TESTS / "unit").glob("*.py"))}
    assert "test_leases" in sources and "test_house" in sources
    found = vllm_reached(sources)
    assert found == [], f"move the test to tests/vllm (it imports vLLM: {found[:5]})"


def test_vllm_check_sees_a_direct_import_in_a_test():
    assert vllm_reached({"test_x": "def test_x():\n    from vllm.config import VllmConfig"}) == [
        "vllm.config", "vllm.config.VllmConfig"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here")
def test_vllm_check_sees_a_module_that_loads_vllm_on_import():
    """Negative control: the extend_tasks test (tests/vllm/test_metadata.py) imports
    engine.metadata, whose task types take vLLM's base classes where vLLM is installed."""
    found = vllm_reached({"test_metadata": (TESTS / "vllm" / "test_metadata.py").read_text()})
    assert "vllm" in found
