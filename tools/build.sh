#!/usr/bin/env bash
# Configures and builds kerf into ${KERF_BUILD_DIR:-build}. Extra arguments go to the cmake
# configure step; KERF_TARGETS="a b" builds only those targets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KERF_BUILD_DIR:-$root/build}
[[ ${KERF_SKIP_DEPS:-0} == 1 ]] || "$root/tools/setup-deps.sh"
args=(-S "$root" -B "$build" -G Ninja)
# Name the system Python: only it has Debian's numpy and pytest.
if [[ -x /usr/bin/python3 ]]; then
  args+=(-DPYBIND11_FINDPYTHON=ON -DPython_EXECUTABLE=${KERF_PYTHON:-/usr/bin/python3})
fi
cmake "${args[@]}" "$@" >/dev/null
targets=()
for t in ${KERF_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "${KERF_JOBS:-$(nproc)}" "${targets[@]}"
