#!/usr/bin/env bash
# The GPU check of issue 49 (item 4) in one go, a few minutes on a fresh GPU machine: what is
# installed, the GPU tests (tests/test_gpu.py: an update and a detection on cuda), and
# bench/gpu_timing.py (one Atari and one Humanoid update and detection, timed on CPU and GPU).
#
# Usage, in the repository's root or anywhere:  bench/gpu_check.sh [--device cpu]
#   --device cpu: a dry run where no GPU is (the GPU tests skip; the CPU is timed alone).
# Packages: python3 (or .venv/bin/python) needs torch; what else the learner and the actors import
# is installed from .whl/ when it is there (bench/gpu_wheels.sh fetches it, for a machine that
# cannot reach PyPI), else from PyPI. Output: $OUT when set (a lent machine's folder), else
# bench/results/: gpu_timing_<card>.json, gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
export MUJOCO_GL=disable PYTHONUNBUFFERED=1
exec > >(tee "$LOG") 2>&1
echo "== $(date -u +%FT%TZ) $(uname -n): $("$PY" --version 2>&1), nproc $(nproc), load $(cut -d' ' -f1-3 /proc/loadavg)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"gymnasium": "gymnasium", "mujoco": "mujoco", "ale_py": "ale-py", "cv2": "opencv-python-headless",
        "pydantic": "pydantic", "yaml": "pyyaml", "safetensors": "safetensors", "pytest": "pytest"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "== installing: $missing"
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nitro-site .whl/*.whl \
      || { echo "installing .whl/ failed"; exit 1; }
    export PYTHONPATH=/tmp/nitro-site${PYTHONPATH:+:$PYTHONPATH}
  else
    "$PY" -m pip install -q "gymnasium[mujoco]>=1.1,<1.5" "ale-py>=0.10" opencv-python-headless pydantic pyyaml \
      safetensors pytest || { echo "pip install failed (no .whl/ here: run bench/gpu_wheels.sh where PyPI answers)"; exit 1; }
  fi
fi
"$PY" - <<'PYEOF'
import importlib.metadata as m, torch
names = ["torch", "numpy", "gymnasium", "mujoco", "ale-py", "opencv-python-headless", "pydantic", "safetensors"]
print("==", ", ".join(f"{n} {m.version(n)}" for n in names))
print("== CUDA:", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PYEOF

status=0
echo "== tests/test_gpu.py"
# --noconftest: tests/conftest.py sets up Prefect and MLflow, which these tests do not use
timeout 240 "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="-ra" tests/test_gpu.py || status=1
echo "== bench/gpu_timing.py"
timeout 420 "$PY" bench/gpu_timing.py --out "$DEST/gpu_timing_pending.json" "$@" || status=1
if [ -f "$DEST/gpu_timing_pending.json" ]; then  # named after the card it ran on
  card=$("$PY" -c "import json,re,sys; m=json.load(open(sys.argv[1]))['machine']; \
print(re.sub(r'[^a-z0-9]+','-',m.get('gpu','cpu').lower()).strip('-'))" "$DEST/gpu_timing_pending.json")
  mv "$DEST/gpu_timing_pending.json" "$DEST/gpu_timing_${card}.json" && echo "== wrote $DEST/gpu_timing_${card}.json"
fi
echo "== done (status $status) at $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
exit $status
