#!/usr/bin/env bash
# Create .venv and install Nitro with its test extras. Idempotent: a second run is quick.
#
# torch is installed first and pinned to 2.13.0: a bare `torch` requirement can pull a multi-GB
# CUDA build. For a CPU-only machine elsewhere, set PIP_EXTRA_INDEX_URL to PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
echo "nitro: environment ready in .venv ($(python -c 'import torch, prefect, mlflow; print(f"torch {torch.__version__}, prefect {prefect.__version__}, mlflow {mlflow.__version__}")'))"
