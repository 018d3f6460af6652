#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a GPU machine that cannot reach PyPI (a lent H100/H200:
# Python 3.12 with torch, numpy, opencv, safetensors, pyyaml and pytest already there), downloaded
# here into .whl/ (ignored through .git/info/exclude), about 33 MB: gymnasium with MuJoCo, ale-py
# and pydantic, each with what it needs beyond that image. Carry .whl along; gpu_check.sh installs
# from it with --no-index when it is there. Usage: bench/gpu_wheels.sh [python version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:-3.12}
PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude; }
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# The versions this repository is tested with here (.venv).
"$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp "${platforms[@]}" -d .whl \
  "gymnasium[mujoco]==1.4.0" "mujoco==4.0.0" "ale-py==0.12.1" "pydantic==2.*"
# The GPU image has these already; a second copy would only shadow them.
rm -f .whl/numpy-* .whl/pillow-* .whl/packaging-* .whl/cloudpickle-* .whl/imageio-*
ls -1 .whl
du -sh .whl
