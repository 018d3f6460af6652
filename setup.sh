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
# The browser tests (tests/test_ui.py) drive Debian's Chromium through playwright; no browser
# download. Installed here when we may (root with apt-get); otherwise those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -qq chromium >/dev/null 2>&1 || echo "nitro: could not install chromium; the UI tests will skip"
fi
echo "nitro: environment ready in .venv ($(python -c 'import torch, prefect, mlflow; print(f"torch {torch.__version__}, prefect {prefect.__version__}, mlflow {mlflow.__version__}")'))"
