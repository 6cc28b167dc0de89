#!/usr/bin/env bash
# Builds kerf and runs the whole test suite (C++ through CTest, then Python through pytest).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KERF_BUILD_DIR:-$root/build}
# KERF_TEST_DEPS=1: setup-deps.sh also installs what only the tests use (Debian's
# python3-torch, where the archive has it); KERF_TEST_DEPS=0 leaves it out.
KERF_TEST_DEPS=${KERF_TEST_DEPS:-1} "$root/tools/build.sh" "$@"
cd "$build"
ctest --output-on-failure -j "${KERF_JOBS:-$(nproc)}"

# The Python package is importable from the build tree (<build>/python/kerf).
if grep -q "^KERF_BUILD_PYTHON:BOOL=OFF" "$build/CMakeCache.txt" 2>/dev/null; then
  echo "kerf: Python tests skipped (configured with -DKERF_BUILD_PYTHON=OFF)"
  exit 0
fi
python=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null | head -1)
python=${python:-${KERF_PYTHON:-/usr/bin/python3}}
if ! compgen -G "$build/python/kerf/_kerf*.so" >/dev/null; then
  echo "kerf: the Python module was not built (see the configure output about pybind11)" >&2
  exit 1
fi
cd "$root"
KERF_BUILD_DIR="$build" KERF_CACHE_DIR="${KERF_CACHE_DIR:-$build/test-cache}" \
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest "$root/tests/python" -q -rs
