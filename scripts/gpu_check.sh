#!/usr/bin/env bash
# The GPU check without vLLM: real-NIXL in-process tests with their buffers in VRAM, the state
# digest on CUDA tensors, the transfer benchmark's quick sections over VRAM; on a machine without
# a GPU the same steps over DRAM. Results (summary.json, tables.md, logs, JSON) in one folder.
#
#   scripts/gpu_check.sh [--device auto|cuda|cpu] [--out DIR] [--smoke]
#
# Python: $PYTHON, else .venv/bin/python, else python3; it needs torch, numpy, nixl, msgspec,
# pyzmq and pytest. Wheels carried in .whl/ (scripts/fetch_gpu_wheels.sh) are installed first,
# offline, into .gpu-deps/ (docs/testing.md, "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
missing() {
  "$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "numpy", "nixl", "msgspec", "zmq", "pytest") if u.find_spec(m) is None))'
}
need=$(missing)
if [ -n "$need" ] && [ ! -f .gpu-deps/.installed ] && compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu_check: $need missing; installing the carried wheels (.whl/) into .gpu-deps/ (offline)"
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --target .gpu-deps .whl/*.whl
  else  # no pip: a wheel is a zip of what goes on sys.path
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" .gpu-deps; done
  fi
  touch .gpu-deps/.installed
fi
if [ -n "$need" ] && [ -f .gpu-deps/.installed ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-deps"
  need=$(missing)
fi
if [ -n "$need" ]; then
  echo "gpu_check: $("$PY" -V 2>&1) at $(command -v "$PY") lacks: $need (wheels: scripts/fetch_gpu_wheels.sh)" >&2
  exit 2
fi
exec "$PY" scripts/gpu_check.py "$@"
