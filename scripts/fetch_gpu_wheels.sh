#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels scripts/gpu_check.sh needs on a GPU host that
# has torch (CUDA 13) and numpy but no network and no vLLM: NIXL 1.5.1 for CUDA 13 (its `nixl`
# meta package without its unconditional nixl-cu12 dependency), msgspec, pyzmq, and pytest 8.3
# (no pygments) with its three dependencies. About 59 MiB for one Python version; the host's
# Python minor version decides which (default 3.12):
#
#   scripts/fetch_gpu_wheels.sh [3.11|3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --python-version "$PYVER" -d .whl \
  nixl-cu13==1.5.1 nixl==1.5.1 msgspec==0.23.0 pyzmq==27.3.0 \
  pytest==8.3.5 iniconfig==2.3.1 packaging==26.4 pluggy==1.7.0
ls -l .whl
du -cb .whl/*.whl | tail -1 | awk '{printf "%.1f MiB of wheels in .whl/ (carry it with the tree: 64 MiB in all)\n", $1 / 1048576}'
