#!/usr/bin/env bash
# Build Horovod's last release (0.28.1, 2023) from source into the active environment, for
# the torch installed there, over gloo: what `%%distribute --framework horovod` needs.
#
# PyPI has Horovod only as source. As released, its CMake files compile with C++14, and
# torch's headers (2.1 on) need C++17: this raises the standard and changes nothing else.
# Needs cmake and a C++ compiler (Debian: apt-get install cmake g++). Takes a few minutes.
set -euo pipefail
version=0.28.1
python=${PYTHON:-python3}  # the environment's interpreter (a virtual environment's python3)
jobs=$(( $(nproc) < 4 ? $(nproc) : 4 ))  # compiling against torch's headers takes much memory per job

"$python" -c "import torch" 2>/dev/null || { echo "build_horovod.sh: install torch first (see README)" >&2; exit 1; }
for tool in cmake g++; do
    command -v "$tool" >/dev/null || { echo "build_horovod.sh: needs $tool (apt-get install cmake g++)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$version" -d "$work"
tar xzf "$work/horovod-$version.tar.gz" -C "$work"
src="$work/horovod-$version"
for cmakelists in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$cmakelists" || { echo "build_horovod.sh: $cmakelists changed" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$cmakelists"
done

# Built against this environment's torch, so without build isolation: its build imports these.
"$python" -m pip install --quiet packaging wheel numpy pyyaml cloudpickle psutil cffi
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$jobs" \
    "$python" -m pip install --quiet --no-build-isolation --no-cache-dir "$src"
"$python" -c "import horovod, horovod.torch as hvd; assert hvd.gloo_built(), 'built without gloo'; print('horovod', horovod.__version__, 'built for torch, over gloo')"
