#!/usr/bin/env bash
# vllm-router (PyPI), the production P/D router (README, "Which router"), in a venv of its own,
# .venv-router, so that its dependencies never mix with vLLM's in .venv. The end-to-end tests
# behind it (tests/e2e/test_vllm_router*.py) run .venv-router/bin/vllm-router. Idempotent;
# scripts/setup_venv.sh calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VERSION=0.1.17
[ -x .venv-router/bin/python ] || "$PYTHON" -m venv .venv-router
.venv-router/bin/python -m pip install -q --disable-pip-version-check "vllm-router==$VERSION"
.venv-router/bin/vllm-router --help >/dev/null || {
  echo "setup_router_venv: .venv-router/bin/vllm-router does not run" >&2; exit 1; }
echo "setup_router_venv: .venv-router ready (vllm-router $VERSION)"
