"""The GPU check's counting (``scripts/gpu_check.py``): a failing, a skipped and an
xfailed test are told apart in the junit XML, per part, so a failure on the GPU cannot read as a pass."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# scripts/ is no package: load the check's module from its file (it imports only the stdlib).
_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
_SPEC = importlib.util.spec_from_file_location("gpu_check", _SCRIPT)
gpu_check = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_check)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.nixl.test_transport" name="test_ok" time="0.1" />
<testcase classname="tests.nixl.test_transport" name="test_bad" time="0.1"><failure message="boom">x</failure></testcase>
<testcase classname="tests.nixl.test_reads_outliving_their_lease" name="test_sliced" time="0"><skipped type="pytest.skip" message="needs a READ in several slices">s</skipped></testcase>
<testcase classname="tests.nixl.test_state_digest" name="test_digest" time="0.1" />
<testcase classname="tests.nixl.test_state_digest" name="test_widths" time="0.1"><skipped type="pytest.xfail" message="known" /></testcase>
</testsuite></testsuites>"""


def test_junit_counts_split_transfers_from_digest_and_keep_failures_and_skip_reasons(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    counts = gpu_check.junit_counts(path)
    t, d = counts["transfers"], counts["digest"]
    assert (t["passed"], t["failed"], t["skipped"], t["xfailed"]) == (1, 1, 1, 0)
    assert t["failures"] == ["tests.nixl.test_transport::test_bad"]
    assert t["skip_reasons"] == {"needs a READ in several slices": 1}
    assert (d["passed"], d["failed"], d["skipped"], d["xfailed"]) == (1, 0, 0, 1)


def test_a_missing_junit_counts_nothing_as_passed(tmp_path):
    counts = gpu_check.junit_counts(tmp_path / "absent.xml")
    assert all(c["passed"] == 0 for c in counts.values())
