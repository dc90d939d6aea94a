"""``scripts/gpu_check.sh --smoke`` on CPU, so the GPU check's plumbing (device detection, the
pytest step and its counts, the digest, a benchmark case, summary.json) runs in CI, where no GPU
is; and its refusal of a device torch cannot see (the negative control: no summary, no pass)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rig import devices

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != devices.ENV}
    env["PYTHON"] = sys.executable
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(devices.on_cuda(), reason="the GPU check itself is running (this is its CPU plumbing check)")
def test_gpu_check_smoke_on_cpu_runs_every_step_and_writes_the_summary(tmp_path):
    done = gpu_check("--device", "cpu", "--smoke", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "gpu_check: running on cpu" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["device"] == "cpu" and summary["smoke"]
    assert summary["environment"]["torch"] == torch.__version__
    assert [s["name"] for s in summary["steps"]] == ["tests", "bench"]
    parts = summary["steps"][0]["parts"]
    assert (parts["transfers"]["passed"], parts["digest"]["passed"]) == (2, 2)
    assert summary["tests"]["failed"] == summary["tests"]["errors"] == 0
    case = summary["bench"]["cases"][0]
    assert case["verified"] and {"connector", "raw", "memcpy"} <= set(case["gbps"]) and case["descriptors"] > 0
    assert "stall_ms" in case and "main" in summary["bench"]["tables"]
    for name in ("tables.md", "junit.xml", "tests.log", "bench.log", "bench_transfer.json"):
        assert (tmp_path / name).exists(), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_gpu_check_refuses_cuda_where_torch_sees_none(tmp_path):
    done = gpu_check("--device", "cuda", "--out", str(tmp_path), timeout=120)
    assert done.returncode != 0
    assert "--device cuda, but torch" in done.stderr and "sees no CUDA device" in done.stderr
    assert not (tmp_path / "summary.json").exists()
